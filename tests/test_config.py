"""Training settings: the learning-rate schedule's values and the settings' refusals."""

from __future__ import annotations

import math

import pytest

from runtime.config import ConfigError, TrainConfig, load_config, train_args


def test_warmup_then_cosine_to_the_floor():
    c = TrainConfig(lr=1.0, lr_schedule="cosine", warmup_steps=4, decay_steps=14, min_lr_ratio=0.1)
    lrs = [c.lr_at(s, base_lr=123.0, total_steps=100) for s in range(20)]
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])          # linear warm-up, the peak at its last step
    assert lrs[4] == pytest.approx(1.0)                               # the cosine starts at the peak
    assert lrs[9] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))   # half-way: the middle
    assert lrs[14:] == pytest.approx([0.1] * 6)                       # the floor from decay_steps on
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))              # never rises after warm-up


def test_constant_uses_the_plans_rate_and_the_run_length_is_the_default_horizon():
    assert TrainConfig().lr_at(7, base_lr=0.003, total_steps=10) == 0.003
    c = TrainConfig(lr_schedule="cosine", min_lr_ratio=0.0)
    assert c.lr_at(5, base_lr=2.0, total_steps=10) == pytest.approx(1.0)   # half-way through the run


def test_toml_file_and_flags(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('lr = 0.01\nlr_schedule = "cosine"\nwarmup_steps = 5\n')
    c = load_config(f, warmup_steps=2, lr=None)
    assert (c.lr, c.lr_schedule, c.warmup_steps) == (0.01, "cosine", 2)    # flags win, None is unset
    assert train_args(f, lr=0.5, clip_grad_norm=None) == ["--config", str(f), "--lr", "0.5"]


@pytest.mark.parametrize("text, flags, says", [
    ("lr = -1\n", {}, "learning rate is -1"),
    ("", {"lr_schedule": "linear"}, "use one of constant, cosine"),
    ("", {"warmup_steps": 10, "decay_steps": 5}, "more steps than the warm-up's 10"),
    ("", {"clip_grad_norm": -0.5}, "clip_grad_norm is -0.5"),
    ("lr_shedule = 'cosine'\n", {}, "sets lr_shedule, which plan does not know"),
    ("lr = [1\n", {}, "is not valid TOML"),
    ("lr = 'high'\n", {}, "learning rate is 'high'"),
])
def test_bad_settings_are_one_sentence(tmp_path, text, flags, says):
    f = tmp_path / "run.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=says):
        load_config(f, **flags)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_optimizer_settings_and_seed_override_the_plans_only_where_given():
    from planner.plan import OptimizerConfig

    from runtime_cases import make_plan
    plan = make_plan(optimizer=OptimizerConfig(name="adamw", lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01), seed=3)
    got = TrainConfig(lr=2e-3, beta2=0.95, seed=11).apply_to(plan)
    assert (got.optimizer.lr, got.optimizer.betas, got.optimizer.weight_decay, got.seed) == (2e-3, (0.9, 0.95), 0.01, 11)
    assert plan.optimizer.lr == 1e-3 and plan.seed == 3                       # a copy: the plan is untouched
    assert TrainConfig().apply_to(plan) == plan
    assert train_args(beta2=0.99999999) == ["--beta2", "0.99999999"]          # every digit reaches the runtime
    with pytest.raises(ConfigError, match="beta1 is 1.0"):
        load_config(None, beta1=1.0)
