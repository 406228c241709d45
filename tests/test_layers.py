"""Layers: rotary variants against transformers' formulas, fused-linear loaders, norms,
activations, embeddings."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.kernels import KernelRegistry
from engine.layers import (
    GatedActivation,
    MergedColumnParallelLinear,
    ModelLoadError,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    VocabParallelEmbedding,
    rope_parameters,
)
from engine.layers.rotary import compute_inv_freq

KERNELS = KernelRegistry().resolve("cpu")


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 16,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
        },
    ],
)
@pytest.mark.parametrize("partial", [None, 0.5])
def test_inv_freq_matches_transformers(scaling, partial):
    kwargs = dict(hidden_size=128, num_attention_heads=2, max_position_embeddings=1024)
    if scaling:
        kwargs["rope_scaling"] = dict(scaling)
    cfg = LlamaConfig(rope_theta=50000.0, **kwargs)
    if partial:
        cfg.rope_parameters["partial_rotary_factor"] = partial
    params = rope_parameters(cfg)
    rot_dim = int(64 * (partial or 1.0))
    ours, scale = compute_inv_freq(rot_dim, params)
    rope_type = params["rope_type"]
    if rope_type == "default":
        expected = 1.0 / (50000.0 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
        expected_scale = 1.0
    else:
        expected, expected_scale = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"))
    assert torch.equal(ours, expected)
    assert scale == expected_scale


def test_rope_parameters_from_transformers4_style_config():
    cfg = type("Cfg", (), {})()
    cfg.rope_theta = 1e6
    cfg.rope_scaling = {"type": "linear", "factor": 2.0}
    cfg.max_position_embeddings = 64
    p = rope_parameters(cfg)
    assert p["rope_type"] == "linear" and p["rope_theta"] == 1e6 and p["factor"] == 2.0


def test_rope_parameters_nested_per_layer_type():
    cfg = type("Cfg", (), {})()
    cfg.rope_parameters = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    assert rope_parameters(cfg, "sliding_attention")["rope_theta"] == 1e4
    assert rope_parameters(cfg, "full_attention")["factor"] == 8.0


def test_unsupported_rope_type_is_named():
    with pytest.raises(ValueError, match="rope type 'dynamic' is not supported"):
        compute_inv_freq(8, {"rope_type": "dynamic", "rope_theta": 1e4})


def test_partial_rotary_leaves_tail_untouched():
    rope = RotaryEmbedding(
        16, 32, {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}, KERNELS
    )
    assert rope.cos_sin_cache.shape == (32, 8)
    q, k = torch.randn(5, 2 * 16), torch.randn(5, 16)
    q2, k2 = rope(torch.arange(5), q.clone(), k.clone())
    assert torch.equal(q2.view(5, 2, 16)[..., 8:], q.view(5, 2, 16)[..., 8:])
    assert not torch.equal(q2.view(5, 2, 16)[..., :8], q.view(5, 2, 16)[..., :8])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm_dtype", ["activation", "float32"])  # Qwen3 / Gemma 3 weights
def test_rotary_with_qk_norm_is_norm_then_rotary_in_place(dtype, norm_dtype):
    """``rope(pos, q, k, q_norm, k_norm)`` equals the separate per-head norms followed by
    rotary, bit for bit, and writes into the q/k slices of the qkv output (v untouched)."""
    heads, kv_heads, d = 4, 2, 16
    rope = RotaryEmbedding(d, 64, {"rope_type": "default", "rope_theta": 1e4}, KERNELS)
    wdtype = dtype if norm_dtype == "activation" else torch.float32
    q_norm, k_norm = RMSNorm(d, 1e-5, KERNELS, wdtype), RMSNorm(d, 1e-5, KERNELS, wdtype)
    q_norm.weight.data.copy_(1 + 0.2 * torch.randn(d))
    k_norm.weight.data.copy_(1 + 0.2 * torch.randn(d))
    qkv = torch.randn(7, (heads + 2 * kv_heads) * d).to(dtype)
    original = qkv.clone()
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    positions = torch.randint(0, 64, (7,))

    oq, ok, ov = original.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    eq = q_norm(oq.unflatten(-1, (heads, d))).view(7, -1)
    ek = k_norm(ok.unflatten(-1, (kv_heads, d))).view(7, -1)
    eq, ek = KERNELS.rotary_embedding(positions, eq, ek, rope.cos_sin_cache, d, True)

    q2, k2 = rope(positions, q, k, q_norm, k_norm)
    assert q2.data_ptr() == q.data_ptr() and k2.data_ptr() == k.data_ptr()
    assert torch.equal(q, eq) and torch.equal(k, ek)
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], ov)


def test_rotary_refuses_norms_that_do_not_fit_the_heads():
    rope = RotaryEmbedding(16, 8, {"rope_type": "default", "rope_theta": 1e4}, KERNELS)
    q, k = torch.randn(2, 32), torch.randn(2, 16)
    with pytest.raises(ValueError, match="over 8 dims, heads have 16"):
        rope(torch.arange(2), q, k, RMSNorm(8, 1e-6, KERNELS), None)
    with pytest.raises(ValueError, match="eps"):
        rope(torch.arange(2), q, k, RMSNorm(16, 1e-6, KERNELS), RMSNorm(16, 1e-5, KERNELS))


def test_qkv_and_merged_loaders_copy_into_slices():
    qkv = QKVParallelLinear(8, 4, 3, 1, bias=True, dtype=torch.float32)
    q, k, v = torch.randn(12, 8), torch.randn(4, 8), torch.randn(4, 8)
    for shard, w in zip("qkv", (q, k, v), strict=True):
        qkv.weight.weight_loader(qkv.weight, w, shard)
        qkv.bias.weight_loader(qkv.bias, torch.full((w.shape[0],), ord(shard) * 1.0), shard)
    x = torch.randn(2, 8)
    oq, ok, ov = qkv.split(qkv(x))
    torch.testing.assert_close(oq, x @ q.T + ord("q"))
    torch.testing.assert_close(ok, x @ k.T + ord("k"))
    torch.testing.assert_close(ov, x @ v.T + ord("v"))
    with pytest.raises(ModelLoadError, match=r"expected shape \(4, 8\), got \(5, 8\)"):
        qkv.weight.weight_loader(qkv.weight, torch.randn(5, 8), "k")

    merged = MergedColumnParallelLinear(8, [6, 6], dtype=torch.bfloat16)
    gate, up = torch.randn(6, 8), torch.randn(6, 8)
    merged.weight.weight_loader(merged.weight, gate, 0)
    merged.weight.weight_loader(merged.weight, up, 1)
    assert torch.equal(merged.weight.float(), torch.cat([gate, up]).bfloat16().float())


def test_rmsnorm_plain_fused_and_offset():
    norm = RMSNorm(8, 1e-6, KERNELS, torch.float32)
    norm.weight.data.copy_(torch.linspace(0.5, 1.5, 8))
    x, r = torch.randn(3, 8), torch.randn(3, 8)
    expected = F.rms_norm(x + r, (8,), norm.weight, 1e-6)
    out, res = norm(x, r)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(res, x + r)
    per_head = norm(torch.randn(3, 4, 8))
    assert per_head.shape == (3, 4, 8)
    gemma = RMSNorm(8, 1e-6, KERNELS, torch.float32, weight_offset=1.0)
    gemma.weight.data.zero_()
    torch.testing.assert_close(gemma(x), F.rms_norm(x, (8,), None, 1e-6))


def test_gated_activations():
    x = torch.randn(3, 10)
    torch.testing.assert_close(GatedActivation("silu", KERNELS)(x), F.silu(x[:, :5]) * x[:, 5:])
    torch.testing.assert_close(
        GatedActivation("gelu_pytorch_tanh", KERNELS)(x),
        F.gelu(x[:, :5], approximate="tanh") * x[:, 5:],
    )
    with pytest.raises(ValueError, match="relu"):
        GatedActivation("relu", KERNELS)


def test_embedding_scale_and_tied_head():
    emb = VocabParallelEmbedding(10, 4, torch.float32, embed_scale=2.0)
    emb.weight.data.copy_(torch.randn(10, 4))
    ids = torch.tensor([3, 7])
    torch.testing.assert_close(emb(ids), emb.weight[ids] * 2)
    head = ParallelLMHead(10, 4, torch.bfloat16, final_logit_softcap=5.0)
    head.tie(emb)
    assert head.weight is emb.weight
    h = torch.randn(2, 4)
    logits = head(h)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, 5.0 * torch.tanh(h @ emb.weight.T / 5.0))


def test_linear_layers_use_the_kernel_registry_and_still_pack_on_cpu():
    """Layers built with ``kernels`` call ``kernels.linear`` (the GPU plugins' skinny GEMM);
    without, ``F.linear``. The CPU runner's oneDNN packing replaces either product."""
    from engine.layers import ReplicatedLinear
    from engine.layers.cpu_packed_linear import pack_linears, packing_supported

    calls = []

    def counting_linear(x, weight, bias=None):
        calls.append(tuple(weight.shape))
        return F.linear(x, weight, bias)

    registry = KernelRegistry()
    registry.register("linear", counting_linear, platforms=("cpu",), provider="test")
    kernels = registry.resolve("cpu")
    layers = torch.nn.ModuleList(
        [
            ReplicatedLinear(8, 5, True, dtype=torch.float32, kernels=kernels),
            MergedColumnParallelLinear(8, [3, 4], dtype=torch.float32, kernels=kernels),
            QKVParallelLinear(8, 4, 2, 1, dtype=torch.float32, kernels=kernels),
            ParallelLMHead(11, 8, torch.float32, kernels=kernels),
            ReplicatedLinear(8, 6, dtype=torch.float32),  # no registry: F.linear
        ]
    )
    for p in layers.parameters():
        p.data.copy_(torch.randn_like(p))
    x = torch.randn(3, 8)
    expected = [F.linear(x, m.weight, getattr(m, "bias", None)) for m in layers]
    outs = [m(x) for m in layers]
    assert calls == [(5, 8), (7, 8), (16, 8), (11, 8)]
    for out, exp in zip(outs, expected, strict=True):
        torch.testing.assert_close(out, exp)
    if packing_supported(torch.float32, x.device):
        assert pack_linears(layers) == 5
        calls.clear()
        for m, exp in zip(layers, expected, strict=True):
            torch.testing.assert_close(m(x), exp, atol=1e-5, rtol=1e-5)
        assert calls == []  # the packed product replaced the kernel call


def test_tied_float32_lm_head_runs_onednn_on_the_shared_matrix():
    """A tied float32 head is not copied into a packed layout (it would double the embedding):
    oneDNN multiplies the plain matrix the embedding keeps using."""
    from engine.layers import ParallelLMHead
    from engine.layers.cpu_packed_linear import pack_linears, packing_supported

    if not packing_supported(torch.float32, torch.device("cpu")):
        pytest.skip("this torch build has no oneDNN")
    torch.manual_seed(0)
    heads = torch.nn.ModuleList(
        [ParallelLMHead(301, 64, torch.float32), ParallelLMHead(301, 64, torch.float32)]
    )
    for p in heads.parameters():
        p.data.normal_()
    tied = heads[0].weight
    xs = [torch.randn(n, 64) for n in (1, 7, 33)]
    expected = [[F.linear(x, h.weight) for x in xs] for h in heads]
    assert pack_linears(heads, shared_weights=(tied,)) == 2
    assert heads[0].packed_weight.data_ptr() == tied.data_ptr()  # no copy
    assert heads[0].packed_weight.layout == torch.strided
    assert heads[1].packed_weight.layout != torch.strided  # untied: packed as before
    for head, exps in zip(heads, expected, strict=True):
        for x, exp in zip(xs, exps, strict=True):
            out = head(x)
            assert out.dtype == torch.float32 and out.shape == exp.shape
            torch.testing.assert_close(out, exp, atol=1e-5, rtol=1e-5)
