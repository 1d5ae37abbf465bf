"""The limits the planner must hold (issue 14): what a user pins stays pinned, host memory is
checked, a no-fit explanation makes sense, and node boundaries hold. Torch-free."""

import random

import pytest

from planner.hardware import PRESETS, Hardware
from planner.search import SolveOptions, search
from tests.synthetic import random_profile


def roomy_cpu() -> Hardware:
    """The cpu preset with memory to spare: nothing needs checkpointing or offload."""
    return Hardware.from_json({**PRESETS["cpu"].to_json(), "memory_bytes": 1 << 40, "name": "roomy"})


@pytest.mark.parametrize("flag, mode", [("all", "full"), ("selective", "selective")])
def test_pinned_checkpoint_all_stays_in_every_layout(flag, mode):
    """--checkpoint all (selective) reproduces a full-recompute (selective) run: the
    simplification that drops checkpoints memory does not need must leave pinned ones alone."""
    prof = random_profile(random.Random(3), 6)
    for gpus in (1, 2, 4):
        result = search(prof, SolveOptions(gpus=gpus, hardware=roomy_cpu(), global_batch=8, checkpoint=flag, top_k=3))
        assert result.solutions
        for sol in result.solutions:
            assert all(ck == mode for st in sol.stages for _, ck, _ in st), sol.candidate.describe()
        free = search(prof, SolveOptions(gpus=gpus, hardware=roomy_cpu(), global_batch=8, top_k=1))
        assert all(ck == "none" for st in free.solutions[0].stages for _, ck, _ in st)   # so "all" was kept, not free


@pytest.mark.parametrize("v", [2, 3])
def test_pinned_interleaved_schedule_stays_in_every_layout(v):
    """--schedule interleaved --virtual-stages v: every listed layout runs v stages a rank."""
    prof = random_profile(random.Random(3), 6)
    result = search(prof, SolveOptions(gpus=2, hardware=roomy_cpu(), global_batch=8, schedule="interleaved",
                                       virtual_stages=v, top_k=3))
    assert result.solutions
    for sol in result.solutions:
        c = sol.candidate
        assert (c.pp, c.schedule, c.virtual_stages, len(sol.stages)) == (2, "interleaved", v, 2 * v)
        assert [i for st in sol.stages for i, _, _ in st] == list(range(6))


def test_no_fit_explanation_names_a_limit_that_fits():
    """When nothing fits, the shortfall is positive, in a unit that suits it, and the limit it
    suggests is one at which a layout fits (a lower bound on memory is not such a limit); on
    CPU processes it speaks of processes."""
    import re

    from planner.build import explain_no_fit
    from planner.hardware import parse_size
    prof = random_profile(random.Random(5), 6)
    for gpus, limit in ((1, 1024), (2, 300 << 10), (4, 400 << 10)):
        opts = SolveOptions(gpus=gpus, hardware=roomy_cpu(), global_batch=8, memory_limit=limit, top_k=1)
        result = search(prof, opts)
        assert not result.solutions
        text = " ".join(explain_no_fit(prof, opts, result, limit))
        assert not re.search(r"(?<![\w-])-\d", text), text      # no negative figure
        assert not re.search(r"\b0\.00 [KMG]iB", text), text
        assert "per process" in text and "GPU" not in text, text     # CPU processes, not GPUs
        flag = re.search(r"--memory-limit (\S+)", text).group(1)
        refit = search(prof, SolveOptions(**{**opts.__dict__, "memory_limit": parse_size(flag)}))
        assert refit.solutions, (flag, text)
        assert refit.solutions[0].prediction.peak_bytes <= parse_size(flag)


def hardware(memory: int, host: int) -> Hardware:
    return Hardware.from_json({**PRESETS["cpu"].to_json(), "memory_bytes": memory, "host_memory_bytes": host,
                               "name": "tight"})


def test_offloaded_states_of_a_node_fit_its_host_memory():
    """A layout that offloads may not fill more of a node's host memory than plans may use:
    every rank of the node keeps its offloaded states there."""
    from planner.build import explain_no_fit
    prof = random_profile(random.Random(11), 6, byte_scale=2**10)      # 1.5 GiB of model states
    opts = dict(gpus=2, gpus_per_node=2, global_batch=4, top_k=3)
    roomy = search(prof, SolveOptions(hardware=hardware(512 << 20, 1 << 50), **opts))
    offloading = [s for s in roomy.solutions if s.prediction.host_peak_bytes]
    assert offloading, "the device is too small to train without offload"
    need = max(s.prediction.host_peak_bytes for s in offloading)
    host = int(need * 0.7 / 0.8)                    # usable host memory: 70% of what those layouts fill
    tight = search(prof, SolveOptions(hardware=hardware(512 << 20, host), **opts))
    usable = hardware(512 << 20, host).usable_host_bytes()
    for sol in tight.solutions:
        assert sol.prediction.host_peak_bytes <= usable, sol.candidate.describe()
    assert [s.candidate for s in tight.solutions] != [s.candidate for s in roomy.solutions] or \
        any(a.stages != b.stages for a, b in zip(tight.solutions, roomy.solutions))
    none = SolveOptions(hardware=hardware(512 << 20, 1 << 20), **opts)
    result = search(prof, none)
    assert not result.solutions
    text = " ".join(explain_no_fit(prof, none, result, none.hardware.usable_memory_bytes()))
    assert "host memory" in text, text


def test_tp_groups_stay_inside_nodes_and_launches_fill_them(tmp_path):
    """12 GPUs on nodes of 6: a TP group of 4 would straddle two nodes (ranks 4-7) yet be
    costed at the node's links, so no layout has one; 16 GPUs on nodes of 8 launch 8 per node."""
    from planner.build import build_plan
    from planner.search import enumerate_candidates
    prof = random_profile(random.Random(2), 4)
    prof.tp_divides = []
    for layer in prof.layers:        # make every TP degree divide the (synthetic) split dims
        for p in layer.params:
            p.tp_dim = None
    opts = SolveOptions(gpus=12, gpus_per_node=6, hardware=roomy_cpu(), global_batch=24)
    tps = {c.tp for c in enumerate_candidates(prof, opts)}
    assert 4 not in tps and {1, 2, 3, 6} <= tps
    opts = SolveOptions(gpus=16, gpus_per_node=8, hardware=roomy_cpu(), global_batch=16, top_k=1)
    result = search(prof, opts)
    path = tmp_path / "profile.json"
    prof.save(path)
    plan = build_plan(result.solutions[0], [], prof, str(path), opts.hardware, opts, 1 << 40, "plan.json")
    assert plan.launch.startswith("torchrun --nproc-per-node 8 --nnodes 2 ")
    assert plan.nodes == 2
