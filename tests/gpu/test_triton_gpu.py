"""engine-llm-triton's kernels on a CUDA GPU at model-like sizes, against the torch references and
the float64 paged-attention oracle (fresh random inputs every run)."""

from __future__ import annotations

import pytest
import torch
from kernel_tolerance import close, qk_norm_rotary_slack
from paged_reference import (
    TOLERANCE,
    make_batch,
    reference_attention,
    rel_error,
    worst_head_error,
)

from engine.attention_backends.interface import BatchLayout
from engine.kernels import reference as ref

pytestmark = pytest.mark.gpu
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_and_activations(dtype, seed):
    from engine_triton.kernels import activation, norm

    x = torch.randn(77, 4096).to(dtype)
    r = torch.randn(77, 4096).to(dtype)
    w = torch.randn(4096).to(dtype)
    close(norm.rms_norm(x.cuda(), w.cuda(), 1e-6), ref.rms_norm(x, w, 1e-6), dtype, seed)
    a, b = norm.fused_add_rms_norm(x.cuda(), r.cuda(), w.cuda(), 1e-6)
    ea, eb = ref.fused_add_rms_norm(x, r, w, 1e-6)
    close(b, eb, dtype, seed)
    close(a, ea, dtype, seed)
    g = (3 * torch.randn(33, 2 * 3000)).to(dtype)
    close(activation.silu_and_mul(g.cuda()), ref.silu_and_mul(g), dtype, seed)
    close(activation.gelu_tanh_and_mul(g.cuda()), ref.gelu_tanh_and_mul(g), dtype, seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox,rot_dim", [(True, 128), (False, 128), (True, 64)])
def test_rotary(dtype, is_neox, rot_dim, seed):
    from engine_triton.kernels.rotary import rotary_embedding

    t, h, hk, d = 65, 32, 8, 128
    qkv = torch.randn(t, (h + 2 * hk) * d).to(dtype)
    q, k = qkv[:, : h * d], qkv[:, h * d : (h + hk) * d]
    pos = torch.randint(0, 4096, (t,))
    cache = torch.randn(4096, rot_dim)
    qkv_c = qkv.cuda()
    oq, ok = rotary_embedding(pos.cuda(), qkv_c[:, : h * d], qkv_c[:, h * d : (h + hk) * d],
                              cache.cuda(), d, is_neox)  # fmt: skip
    eq, ek = ref.rotary_embedding(pos, q, k, cache, d, is_neox)
    close(oq, eq, dtype, seed)
    close(ok, ek, dtype, seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize(
    "t,h,hk,d,is_neox,rot_dim",
    [(1, 16, 8, 128, True, 128), (8193, 16, 8, 128, True, 128), (65, 32, 8, 128, False, 128),
     (65, 32, 8, 128, True, 64), (33, 8, 1, 256, True, 256), (33, 12, 4, 64, True, 64)],
)  # fmt: skip
def test_qk_norm_rotary(dtype, norm, t, h, hk, d, is_neox, rot_dim, seed):
    from engine_triton.kernels.rotary import qk_norm_rotary

    sizes = [h * d, hk * d, hk * d]
    qkv = torch.randn(t, sum(sizes)).to(dtype)
    q, k, v = qkv.clone().split(sizes, dim=-1)
    pos = torch.randint(0, 4096, (t,))
    cache = torch.randn(4096, rot_dim)
    weights = [(1 + 0.3 * torch.randn(d)).to(dtype) if norm else None for _ in "qk"]
    slack_q, slack_k = qk_norm_rotary_slack(pos, q, k, cache, d, is_neox, *weights, 1e-6)
    eq, ek = ref.qk_norm_rotary(pos, q, k, cache, d, is_neox, *weights, 1e-6)
    qkv_c = qkv.cuda()
    q_c, k_c, v_c = qkv_c.split(sizes, dim=-1)
    qk_norm_rotary(pos.cuda(), q_c, k_c, cache.cuda(), d, is_neox,
                   *[None if w is None else w.cuda() for w in weights], 1e-6)  # fmt: skip
    close(q_c, eq, dtype, seed, slack_q)
    close(k_c, ek, dtype, seed, slack_k)
    assert torch.equal(v_c.cpu(), v), f"seed={seed}"


def test_write_kv_cache(seed):
    from engine_triton.kernels.kv_cache import write_kv_cache

    cache = torch.randn(2, 64, 16, 8, 128, dtype=torch.bfloat16)
    expected = cache.clone()
    k, v = torch.randn(2, 300, 8, 128, dtype=torch.bfloat16)
    slots = torch.randperm(64 * 16)[:300]
    slots[::7] = -1
    dev = cache.cuda()
    write_kv_cache(k.cuda(), v.cuda(), dev, slots.cuda())
    ref.write_kv_cache(k, v, expected, slots)
    assert torch.equal(dev.cpu(), expected), f"seed={seed}"


def _meta(batch):
    from engine_triton.attention import TritonAttentionBackend

    layout = BatchLayout(batch.query_lens, batch.seq_lens, batch.block_tables,
                         batch.slot_mapping, batch.block_size, batch.num_decodes)  # fmt: skip
    return TritonAttentionBackend.build_metadata(layout, torch.device("cuda"))


@pytest.mark.parametrize(
    "dtype,heads,kv_heads,head,window,cap",
    [
        (torch.bfloat16, 32, 8, 128, None, None),  # Llama-3 8B shape
        (torch.bfloat16, 16, 8, 128, 257, None),  # Qwen3 heads, sliding window
        (torch.float32, 8, 4, 64, None, 30.0),  # float32, soft-cap
        (torch.bfloat16, 12, 4, 80, 100, 50.0),  # odd group and head size
    ],
)
def test_backend_mixed_batch(dtype, heads, kv_heads, head, window, cap, seed):
    """Decodes (long and short contexts: split-KV) then chunked prefills over a cached prefix."""
    from engine_triton.attention import TritonAttentionBackend

    qlens = [1, 1, 1, 300, 77, 1024]
    slens = [3000, 17, 1, 300, 600, 1500]
    batch = make_batch(qlens, slens, heads, kv_heads, head, 16, dtype, "cuda")
    backend = TritonAttentionBackend(heads, head, kv_heads, head**-0.5, window, cap)
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, _meta(batch))
    expected = reference_attention(batch.query, batch.kv_cache, qlens, slens, batch.block_tables,
                                   head**-0.5, window, cap)  # fmt: skip
    err = rel_error(out, expected)
    assert err < TOLERANCE[dtype], f"seed={seed} rel_error={err}"


@pytest.mark.parametrize("batch_size", [1, 7, 64])
def test_decode_every_split_count(batch_size, seed):
    """The automatic split count at several batch sizes equals the unsplit result."""
    from engine_triton.kernels.attention import decode_splits, paged_decode

    slens = torch.randint(1, 2500, (batch_size,)).tolist()
    batch = make_batch([1] * batch_size, slens, 32, 8, 128, 16, torch.bfloat16, "cuda")
    meta = _meta(batch)
    auto = decode_splits(batch_size, 8, torch.device("cuda"))
    outs = []
    for splits in (1, auto):
        out = torch.full_like(batch.query, float("nan"))
        paged_decode(batch.query, batch.kv_cache, out, meta.seq_lens, meta.block_table,
                     batch_size, 128**-0.5, num_splits=splits)  # fmt: skip
        outs.append(out)
    expected = reference_attention(batch.query, batch.kv_cache, [1] * batch_size, slens,
                                   batch.block_tables, 128**-0.5)  # fmt: skip
    for out in outs:
        assert rel_error(out, expected) < TOLERANCE[torch.bfloat16], f"seed={seed}"


@pytest.mark.parametrize("batch_size", [32, 256])
def test_decode_cascade_at_8b_shape(batch_size, seed):
    """Cascade attention at the Llama-3.1-8B head shape: a 2,000-token prefix in the same
    blocks for all requests but the last, suffixes of 1-500 tokens; the shared pass and the
    decode kernel (its automatic splits) against the oracle."""
    from engine.attention_backends.interface import (
        CascadeInputs,
        SharedPrefix,
        find_shared_prefix,
    )
    from engine_triton.kernels.attention import paged_decode

    suffix = torch.randint(1, 500, (batch_size,)).tolist()
    slens = [2000 + n for n in suffix]
    batch = make_batch([1] * batch_size, slens, 32, 8, 128, 16, torch.bfloat16, "cuda")
    for table in batch.block_tables[1:-1]:  # the last request holds its own copy
        table[:125] = batch.block_tables[0][:125]
    prefix = find_shared_prefix(batch.block_tables, slens, batch_size, 16)
    assert prefix == SharedPrefix(2000, tuple(range(batch_size - 1)))
    meta = _meta(batch)
    out = torch.full_like(batch.query, float("nan"))
    cascade = CascadeInputs.from_prefix(prefix, batch_size, "cuda")
    paged_decode(batch.query, batch.kv_cache, out, meta.seq_lens, meta.block_table, batch_size,
                 128**-0.5, cascade_starts=cascade.starts, cascade_prefix=cascade.prefix)  # fmt: skip
    expected = reference_attention(batch.query, batch.kv_cache, [1] * batch_size, slens,
                                   batch.block_tables, 128**-0.5)  # fmt: skip
    err = rel_error(out, expected)
    assert err < TOLERANCE[torch.bfloat16], f"seed={seed} rel_error={err}"


# GPT-OSS-20B's attention: 64 query heads of 64 over 8 KV heads, a 128-token window on half
# the layers, attention sinks.
GPT_OSS_HEADS = (64, 8, 64)


def _sinks(seed: int) -> torch.Tensor:
    """GPT-OSS-like sinks on the GPU: one that takes almost all the weight (e^12), one that
    adds nothing (e^-30), the rest within a few units of 0 (tests/test_attention_sinks.py)."""
    from test_attention_sinks import random_sinks

    return random_sinks(GPT_OSS_HEADS[0], torch.Generator().manual_seed(seed)).cuda()


def _sink_error(out, batch, scale, window, sinks) -> float:
    """The worst query head's relative error against the dense sink oracle."""
    expected = reference_attention(batch.query, batch.kv_cache, batch.query_lens,
                                   batch.seq_lens, batch.block_tables, scale, window, None,
                                   sinks)  # fmt: skip
    return worst_head_error(out[: expected.shape[0]], expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 128])
def test_sinks_backend_mixed_batch(dtype, window, seed):
    """Attention sinks through ``forward`` at GPT-OSS's head shape: decodes (a long context:
    split-KV, short ones in one split), then chunked prefills over cached prefixes."""
    from engine_triton.attention import TritonAttentionBackend

    heads, kv_heads, head = GPT_OSS_HEADS
    qlens, slens = [1, 1, 1, 300, 77, 256], [3000, 17, 1, 300, 600, 800]
    batch = make_batch(qlens, slens, heads, kv_heads, head, 16, dtype, "cuda")
    backend = TritonAttentionBackend(heads, head, kv_heads, head**-0.5, window)
    backend.sinks = _sinks(seed)
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, _meta(batch))
    err = _sink_error(out, batch, head**-0.5, window, backend.sinks)
    assert err < TOLERANCE[dtype], f"seed={seed} worst head rel_error={err}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sinks_decode_every_split_count(dtype, seed):
    """Unsplit, the automatic split count and 32 splits: the sink counted once each time."""
    from engine_triton.kernels.attention import decode_splits, paged_decode

    heads, kv_heads, head = GPT_OSS_HEADS
    slens = torch.randint(1, 2500, (7,)).tolist()
    batch = make_batch([1] * 7, slens, heads, kv_heads, head, 16, dtype, "cuda")
    meta = _meta(batch)
    sinks = _sinks(seed)
    for splits in (1, decode_splits(7, kv_heads, torch.device("cuda")), 32):
        out = torch.full_like(batch.query, float("nan"))
        paged_decode(batch.query, batch.kv_cache, out, meta.seq_lens, meta.block_table, 7,
                     head**-0.5, num_splits=splits, sinks=sinks)  # fmt: skip
        err = _sink_error(out, batch, head**-0.5, None, sinks)
        assert err < TOLERANCE[dtype], f"seed={seed} splits={splits} rel_error={err}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sinks_decode_cascade(dtype, seed):
    """Cascade attention with sinks: a 2,000-token prefix shared by all requests but the last,
    suffixes of 1-500 tokens; the shared pass's partials and the split rest merge with the
    sink once."""
    from engine.attention_backends.interface import CascadeInputs, find_shared_prefix
    from engine_triton.kernels.attention import paged_decode

    heads, kv_heads, head = GPT_OSS_HEADS
    n = 64
    slens = [2000 + s for s in torch.randint(1, 500, (n,)).tolist()]
    batch = make_batch([1] * n, slens, heads, kv_heads, head, 16, dtype, "cuda")
    for table in batch.block_tables[1:-1]:
        table[:125] = batch.block_tables[0][:125]
    prefix = find_shared_prefix(batch.block_tables, slens, n, 16)
    assert prefix is not None and prefix.length == 2000
    cascade = CascadeInputs.from_prefix(prefix, n, "cuda")
    meta = _meta(batch)
    sinks = _sinks(seed)
    out = torch.full_like(batch.query, float("nan"))
    paged_decode(batch.query, batch.kv_cache, out, meta.seq_lens, meta.block_table, n,
                 head**-0.5, cascade_starts=cascade.starts, cascade_prefix=cascade.prefix,
                 sinks=sinks)  # fmt: skip
    err = _sink_error(out, batch, head**-0.5, None, sinks)
    assert err < TOLERANCE[dtype], f"seed={seed} worst head rel_error={err}"


def test_sinks_decode_in_a_cuda_graph(seed):
    """A captured split-KV decode (with the fused cache append) reads the sinks on the device:
    replays with new queries and new sink values written in place (as a weight reload would)
    give the oracle's answer."""
    from engine_triton.kernels.attention import paged_decode

    heads, kv_heads, head = GPT_OSS_HEADS
    slens = [1500, 3, 700, 129]
    batch = make_batch([1] * 4, slens, heads, kv_heads, head, 16, torch.bfloat16, "cuda")
    meta = _meta(batch)
    sinks = _sinks(seed)
    out = torch.zeros_like(batch.query)
    counters = torch.zeros(4 * kv_heads, dtype=torch.int32, device="cuda")

    def decode():
        paged_decode(batch.query, batch.kv_cache, out, meta.seq_lens, meta.block_table, 4,
                     head**-0.5, num_splits=8, key=batch.key, value=batch.value,
                     slot_mapping=meta.slot_mapping, split_counters=counters,
                     sinks=sinks)  # fmt: skip

    decode()  # compile outside the capture (and write the newest keys, as every replay does)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode()
    for step in range(3):
        batch.query.copy_(torch.randn_like(batch.query))
        sinks.copy_(sinks.flip(0) + step)
        graph.replay()
        err = _sink_error(out, batch, head**-0.5, None, sinks)
        assert err < TOLERANCE[torch.bfloat16], f"seed={seed} replay {step}: rel_error={err}"


# Decode matmuls x[M, K] @ W[N, K]^T of Qwen3-0.6B and Llama-3.1-8B: (N, K).
LINEAR_SHAPES = {
    "qwen-qkv": (4096, 1024),
    "qwen-o": (1024, 2048),
    "qwen-gate_up": (6144, 1024),
    "qwen-down": (1024, 3072),
    "qwen-lm_head": (151936, 1024),
    "llama-qkv": (6144, 4096),
    "llama-o": (4096, 4096),
    "llama-gate_up": (28672, 4096),
    "llama-down": (4096, 14336),
    "llama-lm_head": (128256, 4096),
    "moe-qkv": (5120, 2048),  # Qwen3-30B-A3B's attention and router projections
    "moe-o": (2048, 4096),
    "moe-router": (128, 2048),
    "moe-lm_head": (151936, 2048),
}
LINEAR_TOL = {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float16: dict(atol=4e-3, rtol=4e-3)}


def _linear_inputs(m, n, k, dtype, bias):
    x = torch.randn(m, k, device="cuda").to(dtype)
    w = (torch.randn(n, k, device="cuda") * k**-0.5).to(dtype)
    b = torch.randn(n, device="cuda").to(dtype) if bias else None
    expected = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    return x, w, b, expected


@pytest.mark.parametrize("shape", list(LINEAR_SHAPES))
def test_skinny_linear_model_shapes(shape, seed):
    """The registered ``linear`` (heuristic configuration) on the real decode shapes, against
    ``F.linear`` in float32, for every M bucket and odd M."""
    from engine_triton.kernels.linear import linear, use_skinny

    n, k = LINEAR_SHAPES[shape]
    for dtype, ms in ((torch.bfloat16, (1, 2, 3, 4, 7, 8, 13, 16)), (torch.float16, (1, 16))):
        for m in ms:
            x, w, b, expected = _linear_inputs(m, n, k, dtype, bias=m in (3, 16))
            assert use_skinny(x, w, b)
            out = linear(x, w, b)
            assert out.dtype == dtype and out.shape == (m, n)
            torch.testing.assert_close(
                out.float(), expected, **LINEAR_TOL[dtype],
                msg=lambda msg, m=m, dtype=dtype: f"seed={seed} M={m} {dtype}: {msg}",
            )  # fmt: skip


@pytest.mark.parametrize("shape", ["qwen-o", "qwen-down", "llama-qkv", "llama-down"])
def test_skinny_linear_every_candidate(shape, seed):
    """Every configuration the benchmark sweeps compiles and is right (so any can go into the
    ``TUNED`` table)."""
    from engine_triton.kernels.linear import candidate_configs, skinny_linear

    n, k = LINEAR_SHAPES[shape]
    for m in (1, 2, 3, 5, 8, 16):
        x, w, _, expected = _linear_inputs(m, n, k, torch.bfloat16, bias=False)
        for cfg in candidate_configs(m, n, k):
            torch.testing.assert_close(
                skinny_linear(x, w, None, cfg).float(), expected, **LINEAR_TOL[torch.bfloat16],
                msg=lambda msg, m=m, cfg=cfg: f"seed={seed} M={m} {cfg}: {msg}",
            )  # fmt: skip


def test_skinny_linear_split_k_in_a_cuda_graph(seed):
    """Split-K reduces in the same launch and leaves its counters zeroed, so a captured graph
    replays correctly with new inputs (no memset in the graph)."""
    from engine_triton.kernels.linear import SkinnyConfig, skinny_linear

    n, k = LINEAR_SHAPES["qwen-down"]
    cfg = SkinnyConfig(16, 128, 4, 3, split_k=4)
    x, w, b, _ = _linear_inputs(4, n, k, torch.bfloat16, bias=True)
    skinny_linear(x, w, b, cfg)  # compile and size the workspace outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_linear(x, w, b, cfg)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        expected = torch.nn.functional.linear(x.float(), w.float(), b.float())
        torch.testing.assert_close(out.float(), expected, **LINEAR_TOL[torch.bfloat16],
                                    msg=lambda m: f"seed={seed}: {m}")  # fmt: skip


@pytest.mark.parametrize("vocab", [151936, 128256])  # Qwen3, Llama 3
@pytest.mark.parametrize("n", [1, 8, 256])
def test_argmax_model_vocabularies(vocab, n, seed):
    """The registered ``argmax`` (heuristic split count) on bf16 logits of the real vocabulary
    sizes, also as a padded-vocabulary view, with a tie planted across splits; exact indices,
    several calls in a row (the arrival counters reset themselves)."""
    from engine_triton.kernels.argmax import argmax

    for _ in range(3):
        base = torch.randn(n, vocab + 64, device="cuda").to(torch.bfloat16)
        for logits in (base[:, :vocab].contiguous(), base[:, :vocab]):
            logits[0, vocab - 7] = logits[0, 11] = logits.max() + 1
            out = argmax(logits)
            expected = torch.argmax(logits, dim=-1)
            assert out.dtype == torch.int64
            assert torch.equal(out, expected), f"seed={seed}"
            assert int(out[0]) == 11


@pytest.mark.parametrize("rows", [1, 4])
def test_programmatic_dependent_launch_chain_in_a_cuda_graph(rows, seed, monkeypatch):
    """With programmatic dependent launch (``kernels/pdl.py``) each kernel may start before the
    one it depends on has finished, and waits for it inside the kernel. A chain of dependent
    decode kernels (norms, split-K GEMVs sharing one workspace, the gated activation, FP8 and
    4-bit GEMVs, argmax), eager and captured in a CUDA graph replayed with new inputs, gives
    results bit-identical to the same kernels launched without PDL."""
    from engine_triton.kernels import activation, argmax, fp8_linear, linear, norm, pdl
    from engine_triton.kernels.wna16_linear import wna16_linear

    device = torch.device("cuda")
    if not pdl.pdl_enabled(device):
        pytest.skip("PDL needs an sm_90+ CUDA device (and ENGINE_TRITON_PDL not 0)")
    h, inter, h2, vocab = 2048, 5632, 3072, 32000
    bf = torch.bfloat16

    def weight(n, k):
        return (torch.randn(n, k, device=device) * k**-0.5).to(bf)

    w_norm, w_norm2 = torch.randn(h, device=device).to(bf), torch.randn(h, device=device).to(bf)
    w_gate_up, w_down, w_head = weight(2 * inter, h), weight(h, inter), weight(vocab, h)
    w_fp8 = (torch.randn(h2, h, device=device) * 16).to(torch.float8_e4m3fn)
    fp8_scale = torch.rand(h2, device=device) * 1e-3 + 1e-4
    q4 = torch.randint(0, 16, (h, h2), device=device, dtype=torch.uint8)
    s4 = (torch.rand(h, h2 // 128, device=device) * 0.02 + 1e-3).half()
    z4 = torch.randint(0, 16, (h, h2 // 128), device=device, dtype=torch.uint8)
    packed = wna16_linear.prepack(q4, s4, z4, bits=4, group_size=128)
    split = linear.SkinnyConfig(16, 128, 4, 3, split_k=4)

    def chain(x, residual):
        a = norm.rms_norm(x, w_norm, 1e-6)
        b = activation.silu_and_mul(linear.skinny_linear(a, w_gate_up))
        c = linear.skinny_linear(b, w_down, None, split)
        d, r = norm.fused_add_rms_norm(c, residual, w_norm2, 1e-6)
        e = fp8_linear.fp8_linear(d, w_fp8, fp8_scale)
        f = wna16_linear(e, packed, bits=4, group_size=128)
        logits = linear.skinny_linear(f, w_head)
        return a, b, c, d, r, e, f, logits, argmax.argmax(logits)

    def reference(x, residual):
        monkeypatch.setenv(pdl.ENV, "0")
        try:
            return [t.clone() for t in chain(x, residual)]
        finally:
            monkeypatch.delenv(pdl.ENV)

    def check(got, want, what):
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(g, w), f"seed={seed} rows={rows} {what}: output {i} differs"

    x = torch.randn(rows, h, device=device).to(bf)
    residual = torch.randn(rows, h, device=device).to(bf)
    check(chain(x, residual), reference(x, residual), "eager")  # also compiles both variants
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain(x, residual)
    for i in range(5):
        x.copy_(torch.randn_like(x))
        residual.copy_(torch.randn_like(residual))
        graph.replay()
        torch.cuda.synchronize()
        check(outs, reference(x, residual), f"replay {i}")
