"""How a run trains, beyond the layout: the learning-rate schedule, clipping, logging. Torch-free.

The plan fixes what changes memory and time (the optimizer's kind, the batch); this fixes
the rest, from `plan run` / `python -m runtime` flags or a TOML file of the same names
(`--config run.toml`, flags win). Every step's learning rate is a function of the step
number alone (`lr_at`), so a resumed run needs nothing of the schedule but its step.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

LR_SCHEDULES = ("constant", "cosine")


class ConfigError(Exception):
    """A training setting that cannot be used; the message is one sentence with the fix."""


@dataclass(frozen=True)
class TrainConfig:
    lr: float | None = None            # peak learning rate; None: the plan's optimizer's
    weight_decay: float | None = None  # None: the plan's optimizer's (as are the next three)
    beta1: float | None = None         # Adam / AdamW
    beta2: float | None = None
    momentum: float | None = None      # SGD with momentum
    seed: int | None = None            # the initial weights' and the data order's; None: the plan's
    lr_schedule: str = "constant"      # after warm-up: constant, or cosine down to min_lr_ratio * lr
    warmup_steps: int = 0              # linear warm-up from lr / warmup_steps to lr
    decay_steps: int | None = None     # the step the cosine reaches its floor; None: the run's --steps
    min_lr_ratio: float = 0.1          # the cosine's floor, as a fraction of lr
    clip_grad_norm: float = 0.0        # clip gradients to this global L2 norm; 0: no clipping
    log_every: int = 0                 # a log line every N steps; 0: about 20 lines per run

    def problem(self) -> str | None:
        """What is wrong with these settings, or None."""
        def number(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        def whole(v):
            return isinstance(v, int) and not isinstance(v, bool) and v >= 0
        if self.lr is not None and not (number(self.lr) and self.lr > 0):
            return f"the learning rate is {self.lr!r}; give a positive number"
        for name in ("weight_decay", "beta1", "beta2", "momentum"):
            v = getattr(self, name)
            if v is not None and not (number(v) and 0 <= v and (name == "weight_decay" or v < 1)):
                return f"{name} is {v!r}; give a number in {'[0, inf)' if name == 'weight_decay' else '[0, 1)'}"
        if self.seed is not None and not whole(self.seed):
            return f"the seed is {self.seed!r}; give a whole number, 0 or more"
        if self.lr_schedule not in LR_SCHEDULES:
            return f"the learning-rate schedule is {self.lr_schedule!r}; use one of {', '.join(LR_SCHEDULES)}"
        if not whole(self.warmup_steps):
            return f"warmup_steps is {self.warmup_steps!r}; give 0 or more steps"
        if self.decay_steps is not None and not (whole(self.decay_steps) and self.decay_steps > self.warmup_steps):
            return f"decay_steps is {self.decay_steps!r}; give more steps than the warm-up's {self.warmup_steps}"
        if not (number(self.min_lr_ratio) and 0 <= self.min_lr_ratio <= 1):
            return f"min_lr_ratio is {self.min_lr_ratio!r}; give a fraction of the learning rate in [0, 1]"
        if not (number(self.clip_grad_norm) and self.clip_grad_norm >= 0):
            return f"clip_grad_norm is {self.clip_grad_norm!r}; give a positive norm, or 0 for no clipping"
        if not whole(self.log_every):
            return f"log_every is {self.log_every!r}; give 0 or more steps"
        return None

    def lr_at(self, step: int, base_lr: float, total_steps: int) -> float:
        """The learning rate of step `step` (0-based): linear warm-up over warmup_steps, then
        constant, or a half cosine from lr to min_lr_ratio * lr at decay_steps (default
        total_steps), flat after."""
        lr = self.lr if self.lr is not None else base_lr
        if step < self.warmup_steps:
            return lr * (step + 1) / self.warmup_steps
        if self.lr_schedule == "constant":
            return lr
        end = self.decay_steps if self.decay_steps is not None else total_steps
        span = max(1, end - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        floor = self.min_lr_ratio * lr
        return floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    def apply_to(self, plan):
        """The plan with these settings' optimizer hyper-parameters and seed (a copy): none of
        them changes memory or time, so the plan's prediction still holds."""
        o = plan.optimizer
        optimizer = replace(o, lr=self.lr if self.lr is not None else o.lr,
                            weight_decay=self.weight_decay if self.weight_decay is not None else o.weight_decay,
                            betas=(self.beta1 if self.beta1 is not None else o.betas[0],
                                   self.beta2 if self.beta2 is not None else o.betas[1]),
                            momentum=self.momentum if self.momentum is not None else o.momentum)
        return replace(plan, optimizer=optimizer, seed=self.seed if self.seed is not None else plan.seed)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "TrainConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


# What each setting means, for both command lines (`plan run` and `python -m runtime`).
HELP = {
    "lr": "Peak learning rate (default: the plan's optimizer's).",
    "weight_decay": "The optimizer's weight decay (default: the plan's).",
    "beta1": "Adam's first beta (default: the plan's).",
    "beta2": "Adam's second beta (default: the plan's).",
    "momentum": "SGD's momentum (default: the plan's).",
    "seed": "The seed of the initial weights and the data order (default: the plan's).",
    "lr_schedule": "After warm-up: constant (the default), or cosine down to min-lr-ratio x lr at decay-steps.",
    "warmup_steps": "Steps of linear warm-up to the peak learning rate (default: 0).",
    "decay_steps": "The step at which the cosine reaches its floor (default: --steps).",
    "min_lr_ratio": "The cosine's floor as a fraction of the peak learning rate (default: 0.1).",
    "clip_grad_norm": "Clip gradients to this global L2 norm (over every shard and stage); 0, the default: no clipping.",
    "log_every": "A log line every N steps (0: about 20 per run).",
}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def train_args(config_path: str | None = None, **values) -> list[str]:
    """The runtime's command-line arguments for these settings (those not None)."""
    out = ["--config", str(config_path)] if config_path is not None else []
    for name, v in values.items():
        if name not in HELP:
            raise KeyError(name)
        if v is not None:
            out += [flag(name), repr(v) if isinstance(v, float) else str(v)]   # repr: every digit
    return out


def add_train_args(parser) -> None:
    """argparse options for every setting, each defaulting to None (load_config fills them in)."""
    parser.add_argument("--config", help="A TOML file of these settings (flags win).")
    types = {f.name: f.type for f in fields(TrainConfig)}
    for name, text in HELP.items():
        kind = str if "str" in types[name] else int if "int" in types[name] else float
        parser.add_argument(flag(name), dest=name, type=kind, default=None, help=text)


def load_config(path: str | Path | None, **flags) -> TrainConfig:
    """The TOML file's settings (if any), overridden by the flags that are not None; checked."""
    values: dict = {}
    if path is not None:
        p = Path(path)
        try:
            values = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist; pass the path of a TOML file of training settings.") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {path} is not valid TOML ({e}); fix it.") from None
        known = [f.name for f in fields(TrainConfig)]
        if unknown := sorted(set(values) - set(known)):
            raise ConfigError(f"config file {path} sets {', '.join(unknown)}, which plan does not know; "
                              f"the settings are {', '.join(known)}.")
    values.update({k: v for k, v in flags.items() if v is not None})
    try:
        config = TrainConfig(**values)
    except TypeError as e:
        raise ConfigError(f"the training settings are not understood ({e}); see `plan run --help`.") from None
    if problem := config.problem():
        raise ConfigError(f"{problem}.")
    return config
