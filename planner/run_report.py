"""The run document (run.json): what the runtime measured, rank by rank. Torch-free.

The runtime writes it (rank 0, after every rank reported); `plan verify` holds it to the
plan, `plan show` prints it. A document that is not one, of another schema, or damaged is
refused with one sentence (RunReportError).
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
import statistics
from pathlib import Path

from profiles.schema import read_json_document, write_json_atomic

RUN_SCHEMA_VERSION = 1


class RunReportError(Exception):
    """A run document that cannot be used; the message is one sentence with the fix."""


@dataclass
class RankReport:
    """One rank's measurements."""

    rank: int
    pp_rank: int
    dp_rank: int
    tp_rank: int
    stages: list[int]                                  # the pipeline stages this rank runs
    peak_bytes: int                                    # device memory at the measured step's peak
    step_times_s: list[float]                          # every step's wall time
    median_step_s: float                               # the median of its timed steps (step_roles)
    threads: int = 1                                   # intra-op threads this rank ran with
    breakdown_s: dict[str, float] | None = None        # a profiled step by component, that of median wall time (runtime/breakdown.py)
    breakdown_step_s: float = 0.0                      # that step's wall time under the profiler
    reserved_bytes: int = 0                            # CUDA: the allocator's most reserved over the run (max_memory_reserved); 0 on CPU
    cpu_times_s: list[float] = field(default_factory=list)  # every step's CPU time of the rank's process, all its threads ([]: not recorded)


@dataclass
class RunReport:
    plan_path: str
    plan_sha256: str           # of the plan.json that ran: verify refuses another plan's run
    world_size: int
    steps: int
    losses: list[float]        # the global batch's mean loss per step
    device: str                # "cpu" or the CUDA device's name
    torch_version: str
    ranks: list[RankReport] = field(default_factory=list)
    first_step: int = 0        # steps trained before this launch (resumed from a checkpoint)
    global_batch: int = 0      # samples per step
    tokens_per_sample: int = 0  # token ids per input row (integer inputs); 0: the inputs are not tokens
    checkpoint: str = ""       # the last checkpoint this launch wrote ("" if none)
    mfu: float = 0.0           # the plan's model FLOPs per step over the hardware's peak at the measured step (0: the plan predicts none)
    host_cpus: int = 0         # CPUs rank 0's machine has (os.cpu_count(); 0: not recorded)
    profiled_steps: int = 1    # how many of the last steps ran under the profiler (step_roles; documents before 2026-12-07 profiled one)
    schema: int = RUN_SCHEMA_VERSION
    kind: str = "run"

    def to_json(self) -> dict:
        return asdict(self)

    def save(self, path: str | Path) -> None:
        write_json_atomic(path, self.to_json())

    @classmethod
    def from_json(cls, d: dict, source: str = "run") -> "RunReport":
        if not isinstance(d, dict) or d.get("kind") != "run":
            raise RunReportError(f"{source} is not a run document; pass the run.json the runtime wrote.")
        if d.get("schema") != RUN_SCHEMA_VERSION:
            raise RunReportError(f"{source} has schema {d.get('schema')!r}, this plan reads {RUN_SCHEMA_VERSION}; run the plan again.")
        try:
            ranks = [RankReport(**r) for r in d["ranks"]]
            # Fields with a default may be missing (documents written before they existed).
            run = cls(ranks=ranks, **{f.name: d[f.name] for f in fields(cls) if f.name != "ranks"
                                      and (f.name in d or f.default is MISSING)})
            run.validate()
        except (KeyError, TypeError, ValueError) as e:
            raise RunReportError(f"{source} is damaged or hand-edited ({type(e).__name__}: {e}); run the plan again.") from None
        return run

    @property
    def step_s(self) -> float:
        """The step's measured time: over the timed steps, the median of the slowest rank's time.
        Every rank starts each step at once (runtime/train.py), so a step lasts as long as its
        slowest rank: in a pipeline the first stage, whose last backward ends the step, while the
        last stage is done a backward or more before it. (The median over ranks read a 4-stage
        pipeline of the GPT 10% short and the MLP's pipeline of one micro-batch 25% short: with
        the log line's norm all-reduce between steps, the early ranks waited outside their
        timers; runs without it, every rank in lockstep, measured the slowest rank's time on
        every rank, 2026-12-06, docs/fidelity.md.)"""
        return statistics.median(self._timed_steps_s())

    @property
    def step_range_s(self) -> tuple[float, float, int]:
        """(shortest, longest, how many) of the timed steps step_s is the median of: how much a
        step moved within the run, beside which an error of the prediction can be read."""
        times = self._timed_steps_s()
        return min(times), max(times), len(times)

    def _timed_steps_s(self) -> list[float]:
        """Each timed step's time (its slowest rank's), in order."""
        return [self._slowest_s(i) for i in self.timed_steps]

    @property
    def timed_steps(self) -> list[int]:
        """The indices of the steps that time the step (step_roles, as this run profiled)."""
        return step_roles(self.steps, self.profiled_steps)[2]

    def _slowest_s(self, i: int) -> float:
        """Step i's time: its slowest rank's (every rank starts it at once)."""
        return max(r.step_times_s[i] for r in self.ranks)

    @property
    def cores_busy(self) -> float | None:
        """How many CPU cores the ranks kept busy: over the timed steps, the median of all
        ranks' CPU time in the step (every thread of each process: gloo's too) over the step's
        time (its slowest rank's). None where a rank recorded no CPU times (runs written before
        they were). On CPU processes, a figure near the machine's cores says the run was
        bound by them, whatever its pipeline bubbles."""
        if not all(r.cpu_times_s for r in self.ranks):
            return None
        return statistics.median(sum(r.cpu_times_s[i] for r in self.ranks) / self._slowest_s(i)
                                 for i in self.timed_steps)

    @property
    def samples_per_s(self) -> float:
        return self.global_batch / self.step_s

    @property
    def tokens_per_s(self) -> float:
        """Input tokens a second (0 when the inputs are not token ids)."""
        return self.samples_per_s * self.tokens_per_sample

    def validate(self) -> None:
        """Types and counts a reader relies on; a ValueError names the first that is wrong."""
        def whole(name, v, least=0):
            if not isinstance(v, int) or isinstance(v, bool) or v < least:
                raise ValueError(f"{name} is {v!r}")
        whole("world_size", self.world_size, 1)
        for name in ("plan_path", "plan_sha256", "device", "torch_version"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} is {getattr(self, name)!r}, not text")
        whole("steps", self.steps, 1)
        for name in ("first_step", "global_batch", "tokens_per_sample", "host_cpus", "profiled_steps"):
            whole(name, getattr(self, name))
        if self.steps >= 4 and not 1 <= self.profiled_steps <= self.steps - 3:   # warm-up, memory, a timed step
            raise ValueError(f"{self.profiled_steps} profiled steps of {self.steps}")
        if not isinstance(self.mfu, (int, float)) or isinstance(self.mfu, bool) or not 0 <= self.mfu:
            raise ValueError(f"mfu is {self.mfu!r}")
        if not isinstance(self.checkpoint, str):
            raise ValueError(f"checkpoint is {self.checkpoint!r}, not text")
        if len(self.ranks) != self.world_size:
            raise ValueError(f"{len(self.ranks)} ranks for world size {self.world_size}")
        if sorted(r.rank for r in self.ranks) != list(range(self.world_size)):
            raise ValueError("its ranks are not 0, 1, 2, ...")
        if len(self.losses) != self.steps or not all(isinstance(x, (int, float)) for x in self.losses):
            raise ValueError(f"{len(self.losses)} losses for {self.steps} steps")
        for r in self.ranks:
            for name in ("pp_rank", "dp_rank", "tp_rank", "peak_bytes", "threads"):
                whole(f"rank {r.rank}'s {name}", getattr(r, name))
            for what, seconds in (("step times", r.step_times_s), ("CPU times", r.cpu_times_s)):
                if what == "CPU times" and not seconds:
                    continue                        # not recorded (runs written before they were)
                if len(seconds) != self.steps or not all(isinstance(x, (int, float)) and x >= 0 for x in seconds):
                    raise ValueError(f"rank {r.rank} has {len(seconds)} {what} for {self.steps} steps")
            if not isinstance(r.median_step_s, (int, float)) or r.median_step_s <= 0:
                raise ValueError(f"rank {r.rank}'s median_step_s is {r.median_step_s!r}")
            if r.breakdown_s is not None and not all(isinstance(v, (int, float)) for v in r.breakdown_s.values()):
                raise ValueError(f"rank {r.rank}'s breakdown_s is not seconds by component")


# From this many steps a launch profiles its last PROFILED_STEPS steps, not only its last, and
# its breakdown is the one of median wall time among them: a single profiled step took 1.10-1.12x
# the run's timed median at the median over the kept runs of bench/time_fidelity.py, but up to
# 1.8x and 2-3x in some (docs/runtime.md), and its parts then carried that step's noise.
PROFILE_SEVERAL_FROM, PROFILED_STEPS = 12, 3


def profiled_count(n: int) -> int:
    """How many of a launch's n steps, its last, run under the profiler: PROFILED_STEPS from
    PROFILE_SEVERAL_FROM steps, one from 4, none with fewer."""
    return PROFILED_STEPS if n >= PROFILE_SEVERAL_FROM else 1 if n >= 4 else 0


def step_roles(n: int, profiled: int | None = None) -> tuple[int, list[int], list[int]]:
    """What each of a launch's n steps (counted from 0) is for, the one rule the runtime runs by
    and a run document is read by: (the step that measures memory, the steps under the
    profiler, the steps that time the step). The first warms up, the second measures memory,
    the last `profiled` (profiled_count(n) unless told; a run document says how many it ran)
    run under the profiler, and the ones between are timed; with fewer steps, what there is."""
    profiled = profiled_count(n) if profiled is None else profiled
    measured = min(1, n - 1)
    under = list(range(n - profiled, n)) if n >= 4 else []
    timed = [i for i in range(2, n) if i not in under] or [n - 1]
    return measured, under, timed


def load_run(path: str | Path) -> RunReport:
    d = read_json_document(path, "run", "create it with `plan run PLAN`", "run the plan again", RunReportError)
    return RunReport.from_json(d, source=f"run {path}")
