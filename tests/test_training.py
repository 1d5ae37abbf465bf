"""Training for real: checkpoints that resume exactly (under the same plan or another), a
dataset read per data-parallel rank, and the refusals of bad checkpoint folders and data.

Real torchrun launches of `python -m runtime`, real torch.distributed.checkpoint files.

Tolerances. Resuming under the same plan runs the same ops in the same order as the
uninterrupted run, so losses and final states are held to rtol 1e-6 (seen: bit-equal).
Resuming under another plan changes the order of the sums (dp 4 -> pp 2 x tp 2): the losses
are held to rtol 1e-5 (test_runtime's fp32 tolerance; seen 4e-8).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from typer.testing import CliRunner

from cli import app

from planner.plan import OptimizerConfig
from profiles.model_file import load_spec
from runtime.config import TrainConfig, train_args
from runtime.data import DatasetBatches, batch_source
from runtime.launch import build_command
from runtime.reference import train_reference

from runtime_cases import GPT, ROOT, make_plan

SAME_PLAN_TOL = {"rtol": 1e-6, "atol": 1e-8}
OTHER_PLAN_TOL = {"rtol": 1e-5, "atol": 1e-6}
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
DATA_MODEL = Path(__file__).parent / "data_model.py"
ADAMW = OptimizerConfig(name="adamw", lr=1e-3, weight_decay=0.01)
# Warm-up, a cosine over the 6 steps and clipping that bites (gpt's norm is ~0.6 at these steps):
# every part of the step's settings that a resume must carry on.
SETTINGS = dict(lr_schedule="cosine", warmup_steps=2, decay_steps=6, clip_grad_norm=0.5)
PLANS = {
    "dp2_tp2": make_plan(dp=2, tp=2, zero=3, m=2, optimizer=ADAMW),
    "pp2_dp2": make_plan(pp=2, dp=2, zero=1, m=2, optimizer=ADAMW),     # ZeRO-1: the optimizer's chunks gathered
    "dp4": make_plan(dp=4, b=2, optimizer=ADAMW),
    "pp2_tp2": make_plan(pp=2, tp=2, b=4, m=2, optimizer=ADAMW),
}


def launch(tmp: Path, name: str, *args: str, plan=None, env=None) -> dict:
    """Run plan `name` under torchrun with the runtime's own flags; its run.json."""
    plan = plan or PLANS[name]
    plan_path, out = tmp / f"{name}.plan.json", tmp / f"{name}-{len(list(tmp.glob('*.run.json')))}.run.json"
    plan.save(plan_path)
    cmd = build_command(plan_path, plan, out=out, extra=[*train_args(**SETTINGS), *args])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env or ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def saved_state(directory: Path) -> dict:
    """A checkpoint's tensors, read back without a process group."""
    out = directory.parent / f"{directory.name}.pt"
    dcp_to_torch_save(directory, out)
    return torch.load(out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Uninterrupted 6-step runs, and 3 steps + resume + 3 steps, for dp2 x tp2 and pp2 x dp2;
    and 3 steps under dp 4 resumed under pp2 x tp2: in one launch (tests/resume_driver.py)."""
    tmp = tmp_path_factory.mktemp("training")
    jobs, got = [], {}

    def job(name: str, plan: str, steps: int, directory: Path, resume: bool = False) -> str:
        PLANS[plan].save(tmp / f"{plan}.plan.json")
        jobs.append({"name": name, "plan": str(tmp / f"{plan}.plan.json"), "steps": steps,
                     "checkpoint_dir": str(directory), "resume": resume, "config": SETTINGS})
        return name
    for name in ("dp2_tp2", "pp2_dp2"):
        whole, parts = tmp / f"{name}-whole", tmp / f"{name}-parts"
        got[name] = {"whole": job(f"{name}-whole", name, 6, whole), "first": job(f"{name}-first", name, 3, parts),
                     "second": job(f"{name}-second", name, 6, parts, resume=True), "whole_dir": whole, "parts_dir": parts}
    moved = tmp / "dp4-then-pp2_tp2"
    got["moved"] = {"first": job("moved-first", "dp4", 3, moved), "second": job("moved-second", "pp2_tp2", 6, moved, resume=True),
                    "dir": moved}
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                           str(Path(__file__).parent / "resume_driver.py"), str(tmp / "jobs.json")],
                          capture_output=True, text=True, timeout=400, env=ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for entry in got.values():
        for key in ("whole", "first", "second"):
            if key in entry:
                entry[key] = json.loads((tmp / f"{entry[key]}.result.json").read_text())
    return got


@pytest.mark.parametrize("name", ["dp2_tp2", "pp2_dp2"])
def test_resume_is_exact(runs, name):
    """6 steps in one run equal 3 steps + resume + 3 steps: losses, parameters, optimizer states."""
    r = runs[name]
    assert (r["first"]["first_step"], r["second"]["first_step"], r["second"]["steps"]) == (0, 3, 3)
    losses = r["first"]["losses"] + r["second"]["losses"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(r["whole"]["losses"]), **SAME_PLAN_TOL)
    assert r["second"]["checkpoint"].endswith("step-00000006")
    whole, resumed = saved_state(r["whole_dir"] / "step-00000006"), saved_state(r["parts_dir"] / "step-00000006")
    assert sorted(whole["model"]) == sorted(resumed["model"]) and len(whole["optimizer"]) == 3 * len(whole["model"])
    for part in ("model", "optimizer"):
        for key, t in whole[part].items():
            torch.testing.assert_close(resumed[part][key], t, **SAME_PLAN_TOL, msg=lambda m: f"{part} {key}: {m}")
    # A resume that dropped the optimizer's states or the schedule would not have matched:
    # Adam's first step from zero states moves every parameter by ~lr, far outside the tolerance.
    first = saved_state(r["parts_dir"] / "step-00000003")
    assert any(not torch.allclose(first["model"][k], t, **SAME_PLAN_TOL) for k, t in whole["model"].items())


def test_checkpoint_from_dp4_resumes_under_pp2_tp2(runs):
    """DCP reshards: a dp 4 checkpoint (replicated parameters) continues as pp 2 x tp 2
    (split layers, sharded matrices) with the uninterrupted run's losses."""
    r = runs["moved"]
    whole = runs["dp2_tp2"]["whole"]["losses"]        # the same global batches, settings and init
    losses = r["first"]["losses"] + r["second"]["losses"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(whole), **OTHER_PLAN_TOL)
    info = json.loads((r["dir"] / "step-00000003" / "checkpoint.json").read_text())
    assert info["layout"] == {"dp": 4, "tp": 1, "pp": 1, "zero": 0} and info["step"] == 3


def test_a_save_cut_short_is_never_resumed(runs, tmp_path):
    """Only a renamed folder with checkpoint.json is complete: a .partial one (a crash during
    the save) is passed over, and alone it is refused."""
    import shutil
    d = tmp_path / "ck"
    shutil.copytree(runs["pp2_dp2"]["parts_dir"] / "step-00000003", d / "step-00000009.partial")
    from runtime.checkpoint import CheckpointError, complete_checkpoints, find_resume
    assert complete_checkpoints(d) == []
    with pytest.raises(CheckpointError, match="cut short"):
        find_resume(d, {}, "adamw")
    shutil.copytree(runs["pp2_dp2"]["parts_dir"] / "step-00000003", d / "step-00000003")
    assert [p.name for p in complete_checkpoints(d)] == ["step-00000003"]


# -- bad input: one sentence, exit 2, nothing written ----------------------------------------

def plan_run(tmp: Path, plan, *args: str) -> tuple[int, str]:
    """`plan run` in this process (its checks refuse before any launch): exit code and output."""
    plan_path = tmp / "p.plan.json"
    plan.save(plan_path)
    result = CliRunner().invoke(app, ["run", str(plan_path), "--out", str(tmp / "r.json"), *args], catch_exceptions=False)
    return result.exit_code, result.output


def listing(d: Path) -> dict:
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(d.rglob("*"))}


def test_bad_checkpoint_folders_are_refused_before_launch(runs, tmp_path):
    ck = runs["dp2_tp2"]["whole_dir"]
    before = listing(ck)
    foreign = tmp_path / "foreign"
    (foreign / "step-00000001").mkdir(parents=True)
    (foreign / "step-00000001" / "checkpoint.json").write_text('{"kind": "plan"}')
    mlp = make_plan(ROOT / "examples" / "mlp.py", dp=2, optimizer=ADAMW)
    cases = [
        (PLANS["dp2_tp2"], ["--resume"], "--resume needs --checkpoint-dir"),
        (PLANS["dp2_tp2"], ["--checkpoint-dir", str(tmp_path / "none"), "--resume"], "does not exist"),
        (PLANS["dp2_tp2"], ["--checkpoint-dir", str(foreign), "--resume"], "is not a checkpoint written by plan"),
        (mlp, ["--checkpoint-dir", str(ck), "--resume"], "is a checkpoint of another model"),
        (make_plan(dp=2, tp=2, zero=3, m=2, optimizer=OptimizerConfig(name="momentum", lr=0.05)),
         ["--checkpoint-dir", str(ck), "--resume"], "holds adamw optimizer states but the plan trains with momentum"),
        (PLANS["dp2_tp2"], ["--checkpoint-dir", str(ck)], "already holds checkpoints"),      # no --resume: no overwrite
        (PLANS["dp2_tp2"], ["--checkpoint-dir", str(ck), "--resume", "--steps", "6"], "leaves nothing to train"),
        (PLANS["dp2_tp2"], ["--lr", "-1"], "learning rate is -1"),
    ]
    for plan, args, says in cases:
        code, text = plan_run(tmp_path, plan, *args)
        assert code == 2, (args, text)
        assert says in " ".join(text.split()) and "Traceback" not in text, (args, text)
        assert " ".join(text.split()).count(". ") == 0, text      # one sentence
    assert listing(ck) == before
    assert not (tmp_path / "r.json").exists()


# -- data ----------------------------------------------------------------------------------

DATA_PLAN = make_plan(DATA_MODEL, pp=2, dp=2, b=2, m=2, n_layers=4, optimizer=OptimizerConfig(name="momentum", lr=0.05))


@pytest.fixture(scope="module")
def data_run(tmp_path_factory) -> tuple[dict, dict[int, list[int]]]:
    """A run of a pp2 x dp2 plan on the dataset: run.json and each rank's reads."""
    tmp = tmp_path_factory.mktemp("data")
    reads = tmp / "reads"
    reads.mkdir()
    run = launch(tmp, "data", "--steps", "4", plan=DATA_PLAN, env={**ENV, "READS_DIR": str(reads)})
    return run, {int(f.stem.removeprefix("rank")): [int(x) for x in f.read_text().split()] for f in reads.glob("rank*.txt")}


def test_each_rank_reads_only_its_samples(data_run):
    run, reads = data_run
    spec = load_spec(DATA_PLAN.model)
    order = DatasetBatches(spec.dataset(), spec, DATA_PLAN)
    assert sorted(reads) == [0, 1, 2, 3]                          # every rank read; nothing else did
    for rank, got in reads.items():
        dp_rank = rank % 2                                        # mesh (pp, dp, tp): rank = pp*2 + dp
        want = [i for step in range(4) for i in order.indices(step, dp_rank)]
        assert got == want, rank                                  # its own rows, each once, in order
    for step in range(4):                                         # the two dp ranks split each step's batch
        a, b = order.indices(step, 0), order.indices(step, 1)
        assert not set(a) & set(b) and len(a) == len(b) == 4
    # 16 positions of a 40-sample dataset per 4 steps: the first permutation is a permutation.
    assert sorted(order.index(q) for q in range(40)) == list(range(40))


def test_same_seed_same_batches_and_one_process_losses(data_run):
    """What the ranks read is a function of the seed and the step alone: another run with the
    same seed (one process, reading every dp rank's rows in rank order) sees the same batches,
    so it gets the same losses; batches that differed would not."""
    run, _ = data_run
    spec = load_spec(DATA_PLAN.model)
    ref_losses, _ = train_reference(spec, DATA_PLAN, 4, TrainConfig(**SETTINGS))
    torch.testing.assert_close(torch.tensor(run["losses"], dtype=torch.float64),
                               torch.tensor(ref_losses, dtype=torch.float64), rtol=1e-5, atol=1e-6)


def test_another_seed_reads_other_samples():
    spec = load_spec(DATA_PLAN.model)
    other = make_plan(DATA_MODEL, pp=2, dp=2, b=2, m=2, n_layers=4, seed=1)
    a, b = batch_source(spec, DATA_PLAN), batch_source(spec, other)
    assert a.indices(0, 0) != b.indices(0, 0)


def test_a_dataset_of_the_wrong_shape_is_refused(tmp_path):
    bad = tmp_path / "bad_data.py"
    bad.write_text(DATA_MODEL.read_text().replace("torch.randn(D_IN, generator", "torch.randn(D_IN + 1, generator"))
    plan = make_plan(bad, dp=2, b=2, n_layers=4)
    code, text = plan_run(tmp_path, plan)
    assert code == 2, text
    assert "gives a float32 tensor of shape (9,) as its input, but make_batch's rows are float32 of shape (8,)" in " ".join(text.split())
    assert "Traceback" not in text and not (tmp_path / "r.json").exists()


# -- your own loop ---------------------------------------------------------------------------

def test_own_loop_example_matches_one_process(tmp_path):
    """examples/own_loop.py under torchrun (pp 2, 1F1B, AdamW, its own data, schedule and
    clipping) trains to the losses of the same loop in one process, and resumes from its checkpoint."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("own_loop", ROOT / "examples" / "own_loop.py")
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        loop = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loop)
    finally:
        sys.path.remove(str(ROOT / "examples"))
    plan = make_plan(pp=2, m=2, optimizer=ADAMW)
    plan.save(tmp_path / "plan.json")
    script = [str(ROOT / "examples" / "own_loop.py"), str(tmp_path / "plan.json"), "--checkpoint-dir", str(tmp_path / "ck")]
    for args in (["--steps", "3"], ["--steps", "5", "--resume"]):
        out = tmp_path / f"losses{args[1]}.txt"
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                               *script, *args, "--losses", str(out)], capture_output=True, text=True, timeout=180, env=ENV)
        assert proc.returncode == 0, proc.stderr[-3000:]
    got = [float(x) for f in ("losses3.txt", "losses5.txt") for x in (tmp_path / f).read_text().split()]

    torch.manual_seed(plan.seed)
    model = loop.gpt.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    want = []
    for step in range(5):
        inputs, targets = loop.my_batches(step, 0, plan.global_batch, 1)
        loss = loop.gpt.loss_fn(model(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in optimizer.param_groups:
            group["lr"] = loop.lr_at(step)
        optimizer.step()
        optimizer.zero_grad()
        want.append(loss.item())
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **OTHER_PLAN_TOL)


# -- faults --------------------------------------------------------------------------------

KILLED_MODEL_TAIL = '''

import os as _os
import signal as _signal
import time as _time

_make_batch = make_batch


def make_batch(batch_size):
    """Rank 1 of the first attempt kills itself (SIGKILL) once the checkpoint $KILL_AFTER is complete."""
    if (_os.environ.get("RANK") == "1" and _os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
            and _os.path.isfile(_os.path.join(_os.environ.get("KILL_AFTER", "/nonexistent"), "checkpoint.json"))):
        with open(_os.environ["KILL_AFTER"] + ".killed-at", "w") as f:
            f.write(repr(_time.time()))
        _os.kill(_os.getpid(), _signal.SIGKILL)
    return _make_batch(batch_size)
'''


@pytest.mark.parametrize("restarts", [0, 1])
def test_a_killed_rank(runs, tmp_path, restarts):
    """SIGKILL of rank 1 after the step-2 checkpoint: without restarts the launch ends within
    30 s in one sentence naming the rank and that checkpoint; with --max-restarts 1 every rank
    restarts, resumes from it and ends with the uninterrupted run's losses."""
    import time
    model = tmp_path / "gpt_killed.py"
    model.write_text((ROOT / "examples" / "gpt.py").read_text() + KILLED_MODEL_TAIL)
    plan = make_plan(model, pp=2, b=4, m=2, optimizer=ADAMW, n_layers=6)    # PLANS["pp2_dp2"]'s batches, on 2 ranks
    plan.save(tmp_path / "plan.json")
    ck = tmp_path / "ck"
    args = ["--steps", "6", "--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--out", str(tmp_path / "run.json"),
            *train_args(**SETTINGS), *(["--max-restarts", str(restarts)] if restarts else [])]
    env = {**ENV, "KILL_AFTER": str(ck / "step-00000002"), "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-c", "from cli import app; app()", "run", str(tmp_path / "plan.json"), *args],
                          capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    ended = time.time()
    killed = float((ck / "step-00000002.killed-at").read_text())
    text = " ".join((proc.stdout + proc.stderr).split())
    if not restarts:
        assert proc.returncode != 0 and ended - killed < 30, (ended - killed, text[-2000:])
        assert "error: rank 1 was killed by SIGKILL, so every rank stopped; the latest complete checkpoint is" in text, text[-2000:]
        assert "step-00000002 (continue with --resume)" in text and "Traceback" not in text
        assert not (tmp_path / "run.json").exists()
        return
    assert proc.returncode == 0, text[-3000:]
    assert "restart 1: resumed from" in text
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["first_step"] == 2
    whole = runs["pp2_dp2"]["whole"]["losses"]                   # the same batches under dp 2: other sums' order
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(whole[2:]), **OTHER_PLAN_TOL)


def find_params(plan) -> list[str]:
    from runtime.checkpoint import model_shapes
    from runtime.train import build_model
    return list(model_shapes(build_model(load_spec(plan.model), plan, on_meta=True)))


def test_ctrl_c_saves_a_checkpoint_and_exits_130(tmp_path):
    """SIGINT to plan run with checkpoints on: the ranks finish their step, agree on it, write
    a checkpoint of it and stop; one line, exit 130, a complete checkpoint."""
    import signal
    import time
    plan = make_plan(pp=2, m=2, optimizer=ADAMW)
    plan.save(tmp_path / "plan.json")
    ck = tmp_path / "ck"
    cmd = [sys.executable, "-c", "from cli import app; app()", "run", str(tmp_path / "plan.json"), "--steps", "100000",
           "--checkpoint-dir", str(ck), "--checkpoint-every", "5", "--out", str(tmp_path / "never.json")]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**ENV, "COLUMNS": "200"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (ck / "step-00000005").is_dir() and time.monotonic() < deadline:   # training is under way
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stdout + stderr
    said = [line for line in stderr.splitlines() if line.strip()]
    assert len(said) <= 2 and "interrupted (SIGINT)" in said[0], stderr     # one sentence (rich may fold it in two)
    from runtime.checkpoint import complete_checkpoints, read_info
    latest = complete_checkpoints(ck)[-1]
    assert f"the latest complete checkpoint is {latest}" in " ".join(stderr.split())
    assert not list(ck.glob("*.partial")) and not (tmp_path / "never.json").exists()
    info = read_info(latest)                                                  # complete: resumable (see the resume tests)
    assert info.step >= 5 and sorted(info.params) == sorted(find_params(plan))


# -- weights in ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory) -> Path:
    """The tiny Llama of examples/hf-llama-tiny, random weights saved by transformers (safetensors)."""
    import transformers

    from profiles.hf import make_config, read_config
    folder = tmp_path_factory.mktemp("weights") / "tiny-llama"
    _, d = read_config(str(ROOT / "examples" / "hf-llama-tiny"))
    torch.manual_seed(7)                                  # not the plan's seed: the weights must come from the files
    transformers.AutoModelForCausalLM.from_config(make_config(d), attn_implementation="sdpa").save_pretrained(folder)
    assert (folder / "model.safetensors").is_file()
    return folder


def hf_plan(folder: Path, **kw):
    from profiles.hf import load_hf_spec
    spec = load_hf_spec(str(folder), 32)
    plan = make_plan(GPT, n_layers=6, **kw)
    plan.model = {"path": str(folder), "sha256": spec.sha256, "source": "hf-config", "name": spec.name, "seq_len": 32}
    return plan, spec


def test_loaded_weights_give_transformers_logits(saved_llama):
    """One process: the adapted model with the folder's weights computes from_pretrained's logits."""
    import transformers

    from runtime.checkpoint import model_shapes
    from runtime.weights import load_weights, weight_sources
    _, spec = hf_plan(saved_llama)
    model = spec.build_model()
    load_weights(dict(model.named_parameters()), saved_llama, weight_sources(spec, saved_llama, model_shapes(model)))
    reference = transformers.AutoModelForCausalLM.from_pretrained(saved_llama, attn_implementation="sdpa")
    ids = torch.randint(0, 512, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids).logits, rtol=1e-5, atol=1e-5)


def test_init_from_under_tensor_parallelism(saved_llama, tmp_path):
    """tp 2 x dp 2, each rank reading its shards: the first step's loss is from_pretrained's on that batch."""
    import transformers

    from runtime.data import global_batch
    plan, spec = hf_plan(saved_llama, dp=2, tp=2, zero=3, b=2, optimizer=ADAMW)
    run = launch(tmp_path, "init", "--steps", "2", "--init-from", str(saved_llama), plan=plan)
    reference = transformers.AutoModelForCausalLM.from_pretrained(saved_llama, attn_implementation="sdpa")
    inputs, targets = global_batch(spec, plan, 0)
    with torch.no_grad():
        want = spec.loss_fn(reference(inputs).logits, targets).item()
    assert run["losses"][0] == pytest.approx(want, rel=1e-5)


def test_weights_of_another_shape_are_refused(saved_llama, tmp_path):
    import shutil
    other = tmp_path / "other"
    shutil.copytree(saved_llama, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "intermediate_size": 256}))   # the profiled model is narrower
    plan, _ = hf_plan(other, dp=2, b=2)
    code, text = plan_run(tmp_path, plan, "--init-from", str(other))
    assert code == 2 and "model.layers.0.mlp.gate_proj.weight in" in text and "has shape (384, 128) but the model's is (256, 128)" in " ".join(text.split()), text
    code, text = plan_run(tmp_path, make_plan(GPT, dp=2), "--init-from", str(saved_llama))
    assert code == 2 and "is a model file" in text, text


def test_the_text_example_learns(tmp_path):
    """examples/bytes.py (gpt on the repository's own text, byte tokens, read per dp rank): the loss falls."""
    plan = make_plan(ROOT / "examples" / "bytes.py", dp=2, b=8, n_layers=6, optimizer=OptimizerConfig(name="adamw", lr=3e-3))
    run = launch(tmp_path, "text", "--steps", "30", "--warmup-steps", "3", "--decay-steps", "30", plan=plan)
    losses = run["losses"]
    assert losses[0] > 6.0 and sum(losses[-5:]) / 5 < losses[0] - 2.0, losses


def test_tensorboard_log(tmp_path):
    """With tensorboard installed, --tensorboard DIR gets the log lines' figures, one point per logged step."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    board = tmp_path / "board"
    run = launch(tmp_path, "board", "--steps", "4", "--log-every", "2", "--tensorboard", str(board), plan=make_plan(pp=2, m=2))
    events = EventAccumulator(str(board))
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [2, 4]
    assert [e.value for e in loss] == pytest.approx([run["losses"][1], run["losses"][3]], rel=1e-5)   # pp 2, dp 1: the whole batch
    assert {"train/lr", "train/grad_norm", "train/tokens_per_s"} <= set(events.Tags()["scalars"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: an offloaded parameter's states on the device")
def test_loaded_states_of_an_offloaded_parameter_step_on_the_host():
    """An offloaded parameter's shard lives on the host while DCP hands its loaded states
    back on the GPU (DTensor.from_local moves the template there): they are installed on the
    host, where its fused step runs, and the step is the uninterrupted one's (on an H200 a
    resumed plan with offloaded layers failed its first step, 2026-12-04)."""
    from runtime.sharded_optimizer import ShardedOptimizer
    torch.manual_seed(0)
    grads = [torch.randn(4, 3) for _ in range(3)]
    whole = torch.nn.Parameter(torch.randn(4, 3))
    resumed = torch.nn.Parameter(whole.detach().clone())
    first, second = ShardedOptimizer([whole], OptimizerConfig()), ShardedOptimizer([resumed], OptimizerConfig())
    for g in grads[:2]:
        whole.grad = g.clone()
        first.step()
    states = {k: v.cuda() for k, v in first.export_state({"w": whole}).items()}   # as DCP loads them
    with torch.no_grad():
        resumed.copy_(whole)
    second.import_state({"w": resumed}, states)
    whole.grad, resumed.grad = grads[2].clone(), grads[2].clone()
    first.step()
    second.step()
    assert all(t.device.type == "cpu" for t in second.state_of([resumed])[0].values())
    assert torch.equal(resumed.detach(), whole.detach())
