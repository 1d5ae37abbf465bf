"""Random but self-consistent profiles, for testing the planner without torch."""

from __future__ import annotations

import copy
import random

from profiles.schema import LayerProfile, LayerSample, LossProfile, ParamInfo, Profile


def _sample(rng: random.Random, b: int, base: dict, in_bytes: int, out_bytes: int) -> LayerSample:
    """Figures linear in the micro-batch size b, from per-sample random bases."""
    keeps_in, keeps_out = base["keeps_in"], base["keeps_out"]
    own = base["own"] * b
    saved = own + (in_bytes if keeps_in else 0) + (out_bytes if keeps_out else 0)
    return LayerSample(
        input_bytes=in_bytes, output_bytes=out_bytes, saved_bytes=saved,
        saved_input_bytes=in_bytes if keeps_in else 0, saved_output_bytes=out_bytes if keeps_out else 0,
        fwd_transient_bytes=base["fwd_t"] * b, bwd_peak_bytes=base["bwd"] * b + base["grad"],
        bwd_accum_peak_bytes=base["bwd"] * b, ckpt_saved_bytes=base["ck_own"],
        ckpt_fwd_transient_bytes=base["ck_fwd_t"] * b, ckpt_bwd_peak_bytes=(base["bwd"] + base["own"]) * b + base["grad"],
        ckpt_bwd_accum_peak_bytes=(base["bwd"] + base["own"]) * b,
        # Selective: keeps part of `own` (its matmuls' outputs), sometimes its output too, and
        # recomputes a share of the forward.
        sac_saved_bytes=base["sac_own"] * b, sac_saved_output_bytes=out_bytes if base["sac_keeps_out"] else 0,
        sac_fwd_transient_bytes=base["sac_fwd_t"] * b,
        sac_bwd_peak_bytes=(base["bwd"] + base["own"] - base["sac_own"]) * b + base["grad"],
        sac_bwd_accum_peak_bytes=(base["bwd"] + base["own"] - base["sac_own"]) * b,
        sac_recompute_s=base["sac_share"] * base["fwd_s"] * b,
        fwd_s=base["fwd_s"] * b, bwd_s=2 * base["fwd_s"] * b, fwd_flops=base["flops"] * b, bwd_flops=2 * base["flops"] * b,
        fwd_io_bytes=base["io"] * b, bwd_io_bytes=2 * base["io"] * b,
    )


def random_profile(rng: random.Random, n_layers: int, repeat_runs: bool = True, optimizer: str = "adamw",
                   byte_scale: int = 1) -> Profile:
    """A profile of n_layers with random figures; with repeat_runs, some consecutive layers are
    identical. byte_scale multiplies every size (activations, transients, parameter rows): 2**17
    turns these KiB-sized layers into GiB-sized ones, as on a GPU."""
    batch_sizes = [1, 2, 4]
    kib = 1024 * byte_scale
    width = rng.choice([8, 16, 32]) * kib            # bytes of one sample's activation between layers
    layers: list[LayerProfile] = []
    i = 0
    while i < n_layers:
        run = rng.randint(1, 3) if repeat_runs else 1
        run = min(run, n_layers - i)
        rows, cols = rng.choice([64, 128, 256]) * byte_scale, rng.choice([64, 128])
        base = {
            "own": rng.randint(1, 8) * kib, "keeps_in": rng.random() < 0.7, "keeps_out": rng.random() < 0.3,
            "fwd_t": rng.randint(0, 4) * kib, "bwd": rng.randint(1, 6) * kib, "ck_own": rng.choice([0, 64]) * byte_scale,
            "ck_fwd_t": rng.randint(1, 4) * kib, "grad": 4 * rows * cols, "fwd_s": rng.uniform(1e-4, 1e-3),
            "flops": rng.randint(1, 100) * 10**6, "io": rng.randint(1, 10) * 10**5,
            "opt_s": rng.choice([0.0, rng.uniform(1e-5, 2e-4)]),   # 0: not measured, the cost model's formula
        }
        # Drawn from their own generator, so that the other figures are those drawn before
        # selective checkpointing existed.
        sub = random.Random(f"{base['own']}-{base['fwd_s']}-{i}")
        base.update(sac_own=base["own"] * sub.choice([0, 1, 2, 3]) // 4, sac_keeps_out=sub.random() < 0.2,
                    sac_fwd_t=sub.randint(0, 4) * kib, sac_share=sub.uniform(0.05, 0.5))
        sig = f"s{i}"
        for _ in range(run):
            params = [ParamInfo("w", [rows, cols], 0 if rng.random() < 0.5 else None)]
            numel = rows * cols
            lp = LayerProfile(
                index=i, name=str(i), kind="Synthetic", signature=sig, param_count=numel, param_bytes=4 * numel,
                compute_param_bytes=4 * numel, buffer_bytes=0, grad_bytes=4 * numel,
                optimizer_state_bytes=8 * numel + 4 if optimizer in ("adam", "adamw") else 0,
                tp_param_bytes=4 * numel if params[0].tp_dim is not None else 0, params=params,
                optimizer_step_s=base["opt_s"],
            )
            layers.append(lp)
            i += 1
        # Identical layers share everything, including the tp split and the measured samples.
        for lp in layers[-run:]:
            lp.params = [ParamInfo("w", [rows, cols], layers[-run].params[0].tp_dim)]
            lp.tp_param_bytes = layers[-run].tp_param_bytes
            lp.samples = {b: _sample(rng, b, base, width * b, width * b) for b in batch_sizes}
            lp.refit()
    loss = LossProfile(samples={b: LayerSample(input_bytes=width * b, output_bytes=4, saved_bytes=width * b,
                                           fwd_transient_bytes=width * b, bwd_peak_bytes=width * b,
                                           bwd_accum_peak_bytes=width * b, fwd_s=1e-5 * b, bwd_s=1e-5 * b)
                            for b in batch_sizes})
    loss.refit()
    return Profile(model={"path": "synthetic.py", "sha256": "0" * 64, "source": "synthetic", "name": "synthetic"},
                   torch_version="2.13.0", device="cpu", device_type="cpu", method="measured", hardware=None,
                   precision="fp32", optimizer=optimizer, batch_sizes=batch_sizes, layers=layers, loss=loss,
                   batch={"input_bytes_per_sample": 512, "target_bytes_per_sample": 64})


def add_tensor_parallel_samples(rng: random.Random, prof: Profile) -> Profile:
    """Give every layer figures at t = 2 (tp_samples) and under sequence parallelism
    (sp_samples), the same for identical layers: tensor parallelism splits part of what a layer
    keeps and its transients and all-reduces its regions' outputs; sequence parallelism splits
    the rest of what it keeps, its input and output too, and all-gathers and reduce-scatters
    instead. A random share of each figure is split, as measured layers differ in how much."""
    by_signature: dict[str, tuple[dict, dict]] = {}
    for lp in prof.layers:
        if lp.signature not in by_signature:
            split = rng.uniform(0.3, 0.9)        # the share of `own` and the transients TP splits
            tp, sp = {}, {}
            for b, s in lp.samples.items():
                own = s.saved_bytes - s.saved_input_bytes - s.saved_output_bytes
                t = copy.copy(s)
                t.fwd_transient_bytes = int(s.fwd_transient_bytes * (1 - split / 2))
                t.bwd_peak_bytes, t.bwd_accum_peak_bytes = (int(x * (1 - split / 2)) for x in (s.bwd_peak_bytes, s.bwd_accum_peak_bytes))
                t.saved_bytes = s.saved_bytes - int(own * split / 2)
                t.tp_fwd_comm_bytes, t.tp_bwd_comm_bytes, t.tp_fwd_comm_count, t.tp_bwd_comm_count = \
                    2 * s.output_bytes, 2 * s.output_bytes, 2, 2
                q = copy.copy(t)
                q.input_bytes, q.output_bytes = s.input_bytes // 2, s.output_bytes // 2
                q.saved_input_bytes, q.saved_output_bytes = s.saved_input_bytes // 2, s.saved_output_bytes // 2
                q.saved_bytes = own // 2 + q.saved_input_bytes + q.saved_output_bytes
                q.sac_saved_bytes = s.sac_saved_bytes // 2
                q.sac_saved_output_bytes = s.sac_saved_output_bytes // 2
                q.tp_fwd_comm_bytes = q.tp_bwd_comm_bytes = q.tp_fwd_comm_count = q.tp_bwd_comm_count = 0
                q.sp_fwd_comm_bytes, q.sp_bwd_comm_bytes, q.sp_fwd_comm_count, q.sp_bwd_comm_count = \
                    4 * s.output_bytes, 4 * s.output_bytes, 4, 4
                tp[b], sp[b] = t, q
            by_signature[lp.signature] = (tp, sp)
        tp, sp = by_signature[lp.signature]
        lp.tp_samples = {b: copy.copy(s) for b, s in tp.items()}
        lp.sp_samples = {b: copy.copy(s) for b, s in sp.items()}
        lp.params = [ParamInfo(p.name, p.shape, 0) for p in lp.params]   # every layer splits
        lp.tp_param_bytes = lp.param_bytes
        lp.refit()
    # The head splits the vocabulary: the loss takes 1/t of its logits, all-reduces three scalars a token.
    prof.layers[-1].vocab_head = True
    for t in (2, 4):
        prof.loss.split_samples[t] = {}
        for b, s in prof.loss.samples.items():
            q = copy.copy(s)
            q.input_bytes, q.saved_bytes, q.fwd_transient_bytes = s.input_bytes // t, s.saved_bytes // t, s.fwd_transient_bytes // t
            q.bwd_peak_bytes, q.bwd_accum_peak_bytes = s.bwd_peak_bytes // t, s.bwd_accum_peak_bytes // t
            q.fwd_s, q.bwd_s = s.fwd_s / t, s.bwd_s / t
            q.tp_fwd_comm_bytes, q.tp_fwd_comm_count = 12 * b, 3
            prof.loss.split_samples[t][b] = q
    prof.loss.refit()
    return prof


def keeps_neither_profile(rng: random.Random, n_layers: int = 7) -> Profile:
    """A layer that keeps its output, a run of identical layers that keep neither their input
    nor their output (parameters smaller than their activations), then a layer with a narrow
    output and a last layer: under pipelined ZeRO 3, once gradients exist, the run's forward
    peaks at its second layer (the first finds its input kept by the layer before, and the copies
    the later layers' backwards left shrink along the run)."""
    prof = random_profile(rng, n_layers, repeat_runs=False)
    width, own, rows = rng.choice([16, 32]) * 1024, rng.choice([1, 2]) * 1024, rng.choice([4, 8, 16])
    for i, lp in enumerate(prof.layers):
        numel = rows * 128
        lp.params = [ParamInfo("w", [rows, 128], None)]
        lp.param_count, lp.param_bytes, lp.compute_param_bytes, lp.grad_bytes = numel, 4 * numel, 4 * numel, 4 * numel
        lp.optimizer_state_bytes, lp.tp_param_bytes = 8 * numel + 4, 0
        lp.signature = "run" if 0 < i < n_layers - 2 else f"layer{i}"
        for b, s in lp.samples.items():
            s.input_bytes = 256 * b if i == n_layers - 1 else width * b
            s.output_bytes = 256 * b if i >= n_layers - 2 else width * b
            s.saved_input_bytes, s.saved_output_bytes = 0, (s.output_bytes if i == 0 else 0)
            s.saved_bytes = own * b + s.saved_output_bytes
            s.fwd_transient_bytes, s.bwd_accum_peak_bytes, s.bwd_peak_bytes = 0, 512 * b, 512 * b + lp.grad_bytes
        lp.refit()
    for b, s in prof.loss.samples.items():
        s.input_bytes = s.saved_bytes = s.fwd_transient_bytes = s.bwd_peak_bytes = s.bwd_accum_peak_bytes = 256 * b
    prof.loss.refit()
    return prof
