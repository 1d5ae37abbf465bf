"""Every table the CLI prints fits 80 columns with no cell cut, at the sizes real plans reach.
Torch-free."""

import io
import random

import pytest
from rich.console import Console

import display
from planner.build import build_plan
from planner.hardware import PRESETS
from planner.run_report import RankReport, RunReport
from planner.cost import Candidate, CostModel
from planner.milp import choices_for
from planner.search import Solution, SolveOptions, frugal_layout
from planner.verify import StageRow, TimeRow
from tests.synthetic import random_profile


def render(renderable, width: int = 80) -> str:
    console = Console(width=width, file=io.StringIO(), record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def assert_readable(text: str, width: int = 80) -> None:
    assert "…" not in text, text                       # rich's mark of a cut cell
    assert max(len(line) for line in text.splitlines()) <= width, text


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """GiB-sized layers on 64 GPU-like devices in 16 stages: long numbers, many rows. The
    layouts are built, not solved (a search of these random layers takes minutes)."""
    prof = random_profile(random.Random(7), 48, byte_scale=2**15)
    path = tmp_path_factory.mktemp("big") / "profile.json"
    prof.save(path)
    hw = PRESETS["h100-sxm-80g"]
    opts = SolveOptions(gpus=64, hardware=hw, global_batch=1024)
    model = CostModel(prof, hw, 8, None)
    solutions = []
    for k, (dp, tp, pp, b, zero) in enumerate([(4, 1, 16, 1, 1), (2, 2, 16, 2, 3), (1, 4, 16, 4, 0),
                                               (8, 1, 8, 1, 3), (16, 4, 1, 2, 3)]):
        cand = Candidate(dp, tp, pp, b, 1024 // (dp * b), zero, "1f1b", zero > 0, False)
        stages = [[(i, ck, False) for i, ck, _ in st] for st in frugal_layout(model, cand, choices_for("auto", "none", False))]
        stages = [[(i, ck and (i + k) % 3 > 0, off) for i, ck, off in st] for st in stages]   # ranges like 1-2,4-5
        solutions.append(Solution(cand, stages, model.evaluate(cand, stages)))
    plan = build_plan(solutions[0], solutions[1:], prof, str(path), hw, opts, hw.usable_memory_bytes(), "plan.json")
    return prof, solutions, plan


@pytest.mark.parametrize("wide", [False, True])
def test_every_table_fits_80_columns(big, wide):
    prof, solutions, plan = big
    width = 80 if not wide else 400
    tables = [
        display.profile_table(prof, 4, wide),
        display.hardware_table(PRESETS, wide),
        display.top_table(solutions, plan.memory_limit_bytes, wide),
        display.plan_table(plan, wide),
        display.memory_check_table([StageRow(s, list(range(4 * s, 4 * s + 4)), 70 * 2**30 + s, 71 * 2**30, -1.41, 74 * 2**30)
                                    for s in range(16)], "predicted vs measured: plan-64xh100.json / run.json", 3.0)[0],
        display.time_check_table([TimeRow(c, 1.234, 12.345) for c in ("compute", "tp_comm", "dp_comm", "p2p")], 63),
        display.run_table(RunReport("plan-64xh100.json", "0" * 64, 64, 6, [10.0] * 6, "NVIDIA H100 80GB HBM3", "2.13",
                                    [RankReport(r, r // 4, r % 4, 0, [r // 4], 71 * 2**30, [12.5] * 6, 12.5)
                                     for r in range(64)])),
    ]
    for t in tables:
        assert_readable(render(t, width), width)


def test_wide_adds_columns_and_default_keeps_what_matters(big):
    prof, solutions, plan = big
    narrow, wide = render(display.plan_table(plan, False)), render(display.plan_table(plan, True), 400)
    assert "peak during" in wide and "peak during" not in narrow
    for column in ("weights", "grads", "optim", "activ", "peak"):
        assert column in narrow
    assert "peak per stage" in render(display.top_table(solutions, plan.memory_limit_bytes, True), 400)


def test_memory_check_shows_reserved_memory_only_where_measured():
    """CUDA runs carry what the allocator reserved; CPU runs (0) show no such column."""
    rows = [StageRow(0, [0], 11 * 2**30, 12 * 2**30, -8.3, 13 * 2**30)]
    text = render(display.memory_check_table(rows, "t", 3.0)[0])
    assert "reserved" in text and "13" in text
    rows[0].reserved = 0
    assert "reserved" not in render(display.memory_check_table(rows, "t", 3.0)[0])


def test_brackets_in_names_survive():
    """A title or message holding [brackets] prints them (rich markup would swallow them)."""
    text = render(display.titled("a TOML file with a [hardware] table", display.table(["x"])))
    assert "[hardware]" in text


@pytest.mark.parametrize("value, text", [(0, "0"), (0.001, "0.001"), (3.14159, "3.14"), (31.4159, "31.4"),
                                         (31415.9, "31,416")])
def test_numbers_stay_short(value, text):
    assert display.number(value) == text


@pytest.mark.parametrize("n, text", [(4096, "4,096"), (73_728, "73.7K"), (856_686_592, "857M"),
                                     (70_553_706_496, "70.6B")])
def test_parameter_counts(n, text):
    assert display.count(n) == text


# -- pictures --------------------------------------------------------------------------

def test_the_timeline_drawn_is_the_step_predicted(big):
    """Each stage's forward and backward add up to its time per micro-batch, and the schedule
    run with them has every action once, never two at a time on a stage."""
    import plots
    from planner.timeline import schedule_timeline
    _, _, plan = big
    phases = [plots.stage_phases(s) for s in plan.predicted.stages]
    for (f, b, parts), s in zip(phases, plan.predicted.stages):
        assert f + b == pytest.approx(s.micro_batch_s, rel=1e-9)
        assert sum(parts.values()) * 1 == pytest.approx(s.micro_batch_s - parts["communication"], rel=1e-9)
        assert parts["recompute"] > 0 or not any(lc.recomputes for lc in plan.stages[s.index].layers)
    actions = schedule_timeline(plan.schedule, [f for f, _, _ in phases], [b for _, b, _ in phases], plan.num_micro_batches)
    assert len(actions) == 2 * plan.pp * plan.num_micro_batches
    for stage in range(plan.pp):
        mine = sorted((a.start_s, a.end_s) for a in actions if a.stage == stage)
        assert all(end <= nxt + 1e-12 for (_, end), (nxt, _) in zip(mine, mine[1:]))


def test_plot_files_are_pictures(big, tmp_path):
    import plots
    from planner.verify import StageRow, TimeRow
    _, _, plan = big
    plots.plot_plan(plan, tmp_path / "plan.png")
    rows = [StageRow(s, [s], 70 * 2**30, 71 * 2**30, -1.4) for s in range(plan.pp)]
    plots.plot_verify(plan, rows, [TimeRow("compute", 1.0, 1.2)], tmp_path / "verify.png")
    for name in ("plan.png", "verify.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.png", "verify.png"]   # no temporary left


def test_run_summary_says_throughput_and_mfu_only_on_gpus():
    from display import run_summary
    from planner.run_report import RankReport, RunReport
    ranks = [RankReport(r, 0, r, 0, [0], 1 << 20, [0.5] * 3, 0.5) for r in range(2)]
    run = RunReport("p.json", "0" * 64, 2, 3, [6.5, 6.0, 5.5], "cpu", "2.13", ranks, global_batch=16,
                    tokens_per_sample=64, mfu=0.4)
    assert run_summary(run) == "p.json: 3 steps on 2 x cpu, loss 6.5000 -> 5.5000, 2,048 tokens/s"   # 16 x 64 / 0.5 s
    run.device, run.tokens_per_sample = "NVIDIA H100", 0
    assert run_summary(run).endswith("loss 6.5000 -> 5.5000, 32.0 samples/s, MFU 40.0%")
    run.global_batch = 0                                  # an older run document: no throughput to show
    assert run_summary(run).endswith("loss 6.5000 -> 5.5000")


def test_solve_tables_show_mfu_and_say_gpu_only_on_gpus(big):
    """On CPU processes MFU is a share of a nominal peak: `plan solve` leaves it out, as
    `plan run`'s summary does, and says memory per process, not per GPU."""
    prof, solutions, plan = big
    gpu = render(display.top_table(solutions, plan.memory_limit_bytes, False, "cuda"))
    cpu = render(display.top_table(solutions, plan.memory_limit_bytes, False, "cpu"))
    assert "MFU" in gpu and "per GPU" in gpu and f"{100 * solutions[0].prediction.mfu:.1f}%" in gpu
    assert "MFU" not in cpu and "%" not in cpu and "per process" in cpu and "per GPU" not in cpu
    assert "per GPU" in render(display.plan_table(plan, False))
    plan.device_type = "cpu"
    try:
        assert "per process" in render(display.plan_table(plan, False))
    finally:
        plan.device_type = "cuda"


def test_the_component_table_adds_up_each_side_and_says_how_far_the_profiled_step_ran_long():
    rows = [TimeRow("compute", 0.040, 0.060), TimeRow("p2p", 0.050, 0.040), TimeRow("other", 0.0, 0.050)]
    text = render(display.time_check_table(rows, 0, (0.090, 0.150)))
    assert text.splitlines()[-1].split() == ["step", "90.0", "150.0"]
    line = display.profiled_step_line(0.150, 0.100)
    assert "1.50x" in line and "0.1000 s" in line and "overhead" in line
    assert "within 5%" in display.profiled_step_line(0.103, 0.100)


def test_a_plan_gives_back_its_candidate_and_layout(big, tmp_path):
    """layout_of is build_plan's inverse: the candidate (degrees, micro-batching, ZeRO, whether
    layers are wrapped) and every stage's layers, so a kept plan can be predicted again."""
    from planner.build import layout_of
    from planner.plan import checkpoint_mode, load_plan
    prof, solutions, _ = big
    hw = PRESETS["h100-sxm-80g"]
    opts = SolveOptions(gpus=64, hardware=hw, global_batch=1024)
    prof.save(tmp_path / "profile.json")
    for k, sol in enumerate(solutions):
        plan = build_plan(sol, [], prof, str(tmp_path / "profile.json"), hw, opts, hw.usable_memory_bytes(), "plan.json")
        plan.save(tmp_path / f"plan{k}.json")
        cand, stages = layout_of(load_plan(tmp_path / f"plan{k}.json"))
        assert cand == sol.candidate
        assert stages == [[(i, checkpoint_mode(ck), bool(off)) for i, ck, off in st] for st in sol.stages]
