"""Does a model's step take what its layers take, each timed as the profiler times it?

`plan profile` times each layer on its own. Timed back to back on the same weights, a layer
finds them in the CPU's caches. In a step the other layers run in between, and a
layer whose work is small beside its weights finds them in memory. This times, on one thread,
for each example model and micro-batch size, in turns (rounds):

- hot:    the layers one by one, back to back on their own weights (profiles.measure.measure_time,
          as the profiler timed them until 2026-12-06), plus the loss;
- cycled: each repeat on the next of several copies of the layer whose parameters add up to
          twice the last-level cache, so that its weights come from memory (profiles.measure.
          time_layer, as the profiler times them now); plus the loss;
- step:   the whole model's forward, loss and backward, as a rank runs it.

and, for examples/mlp.py's blocks, 8 distinct blocks against one block run 8 times (the same
work and graph; only the weights differ).

    python bench/layers_in_model.py [--models gpt,mlp,llama] [--rounds 3]   # writes bench/results/layers_in_model.md
"""

from __future__ import annotations

import argparse
import runpy
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from fidelity import example_spec  # noqa: E402
from profiles.allocator import keep_freed_memory  # noqa: E402
from profiles.measure import ProfileOptions, _needs_grad, last_level_cache_bytes, measure_time, time_layer  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "layers_in_model.md"
SIZES = (1, 4, 16)


def load(model: str):
    """(layers as an nn.Sequential, make_batch(b), loss_fn) of one example."""
    from profiles.model_file import build_checked_model, call_make_batch
    spec = example_spec(model)
    return build_checked_model(spec), (lambda b: call_make_batch(spec, b)), spec.loss_fn


def loss_time(loss_fn, out: torch.Tensor, targets: torch.Tensor, reps: int = 7) -> float:
    xs = out.detach().requires_grad_(True)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        loss_fn(xs, targets).backward()
        times.append(time.perf_counter() - t0)
        xs.grad = None
    return statistics.median(times[2:])


def step_time(model: nn.Module, loss_fn, x, targets, reps: int = 7) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        loss_fn(model(x), targets).backward()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[2:])


def measure_model(name: str, rounds: int) -> list[dict]:
    model, make_batch, loss_fn = load(name)
    rows = []
    for b in SIZES:
        x, targets = make_batch(b)
        inputs = []
        with torch.no_grad():
            h = x
            for layer in model:
                inputs.append(h)
                h = layer(h)
        # Every layer's input as the profiler gives it: a leaf that asks for a gradient, but the batch.
        ins = [h_in.detach().requires_grad_(i > 0 and _needs_grad(h_in)) for i, h_in in enumerate(inputs)]
        hot, cyc, whole = [], [], []
        for _ in range(rounds):
            lt = loss_time(loss_fn, h, targets)
            hot.append(sum(sum(measure_time([(layer, layer)], xi, ProfileOptions())) for layer, xi in zip(model, ins)) + lt)
            cyc.append(sum(sum(time_layer(layer, xi, ProfileOptions())) for layer, xi in zip(model, ins)) + lt)
            whole.append(step_time(model, loss_fn, x, targets))
        rows.append({"model": name, "b": b, "hot": statistics.median(hot), "cycled": statistics.median(cyc),
                     "step": statistics.median(whole),
                     "step_over_hot": [w / s for w, s in zip(whole, hot)]})
        print(f"{name} b{b}: hot {1e3 * rows[-1]['hot']:.2f} ms, cycled {1e3 * rows[-1]['cycled']:.2f}, "
              f"step {1e3 * rows[-1]['step']:.2f}", flush=True)
    return rows


def shared_weights(rounds: int) -> list[tuple[int, float, float]]:
    """examples/mlp.py: (b, 8 distinct blocks' step, one block run 8 times' step)."""
    block = runpy.run_path(str(ROOT / "examples" / "mlp.py"))["Block"]
    torch.manual_seed(0)
    distinct = nn.Sequential(*[block() for _ in range(8)])
    one = block()
    shared = nn.Sequential(*[one for _ in range(8)])
    out = []
    for b in SIZES:
        x = torch.randn(b, 256)
        sum_loss = lambda o, _: o.sum()
        d = statistics.median(step_time(distinct, sum_loss, x, None, 20) for _ in range(rounds))
        s = statistics.median(step_time(shared, sum_loss, x, None, 20) for _ in range(rounds))
        out.append((b, d, s))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt,mlp,llama")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)              # as every CPU rank runs, and as the profiler times
    keep_freed_memory()                   # as the profiler and the runtime allocate
    cache = last_level_cache_bytes()
    rows = [r for m in args.models.split(",") for r in measure_model(m, args.rounds)]
    shared = shared_weights(args.rounds)
    lines = [
        "# A model's step against its layers timed one by one",
        "",
        f"`python bench/layers_in_model.py --models {args.models} --rounds {args.rounds}`, {date.today()}, one thread, "
        f"last-level cache {cache >> 20} MiB: per micro-batch size, the medians over rounds (taken in turns) of "
        "the layers' forward + backward summed, each timed back to back on its own weights (hot) and on copies of it "
        "run in turn whose weights fill twice that cache (cycled, as `plan profile` times them since stop 47), each plus the loss, and of the whole model's "
        "forward, loss and backward (step), in ms.",
        "",
        "| model | micro-batch | hot | cycled | step | step / hot (each round) | cycled / hot |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        each = ", ".join(f"{v:.2f}" for v in r["step_over_hot"])
        lines.append(f"| {r['model']} | {r['b']} | {1e3 * r['hot']:.2f} | {1e3 * r['cycled']:.2f} | "
                     f"{1e3 * r['step']:.2f} | {statistics.median(r['step_over_hot']):.2f} ({each}) | "
                     f"{r['cycled'] / r['hot']:.2f} |")
    lines += ["", "examples/mlp.py's block: 8 distinct blocks against one block run 8 times (forward, `.sum()`, backward; ms):",
              "", "| micro-batch | 8 distinct | one, 8 times | ratio |", "|---|---|---|---|"]
    lines += [f"| {b} | {1e3 * d:.2f} | {1e3 * s:.2f} | {d / s:.2f} |" for b, d, s in shared]
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.write_text(text)


if __name__ == "__main__":
    main()
