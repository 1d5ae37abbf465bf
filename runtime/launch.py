"""The torchrun command that runs a plan (what `plan run` executes). Torch-free."""

from __future__ import annotations

import sys
from pathlib import Path


def build_command(plan_path: str | Path, plan, nnodes: int = 1, node_rank: int = 0, rdzv_endpoint: str | None = None,
                  steps: int | None = None, out: str | Path | None = None) -> list[str]:
    """argv for this node: `torchrun` (as `python -m torch.distributed.run`, so it is this
    interpreter's torch) with world_size / nnodes processes, then `-m runtime plan.json`.

    Several nodes use static rendezvous at rdzv_endpoint ("host:port"), so that node_rank fixes
    which global ranks (and so which pp / dp / tp coordinates) each node runs.
    """
    if nnodes < 1 or plan.world_size % nnodes:
        raise ValueError(f"the plan's {plan.world_size} processes cannot be split evenly over {nnodes} nodes")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node rank {node_rank} is not in 0..{nnodes - 1}")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={plan.world_size // nnodes}"]
    if nnodes == 1:
        cmd.append("--standalone")
    else:
        if not rdzv_endpoint or ":" not in rdzv_endpoint:
            raise ValueError(f"a run on {nnodes} nodes needs the rendezvous endpoint host:port of node 0")
        host, port = rdzv_endpoint.rsplit(":", 1)
        cmd += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--master-addr={host}", f"--master-port={port}"]
    cmd += ["-m", "runtime", str(plan_path)]
    if steps is not None:
        cmd += ["--steps", str(steps)]
    if out is not None:
        cmd += ["--out", str(out)]
    return cmd
