"""Attention sinks (GPT-OSS): a learned per-head logit that joins every query's softmax as one
more score with no value (``attention_backends/interface.py``). The torch reference against a
plain dense computation (itself checked against transformers' GPT-OSS ``eager_attention_forward``)
over paged steps; engine-cpu's compiled decode against both, with contexts split into slices
over threads and inside a recorded native plan; the ``Attention`` layer's parameter; and
selection refusing a backend without sinks, with the reason."""

from __future__ import annotations

import math
import random
from typing import ClassVar

import pytest
import torch
from torch import nn

from engine.attention_backends.interface import AttentionBackend, AttentionSpec, BatchLayout
from engine.attention_backends.registry import AttentionBackendRegistry
from engine.attention_backends.selector import select_attention_backend
from engine.attention_backends.torch_ref import TorchReferenceBackend
from engine.errors import AttentionBackendError
from engine.layers.attention import Attention
from engine.platforms.interface import Platform
from engine.plugins import PluginInfo

SINK_REASON = "attention sinks (a learned per-head softmax logit, GPT-OSS) not supported"


def dense_sink_attention(q, k, v, scale, sinks, window=None, softcap=None):
    """One request, written out: q [Lq, H, D] at the last Lq positions of k, v [L, Hkv, D];
    query head h's softmax over its visible keys and sinks[h] (None: no sink), in float64."""
    lq, h, _ = q.shape
    lk, hkv, _ = k.shape
    k = k.double().repeat_interleave(h // hkv, dim=1)
    v = v.double().repeat_interleave(h // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    qpos = torch.arange(lk - lq, lk)[:, None]
    kpos = torch.arange(lk)[None, :]
    visible = kpos <= qpos
    if window is not None:
        visible &= (qpos - kpos) < window
    weights = scores.masked_fill(~visible, float("-inf")).exp()  # [H, Lq, Lk]
    denominator = weights.sum(-1, keepdim=True)
    if sinks is not None:
        denominator = denominator + sinks.double().exp()[:, None, None]
    # exp without the max subtracted: the inputs keep scores and sinks far from overflow.
    return torch.einsum("hqk,khd->qhd", weights / denominator, v).float()


def random_sinks(heads: int, gen: torch.Generator) -> torch.Tensor:
    """float32 [heads]: mostly around 0, with one large positive (the sink takes almost all the
    weight: the output nearly vanishes) and one large negative (no effect) when there is room."""
    sinks = torch.randn(heads, generator=gen) * 2
    sinks[0] = 12.0
    if heads > 1:
        sinks[-1] = -30.0
    return sinks.float()


def test_the_dense_helper_is_transformers_gpt_oss_eager_attention():
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, d, lk, lq = 6, 2, 16, 11, 4
    q = torch.randn(lq, heads, d, generator=gen)
    k, v = (torch.randn(lk, kv_heads, d, generator=gen) for _ in range(2))
    sinks = random_sinks(heads, gen)
    module = nn.Module()
    module.sinks = nn.Parameter(sinks, requires_grad=False)
    module.num_key_value_groups = heads // kv_heads
    module.eval()
    qpos = torch.arange(lk - lq, lk)[:, None]
    mask = torch.zeros(lq, lk).masked_fill(torch.arange(lk)[None, :] > qpos, float("-inf"))
    hf, _ = gpt_oss.eager_attention_forward(
        module,
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        mask[None, None],
        scaling=d**-0.5,
    )
    torch.testing.assert_close(
        dense_sink_attention(q, k, v, d**-0.5, sinks), hf[0], atol=1e-5, rtol=1e-5
    )


def _cpu_backend():
    from engine_cpu import native
    from engine_cpu.attention import CpuAttentionBackend

    if native.load("avx2") is None:
        pytest.skip(f"no AVX2 kernels here: {native.unavailable_reason('avx2')}")
    return CpuAttentionBackend


def backend_class(name: str) -> type[AttentionBackend]:
    return TorchReferenceBackend if name == "torch" else _cpu_backend()


def make(cls, heads, kv_heads, d, window=None, softcap=None, sinks=None):
    backend = cls(heads, d, kv_heads, 1 / math.sqrt(d), window, softcap)
    backend.sinks = sinks
    return backend


def step(backend, requests, kv_cache, block_size, gen, dtype):
    """One step of ``requests`` (context k, v [L, Hkv, D], block ids, tokens done, new tokens),
    decodes first. Returns (output, dense expectation)."""
    qs, ks, vs, query_lens, seq_lens, tables, slots, expected = [], [], [], [], [], [], [], []
    for ck, cv, blocks, done, new in requests:
        q = torch.randn(new, backend.num_heads, backend.head_size, generator=gen).to(dtype)
        qs.append(q)
        ks.append(ck[done : done + new])
        vs.append(cv[done : done + new])
        query_lens.append(new)
        seq_lens.append(done + new)
        tables.append(blocks)
        slots += [
            blocks[p // block_size] * block_size + p % block_size for p in range(done, done + new)
        ]
        expected.append(
            dense_sink_attention(
                q,
                ck[: done + new],
                cv[: done + new],
                backend.scale,
                backend.sinks,
                backend.sliding_window,
                backend.logit_softcap,
            )
        )
    num_decodes = sum(1 for n in query_lens if n == 1)
    assert query_lens[:num_decodes] == [1] * num_decodes
    layout = BatchLayout(query_lens, seq_lens, tables, slots, block_size, num_decodes)
    md = type(backend).build_metadata(layout, torch.device("cpu"))
    out = backend.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), kv_cache, md)
    return out, torch.cat(expected)


CASES = [
    # heads, kv_heads, head_size, block_size, sliding_window, softcap, dtype
    (4, 4, 16, 4, None, None, torch.float32),
    (8, 2, 32, 16, None, None, torch.float32),  # GQA
    (6, 3, 24, 8, 7, None, torch.float32),  # a sliding window with the sinks (GPT-OSS's layers)
    (4, 1, 16, 4, None, 30.0, torch.float32),  # MQA, soft-capped scores (the sink is not)
    (8, 2, 32, 16, None, None, torch.bfloat16),
    (4, 2, 16, 4, 6, None, torch.bfloat16),
    (4, 2, 16, 4, None, None, torch.float16),  # the cpu backend hands it to the reference
]


@pytest.mark.parametrize("name", ["torch", "cpu"])
@pytest.mark.parametrize("heads,kv_heads,head_size,block_size,window,softcap,dtype", CASES)
def test_paged_steps_with_sinks_match_dense(
    name, heads, kv_heads, head_size, block_size, window, softcap, dtype
):
    """Requests prefilled in one or two chunks (the second over a cached prefix), then decoded
    token by token beside the others' prefills (decode batches of mixed lengths), over a
    shuffled block pool."""
    gen = torch.Generator().manual_seed(heads * 100 + head_size)
    sinks = random_sinks(heads, gen)
    backend = make(backend_class(name), heads, kv_heads, head_size, window, softcap, sinks)
    num_blocks = 64
    kv_cache = torch.zeros(
        type(backend).kv_cache_shape(num_blocks, block_size, kv_heads, head_size), dtype=dtype
    )
    pool = list(range(num_blocks))
    random.Random(block_size).shuffle(pool)
    reqs = []
    for n in (1, 3, 13, 17, 29, 9, 40):
        blocks = [pool.pop() for _ in range(-(-n // block_size))]
        ck = torch.randn(n, kv_heads, head_size, generator=gen).to(dtype)
        cv = torch.randn(n, kv_heads, head_size, generator=gen).to(dtype)
        reqs.append([ck, cv, blocks, 0])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    decoded = prefixed = 0
    while any(r[3] < r[0].shape[0] for r in reqs):
        batch = []
        for r in reqs:
            left = r[0].shape[0] - r[3]
            if left:
                new = left if r[3] == 0 and left < 8 else (left // 2 if r[3] == 0 else 1)
                if r[3] and new > 1:
                    prefixed += 1
                batch.append((r[0], r[1], r[2], r[3], new))
        batch.sort(key=lambda s: s[4] != 1)  # decodes first
        decoded += sum(s[4] == 1 for s in batch)
        out, want = step(backend, batch, kv_cache, block_size, gen, dtype)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)
        for r in reqs:
            for s in batch:
                if s[0] is r[0]:
                    r[3] += s[4]
    assert decoded > 40


def test_a_large_sink_takes_the_weight_and_a_very_negative_one_does_nothing():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(5, 2, 8, generator=gen),
        *(torch.randn(5, 1, 8, generator=gen) for _ in "kv"),
    )
    backend = make(TorchReferenceBackend, 2, 1, 8, sinks=torch.tensor([60.0, -60.0]))
    plain = make(TorchReferenceBackend, 2, 1, 8)
    kv_cache = torch.zeros(2, 2, 8, 1, 8)
    layout = BatchLayout([5], [5], [[1]], [8, 9, 10, 11, 12], 8, 0)
    md = TorchReferenceBackend.build_metadata(layout, torch.device("cpu"))
    out = backend.forward(q, k, v, kv_cache, md)
    base = plain.forward(q, k, v, kv_cache, md)
    assert out[:, 0].abs().max() < 1e-20  # e^60 swamps every score
    torch.testing.assert_close(out[:, 1], base[:, 1], atol=1e-6, rtol=1e-6)


def _decode_batch(backend, lens, gen, bs, kv_cache):
    """Decodes of contexts ``lens`` (cache filled but for the newest token, which the step
    writes): (q, k, v, metadata, dense expectation)."""
    kv_heads, d = backend.num_kv_heads, backend.head_size
    tables, slots, qs, ks, vs, expected = [], [], [], [], [], []
    next_block = 0
    for n in lens:
        nb = -(-n // bs)
        table = list(range(next_block, next_block + nb))
        next_block += nb
        ck = torch.randn(n, kv_heads, d, generator=gen).to(kv_cache.dtype)
        cv = torch.randn(n, kv_heads, d, generator=gen).to(kv_cache.dtype)
        for p in range(n - 1):
            kv_cache[0, table[p // bs], p % bs] = ck[p]
            kv_cache[1, table[p // bs], p % bs] = cv[p]
        tables.append(table)
        slots.append(table[(n - 1) // bs] * bs + (n - 1) % bs)
        q = torch.randn(1, backend.num_heads, d, generator=gen).to(kv_cache.dtype)
        qs.append(q)
        ks.append(ck[-1:])
        vs.append(cv[-1:])
        expected.append(
            dense_sink_attention(
                q, ck, cv, backend.scale, backend.sinks, backend.sliding_window,
                backend.logit_softcap,
            )
        )  # fmt: skip
    layout = BatchLayout([1] * len(lens), lens, tables, slots, bs, len(lens))
    md = type(backend).build_metadata(layout, torch.device("cpu"))
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), md, torch.cat(expected)


@pytest.mark.parametrize("threads", [1, 2, 5])
@pytest.mark.parametrize("window,softcap", [(None, None), (300, None), (None, 20.0)])
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_cpu_decodes_split_over_threads_add_the_sink_once(threads, window, softcap, kv_heads):
    """With fewer (request, KV head) pairs than threads the compiled decode cuts each context
    into slices and combines their softmax sums: the sink must count once per head, not once
    per slice (batches of one long context, mixed lengths, and many short ones)."""
    cls = _cpu_backend()
    gen = torch.Generator().manual_seed(threads * 10 + kv_heads)
    heads, d, bs = 4, 64, 16
    # Sinks near the scores' range, so a sink counted per slice would show.
    sinks = torch.tensor([2.0, -1.0, 0.5, 4.0])
    backend = make(cls, heads, kv_heads, d, window, softcap, sinks)
    kv_cache = torch.zeros(2, 160, bs, kv_heads, d)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for lens in ([900], [1], [130, 700], [5, 17, 33, 2, 64, 9, 1, 250]):
            q, k, v, md, want = _decode_batch(backend, lens, gen, bs, kv_cache)
            out = backend.forward(q, k, v, kv_cache, md)
            torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_decode_matches_the_reference(dtype):
    cls = _cpu_backend()
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, d, bs = 8, 2, 64, 16
    sinks = random_sinks(heads, gen)
    ours = make(cls, heads, kv_heads, d, 128, None, sinks)
    ref = make(TorchReferenceBackend, heads, kv_heads, d, 128, None, sinks)
    cache = torch.zeros(2, 110, bs, kv_heads, d, dtype=dtype)
    q, k, v, md, _ = _decode_batch(ours, [3, 400, 129, 60, 1000 - 1], gen, bs, cache)
    ref_cache = cache.clone()
    got = ours.forward(q, k, v, cache, md)
    want = ref.forward(q, k, v, ref_cache, md)
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert torch.equal(cache, ref_cache)


@pytest.mark.parametrize("name", ["torch", "cpu"])
def test_no_sinks_is_unchanged(name):
    """``sinks`` None is the default and plain softmax; sinks of -inf add nothing (bit for bit
    in the compiled decode, whose sink term is then e^-inf = 0 and whose maximum is kept)."""
    cls = backend_class(name)
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, d, bs = 4, 2, 32, 8
    assert cls(heads, d, kv_heads, 0.2).sinks is None
    plain = make(cls, heads, kv_heads, d)
    silent = make(cls, heads, kv_heads, d, sinks=torch.full((heads,), float("-inf")))
    cache = torch.zeros(2, 90, bs, kv_heads, d)
    q, k, v, md, _ = _decode_batch(plain, [1, 20, 300], gen, bs, cache)
    want = plain.forward(q, k, v, cache.clone(), md)
    got = silent.forward(q, k, v, cache.clone(), md)
    if name == "cpu":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_cpu_decode_with_sinks_records_into_a_native_plan():
    """The compiled decode with sinks is recordable (no torch op in between) and its replay
    reads the layer's sinks in place: new values are seen without recording again."""
    cls = _cpu_backend()
    from engine_cpu import native, plan

    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, d, bs = 4, 2, 32, 8
    sinks = nn.Parameter(random_sinks(heads, gen), requires_grad=False)
    backend = make(cls, heads, kv_heads, d, sinks=sinks)
    cache = torch.zeros(2, 20, bs, kv_heads, d)
    q, k, v, md, _ = _decode_batch(backend, [9, 70], gen, bs, cache)
    recorder, guard = plan.PlanRecorder(), plan.CaptureGuard()
    native.Kernel.recorder = recorder
    try:
        with guard, torch.inference_mode():
            out = backend.forward(q, k, v, cache, md)
    finally:
        native.Kernel.recorder = None
    assert not guard.refused and not recorder.refused
    assert len(recorder.calls) == 2  # the cache write and the decode
    assert sinks.data_ptr() in recorder.calls[1][1]
    recorded = plan.build_plan(recorder.calls, guard.allocations, out)
    with torch.no_grad():
        sinks.copy_(random_sinks(heads, gen) - 1.0)
    q.copy_(torch.randn(q.shape, generator=gen))
    got = recorded.run()
    want = make(TorchReferenceBackend, heads, kv_heads, d, sinks=sinks.detach().clone())
    torch.testing.assert_close(got, want.forward(q, k, v, cache.clone(), md), atol=2e-5, rtol=2e-5)


# ---- the Attention layer ---------------------------------------------------------------------
def test_the_layer_owns_a_float32_parameter_the_backend_shares():
    layer = Attention(4, 16, 2, 0.25, TorchReferenceBackend, sinks=True)
    assert isinstance(layer.sinks, nn.Parameter) and not layer.sinks.requires_grad
    assert layer.sinks.dtype == torch.float32 and tuple(layer.sinks.shape) == (4,)
    assert layer.impl.sinks is layer.sinks
    assert dict(layer.named_parameters()) == {"sinks": layer.sinks}
    assert "sinks=True" in repr(layer)
    layer.to(torch.device("cpu"))
    layer.to(torch.float32)
    assert layer.impl.sinks is layer.sinks
    plain = Attention(4, 16, 2, 0.25, TorchReferenceBackend)
    assert plain.sinks is None and plain.impl.sinks is None
    assert dict(plain.named_parameters()) == {} and "sinks=False" in repr(plain)


def test_the_layer_attends_with_its_sinks_even_when_the_parameter_is_replaced():
    gen = torch.Generator().manual_seed(2)
    layer = Attention(4, 16, 2, 0.25, TorchReferenceBackend, sinks=True)
    layer.sinks = nn.Parameter(random_sinks(4, gen), requires_grad=False)  # a loader's way
    layer.kv_cache = torch.zeros(2, 4, 8, 2, 16)
    layout = BatchLayout([6], [6], [[2]], [16 + i for i in range(6)], 8, 0)
    md = TorchReferenceBackend.build_metadata(layout, torch.device("cpu"))
    q = torch.randn(6, 4 * 16, generator=gen)
    k, v = (torch.randn(6, 2 * 16, generator=gen) for _ in "kv")
    out = layer(q, k, v, [md])
    assert layer.impl.sinks is layer.sinks
    want = dense_sink_attention(
        q.view(6, 4, 16), k.view(6, 2, 16), v.view(6, 2, 16), 0.25, layer.sinks
    )
    torch.testing.assert_close(out.view(6, 4, 16), want, atol=1e-5, rtol=1e-5)


class _NoSinks(AttentionBackend):
    name: ClassVar[str] = "nosinks"

    def forward(self, query, key, value, kv_cache, metadata):  # pragma: no cover
        raise NotImplementedError


def test_the_layer_refuses_a_backend_without_sinks():
    with pytest.raises(ValueError, match="nosinks does not support attention sinks"):
        Attention(4, 16, 2, 0.25, _NoSinks, sinks=True)


# ---- selection -------------------------------------------------------------------------------
def test_supports_names_the_missing_ability():
    spec = AttentionSpec(device_type="cpu", dtype="float32", attention_sinks=True)
    assert AttentionSpec().attention_sinks is False
    assert AttentionBackend.supports_attention_sinks is False
    assert SINK_REASON in _NoSinks.supports(spec)
    assert _NoSinks.supports(AttentionSpec(device_type="cpu", dtype="float32")) == []
    assert TorchReferenceBackend.supports(spec) == []


def test_selection_refuses_a_backend_without_sinks_with_the_reason():
    reg = AttentionBackendRegistry()
    reg.add("nosinks", _NoSinks, PluginInfo("dist-x", "x", "1.0", "x.plugin", "1"))
    reg.add("torch", TorchReferenceBackend, PluginInfo("engine", "builtin", "1", "b", "1"))

    class Cpu(Platform):
        name = "cpu"

        @classmethod
        def default_attention_backends(cls, config=None):
            return ["nosinks", "torch"]

    spec = AttentionSpec(device_type="cpu", dtype="float32", attention_sinks=True)
    with pytest.raises(AttentionBackendError) as err:
        select_attention_backend("nosinks", spec, Cpu, reg)
    assert SINK_REASON in str(err.value)
    assert select_attention_backend("auto", spec, Cpu, reg) is TorchReferenceBackend


def test_the_installed_backends_declare_sinks_as_documented():
    """The reference, engine-cpu's backend and the Triton ones (engine-triton's and its
    engine-rocm subclass) serve sinks; CUDA's sdpa / flash-attn and the TPU backends do not
    yet, and ``auto`` on the cpu platform still finds one."""
    from engine.plugins import PluginManager

    pm = PluginManager.from_env()
    registry = pm.attention_backends()
    spec = AttentionSpec(attention_sinks=True)
    for entry in registry:
        try:
            cls = entry.load()
        except Exception:  # an optional dependency missing here: not this test's business
            continue
        # triton / triton-rocm: their kernels take sinks, declared once their GPU tests ran
        # (engine_triton.attention); the ``triton_sinks_declared`` fixture declares them.
        has = cls.name in ("torch", "cpu")
        assert cls.supports_attention_sinks is has, cls.name
        assert (SINK_REASON in cls.supports(spec)) is not has, cls.name
    platform = pm.resolve_platform()
    if platform.name == "cpu":
        chosen = pm.select_attention_backend(
            "auto", AttentionSpec(device_type="cpu", dtype="float32", attention_sinks=True),
            platform,
        )  # fmt: skip
        assert chosen.supports_attention_sinks


class _Chosen(Exception):
    """Stops the engine build once the attention spec is known."""


@pytest.mark.parametrize("declared", [False, True])
def test_the_runtime_asks_for_sinks_when_the_model_class_declares_them(
    tmp_path, monkeypatch, declared
):
    from engine import LLM
    from engine.models.llama import LlamaForCausalLM
    from engine.plugins import PluginManager
    from engine.testing.tiny_models import build_tiny_model

    path = build_tiny_model(tmp_path / "tiny", "llama")
    if declared:
        monkeypatch.setattr(LlamaForCausalLM, "attention_sinks", True, raising=False)
    specs = []

    def spy(self, name, spec, platform, config=None):
        specs.append(spec)
        raise _Chosen

    monkeypatch.setattr(PluginManager, "select_attention_backend", spy)
    with pytest.raises(_Chosen):
        LLM(model=str(path), skip_tokenizer_init=True)
    assert [s.attention_sinks for s in specs] == [declared]
