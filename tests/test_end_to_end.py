"""The README's main job on a small scale: profile -> solve -> run (torchrun, gloo) -> verify."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def plan_cli(*args, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-c", "from cli import app; app()", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def flow(tmp_path_factory):
    d = tmp_path_factory.mktemp("flow")
    shutil.copy(ROOT / "examples" / "mlp.py", d / "mlp.py")
    steps = {}
    steps["profile"] = plan_cli("profile", "mlp.py", "--batch-sizes", "1,2", "--repeats", "1", cwd=d)
    steps["solve"] = plan_cli("solve", "--gpus", "2", "--hardware", "cpu", "--global-batch", "8", cwd=d)
    steps["run"] = plan_cli("run", "plan.json", "--steps", "3", cwd=d)
    steps["verify"] = plan_cli("verify", "plan.json", "run.json", cwd=d)
    return d, steps


def test_every_step_succeeds_and_writes_its_document(flow):
    d, steps = flow
    for name, proc in steps.items():
        assert proc.returncode == 0, (name, proc.stdout[-2000:], proc.stderr[-2000:])
    for doc, kind in (("profile.json", "profile"), ("plan.json", "plan"), ("run.json", "run")):
        assert json.loads((d / doc).read_text())["kind"] == kind


def test_run_follows_the_plan(flow):
    d, _ = flow
    plan = json.loads((d / "plan.json").read_text())
    run = json.loads((d / "run.json").read_text())
    assert run["world_size"] == plan["world_size"] == 2
    assert len(run["losses"]) == 3 and all(x > 0 for x in run["losses"])
    assert {r["pp_rank"] for r in run["ranks"]} == set(range(plan["pp"]))


def test_verify_reports_every_stage_within_tolerance(flow):
    d, steps = flow
    plan = json.loads((d / "plan.json").read_text())
    out = " ".join(steps["verify"].stdout.split())
    assert "predicted vs measured" in out
    assert out.count("%") >= plan["pp"] + 1


def test_verify_fails_past_tolerance(flow):
    d, _ = flow
    run = json.loads((d / "run.json").read_text())
    for r in run["ranks"]:
        r["peak_bytes"] *= 2                       # a run that used twice the predicted memory
    (d / "bad_run.json").write_text(json.dumps(run))
    proc = plan_cli("verify", "plan.json", "bad_run.json", "--tolerance", "3", cwd=d)
    assert proc.returncode == 1
    assert "exceeds --tolerance" in " ".join(proc.stderr.split())


def test_verify_refuses_a_run_of_another_plan(flow):
    d, _ = flow
    other = json.loads((d / "plan.json").read_text())
    other["seed"] = 7
    (d / "other_plan.json").write_text(json.dumps(other))
    proc = plan_cli("verify", "other_plan.json", "run.json", cwd=d)
    assert proc.returncode == 2
    assert "different plan" in " ".join(proc.stderr.split()) and "Traceback" not in proc.stderr


def _truncated(text: str) -> str:
    return text[: len(text) // 2]


def _edited(edit):
    def apply(text: str) -> str:
        doc = json.loads(text)
        edit(doc)
        return json.dumps(doc)
    return apply


@pytest.mark.parametrize("damage, needle", [
    (_truncated, "is not valid JSON"),
    (_edited(lambda d: d.__setitem__("kind", "profile")), "is not a run document"),
    (_edited(lambda d: d.__setitem__("schema", 7)), "has schema 7"),
    (_edited(lambda d: d["ranks"].pop()), "damaged or hand-edited (ValueError: 1 ranks for world size 2)"),
    (_edited(lambda d: d["ranks"][0].__setitem__("median_step_s", "fast")), "rank 0's median_step_s is 'fast'"),
    (_edited(lambda d: d["ranks"][1].pop("peak_bytes")), "damaged or hand-edited (TypeError"),
    (_edited(lambda d: d.__setitem__("losses", [])), "0 losses for 3 steps"),
])
def test_verify_and_show_refuse_a_damaged_or_foreign_run(flow, damage, needle):
    """run.json is a typed document (planner.run_report): a truncated, foreign or edited one
    gets one sentence naming it and the fix, exit 2, in `plan verify` and `plan show`."""
    d, _ = flow
    (d / "damaged_run.json").write_text(damage((d / "run.json").read_text()))
    commands = [("verify", "plan.json", "damaged_run.json")]
    if "is not" not in needle:             # (show tells a document's kind from the file itself)
        commands.append(("show", "damaged_run.json"))
    for args in commands:
        proc = plan_cli(*args, cwd=d)
        text = " ".join(proc.stderr.split())
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert needle in text and "Traceback" not in proc.stderr and ("run the plan again" in text or "pass the run.json" in text), (args, text)


# -- plan run under signals and hangs: every rank stopped, one line, nothing left running ---

def runtime_processes(folder: Path) -> list[int]:
    """Ranks (`-m runtime`) running in `folder`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            cwd = os.readlink(f"/proc/{entry}/cwd")
        except OSError:
            continue
        if b"runtime" in cmd and b"-m" in cmd and Path(cwd) == folder:
            found.append(int(entry))
    return found


def start_plan_run(d: Path, *args) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    return subprocess.Popen([sys.executable, "-c", "from cli import app; app()", "run", "plan.json", *args], cwd=d,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the ranks through /proc")
@pytest.mark.parametrize("signal_name, code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_stops_plan_run_and_every_rank(flow, signal_name, code):
    import signal
    import time
    d, _ = flow
    proc = start_plan_run(d, "--steps", "100000", "--out", "never.json")
    deadline = time.monotonic() + 120
    while len(runtime_processes(d)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(runtime_processes(d)) >= 2, "the ranks did not start"
    time.sleep(2)                                   # inside training, past the process group's setup
    proc.send_signal(getattr(signal, signal_name))
    stdout, stderr = proc.communicate(timeout=90)
    assert proc.returncode == code, stderr[-2000:]
    assert "Traceback" not in stderr + stdout
    assert f"interrupted ({signal_name})" in stderr
    assert runtime_processes(d) == []
    assert not (d / "never.json").exists()


HANGING_MODEL = '''
import os, time
import torch, torch.nn as nn
CALLS = [0]
def build_model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
def make_batch(b):
    CALLS[0] += 1
    if os.environ.get("RANK") == "1" and CALLS[0] == 3:
        time.sleep(600)                 # rank 1 hangs in its third step
    return torch.randn(b, 8), torch.randint(0, 4, (b,))
'''


def test_a_hung_rank_ends_the_run_with_one_sentence(tmp_path):
    (tmp_path / "hang.py").write_text(HANGING_MODEL)
    assert plan_cli("profile", "hang.py", "--batch-sizes", "1", "--repeats", "1", cwd=tmp_path).returncode == 0
    assert plan_cli("solve", "--gpus", "2", "--hardware", "cpu", "--dp", "2", cwd=tmp_path).returncode == 0
    proc = plan_cli("run", "plan.json", "--steps", "6", "--timeout", "3", cwd=tmp_path)
    assert proc.returncode != 0
    text = proc.stderr + proc.stdout
    assert "Traceback" not in text and "ChildFailedError" not in text, text[-3000:]
    assert "rank 0: a collective waited more than 3 s; rank 1 never began step 3" in " ".join(text.split()), text
    assert runtime_processes(tmp_path) == []
    assert not (tmp_path / "run.json").exists()


def test_a_fake_profile_on_a_cluster_file_is_solved_with_its_own_times(tmp_path):
    """`plan profile --fake --hardware FILE` then `plan solve --hardware FILE`: the profile names the
    file's hardware as the solve knows it, so the solve takes its op-by-op times as they are. (It
    recorded the path, and every time was redone from the layer's totals at one rate.)"""
    from planner.cost import CostModel
    from planner.hardware import get_hardware
    from profiles.schema import load_profile
    shutil.copy(ROOT / "examples" / "gpt.py", tmp_path / "gpt.py")
    device_alone = 'base = "h100-sxm-80g"\nop_launch_s = "0s"\n'     # the ops' device time, no launch floor
    (tmp_path / "h100.toml").write_text("[hardware]\n" + device_alone)
    (tmp_path / "slow-hbm.toml").write_text("[hardware]\n" + device_alone + 'hbm_bandwidth = "10 GB/s"\n')
    profiles = {}
    for name in ("h100", "slow-hbm"):
        proc = plan_cli("profile", "gpt.py", "--fake", "--hardware", f"{name}.toml", "--batch-sizes", "2",
                        "-o", f"{name}.json", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-2000:]
        profiles[name] = prof = load_profile(tmp_path / f"{name}.json")
        hw = get_hardware(str(tmp_path / f"{name}.toml"))
        assert prof.hardware == hw.name
        model = CostModel(prof, hw)
        assert model.measured_here
        for layer in prof.layers:
            s = layer.samples[2]
            assert model._times(s) == (s.fwd_s, s.bwd_s)          # the profile's own times
    # and each is its file's: at 10 GB/s of memory bandwidth the layers are memory-bound
    fwd = {name: sum(layer.samples[2].fwd_s for layer in p.layers) for name, p in profiles.items()}
    assert fwd["slow-hbm"] > 10 * fwd["h100"]
