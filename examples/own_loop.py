"""Train with a plan inside your own loop: runtime.api, your data, your schedule, checkpoints.

    plan profile examples/gpt.py && plan solve --gpus 2 --hardware cpu
    torchrun --nproc-per-node 2 examples/own_loop.py plan.json --steps 20 --checkpoint-dir ckpt

Every rank builds the whole model the same way (same seed), and apply_plan keeps this rank's
stages, laid out as the plan says. The loop gives each step this data-parallel rank's rows
(`parallel.rows` samples: the plan's micro-batch size x micro-batches) and lets train_step run
the plan's micro-batches, pipeline schedule, clipping and optimizer step. The loss it returns
is this rank's share (on ranks that hold the last stage); all-reduce it for the batch's mean.
Run it again with --resume to continue from the latest checkpoint, under this plan or another.
"""

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the repository, when run as a script

from runtime import checkpoint                                          # noqa: E402
from runtime.api import apply_plan, init_distributed, leave, load_plan   # noqa: E402

import gpt                                                               # noqa: E402  (this folder's model)


def my_batches(step: int, dp_rank: int, rows: int, dp: int, seed: int = 0):
    """Your data: here random tokens, the global batch of step `step` drawn the same on every
    rank and cut into dp slices of `rows` samples. Read only your rows from a real dataset."""
    g = torch.Generator().manual_seed(seed + step)
    data = torch.randint(0, gpt.VOCAB, (rows * dp, gpt.SEQ_LEN + 1), generator=g)
    mine = data[dp_rank * rows:(dp_rank + 1) * rows]
    return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()


DECAY_STEPS = 20   # the schedule's horizon, fixed: a run resumed with a larger --steps keeps the same curve


def lr_at(step: int, peak: float = 3e-3, warmup: int = 2) -> float:
    """Your schedule: linear warm-up, then cosine to a tenth of the peak at DECAY_STEPS."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / (DECAY_STEPS - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("plan")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--checkpoint-dir")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--losses", help="rank 0 writes the step losses here, one per line")
    args = p.parse_args()

    plan = load_plan(args.plan)
    init_distributed(plan)
    torch.manual_seed(plan.seed)                    # the same initial weights on every rank
    parallel = apply_plan(gpt.build_model(), plan, gpt.loss_fn, gpt.tp_plan)

    with torch.device("meta"):                      # the parameters' names and shapes, nothing allocated
        shapes = checkpoint.model_shapes(gpt.build_model())
    start = 0
    if args.resume:
        path, info = checkpoint.find_resume(args.checkpoint_dir, shapes, plan.optimizer.name)
        checkpoint.load(parallel, path)
        start = info.step

    losses = []
    for step in range(start, args.steps):
        inputs, targets = my_batches(step, parallel.dp_rank, parallel.rows, plan.dp)
        loss = parallel.train_step(inputs.to(parallel.device), targets.to(parallel.device),
                                   lr=lr_at(step), clip_grad_norm=1.0)
        # The global batch's mean: the last stage's dp x tp ranks each hold their rows' mean.
        mean = torch.tensor(float(loss) if loss is not None else 0.0, dtype=torch.float64)
        dist.all_reduce(mean)
        losses.append(float(mean) / (plan.dp * plan.tp))
        if dist.get_rank() == 0:
            print(f"step {step + 1}: loss {losses[-1]:.4f}, grad norm {parallel.grad_norm:.3f}", flush=True)

    if args.checkpoint_dir:
        info = checkpoint.CheckpointInfo.of_run("gpt", plan, shapes, step=args.steps)
        checkpoint.save(parallel, args.checkpoint_dir, info)
    if args.losses and dist.get_rank() == 0:
        Path(args.losses).write_text("".join(f"{x!r}\n" for x in losses))
    dist.destroy_process_group()
    leave()              # not the interpreter's teardown, which gloo's threads can abort (runtime.api.leave)


if __name__ == "__main__":
    main()
