"""The runtime trains every parallel plan to the losses and parameters of one process.

Real torchrun launches, real gloo process groups, no mocks. The plans are grouped by world
size, one launch per group (tests/runtime_driver.py trains each and saves its losses, full
final parameters and reports); each case is then held to `train_reference` on the same global
batches for 3 steps.

Tolerances. fp32 with SGD / momentum: rtol 1e-5, atol 1e-6 on losses and parameters (the
parallel sums differ from one process only in rounding order). Adam / AdamW: the same on the
losses; on the parameters atol 1e-3 (= lr) and at most 0.1% of all elements outside rtol
1e-5 / atol 1e-6. Adam divides each gradient by its running RMS, so an element whose
gradient is rounding noise moves by a noise-decided fraction of lr per step on either side:
the attention key bias (softmax is shift-invariant, its true gradient is 0, measured ~1e-11),
MLP weights in GELU's flat region. Worst seen: 1.9e-4, on 0.03% of the elements; a real
fault (a missed update or broadcast, a wrong shard) moves nearly every element by ~lr.
Mixed precision (bf16 compute, fp32 master weights and reduction) against the fp32
reference, SGD lr 0.1: rtol 2e-2 on the losses (seen 2.5e-3: the loss itself is computed
from bf16 logits), atol 2e-3 on the parameters (seen 3e-5).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from planner.plan import OptimizerConfig
from planner.run_report import RunReport
from profiles.model_file import load_spec
from runtime.config import TrainConfig
from runtime.launch import build_command
from runtime.reference import train_reference
from runtime.sharded_optimizer import chunk_bounds

from runtime_cases import MLP, VOCAB_GPT, make_plan

STEPS = 3
DRIVER = Path(__file__).parent / "runtime_driver.py"
FP32_TOL = {"rtol": 1e-5, "atol": 1e-6}
ADAM_PARAM_TOL = {"rtol": 1e-5, "atol": 1e-3}
ADAM_NOISY_FRACTION = 1e-3
MIXED_LOSS_TOL = {"rtol": 2e-2, "atol": 0.0}
MIXED_PARAM_TOL = {"rtol": 0.0, "atol": 2e-3}

SGD = OptimizerConfig(name="sgd", lr=0.1)
MOMENTUM = OptimizerConfig(name="momentum", lr=0.05, momentum=0.9)
ADAM = OptimizerConfig(name="adam", lr=1e-3, weight_decay=0.0)
ADAMW = OptimizerConfig(name="adamw", lr=1e-3, weight_decay=0.01)

# Momentum SGD unless a case says otherwise: its update is linear in the gradient, so a
# gradient that is off by any factor (dp average, micro-batch scaling) shows at full size.
# Adam normalises that factor away; it runs where its states matter (ZeRO-1) and as the default.
CASES = {
    # one process: the plain path
    "accumulate4_plain": make_plan(b=2, m=4, optimizer=MOMENTUM),
    "bf16_plain": make_plan(b=4, precision="bf16", optimizer=ADAMW),  # the same ops as the reference: equal
    "selective_plain": make_plan(b=2, m=2, selective={0, 1, 2, 5}, checkpoint={3}, optimizer=MOMENTUM),
    # two processes
    "dp2": make_plan(dp=2, optimizer=MOMENTUM),
    "dp2_adamw": make_plan(dp=2, optimizer=ADAMW),
    "tp2": make_plan(tp=2, optimizer=MOMENTUM),
    "pp2_1f1b": make_plan(pp=2, m=2, optimizer=MOMENTUM),
    "pp2_gpipe": make_plan(pp=2, m=2, schedule="gpipe", optimizer=SGD),
    "pp2_interleaved": make_plan(pp=2, virtual=2, m=4, schedule="interleaved", optimizer=MOMENTUM),
    "pp2_looped_bfs": make_plan(pp=2, virtual=2, m=3, schedule="looped_bfs", checkpoint={2}, optimizer=MOMENTUM),
    "zero1": make_plan(MLP, dp=2, zero=1, optimizer=MOMENTUM),
    "zero1_adam": make_plan(MLP, dp=2, zero=1, optimizer=ADAM),
    "zero2": make_plan(dp=2, zero=2, optimizer=MOMENTUM),
    "zero3": make_plan(dp=2, zero=3, optimizer=MOMENTUM),
    "accumulate4_zero0": make_plan(dp=2, m=4, optimizer=MOMENTUM),
    "accumulate4_zero3": make_plan(MLP, dp=2, zero=3, b=2, m=4, optimizer=MOMENTUM),
    "offload_zero0": make_plan(dp=2, offload={1, 4}, optimizer=MOMENTUM),
    "offload_zero1": make_plan(MLP, dp=2, zero=1, offload={0, 5}, m=2, optimizer=MOMENTUM),
    "offload_pp2": make_plan(pp=2, m=2, offload={1, 3}, optimizer=MOMENTUM),
    "checkpoint_zero3": make_plan(dp=2, zero=3, checkpoint={1, 2}, optimizer=MOMENTUM),
    "checkpoint_pp2": make_plan(pp=2, m=2, checkpoint={0, 4}, optimizer=MOMENTUM),
    "selective_zero3": make_plan(dp=2, zero=3, selective={1, 2, 5}, optimizer=MOMENTUM),
    "selective_tp2": make_plan(tp=2, selective={1, 2, 3, 4}, optimizer=MOMENTUM),
    "tp2_sp": make_plan(tp=2, sp=True, optimizer=MOMENTUM),
    "tp2_vocab_embedding": make_plan(VOCAB_GPT, tp=2, checkpoint={0}, optimizer=MOMENTUM),   # rowwise nn.Embedding
    "selective_tp2_sp": make_plan(tp=2, sp=True, selective={1, 2, 4}, checkpoint={3}, optimizer=MOMENTUM),
    "selective_pp2": make_plan(MLP, pp=2, m=2, selective=set(range(10)), optimizer=MOMENTUM),
    "mixed_zero2": make_plan(dp=2, zero=2, precision="mixed", optimizer=SGD),
    # four processes
    "dp2_tp2": make_plan(dp=2, tp=2, zero=3, m=2, optimizer=MOMENTUM),
    "pp2_dp2": make_plan(pp=2, dp=2, zero=1, m=2, optimizer=ADAMW),
    "pp2_tp2": make_plan(pp=2, tp=2, m=2, schedule="gpipe", optimizer=SGD),
    "pp2_tp2_sp": make_plan(pp=2, tp=2, m=2, sp=True, optimizer=MOMENTUM),      # the stages pass sequence slices
    "dp2_tp2_sp_selective_zero3": make_plan(dp=2, tp=2, zero=3, m=2, sp=True, selective={1, 2, 3}, optimizer=MOMENTUM),
    "pp2_dp2_interleaved": make_plan(pp=2, dp=2, zero=3, virtual=2, m=4, schedule="interleaved", selective={1, 2},
                                     optimizer=MOMENTUM),
    "pp2_dp2_looped_bfs": make_plan(pp=2, dp=2, zero=2, virtual=2, m=2, schedule="looped_bfs", selective={3},
                                    optimizer=MOMENTUM),
    # gradient clipping by the global norm, with a warm-up and cosine schedule (CONFIGS)
    "clip_offload_zero2": make_plan(dp=2, zero=2, offload={1}, optimizer=MOMENTUM),
    "clip_dp2_tp2": make_plan(dp=2, tp=2, zero=3, m=2, optimizer=MOMENTUM),
    "clip_pp2_dp2": make_plan(pp=2, dp=2, zero=1, m=2, optimizer=MOMENTUM),
}
# gpt's gradient norm is ~0.6 on these steps: a limit of 0.2 scales every step's gradients.
CLIPPED = TrainConfig(clip_grad_norm=0.2, lr_schedule="cosine", warmup_steps=1)
CONFIGS = {name: CLIPPED for name in CASES if name.startswith("clip_")}


# One intra-op thread per process, as torchrun gives several: on a 2-core machine another
# busy process makes a second thread's spin-waits cost 100x (0.4 s instead of 4 ms a forward).
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def torchrun(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]


@contextlib.contextmanager
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("runtime")
    groups = defaultdict(list)
    for name, plan in CASES.items():
        groups[plan.world_size].append(name)
    for world, names in groups.items():
        d = root / f"world{world}"
        d.mkdir()
        for name in names:
            CASES[name].save(d / f"{name}.plan.json")
            if name in CONFIGS:
                (d / f"{name}.config.json").write_text(json.dumps(CONFIGS[name].to_json()))
        proc = subprocess.run(torchrun(world, str(DRIVER), str(d), str(STEPS)), capture_output=True, text=True, timeout=300, env=ENV)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return {name: torch.load(root / f"world{CASES[name].world_size}" / f"{name}.result.pt") for name in CASES}


@pytest.fixture(scope="module")
def references() -> dict:
    cache = {}

    def get(name):
        if name not in cache:
            plan = CASES[name]
            with one_thread():
                cache[name] = train_reference(load_spec(plan.model), plan, STEPS, CONFIGS.get(name))
        return cache[name]
    return get


def is_adam(plan) -> bool:
    return plan.optimizer.name in ("adam", "adamw")


def tolerances(plan) -> tuple[dict, dict]:
    """(losses, parameters)"""
    if plan.precision == "mixed":
        return MIXED_LOSS_TOL, MIXED_PARAM_TOL
    return FP32_TOL, ADAM_PARAM_TOL if is_adam(plan) else FP32_TOL


@pytest.mark.parametrize("name", list(CASES))
def test_plan_matches_single_process(name, results, references):
    got = results[name]
    ref_losses, ref_state = references(name)
    loss_tol, param_tol = tolerances(CASES[name])
    torch.testing.assert_close(torch.tensor(got["losses"], dtype=torch.float64), torch.tensor(ref_losses, dtype=torch.float64), **loss_tol)
    assert sorted(got["state"]) == sorted(ref_state)
    for key, ref in ref_state.items():
        torch.testing.assert_close(got["state"][key], ref, **param_tol, msg=lambda m: f"{key}: {m}")
    if is_adam(CASES[name]) and CASES[name].precision == "fp32":
        noisy = sum(int((~torch.isclose(got["state"][k], ref, **FP32_TOL)).sum()) for k, ref in ref_state.items())
        assert noisy <= ADAM_NOISY_FRACTION * sum(ref.numel() for ref in ref_state.values())


def test_clipping_bites_in_the_clipped_cases(references):
    """Without clipping the reference ends elsewhere: the clipped cases test the clipping."""
    plan = CASES["clip_dp2_tp2"]
    _, unclipped = train_reference(load_spec(plan.model), plan, STEPS, replace(CLIPPED, clip_grad_norm=0.0))
    _, clipped = references("clip_dp2_tp2")
    assert any(not torch.allclose(clipped[k], t, **FP32_TOL) for k, t in unclipped.items())


def test_reports_cover_every_rank(results):
    for name, got in results.items():
        plan = CASES[name]
        assert [r["rank"] for r in got["reports"]] == list(range(plan.world_size))
        for r in got["reports"]:
            assert r["peak_bytes"] > 0 and len(r["step_times_s"]) == STEPS and r["median_step_s"] > 0
        held = sorted(s for r in got["reports"] for s in r["stages"])
        assert held == sorted(s.index for s in plan.stages for _ in range(plan.dp * plan.tp))


def test_memory_follows_the_zero_stage(results):
    """Same model and batch, dp 2: each ZeRO stage shards more, so it peaks lower."""
    peak = {name: results[name]["reports"][0]["peak_bytes"] for name in ("dp2", "zero2", "zero3", "offload_zero0")}
    assert peak["zero3"] < peak["zero2"] < peak["dp2"]
    assert peak["offload_zero0"] < peak["dp2"]


def run_for_breakdown(tmp_path, plan, steps: int) -> dict:
    plan_path, out = tmp_path / "plan.json", tmp_path / "run.json"
    plan.save(plan_path)
    proc = subprocess.run(build_command(plan_path, plan, steps=steps, out=out), capture_output=True, text=True, timeout=180, env=ENV)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = json.loads(out.read_text())
    # The log lines' step times (every step of a short run logs) are each step's slowest rank's.
    logged = [float(m) for m in re.findall(r"lr [^,]+, (?:grad norm [^,]+, )?([0-9.]+) s,", proc.stdout)]
    assert logged == [round(max(r["step_times_s"][k] for r in run["ranks"]), 3) for k in range(steps)], proc.stdout
    return run


def assert_breakdown_adds_up(report: dict) -> dict:
    """The profiled step's components are non-negative and add up to its wall time (`other`
    is what no op accounts for; it can only be 0 if the ops' times already fill the step)."""
    parts = report["breakdown_s"]
    assert set(parts) == {"compute", "tp_comm", "dp_comm", "p2p", "optimizer", "other"}
    assert all(v >= 0 for v in parts.values())
    assert sum(parts.values()) == pytest.approx(report["breakdown_step_s"], rel=0.02)
    assert parts["compute"] > 0 and parts["optimizer"] > 0
    return parts


def test_a_pipeline_wait_is_p2p_not_the_region_around_it():
    """torch's GPipe waits for a receive inside its "Forward i" region, and the wait records no
    event: the profiled step marks it, so the bubble is p2p and not compute. A real Work on a
    future another thread completes 50 ms later, waited on through torch's own schedules."""
    import threading
    from torch.distributed.pipelining import schedules
    from runtime.breakdown import profile_step
    make_work = getattr(torch._C._distributed_c10d, "_create_work_from_future", None)
    if make_work is None or not hasattr(schedules, "_wait_batch_p2p"):
        pytest.skip("this torch has no Work from a future, or its schedules wait elsewhere")
    a = torch.randn(64, 64)

    def step():
        arrived = torch.futures.Future()
        threading.Timer(0.05, lambda: arrived.set_result(None)).start()
        with torch.profiler.record_function("Forward 0"):
            schedules._wait_batch_p2p([make_work(arrived)])
            a @ a
    profile_step(step, lambda: None)                    # the profiler's first start is slow
    parts, wall = profile_step(step, lambda: None)
    assert parts["p2p"] >= 0.045 and parts["p2p"] > parts["compute"], parts
    assert sum(parts.values()) == pytest.approx(wall, rel=0.02)
    assert schedules._wait_batch_p2p.__name__ == "_wait_batch_p2p"   # torch's own again after the step


def test_cli_run_writes_the_report(tmp_path):
    """A pp2 run: the report, the losses of one process, and a breakdown whose pipeline part is seen."""
    steps = 4                                      # the 4th runs under the profiler, and trains like the others
    plan = make_plan(pp=2, m=2)
    run = run_for_breakdown(tmp_path, plan, steps)
    assert (run["schema"], run["kind"], run["world_size"], run["steps"], run["device"]) == (1, "run", 2, steps, "cpu")
    assert [(r["rank"], r["pp_rank"], r["stages"]) for r in run["ranks"]] == [(0, 0, [0]), (1, 1, [1])]
    with one_thread():
        ref_losses, _ = train_reference(load_spec(plan.model), plan, steps)
    torch.testing.assert_close(torch.tensor(run["losses"], dtype=torch.float64), torch.tensor(ref_losses, dtype=torch.float64), **FP32_TOL)
    for r in run["ranks"]:
        parts = assert_breakdown_adds_up(r)
        assert parts["p2p"] > 0 and parts["tp_comm"] == 0 and parts["dp_comm"] == 0
        assert r["threads"] == 1
        assert r["median_step_s"] == statistics.median(r["step_times_s"][2:3])   # the profiled step is not timed
    # The run's step: its slowest rank's timed step (each step starts on both ranks at once).
    assert RunReport.from_json(run).step_s == max(r["step_times_s"][2] for r in run["ranks"])
    # Each step's CPU time, per rank: some, and no more than the machine's cores could give it.
    report = RunReport.from_json(run)
    assert all(len(r.cpu_times_s) == steps and min(r.cpu_times_s) > 0 for r in report.ranks)
    assert 0 < report.cores_busy <= (os.cpu_count() or 1) * 1.05


def test_a_long_run_profiles_its_last_three_steps_and_keeps_the_breakdown_of_median_time(tmp_path):
    """From 12 steps the last 3 run under the profiler: none of them is timed, and each rank's
    breakdown is the one whose wall time is their median (one profiled step took up to 2-3x
    the timed median in the kept runs of bench/time_fidelity.py)."""
    steps = 12
    run = run_for_breakdown(tmp_path, make_plan(dp=2), steps)
    assert run["profiled_steps"] == 3
    for r in run["ranks"]:
        assert_breakdown_adds_up(r)
        assert r["breakdown_step_s"] == sorted(r["step_times_s"][9:12])[1]
        assert r["median_step_s"] == statistics.median(r["step_times_s"][2:9])
    report = RunReport.from_json(run)
    assert report.timed_steps == list(range(2, 9))
    assert report.step_s == statistics.median(max(r["step_times_s"][i] for r in run["ranks"]) for i in range(2, 9))


def test_breakdown_sees_each_kind_of_collective(tmp_path):
    """dp2 x tp2 (ZeRO 3): FSDP2's gathers and reductions, DTensor's all-reduces, each where it belongs."""
    run = run_for_breakdown(tmp_path, make_plan(dp=2, tp=2, zero=3, optimizer=MOMENTUM), 4)
    for r in run["ranks"]:
        parts = assert_breakdown_adds_up(r)
        assert parts["dp_comm"] > 0 and parts["tp_comm"] > 0 and parts["p2p"] == 0


def test_zero1_chunks_every_parameter_evenly():
    # ceil(numel / dp) flattened elements per rank, the last chunks shorter or empty
    assert chunk_bounds(10, 2) == [(0, 5), (5, 10)]
    assert chunk_bounds(10, 3) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]


def test_launch_command_for_one_and_several_nodes():
    plan = make_plan(dp=4)
    one = build_command("p.json", plan, steps=3, out="r.json")
    assert one[1:] == ["-m", "torch.distributed.run", "--nproc-per-node=4", "--standalone",
                       "-m", "runtime", "p.json", "--steps", "3", "--out", "r.json"]
    two = build_command("p.json", plan, nnodes=2, node_rank=1, rdzv_endpoint="node0:29500")
    assert two[3:8] == ["--nproc-per-node=2", "--nnodes=2", "--node-rank=1", "--master-addr=node0", "--master-port=29500"]
    with pytest.raises(ValueError):
        build_command("p.json", plan, nnodes=3)


# -- refusals: one sentence and exit code 2 on every rank, never a hang --------------------

def assert_refused(plan_path: Path, nproc: int, tmp_path: Path, expect: str) -> None:
    logs = tmp_path / "logs"
    cmd = torchrun(nproc, "--log-dir", str(logs), "--redirects", "3", "-m", "runtime", str(plan_path), "--out", str(tmp_path / "run.json"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=ENV)
    assert proc.returncode != 0
    # torchrun's own summary lists each rank's exit code (and torchrun itself exits 1).
    assert proc.stderr.count("exitcode  : 2") == nproc, proc.stderr[-3000:]
    rank_errs = sorted(logs.glob("*/attempt_0/*/stderr.log"))
    assert len(rank_errs) == nproc
    for err in rank_errs:
        text = err.read_text().strip()
        assert "Traceback" not in text and len(text.splitlines()) == 1 and text.endswith("."), text
        assert expect in text, text
    assert not (tmp_path / "run.json").exists()


def test_wrong_world_size_is_refused(tmp_path):
    plan_path = tmp_path / "plan.json"
    make_plan(dp=4).save(plan_path)
    assert_refused(plan_path, 2, tmp_path, "is for 4 processes but this launch has 2")


def test_changed_model_file_is_refused(tmp_path):
    model = tmp_path / "model.py"
    model.write_text(MLP.read_text())
    plan_path = tmp_path / "plan.json"
    make_plan(model, dp=2, n_layers=10).save(plan_path)
    model.write_text(MLP.read_text() + "\n# edited after profiling\n")
    assert_refused(plan_path, 2, tmp_path, "has changed since it was profiled")


def test_unknown_plan_schema_is_refused(tmp_path):
    plan_path = tmp_path / "plan.json"
    d = make_plan(dp=2).to_json()
    d["schema"] = 99
    plan_path.write_text(json.dumps(d))
    assert_refused(plan_path, 2, tmp_path, "has schema 99")


def test_zero1_broadcasts_once_per_layer_and_owner(tmp_path):
    """3 gloo ranks, two layers of two parameters each (and the first weight again, as a tied
    weight would come): 6 broadcasts (not 12, nor 9), each of its owner's chunks packed, every
    rank left with one process's Adam step and no gradients."""
    proc = subprocess.run(torchrun(3, str(Path(__file__).parent / "zero1_driver.py"), str(tmp_path)),
                          capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from zero1_driver import model
    whole = model()
    opt = torch.optim.Adam(whole.parameters(), lr=0.1)
    opt.step()
    for r in range(3):
        seen = torch.load(tmp_path / f"rank{r}.pt")
        # layer 0: 35 + 7 elements, chunks of 12+3 / 12+3 / 11+1; layer 1: 14 + 2, 5+1 / 5+1 / 4+0
        assert seen["sent"] == [15, 15, 12, 6, 6, 4]
        assert seen["grads_left"] == 0
        for got, want in zip(seen["params"], whole.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-7)
