"""The torchrun command that runs a plan (what `plan run` executes). Torch-free."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


DEFAULT_TIMEOUT_S = 300.0   # a collective's wait for the other ranks (torch's default, 30 min, hides a hang)
# Steps a run takes unless told: 1 warms up, 1 measures memory, 15 are timed, 3 are profiled
# (run_report.step_roles; 17 and 1 until 2026-12-07). Six (3 timed) read the README demo's step 5-20% slow in 6 of 8
# runs: its steps 3-5 take longer than the ones after (median over a run's steps 3-5 against
# its steps 6-19: 134/122, 125/113, 125/116, 136/116, 140/120, 131/124, 118/117 and
# 113/114 ms), so six-step runs measured 116-136 ms where twenty-step runs measured
# 113-125 ms, alternated on the 2-core VM (2026-12-06, docs/fidelity.md).
DEFAULT_STEPS = 20
# How long stopped ranks (Ctrl-C) may take to finish their step and write a checkpoint, when
# they write checkpoints, before they are killed; without checkpoints, STOP_GRACE_S.
STOP_GRACE_S = 15.0
STOP_SAVE_GRACE_S = 120.0


def build_command(plan_path: str | Path, plan, nnodes: int = 1, node_rank: int = 0, rdzv_endpoint: str | None = None,
                  steps: int | None = None, out: str | Path | None = None, timeout_s: float | None = None,
                  extra: list[str] = (), max_restarts: int = 0) -> list[str]:
    """argv for this node: `torchrun` (as `python -m torch.distributed.run`, so it is this
    interpreter's torch) with world_size / nnodes processes, then `-m runtime plan.json` and
    its options (`extra`: checkpoint and training flags as the runtime spells them). With
    max_restarts torchrun restarts every rank after a failure, that many times at most.

    Several nodes use static rendezvous at rdzv_endpoint ("host:port"), so that node_rank fixes
    which global ranks (and so which pp / dp / tp coordinates) each node runs.
    """
    if nnodes < 1 or plan.world_size % nnodes:
        raise ValueError(f"the plan's {plan.world_size} processes cannot be split evenly over {nnodes} nodes")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node rank {node_rank} is not in 0..{nnodes - 1}")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={plan.world_size // nnodes}"]
    if max_restarts:
        cmd.append(f"--max-restarts={max_restarts}")
    if nnodes == 1:
        cmd.append("--standalone")
    else:
        if not rdzv_endpoint or ":" not in rdzv_endpoint:
            raise ValueError(f"a run on {nnodes} nodes needs the rendezvous endpoint host:port of node 0")
        host, port = rdzv_endpoint.rsplit(":", 1)
        cmd += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--master-addr={host}", f"--master-port={port}"]
    return cmd + runtime_args(plan_path, steps, out, timeout_s, extra)


def runtime_args(plan_path: str | Path, steps: int | None, out: str | Path | None, timeout_s: float | None,
                 extra: list[str] = ()) -> list[str]:
    """`-m runtime plan.json` and its options (runtime/__main__.py)."""
    cmd = ["-m", "runtime", str(plan_path), *extra]
    if steps is not None:
        cmd += ["--steps", str(steps)]
    if out is not None:
        cmd += ["--out", str(out)]
    if timeout_s is not None and timeout_s != DEFAULT_TIMEOUT_S:
        cmd += ["--timeout", f"{timeout_s:g}"]
    return cmd


def slurm_script(plan_path: str | Path, plan, steps: int | None = None, out: str | Path | None = None,
                 timeout_s: float | None = None, port: int = 29500, extra: list[str] = (), max_restarts: int = 0) -> str:
    """An sbatch script that runs the plan: one task per node, each starting torchrun for its
    node's ranks, with node 0 of the allocation as the rendezvous (static, as build_command)."""
    import shlex
    per_node = plan.world_size // plan.nodes
    torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={per_node}",
                f"--nnodes={plan.nodes}", "--node-rank=$SLURM_NODEID", "--master-addr=$HEAD", f"--master-port={port}",
                *([f"--max-restarts={max_restarts}"] if max_restarts else [])]
    args = " ".join(shlex.quote(a) for a in runtime_args(Path(plan_path).resolve(), steps, out, timeout_s, extra))
    line = " ".join(torchrun[:4]) + " " + " ".join(torchrun[4:]) + " " + args
    return "\n".join([
        "#!/bin/bash",
        f"#SBATCH --job-name=plan-{Path(plan_path).stem}",
        f"#SBATCH --nodes={plan.nodes}",
        "#SBATCH --ntasks-per-node=1",
        *([f"#SBATCH --gpus-per-node={per_node}"] if plan.device_type == "cuda" else []),
        "#SBATCH --exclusive",
        "set -euo pipefail",
        "# node 0 of the allocation is the rendezvous; each node's task starts torchrun for its ranks",
        'export HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        *([f"export OMP_NUM_THREADS={plan.threads}"] if plan.device_type == "cpu" else []),
        f"srun --kill-on-bad-exit=1 bash -c '{line}'",
        "",
    ])


# What torchrun itself prints around a run, which says nothing the ranks have not: its
# OMP_NUM_THREADS banner, the elastic agent's log lines, and its own traceback (ending in
# ChildFailedError or SignalException) with the failure report after it.
_BANNER = re.compile(r"^(\*+|Setting OMP_NUM_THREADS environment variable .*)$")
_AGENT_LOG = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ .*torch/distributed/(elastic|run)")
_AGENT_ERRORS = ("ChildFailedError", "SignalException")
_PROFILER_LOG = re.compile(r"USDT:.*ActivityProfilerHandler")   # kineto's start/stop lines (torch.profiler)
_REPORT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_REPORT_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)(?:.*\((SIG[A-Z]+)\))?")


class TorchrunOutput:
    """Filters torchrun's stderr line by line: the ranks' lines pass (each distinct line once:
    every rank prints the same refusal), torchrun's own noise does not."""

    def __init__(self, write):
        self.write = write
        self.traceback: list[str] | None = None   # a traceback of torchrun's, held until its last line says whose
        self.done = False                        # past torchrun's failure report: nothing more to show
        self.seen: set[str] = set()
        self.in_root_cause = False
        self.failed_rank: int | None = None      # the report's root cause: the first rank that failed
        self.failed_how: str | None = None       # "was killed by SIGKILL", "exited with code 1"

    def feed(self, line: str) -> None:
        text = line.rstrip("\n")
        if self.done:
            self._read_failure_report(text)
            return
        if _BANNER.match(text) or _AGENT_LOG.match(text) or _PROFILER_LOG.search(text):
            return
        if self.traceback is not None:
            self.traceback.append(line)
            if text and not text[0].isspace():          # the exception line ends the traceback
                held, self.traceback = self.traceback, None
                if any(name in text for name in _AGENT_ERRORS):
                    self.done = True
                else:
                    for held_line in held:
                        self.write(held_line)
            return
        if text == "Traceback (most recent call last):":
            self.traceback = [line]
            return
        if text and not text.startswith("[rank") and text in self.seen:
            return
        self.seen.add(text)
        self.write(line)

    def _read_failure_report(self, text: str) -> None:
        """torchrun's report names the root cause: `rank : 1 (local_rank: 1)`, `exitcode : -9 (pid: 5)  (SIGKILL)`."""
        if text.startswith("Root Cause"):
            self.in_root_cause = True
        elif self.in_root_cause and (m := _REPORT_RANK.match(text)):
            self.failed_rank = int(m.group(1))
        elif self.in_root_cause and (m := _REPORT_EXIT.match(text)):
            code, name = int(m.group(1)), m.group(2)
            self.failed_how = f"was killed by {name or f'signal {-code}'}" if code < 0 else f"exited with code {code}"
            self.in_root_cause = False

    def failure(self) -> str | None:
        """"rank 1 was killed by SIGKILL", when torchrun's report said so."""
        if self.failed_rank is None or self.failed_how is None:
            return None
        return f"rank {self.failed_rank} {self.failed_how}"


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc; elsewhere none are found)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def run_torchrun(cmd: list[str], env: dict[str, str], grace_s: float = STOP_GRACE_S) -> tuple[int, str | None, str | None]:
    """Run torchrun, pass its output on (filtered), and on SIGINT / SIGTERM stop it and every
    rank: torchrun is told to (it stops its ranks), and whatever is left after `grace_s` is
    killed. Returns (exit code, the signal's name or None, which rank failed how or None)."""
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, bufsize=1,
                            start_new_session=True)   # a terminal's Ctrl-C reaches this process only
    out = TorchrunOutput(lambda line: (sys.stderr.write(line), sys.stderr.flush()))
    relay = threading.Thread(target=lambda: [out.feed(line) for line in proc.stderr], daemon=True)
    relay.start()
    received: list[int] = []
    ranks: set[int] = set()

    def on_signal(signum, _frame):
        if not received:
            out.done = True                    # what torchrun and the ranks say while stopping is noise
            ranks.update(descendants(proc.pid))
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        received.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    deadline = None
    try:
        while proc.poll() is None:             # (not proc.wait(): it holds a lock a handler would need)
            if received and deadline is None:
                deadline = time.monotonic() + grace_s
            if deadline is not None and time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            time.sleep(0.05)
        if received:
            for pid in ranks | set(descendants(proc.pid)):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    relay.join(timeout=5)
    return proc.returncode, (signal.Signals(received[0]).name if received else None), out.failure()
