"""Bad input to `plan profile` and `plan solve`: one sentence naming the problem and the fix,
exit code 2, no traceback, and no output file written or overwritten."""

import json
import textwrap

import pytest
from typer.testing import CliRunner

from cli import app

GOOD_HEAD = """
import torch, torch.nn as nn
def make_batch(b):
    return torch.randn(b, 8), torch.randint(0, 4, (b,))
"""

BAD_MODEL_FILES = {
    "syntax_error": ("def build_model(:\n    pass\n", ["syntax error at line 1"]),
    "no_build_model": (GOOD_HEAD, ["defines no build_model()"]),
    "not_sequential": (GOOD_HEAD + "def build_model():\n    return nn.Linear(8, 4)\n",
                       ["returned a Linear, not an nn.Sequential"]),
    "no_make_batch": ("import torch.nn as nn\ndef build_model():\n    return nn.Sequential(nn.Linear(8, 4))\n",
                      ["defines no make_batch()"]),
    "bad_batch": ("import torch, torch.nn as nn\ndef build_model():\n    return nn.Sequential(nn.Linear(8, 4))\n"
                  "def make_batch(b):\n    return torch.randn(b, 8)\n",
                  ["make_batch(", "must return a pair of tensors (inputs, targets)"]),
    "layers_do_not_chain": (GOOD_HEAD + "def build_model():\n    return nn.Sequential(nn.Linear(8, 16), nn.Linear(32, 4))\n",
                            ["layer 1 (Linear)", "output of layer 0 (Linear)", "shape (1, 16)"]),
    "tp_plan_matches_nothing": (GOOD_HEAD + "def build_model():\n    return nn.Sequential(nn.Linear(8, 4))\n"
                                "tp_plan = {'mlp.fc': 'colwise'}\n",
                                ["tp_plan entry 'mlp.fc'", "matches no submodule"]),
    "import_fails": ("import torch\nraise RuntimeError('boom')\n", ["failed to import", "boom"]),
}


def run(args, tmp_path):
    return CliRunner().invoke(app, args, catch_exceptions=False)


def assert_one_sentence_error(result, needles):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    text = " ".join(result.output.split())
    for needle in needles:
        assert needle in text, (needle, text)


@pytest.mark.parametrize("case", sorted(BAD_MODEL_FILES))
def test_bad_model_file(case, tmp_path):
    source, needles = BAD_MODEL_FILES[case]
    model = tmp_path / f"{case}.py"
    model.write_text(textwrap.dedent(source))
    out = tmp_path / "profile.json"
    result = run(["profile", str(model), "-o", str(out), "--batch-sizes", "1", "--repeats", "1"], tmp_path)
    assert_one_sentence_error(result, needles)
    assert not out.exists()


def test_missing_model_file(tmp_path):
    out = tmp_path / "profile.json"
    result = run(["profile", str(tmp_path / "nope.py"), "-o", str(out)], tmp_path)
    assert_one_sentence_error(result, ["does not exist"])
    assert not out.exists()


def test_failed_profile_keeps_the_old_file(tmp_path):
    out = tmp_path / "profile.json"
    out.write_text("old")
    model = tmp_path / "m.py"
    model.write_text(BAD_MODEL_FILES["not_sequential"][0])
    result = run(["profile", str(model), "-o", str(out)], tmp_path)
    assert result.exit_code == 2
    assert out.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".profile")] == []


@pytest.fixture(scope="module")
def small_profile(tmp_path_factory):
    """A real profile of a small model file (its own copy, so tests can edit it)."""
    d = tmp_path_factory.mktemp("prof")
    model = d / "model.py"
    model.write_text(GOOD_HEAD + textwrap.dedent("""
        def build_model():
            return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    """))
    out = d / "profile.json"
    result = CliRunner().invoke(app, ["profile", str(model), "-o", str(out), "--batch-sizes", "1,2", "--repeats", "1"])
    assert result.exit_code == 0, result.output
    return model, out


def test_solve_missing_profile(tmp_path):
    result = run(["solve", str(tmp_path / "none.json"), "--gpus", "2", "-o", str(tmp_path / "plan.json")], tmp_path)
    assert_one_sentence_error(result, ["does not exist", "plan profile"])


def test_solve_profile_of_changed_model(small_profile, tmp_path):
    model, prof = small_profile
    original = model.read_text()
    try:
        model.write_text(original + "\n# edited\n")
        plan = tmp_path / "plan.json"
        result = run(["solve", str(prof), "--gpus", "1", "--hardware", "cpu", "-o", str(plan)], tmp_path)
        assert_one_sentence_error(result, ["has changed since it was profiled"])
        assert not plan.exists()
    finally:
        model.write_text(original)


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d["layers"][0].__setitem__("param_bytes", "many"), "param_bytes"),
    (lambda d: d["layers"][0]["samples"]["1"].__setitem__("saved_bytes", -5), "saved_bytes"),
    (lambda d: d.__setitem__("schema", 99), "schema 99"),
    (lambda d: d.__setitem__("optimizer", "lion"), "optimizer 'lion'"),
    (lambda d: d["layers"][0].pop("grad_bytes"), "grad_bytes"),
])
def test_solve_hand_edited_profile(small_profile, tmp_path, edit, needle):
    _, prof = small_profile
    d = json.loads(prof.read_text())
    edit(d)
    bad = tmp_path / "edited.json"
    bad.write_text(json.dumps(d))
    result = run(["solve", str(bad), "--gpus", "1", "--hardware", "cpu", "-o", str(tmp_path / "plan.json")], tmp_path)
    assert_one_sentence_error(result, [needle])


def test_solve_bad_cluster_file(small_profile, tmp_path):
    _, prof = small_profile
    cluster = tmp_path / "c.toml"
    cluster.write_text('[hardware]\nbase = "h100-sxm-80g"\nmemory_bytes = "lots"\n')
    result = run(["solve", str(prof), "--gpus", "1", "--cluster", str(cluster), "-o", str(tmp_path / "p.json")], tmp_path)
    assert_one_sentence_error(result, ["memory_bytes"])


@pytest.mark.parametrize("flags, needle", [
    (["--gpus", "6", "--tp", "4"], "cannot be split"),
    (["--gpus", "4", "--dp", "2", "--tp", "1", "--pp", "1"], "is not --gpus 4"),
    (["--gpus", "4", "--global-batch", "6", "--dp", "4"], "not divisible by --dp 4"),
    (["--gpus", "2", "--global-batch", "8", "--dp", "2", "--micro-batch", "3"], "not divisible by --dp 2 x --micro-batch 3"),
    (["--gpus", "2", "--pp", "4"], "cannot be split into the pinned degrees (--pp 4)"),
    (["--gpus", "9", "--pp", "9", "--gpus-per-node", "9"], "more pipeline stages than the model's 3 layers"),
    (["--gpus", "12", "--gpus-per-node", "8"], "not a whole number of nodes of 8 GPUs"),
    (["--gpus", "12", "--gpus-per-node", "6", "--tp", "4"], "--tp 4 groups would straddle nodes of 6 GPUs"),
    (["--gpus", "2", "--gpus-per-node", "0"], "--gpus-per-node is 0"),
    (["--gpus", "2", "--global-batch", "0"], "--global-batch is 0"),
    (["--gpus", "2", "--top", "0"], "--top is 0"),
    (["--gpus", "2", "--memory-limit", "0"], "--memory-limit = '0' must be positive"),
    (["--gpus", "2", "--time-limit", "0"], "--time-limit is 0"),
    (["--gpus", "2", "--micro-batch", "-1"], "--micro-batch is -1"),
    (["--gpus", "2", "--checkpoint", "some"], "--checkpoint some is not one of"),
    (["--gpus", "2", "--schedule", "zb"], "--schedule zb is not one"),
    (["--gpus", "2", "--zero", "5"], "not a ZeRO stage"),
    (["--gpus", "0"], "positive number of GPUs"),
    (["--gpus", "2", "--memory-limit", "lots"], "--memory-limit"),
])
def test_solve_impossible_flags(small_profile, tmp_path, flags, needle):
    _, prof = small_profile
    plan = tmp_path / "plan.json"
    result = run(["solve", str(prof), "--hardware", "cpu", "-o", str(plan), *flags], tmp_path)
    assert_one_sentence_error(result, [needle])
    assert not plan.exists()


def test_solve_nothing_fits_exits_3(small_profile, tmp_path):
    _, prof = small_profile
    plan = tmp_path / "plan.json"
    result = run(["solve", str(prof), "--gpus", "1", "--hardware", "cpu", "--memory-limit", "1KiB", "-o", str(plan)], tmp_path)
    assert result.exit_code == 3, result.output
    text = " ".join(result.output.split())
    assert "no layout fits" in text and "more than the" in text and "--memory-limit" in text
    assert not plan.exists()


@pytest.mark.parametrize("args, needles", [
    (["--processes", "1"], ["--processes '1' must list counts of 2 or more"]),
    (["--processes", "two"], ["is not a comma-separated list of integers"]),
    (["--device", "tpu"], ["--device tpu is not cpu or cuda"]),
    (["--base", "h300"], ["--base h300 is not a preset"]),
])
def test_bad_calibrate_flags(args, needles, tmp_path):
    out = tmp_path / "cluster.toml"
    result = run(["calibrate", "-o", str(out), *args], tmp_path)
    assert_one_sentence_error(result, needles)
    assert not out.exists()


def test_calibrate_refuses_an_output_it_cannot_write_before_measuring(tmp_path):
    result = run(["calibrate", "-o", str(tmp_path / "missing" / "cluster.toml")], tmp_path)
    assert_one_sentence_error(result, ["does not exist; create it or give another path"])
    result = run(["calibrate", "-o", str(tmp_path)], tmp_path)
    assert_one_sentence_error(result, ["is a directory; give a file name"])


def test_bad_threads_flag(tmp_path):
    out = tmp_path / "profile.json"
    result = run(["profile", "examples/gpt.py", "-o", str(out), "--threads", "0"], tmp_path)
    assert_one_sentence_error(result, ["--threads is 0; give 1 or more"])
    assert not out.exists()
