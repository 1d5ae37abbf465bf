"""Bad input to every command: one sentence naming the problem and the fix, exit code 2 (3 when
nothing fits), no traceback, and no output file written or overwritten."""

import json
import os
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
    "exits_on_import": (GOOD_HEAD + "import sys\nsys.exit(3)\n", ["exits when imported (SystemExit(3)", "__main__"]),
    "parses_argv_on_import": (GOOD_HEAD + "import argparse\np = argparse.ArgumentParser()\np.add_argument('--lr', required=True)\n"
                              "p.parse_args()\n", ["exits when imported (SystemExit(2)", "parses the command line"]),
    "no_parameters": (GOOD_HEAD + "def build_model():\n    return nn.Sequential(nn.ReLU(), nn.Identity())\n"
                      "def loss_fn(o, t):\n    return o.sum()\n", ["no trainable parameters"]),
    "nan_output": (GOOD_HEAD + "class N(nn.Module):\n    def __init__(s):\n        super().__init__(); s.l = nn.Linear(8, 4)\n"
                   "    def forward(s, x):\n        return s.l(x) * float('nan')\ndef build_model():\n    return nn.Sequential(N())\n",
                   ["the loss in", "is nan on make_batch's data", "inf or NaN"]),
    "too_big_without_fake": (GOOD_HEAD + "def build_model():\n    return nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 400_000_000_000))\n",
                             ["could not allocate the model", "--fake"]),
    "build_model_raises": (GOOD_HEAD + "def build_model():\n    raise ValueError('bad config')\n",
                           ["build_model() in", "raised ValueError: bad config"]),
    "make_batch_raises": ("import torch.nn as nn\ndef build_model():\n    return nn.Sequential(nn.Linear(8, 4))\n"
                          "def make_batch(b):\n    raise KeyError('x')\n", ["make_batch(1)", "raised KeyError"]),
    "empty_sequential": (GOOD_HEAD + "def build_model():\n    return nn.Sequential()\n", ["empty nn.Sequential"]),
    "build_model_not_callable": (GOOD_HEAD + "build_model = 3\n", ["defines no build_model()"]),
    "empty_file": ("", ["defines no build_model()"]),
    "tp_plan_not_a_dict": (GOOD_HEAD + "def build_model():\n    return nn.Sequential(nn.Linear(8, 4))\ntp_plan = ['a']\n",
                           ["tp_plan in model file", "must be a dict"]),
    "tp_plan_unknown_style": (GOOD_HEAD + "def build_model():\n    return nn.Sequential(nn.Linear(8, 4))\n"
                              "tp_plan = {'0': 'diagonal'}\n", ["has style 'diagonal'", "colwise, rowwise, sequence"]),
    "tp_plan_sequence_leaves_a_weight": (GOOD_HEAD + "class L(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                                         "        self.norm, self.fc, self.out = nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 4)\n"
                                         "    def forward(self, x):\n        return self.out(self.fc(self.norm(x)))\n"
                                         "def build_model():\n    return nn.Sequential(L())\n"
                                         "tp_plan = {'norm': 'sequence', 'fc': 'colwise'}\n",
                                         ["runs sequence-parallel", "parameter out.weight belongs to no module", "name its module"]),
    "tp_plan_sequence_on_a_block": (GOOD_HEAD + "def build_model():\n    return nn.Sequential(nn.Sequential(nn.Sequential(nn.Linear(8, 4))))\n"
                                    "tp_plan = {'0': 'sequence'}\n", ["sequence-parallel", "with submodules", "such as norms"]),
    "tp_plan_vocab_not_the_head": (GOOD_HEAD + "def build_model():\n    return nn.Sequential(nn.Sequential(nn.Linear(8, 8)), nn.Sequential(nn.Linear(8, 4)))\n"
                                   "tp_plan = {'0': 'vocab'}\n", ["makes 0 of layer 0 (Sequential) \"vocab\"", "applies to the output head only"]),
    "tp_plan_two_vocab_heads": (GOOD_HEAD + "class H(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                                "        self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 4)\n"
                                "    def forward(self, x):\n        return self.a(x) + self.b(x)\n"
                                "def build_model():\n    return nn.Sequential(H())\ntp_plan = {'a': 'vocab', 'b': 'vocab'}\n",
                                ["makes both a and b of layer 0 (H) \"vocab\"", "name only the output head"]),
    "tp_divides_not_a_list": (GOOD_HEAD + "def build_model():\n    return nn.Sequential(nn.Linear(8, 4))\ntp_divides = 'x'\n",
                              ["tp_divides in model file", "list of positive integers"]),
    "loss_not_scalar": (GOOD_HEAD + "def build_model():\n    return nn.Sequential(nn.Linear(8, 4))\n"
                        "def loss_fn(o, t):\n    return o\n", ["loss_fn must return a scalar tensor"]),
    "targets_do_not_fit_the_loss": ("import torch, torch.nn as nn\ndef build_model():\n    return nn.Sequential(nn.Linear(8, 4))\n"
                                    "def make_batch(b):\n    return torch.randn(b, 8), torch.randn(b, 4, 5)\n",
                                    ["cannot take the model's output", "fix loss_fn or the last layer"]),
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


def test_a_loss_that_cannot_take_split_logits(tmp_path):
    """A "vocab" head hands the loss its logits split by vocabulary; a loss that mixes them with
    a whole tensor (here gather with the targets) fails under loss_parallel: one sentence."""
    from pathlib import Path
    examples = Path(__file__).resolve().parent.parent / "examples"
    model = tmp_path / "gathering_loss.py"
    model.write_text(textwrap.dedent(f"""\
        import sys
        sys.path.insert(0, {str(examples)!r})
        import gpt
        build_model, make_batch, tp_divides, tp_plan = gpt.build_model, gpt.make_batch, gpt.tp_divides, gpt.tp_plan
        def loss_fn(logits, targets):
            return -logits.log_softmax(-1).gather(-1, targets[..., None]).mean()
        """))
    out = tmp_path / "profile.json"
    result = run(["profile", str(model), "--fake", "-o", str(out), "--batch-sizes", "1"], tmp_path)
    assert_one_sentence_error(result, ["cannot take the logits of its \"vocab\" head split by vocabulary",
                                       "F.cross_entropy", "take the head out of the tp_plan"])
    assert not out.exists()


def test_binary_model_file(tmp_path):
    model = tmp_path / "model.pt"
    model.write_bytes(b"\x80\x04\x95\x00\x00PK\x03\x04\x00\xff\xfe")
    out = tmp_path / "profile.json"
    result = run(["profile", str(model), "-o", str(out)], tmp_path)
    assert_one_sentence_error(result, ["is not Python source text", "binary file"])
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
    (lambda d: d["layers"][0].__setitem__("index", 7), "layer indices are not 0, 1, 2"),
    (lambda d: d["layers"][0]["samples"]["1"].__setitem__("fwd_s", -1.0), "fwd_s = -1.0"),
    (lambda d: d.__setitem__("batch_sizes", [1, 2, 3]), "not at the profile's batch sizes [1, 2, 3]"),
    (lambda d: d["layers"][0].__setitem__("samples", {"x": {}}), "damaged or hand-edited"),
    (lambda d: d.__setitem__("threads", 0), "threads is 0"),
    (lambda d: d["layers"][1]["samples"]["1"].__setitem__("input_bytes", 7), "outputs"),
    (lambda d: d.__setitem__("precision", "fp8"), "precision 'fp8'"),
    (lambda d: d.__setitem__("layers", []), "it has no layers"),
    (lambda d: d["layers"][0].__setitem__("param_count", -3), "param_count = -3"),
    (lambda d: d.pop("loss"), "KeyError: 'loss'"),
    (lambda d: d.pop("model"), "KeyError: 'model'"),
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
    (["--gpus", "2", "--workers", "0"], "--workers is 0"),
    (["--gpus", "2", "--micro-batch", "-1"], "--micro-batch is -1"),
    (["--gpus", "2", "--checkpoint", "some"], "--checkpoint some is not one of"),
    (["--gpus", "2", "--schedule", "zb"], "--schedule zb is not one"),
    (["--gpus", "2", "--schedule", "gpipe", "--virtual-stages", "2"], "--virtual-stages applies to the interleaved and looped_bfs schedules"),
    (["--gpus", "2", "--virtual-stages", "1"], "--virtual-stages is 1"),
    (["--gpus", "2", "--pp", "2", "--virtual-stages", "2"], "--pp 2 x --virtual-stages 2 is more stages than the model's 3 layers"),
    (["--gpus", "2", "--pp", "1", "--schedule", "interleaved"], "the interleaved schedule needs pipeline stages"),
    (["--gpus", "2", "--pp", "1", "--schedule", "looped_bfs"], "the looped_bfs schedule needs pipeline stages"),
    (["--gpus", "4", "--dp", "2", "--schedule", "looped_bfs"], "the looped_bfs schedule is planned without FSDP units only, and --dp 2"),
    (["--gpus", "2", "--virtual-stages", "2"], "--virtual-stages 2 needs 4 layers for the fewest pipeline ranks (2)"),
    (["--gpus", "2", "--zero", "5"], "not a ZeRO stage"),
    (["--gpus", "2", "--sequence-parallel", "maybe"], "--sequence-parallel maybe is not one of on, off, auto"),
    (["--gpus", "2", "--sequence-parallel", "on"], "--sequence-parallel on needs a tp_plan that names the model's norms"),
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
    (["--device", "cuda", "--processes", "0"], ["--processes '0' must list counts of 1 or more"]),
    (["--processes", "two"], ["is not a comma-separated list of integers"]),
    (["--device", "tpu"], ["--device tpu is not cpu or cuda"]),
    (["--base", "h300"], ["--base h300 is not a preset"]),
    (["--runs", "0"], ["--runs 0 must be 1 or more"]),
])
def test_bad_calibrate_flags(args, needles, tmp_path):
    out = tmp_path / "cluster.toml"
    result = run(["calibrate", "-o", str(out), *args], tmp_path)
    assert_one_sentence_error(result, needles)
    assert not out.exists()


def test_calibrate_refuses_an_output_it_cannot_write_before_measuring(tmp_path):
    result = run(["calibrate", "-o", str(tmp_path / "missing" / "cluster.toml")], tmp_path)
    assert_one_sentence_error(result, ["does not exist; create the folder or give another path"])
    result = run(["calibrate", "-o", str(tmp_path)], tmp_path)
    assert_one_sentence_error(result, ["is a directory; give a file name"])


def test_bad_threads_flag(tmp_path):
    out = tmp_path / "profile.json"
    result = run(["profile", "examples/gpt.py", "-o", str(out), "--threads", "0"], tmp_path)
    assert_one_sentence_error(result, ["--threads is 0; give 1 or more"])
    assert not out.exists()


# -- hand-edited plans: refused by every command that reads them, before anything starts --

@pytest.fixture(scope="module")
def small_plan(small_profile, tmp_path_factory):
    _, prof = small_profile
    plan = tmp_path_factory.mktemp("plan") / "plan.json"
    result = CliRunner().invoke(app, ["solve", str(prof), "--gpus", "2", "--hardware", "cpu", "--dp", "2", "-o", str(plan)])
    assert result.exit_code == 0, result.output
    return plan


def edited_copy(doc_path, edit, tmp_path):
    d = json.loads(doc_path.read_text())
    edit(d)
    bad = tmp_path / doc_path.name
    bad.write_text(json.dumps(d))
    return bad


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d.__setitem__("world_size", "2"), "world_size is '2'"),
    (lambda d: d.__setitem__("dp", 0), "dp is 0"),
    (lambda d: d.__setitem__("micro_batch_size", 0), "micro_batch_size is 0"),
    (lambda d: d["optimizer"].__setitem__("lr", "0.001"), "lr is '0.001'"),
    (lambda d: d["optimizer"].__setitem__("name", "lion"), "optimizer 'lion'"),
    (lambda d: d["optimizer"].__setitem__("betas", [0.9]), "betas are [0.9]"),
    (lambda d: d.__setitem__("hardware", {"name": 3}), "hardware's name is 3"),
    (lambda d: d["hardware"].__setitem__("memory_bytes", "lots"), "hardware description is damaged"),
    (lambda d: d.__setitem__("memory_limit_bytes", -1), "memory_limit_bytes is -1"),
    (lambda d: d.__setitem__("seed", "x"), "seed is 'x'"),
    (lambda d: d.__setitem__("sequence_parallel", True), "sequence_parallel is on with tp 1"),
    (lambda d: d.__setitem__("sequence_parallel", "yes"), "sequence_parallel is 'yes'"),
    (lambda d: d["stages"][0]["layers"][0].__setitem__("index", 5), "do not hold the layers 0, 1, 2"),
    (lambda d: d["stages"][0]["layers"][0].__setitem__("checkpoint", "yes"), "not one of none, selective, full"),
    (lambda d: d.__setitem__("precision", "fp8"), "precision is 'fp8'"),
    (lambda d: d["predicted"].__setitem__("step_time_s", 0), "predicted step time 0"),
    (lambda d: d.__setitem__("device_type", "tpu"), "device_type is 'tpu'"),
    (lambda d: d.pop("optimizer"), "KeyError: 'optimizer'"),
    (lambda d: d.__setitem__("profile", "x"), "its profile is 'x'"),
    (lambda d: d.__setitem__("schema", 1), "has schema 1"),
])
@pytest.mark.parametrize("command", [["show"], ["run", "--print"], ["run"]])
def test_hand_edited_plan(small_plan, tmp_path, edit, needle, command):
    bad = edited_copy(small_plan, edit, tmp_path)
    result = run([command[0], str(bad), *command[1:]], tmp_path)
    assert_one_sentence_error(result, [needle])
    assert not (tmp_path / "run.json").exists()


def test_a_plan_missing_a_layer_is_refused_before_launch(small_plan, tmp_path):
    def drop_last_layer(d):
        d["stages"][-1]["layers"].pop()
        d["predicted"] = None
    bad = edited_copy(small_plan, drop_last_layer, tmp_path)
    result = run(["run", str(bad), "--out", str(tmp_path / "run.json")], tmp_path)
    assert_one_sentence_error(result, ["lays out 2 layers but", "builds 3"])


def test_a_cuda_plan_is_refused_where_torch_sees_no_gpu(small_plan, tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from planner.hardware import PRESETS
    bad = edited_copy(small_plan, lambda d: d.update(device_type="cuda", hardware=PRESETS["h100-sxm-80g"].to_json()), tmp_path)
    result = run(["run", str(bad), "--out", str(tmp_path / "run.json")], tmp_path)
    assert_one_sentence_error(result, ["runs 2 ranks on CUDA GPUs per node but torch sees 0 here"])
    assert not (tmp_path / "run.json").exists()


@pytest.mark.parametrize("args, needle", [
    (["--steps", "0"], "--steps is 0"),
    (["--timeout", "0"], "--timeout is 0"),
    (["--nnodes", "2"], "lays its 2 ranks out on 1 node(s)"),
])
def test_bad_run_flags(small_plan, tmp_path, args, needle):
    result = run(["run", str(small_plan), "--out", str(tmp_path / "run.json"), *args], tmp_path)
    assert_one_sentence_error(result, [needle])
    assert not (tmp_path / "run.json").exists()


# -- hand-edited run documents --------------------------------------------------------

@pytest.fixture()
def small_run(small_plan, tmp_path):
    """A well-formed run document of the small plan (figures made up: these tests damage it)."""
    import hashlib

    from planner.run_report import RankReport, RunReport
    doc = RunReport(str(small_plan), hashlib.sha256(small_plan.read_bytes()).hexdigest(), 2, 3, [1.0, 0.9, 0.8], "cpu",
                    "2.13", [RankReport(r, 0, r, 0, [0], 1 << 20, [0.1] * 3, 0.1) for r in range(2)])
    path = tmp_path / "good" / "run.json"
    path.parent.mkdir()
    doc.save(path)
    return path


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d.__setitem__("steps", 0), "steps is 0"),
    (lambda d: d["ranks"][0].__setitem__("peak_bytes", "x"), "peak_bytes is 'x'"),
    (lambda d: d.__setitem__("losses", ["a"]), "1 losses for 3 steps"),
    (lambda d: d["ranks"][0].__setitem__("median_step_s", 0), "median_step_s is 0"),
    (lambda d: d.__setitem__("ranks", []), "0 ranks for world size 2"),
    (lambda d: d["ranks"][0].__setitem__("rank", 9), "ranks are not 0, 1, 2"),
    (lambda d: d["ranks"][0].__setitem__("step_times_s", []), "0 step times for 3 steps"),
    (lambda d: d.__setitem__("device", 4), "device is 4, not text"),
    (lambda d: d.__setitem__("first_step", -1), "first_step is -1"),
    (lambda d: d.__setitem__("mfu", "high"), "mfu is 'high'"),
    (lambda d: d.__setitem__("checkpoint", 3), "checkpoint is 3, not text"),
])
@pytest.mark.parametrize("command", ["show", "verify"])
def test_hand_edited_run(small_plan, small_run, tmp_path, edit, needle, command):
    bad = edited_copy(small_run, edit, tmp_path)
    args = ["show", str(bad)] if command == "show" else ["verify", str(small_plan), str(bad)]
    assert_one_sentence_error(run(args, tmp_path), [needle])


def test_the_well_formed_run_document_is_read(small_plan, small_run, tmp_path):
    """(So the edits above are what the refusals are about.)"""
    assert run(["show", str(small_run)], tmp_path).exit_code == 0


# -- output paths: checked before any work, nothing written or replaced -------------------

@pytest.mark.parametrize("where, needle", [
    (lambda t: t, "is a directory; give a file name"),
    (lambda t: t / "missing" / "out.json", "does not exist; create the folder"),
    (lambda t: t / "afile" / "out.json", "is a file; create the folder"),
    (lambda t: t / ("a" * 250 + ".json"), "file name is longer than"),
])
@pytest.mark.parametrize("command", ["profile", "profile --csv", "solve", "run --out"])
def test_unwritable_output_is_refused_before_the_work(small_profile, small_plan, tmp_path, where, needle, command):
    model, prof = small_profile
    (tmp_path / "afile").write_text("a file")
    target = where(tmp_path)
    kept = tmp_path / "kept.json"
    kept.write_text("old")
    args = {"profile": ["profile", str(model), "-o", str(target), "--repeats", "1"],
            "profile --csv": ["profile", str(model), "-o", str(kept), "--csv", str(target), "--repeats", "1"],
            "solve": ["solve", str(prof), "--gpus", "1", "--hardware", "cpu", "-o", str(target)],
            "run --out": ["run", str(small_plan), "--out", str(target)]}[command]
    assert_one_sentence_error(run(args, tmp_path), [needle])
    assert kept.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "kept.json"]


# -- the rest of the flags and files ---------------------------------------------------

def test_brackets_survive_in_messages(small_profile, tmp_path):
    _, prof = small_profile
    result = run(["solve", str(prof), "--gpus", "1", "--cluster", str(tmp_path / "none.toml")], tmp_path)
    assert_one_sentence_error(result, ["a TOML file with a [hardware] table"])


def test_show_refuses_a_non_positive_batch(small_profile, tmp_path):
    _, prof = small_profile
    assert_one_sentence_error(run(["show", str(prof), "--batch", "-1"], tmp_path), ["--batch is -1"])


@pytest.mark.parametrize("content, needle", [("", "is not a JSON document"), ("[1, 2]", "is not a JSON document"),
                                             ('{"kind": "recipe"}', "its 'kind' is 'recipe'")])
def test_show_refuses_what_is_not_a_document(tmp_path, content, needle):
    path = tmp_path / "doc.json"
    path.write_text(content)
    assert_one_sentence_error(run(["show", str(path)], tmp_path), [needle])


def test_a_profile_read_from_another_folder_still_finds_its_model(small_profile, tmp_path, monkeypatch):
    """Paths in a profile are absolute: `plan solve` run elsewhere finds the model file."""
    model, _ = small_profile
    here = tmp_path / "project"
    here.mkdir()
    (here / "model.py").write_text(model.read_text())
    monkeypatch.chdir(here)
    assert run(["profile", "model.py", "-o", "profile.json", "--batch-sizes", "1", "--repeats", "1"], here).exit_code == 0
    monkeypatch.chdir(tmp_path)
    result = run(["solve", str(here / "profile.json"), "--gpus", "1", "--hardware", "cpu", "-o", "plan.json"], tmp_path)
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "plan.json").read_text())["model"]["path"] == str(here / "model.py")


def test_a_tp_plan_whose_dims_do_not_divide_profiles_and_offers_no_tp(tmp_path):
    """Linear(8, 5) split column-wise: no TP degree divides 5, so the profile measures no TP
    and a pinned --tp 2 is refused with the reason (DTensor cannot run the split unevenly)."""
    model = tmp_path / "odd.py"
    model.write_text(GOOD_HEAD + textwrap.dedent("""
        class L(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc, self.out = nn.Linear(8, 5), nn.Linear(5, 4)
            def forward(self, x):
                return self.out(self.fc(x))
        def build_model():
            return nn.Sequential(L())
        tp_plan = {"fc": "colwise", "out": "rowwise"}
    """))
    prof = tmp_path / "profile.json"
    assert run(["profile", str(model), "-o", str(prof), "--batch-sizes", "1", "--repeats", "1"], tmp_path).exit_code == 0
    plan = tmp_path / "plan.json"
    result = run(["solve", str(prof), "--gpus", "2", "--hardware", "cpu", "--tp", "2", "-o", str(plan)], tmp_path)
    assert_one_sentence_error(result, ["--tp 2 does not divide the dimensions the model's tp_plan splits"])
    assert not plan.exists()


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_is_refused_before_the_work(small_profile, tmp_path):
    _, prof = small_profile
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        result = run(["solve", str(prof), "--gpus", "1", "--hardware", "cpu", "-o", str(folder / "plan.json")], tmp_path)
        assert_one_sentence_error(result, ["is not writable; give another path"])
        assert list(folder.iterdir()) == []
    finally:
        folder.chmod(0o755)
