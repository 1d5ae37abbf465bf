"""Where a step's time goes: one extra step under torch.profiler, its time split by component.

The timed steps run without the profiler, so their times stay honest; the breakdown step
comes after them, and its own wall time is reported beside theirs so the profiler's overhead
shows. Each event of the step's thread gives its own (self) time to the component of the
nearest event around it that names one (itself included):

  optimizer   the optimizer step (plan::optimizer), ZeRO-1's broadcasts inside it
  dp_comm     FSDP2 / replicate hooks: all-gathers, reduce-scatters, all-reduces and their copies
  tp_comm     DTensor's functional collectives (tensor parallelism) and waiting on them
  p2p         pipeline sends and receives, waiting on them included (so the bubble is here:
              torch's schedules wait in schedules._wait_batch_p2p, which records no event of
              its own, so the profiled step marks each of those waits, marked_pipeline_waits)
  compute     every other op: forward, backward, recompute, the loss

and `other` is the rest of the wall time (Python, hooks' bookkeeping): on CPU processes the
ops run on the step's thread, so the components and `other` add up to the step's wall time.
On CUDA the host only launches kernels and waits, so each component is the GPU time of the
kernels its ops launched (on any thread: backward runs on autograd's own), and `other` is
the wall time the GPU spent on none (launch-bound stretches, host copies waited for).
Kernels on side streams (NCCL) overlap the others; then the components add up to more than
the step and `other` is 0.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from typing import Callable

from torch.profiler import ProfilerActivity, profile, record_function

from planner.verify import MEASURED_COMPONENTS as COMPONENTS

OPTIMIZER_MARK = "plan::optimizer"
P2P_WAIT_MARK = "plan::p2p_wait"


def component_of(name: str) -> str | None:
    """The component an event's name marks, or None (it takes its parent's)."""
    if name.startswith(OPTIMIZER_MARK) or name.startswith("Optimizer.step"):
        return "optimizer"
    if name.startswith("FSDP::"):
        return "dp_comm"
    if name.startswith("_c10d_functional::") or name.startswith("c10d_functional::"):
        return "tp_comm"
    if name.startswith((P2P_WAIT_MARK, "gloo:send", "gloo:recv", "nccl:send", "nccl:recv", "c10d::send", "c10d::recv")):
        return "p2p"
    return None


def attribute(events) -> dict[str, float]:
    """Seconds per component of the events of the busiest thread (FunctionEvents, as
    prof.events() gives them), by the rule in the module docstring."""
    per_thread = Counter()
    for e in events:
        if e.cpu_parent is None:
            per_thread[e.thread] += e.cpu_time_total
    if not per_thread:
        return {}
    main = per_thread.most_common(1)[0][0]
    seconds = Counter()
    for e in events:
        if e.thread != main:
            continue
        seconds[component_up(e)] += e.self_cpu_time_total / 1e6
    return dict(seconds)


def component_up(e) -> str:
    """The component of an event: its own mark or its nearest marked ancestor's, else compute."""
    kind, up = None, e
    while up is not None and kind is None:
        kind, up = component_of(up.name), up.cpu_parent
    return kind or "compute"


def attribute_kernels(events) -> dict[str, float]:
    """CUDA: seconds of GPU kernels per component, each kernel given to the component of the
    host op that launched it (FunctionEvent.kernels: the kernels an op launched itself)."""
    seconds = Counter()
    for e in events:
        kernels = sum(k.duration for k in getattr(e, "kernels", ()))
        if kernels:
            seconds[component_up(e)] += kernels / 1e6
    return dict(seconds)


def profile_step(step: Callable[[], None], synchronize: Callable[[], None],
                 on_gpu: bool = False) -> tuple[dict[str, float], float]:
    """Run `step` once under torch.profiler; (seconds per component, the step's wall seconds)."""
    synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with marked_pipeline_waits(), profile(activities=activities) as prof:
        t0 = time.perf_counter()
        step()
        synchronize()
        wall = time.perf_counter() - t0
    parts = attribute_kernels(prof.events()) if on_gpu else attribute(prof.events())
    out = {k: parts.get(k, 0.0) for k in COMPONENTS if k != "other"}
    out["other"] = max(0.0, wall - sum(out.values()))
    return out, wall


@contextlib.contextmanager
def marked_pipeline_waits():
    """Within it, each wait of torch's pipeline schedules on their sends and receives is an
    event of its own (P2P_WAIT_MARK). Unmarked, a wait was the self time of the event around it:
    GPipe waits inside its "Forward i" / "Backward i" regions, so its bubble read as compute
    (the GPT's pp 4 GPipe: 105 ms of compute where 1F1B's was 40, bench/time_fidelity.py
    2026-12-05), and 1F1B waits outside any, so its bubble read as other. Only the profiled
    step runs within it; torch versions without schedules._wait_batch_p2p are left as they are."""
    from torch.distributed.pipelining import schedules

    original = getattr(schedules, "_wait_batch_p2p", None)
    if original is None:
        yield
        return

    def marked(work):
        with record_function(P2P_WAIT_MARK):
            return original(work)

    schedules._wait_batch_p2p = marked
    try:
        yield
    finally:
        schedules._wait_batch_p2p = original


def optimizer_region():
    """The region the breakdown calls the optimizer step."""
    return record_function(OPTIMIZER_MARK)

