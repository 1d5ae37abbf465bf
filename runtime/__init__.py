"""The runtime: executes a plan with PyTorch's own distributed engine.

    torchrun --nproc-per-node N -m runtime plan.json [--steps S] [--out run.json]

Modules, one concern each: api (apply_plan: a rank's ParallelModel, for a loop of your own),
parallel_dims (degrees and the device mesh), parallelize (TP, activation checkpointing, FSDP2 /
replicate per layer), pipeline (stages and schedules), sharded_optimizer (the optimizer step
and ZeRO-1), data (each dp rank's rows), config (the training settings), checkpoint (DCP save
and resume), weights (Hugging Face safetensors in), train (plan run's loop and its
measurements), reference (the single-process oracle), launch (the torchrun command for `plan run`).
This __init__ imports no torch, so `runtime.launch` works without it.
"""
