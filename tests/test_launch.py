"""What `plan run` passes on of torchrun's output, and the sbatch script. Torch-free."""

from types import SimpleNamespace

from runtime.launch import TorchrunOutput, slurm_script

TORCHRUN_FAILURE = """\
*****************************************
Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your system being overloaded, please further tune the variable for optimal performance in your application as needed.
*****************************************
rank 0: a collective waited more than 3 s; rank 1 never began step 3 (stopped, crashed or hung), so the run stops.
W1201 14:47:47.658000 24827 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 24833 closing signal SIGTERM
E1201 14:47:47.691000 24827 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 4) local_rank: 0
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/x/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
runtime FAILED
------------------------------------------------------------
"""


def filtered(text: str) -> str:
    kept: list[str] = []
    out = TorchrunOutput(kept.append)
    for line in text.splitlines(keepends=True):
        out.feed(line)
    return "".join(kept)


def test_torchrun_noise_is_dropped_and_the_ranks_sentence_kept():
    text = filtered(TORCHRUN_FAILURE)
    assert text == ("rank 0: a collective waited more than 3 s; rank 1 never began step 3 (stopped, crashed or hung), "
                    "so the run stops.\n")


def test_a_ranks_own_traceback_passes_and_a_repeated_refusal_shows_once():
    bug = "Traceback (most recent call last):\n  File \"m.py\", line 3, in f\n    1 / 0\nZeroDivisionError: division by zero\n"
    refusal = "plan p.json is for 4 processes but this launch has 2; start it with `plan run p.json`.\n"
    text = filtered(refusal * 4 + bug + "[rank1]: Traceback (most recent call last):\n[rank1]: Traceback (most recent call last):\n")
    assert text.count(refusal) == 1
    assert bug in text                                   # a bug's traceback is the user's to see
    assert text.count("[rank1]: Traceback") == 2         # rank-prefixed lines are never merged


def test_the_sbatch_script_runs_each_nodes_ranks():
    plan = SimpleNamespace(world_size=16, nodes=2, device_type="cuda", threads=1)
    script = slurm_script("plan.json", plan, steps=10)
    assert "#SBATCH --nodes=2" in script and "#SBATCH --gpus-per-node=8" in script
    assert "--nproc-per-node=8 --nnodes=2 --node-rank=$SLURM_NODEID --master-addr=$HEAD" in script
    assert script.rstrip().endswith("--steps 10'")
