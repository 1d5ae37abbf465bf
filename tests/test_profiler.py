"""The profiler against referees no one here wrote: PyTorch's MemTracker and FlopCounterMode.

The per-layer figures, added up as the cost model adds them for one plain training step
(one device, AdamW, fp32, steady state after a first step), must predict the peak MemTracker
measures for that step within 2%; parameter and optimizer bytes must be exact; FLOPs must
equal FlopCounterMode's on the whole model; fake and real profiles must agree.
"""

import functools
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.utils.flop_counter import FlopCounterMode

from planner.cost import single_device_peak
from profiles.schema import Profile, load_profile

EXAMPLES = ["gpt", "mlp"]


class Checkpointed(torch.nn.Module):
    """The layer under torch.utils.checkpoint, written here (not the project's wrapper): whole,
    or with PyTorch's selective API keeping the outputs of matmuls and attention."""

    def __init__(self, layer, mode: str):
        super().__init__()
        self.layer, self.mode = layer, mode

    def forward(self, x):
        if self.mode == "full":
            return checkpoint(self.layer, x, use_reentrant=False)
        aten = torch.ops.aten
        saved = (aten.mm.default, aten.addmm.default, aten.bmm.default,
                 aten._scaled_dot_product_flash_attention_for_cpu.default)

        def policy(ctx, op, *args, **kwargs):
            return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE
        return checkpoint(self.layer, x, use_reentrant=False,
                          context_fn=lambda: create_selective_checkpoint_contexts(policy))


def memtracker_step_peak(spec, b: int, ckpt: list[str], micro_batches: int = 1) -> int:
    """Peak of the second of two training steps, as PyTorch's MemTracker measures it."""
    torch.manual_seed(0)
    model = spec.build_model()
    for i, c in enumerate(ckpt):
        if c != "none":
            model[i] = Checkpointed(model[i], c)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def step():
        batches = [spec.make_batch(b) for _ in range(micro_batches)]
        tracker = MemTracker()
        tracker.track_external(model, opt, *[t for xy in batches for t in xy])
        with tracker:
            for x, y in batches:
                loss = spec.loss_fn(model(x), y) / micro_batches
                loss.backward()
                tracker.reset_mod_stats()   # per-module stats only; the global peak stays
            opt.step()
            opt.zero_grad(set_to_none=True)
        return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]

    step()
    return step()


@pytest.mark.parametrize("name", EXAMPLES)
@pytest.mark.parametrize("case", ["plain", "checkpoint_odd", "accumulate_2", "selective_all", "selective_even_full_odd"])
def test_one_device_peak_matches_memtracker(example_profiles, name, case):
    prof = example_profiles[name]["real"]
    spec = example_profiles[name]["spec"]
    b = 2
    ckpt = {"checkpoint_odd": lambda i: "full" if i % 2 else "none", "selective_all": lambda i: "selective",
            "selective_even_full_odd": lambda i: "full" if i % 2 else "selective"}.get(case, lambda i: "none")
    ckpt = [ckpt(i) for i in range(prof.n_layers)]
    m = 2 if case == "accumulate_2" else 1
    predicted = single_device_peak(prof, b, ckpt, num_micro_batches=m).peak
    measured = memtracker_step_peak(spec, b, ckpt, micro_batches=m)
    assert abs(predicted - measured) / measured < 0.02, (predicted, measured)


@pytest.mark.parametrize("name", EXAMPLES)
def test_parameter_and_optimizer_bytes_exact(example_profiles, name):
    prof = example_profiles[name]["real"]
    spec = example_profiles[name]["spec"]
    model = spec.build_model()
    for layer, lp in zip(model, prof.layers):
        params = list(layer.parameters())
        assert lp.param_count == sum(p.numel() for p in params)
        assert lp.param_bytes == sum(p.numel() * p.element_size() for p in params)
        assert lp.grad_bytes == lp.param_bytes
        opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        state = sum(t.untyped_storage().nbytes() for s in opt.state.values() for t in s.values())
        assert lp.optimizer_state_bytes == state


@pytest.mark.parametrize("name", EXAMPLES)
def test_flops_equal_flop_counter_on_whole_model(example_profiles, name):
    prof = example_profiles[name]["real"]
    spec = example_profiles[name]["spec"]
    b = 2
    model = spec.build_model()
    x, y = spec.make_batch(b)
    with FlopCounterMode(display=False) as counter:
        spec.loss_fn(model(x), y).backward()
    ours = sum(l.at(b).fwd_flops + l.at(b).bwd_flops for l in prof.layers)
    ours += prof.loss.at(b).fwd_flops + prof.loss.at(b).bwd_flops
    assert ours == counter.get_total_flops() > 0


@pytest.mark.parametrize("packet, extra", [
    ("_scaled_dot_product_flash_attention", ()), ("_scaled_dot_product_efficient_attention", (None, True)),
    ("_scaled_dot_product_cudnn_attention", (None, True)), ("_scaled_dot_product_flash_attention_backward", None),
    ("_scaled_dot_product_efficient_attention_backward", None)])
def test_grouped_query_attention_counts_as_keys_and_values_repeated(packet, extra):
    """The CUDA kernels take K and V with fewer heads than Q (GQA); their FLOPs are those of K
    and V repeated to Q's heads (PyTorch 2.11's formula refused them: a Llama 3 profile on CUDA)."""
    from profiles.flops import attention_flops
    op = getattr(torch.ops.aten, packet)
    meta = lambda *shape: torch.empty(shape, dtype=torch.bfloat16, device="meta")
    q, kv, kv_repeated = meta(2, 32, 128, 64), meta(2, 8, 128, 64), meta(2, 32, 128, 64)
    out = (meta(2, 32, 128, 64),)
    if extra is None:           # backward: (grad_out, q, k, v, out, logsumexp, ...)
        grouped, repeated = (q, q, kv, kv, q, meta(2, 32, 128)), (q, q, kv_repeated, kv_repeated, q, meta(2, 32, 128))
        if "efficient" in packet:
            grouped, repeated = grouped[:4] + (None,) + grouped[4:] + (0.0, (True, True, True, False)), \
                repeated[:4] + (None,) + repeated[4:] + (0.0, (True, True, True, False))
        else:
            grouped, repeated = grouped + (None, None, 128, 128, 0.0, False, None, None), \
                repeated + (None, None, 128, 128, 0.0, False, None, None)
    else:
        grouped, repeated = (q, kv, kv, *extra), (q, kv_repeated, kv_repeated, *extra)
    want = attention_flops(op, repeated, {}, out)
    assert want > 0 and attention_flops(op, grouped, {}, out) == want


@pytest.mark.parametrize("name", EXAMPLES)
def test_fake_and_real_profiles_agree(example_profiles, name):
    real, fake = example_profiles[name]["real"], example_profiles[name]["fake"]
    assert fake.method == "fake" and real.method == "measured"
    static = ("param_count", "param_bytes", "grad_bytes", "optimizer_state_bytes", "buffer_bytes", "tp_param_bytes")
    for lr, lf in zip(real.layers, fake.layers):
        assert [getattr(lr, k) for k in static] == [getattr(lf, k) for k in static]
        for b in real.batch_sizes:
            a, c = asdict(lr.samples[b]), asdict(lf.samples[b])
            assert {k: v for k, v in a.items() if not k.endswith("_s")} == {k: v for k, v in c.items() if not k.endswith("_s")}
            if lr.tp_samples:
                # Under the fake process group's tensor parallelism FLOPs are exact and memory
                # within 4 KiB: fake collectives hand back tensors a little differently.
                a, c = asdict(lr.tp_samples[b]), asdict(lf.tp_samples[b])
                assert (a["fwd_flops"], a["bwd_flops"]) == (c["fwd_flops"], c["bwd_flops"])
                for k in ("saved_bytes", "fwd_transient_bytes", "bwd_peak_bytes", "ckpt_bwd_peak_bytes"):
                    assert abs(a[k] - c[k]) <= 4096, (k, a[k], c[k])
    for b in real.batch_sizes:
        a, c = asdict(real.loss.samples[b]), asdict(fake.loss.samples[b])
        assert {k: v for k, v in a.items() if not k.endswith("_s")} == {k: v for k, v in c.items() if not k.endswith("_s")}
    assert sorted(real.loss.split_samples) == sorted(fake.loss.split_samples)
    for t, samples in real.loss.split_samples.items():
        for b, s in samples.items():
            a, c = asdict(s), asdict(fake.loss.split_samples[t][b])
            assert all(abs(a[k] - c[k]) <= 4096 for k in a if not k.endswith("_s")), (t, b, a, c)


def test_vocab_head_splits_the_logits_and_the_loss(example_profiles):
    """examples/gpt.py's head is "vocab": under TP its logits are 1/t of the vocabulary and the
    loss (loss_parallel) takes them so, at every degree; the loss all-reduces three floats a token
    (the max, the sum of exponentials, the target's logit) forward and nothing backward."""
    prof = example_profiles["gpt"]["real"]
    head, b = prof.layers[-1], 2
    tokens = b * 64
    assert head.vocab_head and sorted(prof.loss.split_samples) == [2, 4]
    logits = head.at(b).output_bytes
    assert logits == tokens * 512 * 4
    for t in (2, 4, 8):
        assert head.at_tp(b, t).output_bytes == logits // t
        assert head.at_tp(b, t).fwd_flops == head.at(b).fwd_flops // t
        loss = prof.loss.at_tp(b, t)
        assert loss.input_bytes == logits // t
        assert (loss.tp_fwd_comm_count, loss.tp_fwd_comm_bytes, loss.tp_bwd_comm_count) == (3, 3 * tokens * 4, 0)
    # What the loss keeps for backward shrinks with the logits (the plain loss keeps its log-softmax).
    kept = [prof.loss.at_tp(b, t).saved_bytes for t in (1, 2, 4, 8)]
    assert kept[0] > kept[1] > kept[2] > kept[3] > 0
    assert prof.loss.at_tp(b, 4).saved_bytes == prof.loss.split_samples[4][b].saved_bytes


def test_fake_profile_of_a_vocabulary_split_embedding(tmp_path):
    """tests/vocab_gpt.py splits its token embedding by rows. Measured under FakeTensorMode this
    crashed torch 2.13 (a deep copy of a layer copied the fake mode's constant table, whose weak
    references were then freed twice); each copy now shares the mode. The split embedding's
    output is all-reduced once forward, its weight halved."""
    from profiles.measure import ProfileOptions, profile_model
    from profiles.model_file import load_model_file
    prof = profile_model(load_model_file(str(Path(__file__).resolve().parent / "vocab_gpt.py")),
                         ProfileOptions(precision="bf16", fake=True, batch_sizes=(1, 2)))
    emb = prof.layers[0]
    assert [p.tp_dim for p in emb.params] == [0, None]          # tok split by rows, pos replicated
    for b in (1, 2):
        two = emb.tp_samples[b]
        assert (two.tp_fwd_comm_count, two.tp_fwd_comm_bytes) == (1, emb.samples[b].output_bytes)


def test_tensor_parallel_samples_shard_what_the_plan_splits(example_profiles):
    prof = example_profiles["gpt"]["real"]
    block = prof.layers[1]
    assert block.tp_samples and not prof.layers[0].tp_samples      # the embedding has no tp_plan entry
    one, two = block.at_tp(2, 1), block.at_tp(2, 2)
    # q, k, v, fc (colwise) and both projs (rowwise): two all-reduces forward, activations shrink.
    assert two.tp_fwd_comm_count == 2 and two.tp_fwd_comm_bytes == 2 * one.output_bytes
    assert two.saved_bytes < one.saved_bytes
    assert two.fwd_flops < one.fwd_flops
    sharded = sum(p.shape[0] * (p.shape[1] if len(p.shape) > 1 else 1) for p in block.params if p.tp_dim is not None)
    assert block.tp_param_bytes == 4 * sharded


def test_measured_tp_times_split_through_both_tp_degrees(example_profiles):
    """A measured profile times TP layers at t = 2 and 4 (tp_times); their time at t >= 2 is
    r + s/t through those two, exact at both, and the memory figures keep the line through 1
    and 2. A fake profile, timed op by op, has no DTensor cost to separate and no tp_times."""
    import copy
    prof = example_profiles["gpt"]["real"]
    assert not example_profiles["gpt"]["fake"].layers[1].tp_times
    block = copy.deepcopy(prof.layers[1])
    b = max(block.tp_times)
    assert sorted(block.tp_times) == sorted(block.tp_samples) and all(t > 0 for t in block.tp_times[b])
    block.samples[b].fwd_s, block.tp_samples[b].fwd_s, block.tp_times[b][0] = 0.010, 0.020, 0.015
    block.refit()
    assert block.at_tp(b, 1).fwd_s == pytest.approx(0.010)
    assert block.at_tp(b, 2).fwd_s == pytest.approx(0.020)
    assert block.at_tp(b, 4).fwd_s == pytest.approx(0.015)
    # 0.020 = r + s/2 and 0.015 = r + s/4: s = 0.020, r = 0.010.
    assert block.at_tp(b, 8).fwd_s == pytest.approx(0.010 + 0.020 / 8)
    one, two = block.at_tp(b, 1).saved_bytes, block.at_tp(b, 2).saved_bytes
    assert abs(block.at_tp(b, 4).saved_bytes - (1.5 * two - 0.5 * one)) <= 1


def test_linear_fits_are_exact_for_sizes_measured(example_profiles):
    prof = example_profiles["gpt"]["real"]
    block = prof.layers[1]
    fit = block.fits["saved_bytes"]
    # Activations of a transformer block are linear in the micro-batch size.
    assert fit.max_residual < 1e-6 * block.samples[4].saved_bytes
    assert block.at(8).saved_bytes == pytest.approx(2 * block.samples[4].saved_bytes, rel=1e-6)


def test_profile_round_trips_through_json(example_profiles, tmp_path):
    prof = example_profiles["gpt"]["real"]
    path = tmp_path / "p.json"
    prof.save(path)
    again = load_profile(path)
    assert isinstance(again, Profile)
    assert again.to_json() == prof.to_json()


@functools.cache
def paper_profile():
    """A fake bf16 profile of tests/paper_gpt.py (one for the three degrees)."""
    from profiles.measure import ProfileOptions, profile_model
    from profiles.model_file import load_model_file
    from tests import paper_gpt

    return profile_model(load_model_file(Path(paper_gpt.__file__)),
                         ProfileOptions(precision="bf16", fake=True, hardware="h100-sxm-80g"))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_activation_memory_is_korthikanti_et_al(tp):
    """Korthikanti et al. 2022 (section 4.1), per transformer layer: sbh(34 + 5as/h) bytes of
    activations without parallelism, sbh(10 + 24/t + 5as/(ht)) under tensor parallelism t,
    for 16-bit activations and 1-byte dropout masks. The profiler measures a layer built to
    the paper's assumptions (tests/paper_gpt.py; t = 2 under the fake process group, t = 4
    as the cost model extends it) and must give exactly that, plus what the paper leaves out:
    LayerNorm's mean and rstd (two per token per LayerNorm, in the activation dtype on CPU),
    and masks of the activation's size where it takes one byte: PyTorch's CPU dropout keeps
    its mask in the activation dtype (CUDA's native dropout keeps a bool, the paper's byte).
    With mask bytes mu the paper's own count is sbh(32 + 2 mu + (4 + mu) as/h) and, under TP,
    sbh(8 + 2 mu + 24/t + (4 + mu) as/(ht)); mu = 1 gives its formulas."""
    from tests import paper_gpt as paper

    prof = paper_profile()
    s, h, a = paper.SEQ_LEN, paper.HIDDEN, paper.HEADS
    mu, layer_norm_stats = 2, 2 * 2 * 2      # mask bytes; (mean, rstd) x 2 LayerNorms x 2 bytes, per token
    for b in prof.batch_sizes:
        sbh = s * b * h
        replicated = 8 + 2 * mu if tp > 1 else 32 + 2 * mu
        sharded = (24 if tp > 1 else 0) + (4 + mu) * a * s / h
        paper_bytes = sbh * (replicated + sharded / tp)
        if tp == 1:
            assert sbh * (34 + 5 * a * s / h) == paper_bytes - sbh * (2 * (mu - 1) + (mu - 1) * a * s / h)
        measured = prof.layers[1].at_tp(b, tp).saved_bytes
        assert measured == paper_bytes + layer_norm_stats * s * b, (b, measured, paper_bytes)


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_activation_memory_is_korthikanti_et_al(tp):
    """Korthikanti et al. 2022 (section 4.2.2): under tensor and sequence parallelism a layer
    keeps sbh(34/t + 5as/(ht)) bytes, every activation split t ways (sbh(32 + 2 mu + (4 + mu)
    as/h) / t with mask bytes mu, as in the test above). The profiler measures, under the fake
    process group, that plus the LayerNorm statistics (now of s/t tokens) and one thing torch
    does differently: the input of a column-parallel region, all-gathered from the slices,
    stays alive for the linears' weight gradients (2sbh for attention's q, k and v together,
    2sbh for the MLP's first linear), where Megatron keeps the slice and gathers it again in
    the backward: 4sbh(1 - 1/t) more. Both layers of the model are measured: the first takes
    the whole input and cuts its slice, the second (the last) gathers its output back.
    Its collectives are Megatron's: per micro-batch, an all-gather before and a
    reduce-scatter after each of the two regions, and their mirror images in the backward,
    each of the whole activation (2sbh), and no all-reduce inside the layer; the norms' partial
    gradients are settled once a step, outside it."""
    from tests import paper_gpt as paper

    prof = paper_profile()
    s, h, a = paper.SEQ_LEN, paper.HIDDEN, paper.HEADS
    mu, layer_norm_stats = 2, 2 * 2 * 2
    for b in prof.batch_sizes:
        sbh = s * b * h
        paper_bytes = sbh * (32 + 2 * mu + (4 + mu) * a * s / h) / tp     # mu = 1: sbh(34/t + 5as/(ht))
        for i in (0, 1):
            got = prof.layers[i].at_tp(b, tp, sequence_parallel=True)
            assert got.saved_bytes == paper_bytes + 4 * sbh * (1 - 1 / tp) + layer_norm_stats * s * b / tp, (i, b)
            assert (got.sp_fwd_comm_count, got.sp_bwd_comm_count) == (4 + i, 4)
            assert (got.sp_fwd_comm_bytes, got.sp_bwd_comm_bytes) == ((4 + i) * 2 * sbh, 4 * 2 * sbh)
            assert got.tp_fwd_comm_bytes == got.tp_bwd_comm_bytes == 0
            # The two norms' weights and biases come out of the backward as partial sums over
            # this rank's slice of the sequence: one all-reduce each a step, of the whole
            # gradient (h bf16 values); without sequence parallelism none does.
            assert (got.tp_grad_sync_count, got.tp_grad_sync_bytes) == (4, 4 * h * 2)
            assert prof.layers[i].at_tp(b, tp).tp_grad_sync_count == 0
        # What passes between the layers is the slice: 1/t of the hidden states.
        assert prof.layers[0].at_tp(b, tp, True).output_bytes == prof.layers[1].at_tp(b, tp, True).input_bytes == 2 * sbh / tp


def test_identical_layers_share_the_median_of_their_timings_split_ones_too():
    """Each of a group of identical layers is timed (plain, at TP_MEASURED and at TP_TIMED);
    all then take the group's median, so one unlucky timing does not stand for every layer."""
    from profiles.measure import share_times_of_identical_layers
    from profiles.schema import LayerProfile, LayerSample

    def layer(t):
        return LayerProfile(signature="same", samples={4: LayerSample(fwd_s=t, bwd_s=2 * t)},
                            tp_samples={4: LayerSample(fwd_s=t / 2, bwd_s=t)}, tp_times={4: [t / 4, t / 2]})
    group = [layer(t) for t in (1.0, 5.0, 2.0)]
    share_times_of_identical_layers(group)
    for g in group:
        assert (g.samples[4].fwd_s, g.samples[4].bwd_s) == (2.0, 4.0)
        assert (g.tp_samples[4].fwd_s, g.tp_samples[4].bwd_s) == (1.0, 2.0)
        assert g.tp_times[4] == [0.5, 1.0]


def test_fsdp_overheads_are_the_median_over_micro_batch_sizes_and_shared_by_identical_layers():
    """An FSDP2 unit's hooks do not grow with the micro-batch: each layer takes, per unit kind,
    the median of its measurements at every size (one slow try at the largest does not set it),
    and a layer identical to it the same figures."""
    from profiles.measure import set_fsdp_overheads
    from profiles.schema import LayerProfile
    layers = [LayerProfile(index=i, name=str(i), kind="Block") for i in range(3)]
    at_sizes = [{"replicate": 1.0e-3, "shard": 3.0e-3}, {"replicate": 1.2e-3, "shard": 2.8e-3},
                {"replicate": 4.0e-3, "shard": 3.1e-3}]          # the largest size's replicate: an outlier
    set_fsdp_overheads(layers, {0: at_sizes, 2: [{"replicate": 5e-4, "shard": 1e-3}]}, {1: 0})
    assert layers[0].fsdp_overhead_s == pytest.approx({"replicate": 1.2e-3, "shard": 3.0e-3})
    assert layers[1].fsdp_overhead_s == layers[0].fsdp_overhead_s and layers[1].fsdp_overhead_s is not layers[0].fsdp_overhead_s
    assert layers[2].fsdp_overhead_s == {"replicate": 5e-4, "shard": 1e-3}


def test_each_timed_repeat_runs_on_the_next_copy_of_the_layer_with_the_same_weights():
    """On a CPU a layer is timed on copies of it taken in turn (its weights out of the cache by
    its turn, as in a step): the copies hold the same weights, add up to twice the last-level
    cache of parameters, and every repeat, warm-up included, runs on the next one."""
    from profiles import measure
    from profiles.measure import COPIES_MAX, ProfileOptions, last_level_cache_bytes, time_layer, weight_copies

    class Counted(torch.nn.Linear):
        def forward(self, x):
            ran.append(id(self))
            return super().forward(x)

    ran: list[int] = []
    layer = Counted(256, 1024)                                    # 1 MiB of fp32 weights
    opts = ProfileOptions(warmup=2, repeats=5)
    copies = weight_copies(layer, opts)
    nbytes = 4 * (256 * 1024 + 1024)
    assert copies[0] is layer and len({id(c) for c in copies}) == len(copies)
    assert len(copies) == min(COPIES_MAX, -(-2 * last_level_cache_bytes() // nbytes))
    assert all(torch.equal(c.weight, layer.weight) and c.weight.data_ptr() != layer.weight.data_ptr() for c in copies[1:])

    made = []
    real = measure.weight_copies
    measure.weight_copies = lambda m, o: made.extend(real(m, o)) or made
    try:
        fwd, bwd = time_layer(layer, torch.randn(4, 256), opts)
    finally:
        measure.weight_copies = real
    assert ran == [id(made[r % len(made)]) for r in range(7)]     # 2 warm-up and 5 timed repeats, the copies in turn
    assert fwd > 0 and bwd > 0 and layer.weight.grad is None      # gradients cleared after every repeat
    # On a GPU, and for a layer past twice the cache, the layer alone.
    assert weight_copies(layer, ProfileOptions(device="cuda")) == [layer]
    big = torch.nn.Linear(1, (2 * last_level_cache_bytes()) // 4 + 1, bias=False)
    assert weight_copies(big, opts) == [big]
