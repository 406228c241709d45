"""Attention sinks (GPT-OSS) in engine-llm-triton's paged attention: prefill, decode unsplit and
split-KV, cascade over a shared prefix, the backend's mixed batches and the whole engine on a
tiny GPT-OSS, against the dense sink oracle of ``tests/test_attention_sinks.py`` (through
``paged_reference.reference_attention``) and the torch reference backend.

Errors are measured head by head (``worst_head_error``): a head whose sink takes almost all
the weight has a tiny output, and its error must not hide in the other heads' norm. Most heads
get sinks close to their scores, where a sink counted once per split-KV slice or per cascade
part changes the answer far beyond the tolerance."""

from __future__ import annotations

import pytest
import torch
from paged_reference import TOLERANCE, make_batch, reference_attention, worst_head_error
from test_attention_sinks import random_sinks
from test_triton_attention import _share_prefix, _tensors


def _sinks(heads: int, seed: int, device: str) -> torch.Tensor:
    """float32 ``[heads]``: head 0 a sink that takes almost all the weight (e^12), the last
    one that adds nothing (e^-30) when there are more than two heads, the others within the
    scores' range (-1 .. 3: a sink counted twice moves them by a lot)."""
    sinks = random_sinks(heads, torch.Generator().manual_seed(seed))
    if heads > 2:
        sinks[1:-1] = sinks[1:-1].clamp(-1.0, 3.0)
    return sinks.to(device)


def _check(out, batch, scale, window, cap, sinks, dtype, seed) -> None:
    expected = reference_attention(
        batch.query, batch.kv_cache, batch.query_lens, batch.seq_lens, batch.block_tables,
        scale, window, cap, sinks,
    )  # fmt: skip
    err = worst_head_error(out[: expected.shape[0]], expected)
    assert err < TOLERANCE[dtype], f"seed={seed} worst head rel_error={err}"


def _decode(batch, meta, sinks, splits, append=True, **kw) -> torch.Tensor:
    """``paged_decode`` of every request of ``batch`` (one token each), ``splits`` slices, the
    arrival counters checked to be left at zero."""
    from engine_triton.kernels.attention import paged_decode

    n = len(batch.seq_lens)
    out = torch.full_like(batch.query, float("nan"))
    counters = torch.zeros(n * batch.kv_cache.shape[3], dtype=torch.int32, device=out.device)
    if append:
        kw.update(key=batch.key, value=batch.value, slot_mapping=meta.slot_mapping)
    paged_decode(
        batch.query, batch.kv_cache, out, meta.seq_lens, meta.block_table, n,
        kw.pop("scale", 0.3), kw.pop("window", None), kw.pop("cap", None), num_splits=splits,
        split_counters=counters, sinks=sinks, **kw,
    )  # fmt: skip
    assert not counters.any(), "the arrival counters must be left at zero"
    return out


@pytest.mark.parametrize(
    "dtype,heads,kv_heads,window,cap",
    [
        (torch.float32, 4, 2, None, None),  # GQA
        (torch.bfloat16, 3, 1, 5, None),  # odd group, sliding window (GPT-OSS's other layers)
        (torch.float32, 2, 2, 6, 4.0),  # MHA, window and soft-cap (the sink is not capped)
        (torch.float16, 8, 2, None, 3.0),
    ],
)
def test_prefill_with_sinks(dtype, heads, kv_heads, window, cap, device, seed):
    """Chunked prefill over a cached prefix: a fresh prompt, a chunk after a prefix, one
    token."""
    from engine_triton.kernels.attention import paged_prefill

    batch = make_batch([7, 5, 1], [7, 13, 4], heads, kv_heads, 20, 4, dtype, device)
    meta = _tensors(batch, device)
    sinks = _sinks(heads, seed, device)
    out = torch.full_like(batch.query, float("nan"))
    paged_prefill(
        batch.query, batch.kv_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_table,
        3, meta.num_actual_tokens, 20**-0.5, window, cap, sinks=sinks,
    )  # fmt: skip
    _check(out, batch, 20**-0.5, window, cap, sinks, dtype, seed)


@pytest.mark.parametrize(
    "dtype,splits,window,cap,append",
    [
        (torch.float32, 1, None, None, False),  # one program holds each whole context
        (torch.bfloat16, 4, None, None, False),  # split-KV, combined in the same launch
        (torch.float32, 2, 9, None, True),  # splits over a sliding window, fused append
        (torch.bfloat16, 2, None, 3.0, True),
        (torch.float32, 1, 4, 2.0, True),
        (torch.float16, 8, 5, None, True),  # more splits than some contexts fill
    ],
)
def test_decode_with_sinks(dtype, splits, window, cap, append, device, seed):
    """Decode with and without split-KV; contexts of 37, 1 and 3 tokens leave some splits
    empty and one context in a single split (written without a combine)."""
    from engine.kernels.reference import write_kv_cache

    batch = make_batch([1, 1, 1], [37, 1, 3], 4, 2, 16, 8, dtype, device)
    meta = _tensors(batch, device)
    expected_cache = batch.kv_cache.clone()
    write_kv_cache(batch.key, batch.value, expected_cache, meta.slot_mapping)
    if not append:  # the kernel reads the newest token from the cache
        batch.kv_cache.copy_(expected_cache)
    sinks = _sinks(4, seed, device)
    out = _decode(batch, meta, sinks, splits, append, window=window, cap=cap)
    assert torch.equal(batch.kv_cache.cpu(), expected_cache.cpu()), f"seed={seed}"
    _check(out, batch, 0.3, window, cap, sinks, dtype, seed)


@pytest.mark.parametrize("splits", [2, 8, 32])
def test_decode_counts_the_sink_once_however_many_splits(splits, device, seed):
    """Many splits over contexts of 300, 70, 16 and 2 tokens, 8 query heads per KV head, sinks
    from -1 to 3 (the scores' range): the split answer is the unsplit one and the oracle's.
    A sink added per split would be counted up to ``splits`` times."""
    from engine.kernels.reference import write_kv_cache

    batch = make_batch([1, 1, 1, 1], [300, 70, 16, 2], 16, 2, 32, 16, torch.float32, device)
    meta = _tensors(batch, device)
    write_kv_cache(batch.key, batch.value, batch.kv_cache, meta.slot_mapping)
    sinks = torch.linspace(-1.0, 3.0, 16, device=device)
    whole = _decode(batch, meta, sinks, 1, append=False, scale=0.2)
    split = _decode(batch, meta, sinks, splits, append=False, scale=0.2)
    _check(split, batch, 0.2, None, None, sinks, torch.float32, seed)
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "dtype,heads,kv_heads,splits,shared_splits,append,cap,holders",
    [
        (torch.float32, 4, 2, 1, 1, True, None, None),  # one slice each side
        (torch.bfloat16, 4, 1, 2, 3, True, None, None),  # split rest, prefix in 3 slices
        (torch.float32, 3, 3, 4, 2, False, 2.5, None),  # MHA, soft-cap, newest from the cache
        (torch.float32, 4, 2, 2, 2, True, None, {1, 3, 4}),  # request 2 holds other blocks
    ],
)
def test_cascade_with_sinks(
    dtype, heads, kv_heads, splits, shared_splits, append, cap, holders, device, seed
):
    """Cascade attention: the shared prefix's partials (its own slices) and each request's
    rest (split or not) merge with the sink counted once, for holders and non-holders alike;
    a request with nothing after the prefix but its newest token merges one split with it."""
    from engine.attention_backends.interface import CascadeInputs, find_shared_prefix
    from engine.kernels.reference import write_kv_cache

    seq_lens = [29, 21, 40, 21, 25]
    batch = make_batch([1] * 5, seq_lens, heads, kv_heads, 16, 4, dtype, device)
    _share_prefix(batch, 5, holders)  # 20 tokens
    found = find_shared_prefix(batch.block_tables, seq_lens, 5, 4)
    assert found is not None and found.length == 20
    cascade = CascadeInputs.from_prefix(found, 5, device)
    meta = _tensors(batch, device)
    if not append:
        write_kv_cache(batch.key, batch.value, batch.kv_cache, meta.slot_mapping)
    sinks = _sinks(heads, seed, device)
    out = _decode(
        batch, meta, sinks, splits, append, cap=cap, cascade_starts=cascade.starts,
        cascade_prefix=cascade.prefix, shared_splits=shared_splits,
    )  # fmt: skip
    _check(out, batch, 0.3, None, cap, sinks, dtype, seed)


def _backend(heads, kv_heads, head_size, window=None, cap=None, sinks=None, cls=None):
    from engine_triton.attention import TritonAttentionBackend

    backend = (cls or TritonAttentionBackend)(
        heads, head_size, kv_heads, head_size**-0.5, window, cap
    )
    backend.sinks = sinks
    return backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 6])
def test_backend_mixed_batch_with_sinks(dtype, window, device, seed):
    """Decodes first (split-KV at this batch size), then prefill chunks, through ``forward``:
    the oracle's answer and the torch reference backend's (the spec) with the same sinks."""
    from engine.attention_backends.torch_ref import TorchReferenceBackend
    from engine.kernels.reference import write_kv_cache

    heads, kv_heads, head_size = 4, 2, 16
    batch = make_batch([1, 1, 6, 3], [30, 3, 6, 11], heads, kv_heads, head_size, 4, dtype, device)
    sinks = _sinks(heads, seed, device)
    meta = _tensors(batch, device)
    ref_cache = batch.kv_cache.cpu().float()
    out = _backend(heads, kv_heads, head_size, window, None, sinks).forward(
        batch.query, batch.key, batch.value, batch.kv_cache, meta
    )
    expected_cache = ref_cache.clone()
    write_kv_cache(batch.key.cpu().float(), batch.value.cpu().float(), expected_cache,
                   meta.slot_mapping.cpu())  # fmt: skip
    assert torch.equal(batch.kv_cache.cpu().float(), expected_cache)
    _check(out, batch, 0.25, window, None, sinks, dtype, seed)
    ref = _backend(heads, kv_heads, head_size, window, None, sinks.cpu(), TorchReferenceBackend)
    spec = ref.forward(batch.query.cpu().float(), batch.key.cpu().float(),
                       batch.value.cpu().float(), ref_cache, _tensors(batch, "cpu"))  # fmt: skip
    assert worst_head_error(out, spec.double()) < TOLERANCE[dtype], f"seed={seed}"


def test_backend_cascade_with_sinks_from_metadata(device, seed):
    """``forward`` runs cascade attention with sinks when the metadata names a shared prefix
    (and ignores the prefix under a sliding window): the oracle's answer either way."""
    from engine.attention_backends.interface import CascadeInputs, SharedPrefix

    batch = make_batch([1, 1, 1, 4], [18, 23, 17, 9], 4, 2, 16, 4, torch.float32, device)
    prefix = _share_prefix(batch, 4, {2})  # request 1 holds its own blocks
    meta = _tensors(batch, device)
    meta.cascade = CascadeInputs.from_prefix(SharedPrefix(prefix, (0, 2)), 3, device)
    sinks = _sinks(4, seed, device)
    for window in (None, 7):
        backend = _backend(4, 2, 16, window, None, sinks)
        out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, meta)
        _check(out, batch, 0.25, window, None, sinks, torch.float32, seed)


@pytest.mark.parametrize("value", [40.0, -80.0, float("-inf")])
def test_a_dominant_sink_takes_the_weight_and_a_negligible_one_changes_nothing(value, device, seed):
    """The same sink on every head, through prefill, split decode and cascade (one mixed step
    with a shared prefix): e^40 leaves outputs some e^-35 of the plain ones, still right
    relative to themselves; e^-80 and e^-inf give the plain softmax's answer (-inf bit for
    bit in the interpreter: the factor is exactly 1)."""
    from engine.attention_backends.interface import CascadeInputs, SharedPrefix

    batch = make_batch([1, 1, 1, 5], [26, 30, 9, 12], 4, 2, 16, 4, torch.float32, device)
    prefix = _share_prefix(batch, 4, {1})
    meta = _tensors(batch, device)
    meta.cascade = CascadeInputs.from_prefix(SharedPrefix(prefix, (0, 1)), 3, device)
    sinks = torch.full((4,), value, device=device)
    cache = batch.kv_cache.clone()
    plain = _backend(4, 2, 16).forward(batch.query, batch.key, batch.value, cache, meta)
    out = _backend(4, 2, 16, sinks=sinks).forward(
        batch.query, batch.key, batch.value, batch.kv_cache, meta
    )
    if value > 0:
        assert out.abs().max() < 1e-12 * plain.abs().max(), f"seed={seed}"
        _check(out, batch, 0.25, None, None, sinks, torch.float32, seed)
    elif value == float("-inf") and device == "cpu":  # a GPU's division may round 1 / 1
        assert torch.equal(out, plain), f"seed={seed}"
    else:
        torch.testing.assert_close(out, plain, atol=1e-6, rtol=1e-6)


def test_decode_padding_rows_stay_zero_with_sinks(device, seed):
    """A padded graph batch's rows of length 0 give zeros (no NaN) with finite and -inf
    sinks, split or not."""
    batch = make_batch([1, 1], [5, 9], 2, 1, 16, 4, torch.float32, device)
    meta = _tensors(batch, device)
    meta.seq_lens[1] = 0
    meta.slot_mapping[1] = -1
    for sinks in ([2.0, -1.0], [float("-inf")] * 2):
        for splits in (1, 2):
            out = _decode(batch, meta, torch.tensor(sinks, device=device), splits)
            assert torch.equal(out[1].cpu(), torch.zeros_like(out[1].cpu())), f"seed={seed}"
            assert torch.isfinite(out[0]).all(), f"seed={seed}"


def test_sinks_must_be_float32_per_head_on_the_device(device):
    """The kernels read the layer's parameter in place (graphs keep the pointer), so a tensor
    they cannot index as float32 ``[num_heads]`` is refused rather than converted."""
    from engine_triton.kernels.attention import paged_decode, paged_prefill

    batch = make_batch([1, 3], [4, 3], 4, 2, 16, 4, torch.float32, device)
    meta = _tensors(batch, device)
    out = torch.empty_like(batch.query)
    for bad in (
        torch.zeros(4, dtype=torch.bfloat16, device=device),
        torch.zeros(2, device=device),
        torch.zeros(8, device=device)[::2],
    ):
        with pytest.raises(ValueError, match="float32"):
            paged_decode(batch.query, batch.kv_cache, out, meta.seq_lens, meta.block_table, 1,
                         0.25, sinks=bad)  # fmt: skip
        with pytest.raises(ValueError, match="float32"):
            paged_prefill(batch.query, batch.kv_cache, out, meta.query_start_loc[1:],
                          meta.seq_lens[1:], meta.block_table[1:], 1, 3, 0.25,
                          sinks=bad)  # fmt: skip


def test_the_triton_backends_serve_sinks_once_declared(triton_sinks_declared):
    """Selection offers triton (and engine-rocm's subclass, which inherits it) to GPT-OSS."""
    from engine.attention_backends.interface import AttentionSpec
    from engine_rocm.attention import RocmTritonAttentionBackend
    from engine_triton.attention import TritonAttentionBackend

    spec = AttentionSpec(device_type="cuda", dtype="bfloat16", head_size=64, num_heads=64,
                         num_kv_heads=8, sliding_window=True, attention_sinks=True)  # fmt: skip
    for cls in (TritonAttentionBackend, RocmTritonAttentionBackend):
        assert cls.supports_attention_sinks
        assert cls.supports(spec) == [], cls.name


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory):
    from engine.testing.tiny_models import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without a GPU")
def test_gpt_oss_on_the_triton_backend_matches_torch(
    tiny_gpt_oss, monkeypatch, triton_sinks_declared
):
    """The tiny GPT-OSS (sinks from -2 to 3, sliding-window and full layers) with its attention
    in Triton's interpreter: chunked prefill, a prefix-cache hit, decodes through the decode
    graphs' buffers (``capture_graphs(eager=True)``), split-KV (4 splits, as a GPU's many SMs
    would ask for) and cascade attention over shared prefix blocks (thresholds lowered to this
    batch): the greedy tokens of the torch backend, and
    their log-probabilities within 5e-5 (greedy tokens of a tiny model can survive a wrong
    sink; their log-probabilities do not)."""
    from paged_reference import record_cascades

    import engine_triton.kernels.attention as attention
    from engine import LLM, SamplingParams

    monkeypatch.setattr(attention, "decode_splits", lambda *args: 4)
    log = record_cascades(monkeypatch, min_decodes=2, min_prefix=4)
    prefix = list(range(20, 33))  # 13 tokens: 3 whole blocks of 4 shared
    # The last prompt shares nothing and its decodes fill 3 of the 4 splits (16-token tiles).
    prompts = [prefix + [40 + i] * (1 + i % 3) for i in range(6)] + [list(range(60, 95))]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=0)

    def run(backend: str) -> tuple[list[list[int]], list[float]]:
        llm = LLM(tiny_gpt_oss, attention_backend=backend, dtype="float32", block_size=4,
                  max_num_batched_tokens=24, max_num_seqs=8, platform="cpu")  # fmt: skip
        runner = llm.llm_engine.runner
        assert runner.attn_backend_cls.name == backend
        if backend == "triton":
            runner.capture_graphs(eager=True)
        llm.generate(prompts[:1], params, use_tqdm=False)  # caches the prefix blocks
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        logprobs = [
            lp[t].logprob for o in outs for t, lp in zip(o.token_ids, o.logprobs, strict=True)
        ]
        return [o.token_ids for o in outs], logprobs

    tokens, logprobs = run("torch")
    log.clear()
    got_tokens, got_logprobs = run("triton")
    assert got_tokens == tokens
    # 4e-6 apart here (2026-12-07); a sink counted once per split moved one by 7e-4.
    assert got_logprobs == pytest.approx(logprobs, abs=5e-5)
    assert log.shared_passes > 0, "no step ran cascade attention"
    assert max(log.graph_lengths, default=0) == 12, log.graph_lengths  # cascade graph replays
