"""engine-llm-triton's elementwise kernels against ``engine.kernels.reference`` on random inputs.

Odd sizes on purpose (masks), bf16 and fp32; grids stay tiny because every program costs about
a millisecond in the interpreter.
"""

from __future__ import annotations

import pytest
import torch
from kernel_tolerance import close, qk_norm_rotary_slack

from engine.kernels import reference as ref

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype, device, seed):
    from engine_triton.kernels.norm import rms_norm

    x = torch.randn(3, 37).to(dtype)
    w = torch.randn(37).to(dtype)
    out = rms_norm(x.to(device), w.to(device), 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    close(out, ref.rms_norm(x, w, 1e-6), dtype, seed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_strided_view(dtype, device, seed):
    """q-norm on ``qkv[:, :q_size].unflatten(-1, (heads, head_size))``: read in place."""
    from engine_triton.kernels.norm import rms_norm

    tokens, heads, head_size = 3, 3, 20
    qkv = torch.randn(tokens, (heads + 2) * head_size).to(dtype)
    q = qkv[:, : heads * head_size].unflatten(-1, (heads, head_size))
    w = torch.randn(head_size).to(dtype)
    q_dev = qkv.to(device)[:, : heads * head_size].unflatten(-1, (heads, head_size))
    out = rms_norm(q_dev, w.to(device), 1e-6)
    assert out.shape == (tokens, heads, head_size) and out.is_contiguous()
    close(out, ref.rms_norm(q, w, 1e-6), dtype, seed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(dtype, device, seed):
    from engine_triton.kernels.norm import fused_add_rms_norm

    x, res = torch.randn(3, 37).to(dtype), torch.randn(3, 37).to(dtype)
    w = torch.randn(37).to(dtype)
    x_in, res_in = x.to(device), res.to(device)
    normed, new_res = fused_add_rms_norm(x_in, res_in, w.to(device), 1e-5)
    exp_normed, exp_res = ref.fused_add_rms_norm(x, res, w, 1e-5)
    close(new_res, exp_res, dtype, seed)
    close(normed, exp_normed, dtype, seed)
    # Functional: the inputs are untouched.
    assert torch.equal(x_in.cpu(), x) and torch.equal(res_in.cpu(), res)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu_and_mul", "gelu_tanh_and_mul"])
def test_gated_activation(act, dtype, device, seed):
    from engine_triton.kernels import activation

    x = (3 * torch.randn(2, 2 * 45)).to(dtype)
    out = getattr(activation, act)(x.to(device))
    assert out.shape == (2, 45)
    close(out, getattr(ref, act)(x), dtype, seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_dim", [24, 8])  # full and partial rotary, head_size 24
def test_rotary_embedding(rot_dim, is_neox, dtype, device, seed):
    from engine_triton.kernels.rotary import rotary_embedding

    num_tokens, heads, kv_heads, head_size = 3, 3, 1, 24
    positions = torch.randint(0, 40, (num_tokens,))
    cache = torch.randn(40, rot_dim)
    # q and k as column slices of a fused qkv projection: non-contiguous rows.
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_size).to(dtype)
    q, k = qkv[:, : heads * head_size], qkv[:, heads * head_size : (heads + kv_heads) * head_size]
    qkv_dev = qkv.to(device)
    q_dev = qkv_dev[:, : heads * head_size]
    k_dev = qkv_dev[:, heads * head_size : (heads + kv_heads) * head_size]
    out_q, out_k = rotary_embedding(
        positions.to(device), q_dev, k_dev, cache.to(device), head_size, is_neox
    )
    exp_q, exp_k = ref.rotary_embedding(positions, q, k, cache, head_size, is_neox)
    close(out_q, exp_q, dtype, seed)
    close(out_k, exp_k, dtype, seed)


# (heads, kv_heads, head_size, rot_dim): GQA with a padded head count and head size, partial
# rotary, MHA at 128, and the widest head.
QK_SHAPES = [(3, 1, 24, 24), (3, 1, 24, 8), (4, 4, 128, 128), (2, 1, 256, 256)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("shape", QK_SHAPES, ids=lambda s: "H{}/{}-D{}-rot{}".format(*s))
def test_qk_norm_rotary_in_place_on_the_qkv_output(shape, norm, is_neox, dtype, device, seed):
    from engine_triton.kernels.rotary import qk_norm_rotary

    heads, kv_heads, head_size, rot_dim = shape
    tokens = 5
    sizes = [heads * head_size, kv_heads * head_size, kv_heads * head_size]
    qkv = (2 * torch.randn(tokens, sum(sizes))).to(dtype)
    positions = torch.randint(0, 40, (tokens,))
    cache = torch.randn(40, rot_dim)
    weights = [(1 + 0.3 * torch.randn(head_size)).to(dtype) if norm else None for _ in "qk"]
    q, k, v = qkv.clone().split(sizes, dim=-1)
    slack_q, slack_k = qk_norm_rotary_slack(positions, q, k, cache, head_size, is_neox, *weights,
                                            1e-6)  # fmt: skip
    exp_q, exp_k = ref.qk_norm_rotary(positions, q, k, cache, head_size, is_neox, *weights, 1e-6)

    qkv_dev = qkv.to(device)
    q_dev, k_dev, v_dev = qkv_dev.split(sizes, dim=-1)  # strided rows, written in place
    out_q, out_k = qk_norm_rotary(
        positions.to(device), q_dev, k_dev, cache.to(device), head_size, is_neox,
        *[None if w is None else w.to(device) for w in weights], 1e-6,
    )  # fmt: skip
    assert out_q.data_ptr() == q_dev.data_ptr() and out_k.data_ptr() == k_dev.data_ptr()
    close(q_dev, exp_q, dtype, seed, slack_q)
    close(k_dev, exp_k, dtype, seed, slack_k)
    assert torch.equal(v_dev.cpu(), v), f"seed={seed}: v was written"


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rotary_float32_weights_and_column_major_input(dtype, device, seed):
    """Gemma 3's float32 norm weights on bf16 activations; a query without unit column stride
    is computed on a copy and written back; an empty batch launches nothing."""
    from engine_triton.kernels.rotary import qk_norm_rotary

    tokens, heads, kv_heads, d = 3, 2, 1, 32
    positions = torch.randint(0, 16, (tokens,))
    cache = torch.randn(16, d)
    q = torch.randn(heads * d, tokens).to(dtype).t()  # column-major [T, H*D]
    k = torch.randn(tokens, kv_heads * d).to(dtype)
    qw, kw = 1 + 0.3 * torch.randn(d), 1 + 0.3 * torch.randn(d)
    exp_q, exp_k = ref.qk_norm_rotary(positions, q.clone(), k.clone(), cache, d, True, qw, kw)
    q_dev = q.to(device).t().contiguous().t() if device != "cpu" else q
    k_dev = k.to(device)
    out_q, out_k = qk_norm_rotary(
        positions.to(device), q_dev, k_dev, cache.to(device), d, True, qw.to(device), kw.to(device)
    )
    assert out_q is q_dev and out_k is k_dev
    slack_q, slack_k = qk_norm_rotary_slack(positions, q, k, cache, d, True, qw, kw, 1e-6)
    close(q_dev, exp_q, dtype, seed, slack_q)
    close(k_dev, exp_k, dtype, seed, slack_k)
    empty = torch.empty(0, heads * d, dtype=dtype, device=device)
    qk_norm_rotary(positions[:0].to(device), empty, empty, cache.to(device), d, True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_cache_skips_negative_slots(dtype, device, seed):
    from engine_triton.kernels.kv_cache import write_kv_cache

    blocks, page, kv_heads, head_size = 3, 4, 3, 12
    cache = torch.randn(2, blocks, page, kv_heads, head_size).to(dtype)
    expected = cache.clone()
    kv = torch.randn(4, 2, kv_heads, head_size).to(dtype)  # k and v interleaved: strided views
    k, v = kv[:, 0], kv[:, 1]
    slots = torch.tensor([5, -1, 11, 0])
    dev_cache = cache.to(device)
    kv_dev = kv.to(device)
    write_kv_cache(kv_dev[:, 0], kv_dev[:, 1], dev_cache, slots.to(device))
    ref.write_kv_cache(k, v, expected, slots)
    assert torch.equal(dev_cache.cpu(), expected), f"seed={seed}"


def test_register_overrides_gpu_platforms_only():
    from engine.kernels.registry import KERNEL_NAMES, KernelRegistry
    from engine_triton.kernels import register

    registry = KernelRegistry()
    register(registry)
    # GPT-OSS's MXFP4 experts: engine_triton.kernels.fused_moe.fused_moe_mxfp4 exists but is
    # not registered until it has run on a GPU (tests/gpu/test_fused_moe_gpu.py -k mxfp4), so
    # the reference stays (the FusedMoE method then dequantizes them at load and runs
    # fused_moe_biased, which Triton provides).
    not_yet = {"fused_moe_mxfp4"}
    for platform in ("cuda", "rocm"):
        kernels = registry.resolve(platform)
        overridden = [n for n in KERNEL_NAMES if n not in not_yet]
        assert {kernels.provider(n) for n in overridden} == {"engine-llm-triton"}
        assert {kernels.provider(n) for n in not_yet} == {"engine-llm (torch reference)"}
    cpu = registry.resolve("cpu")
    assert {cpu.provider(n) for n in KERNEL_NAMES} == {"engine-llm (torch reference)"}

    registry = KernelRegistry()
    register(registry, platforms=("cpu",))  # what interpreter tests do explicitly
    assert registry.resolve("cpu").provider("rms_norm") == "engine-llm-triton"
