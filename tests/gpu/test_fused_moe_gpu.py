"""engine-triton's MoE kernels on a CUDA GPU at the real model shapes, against the torch
references (bf16; unquantized, FP8 and 4/8-bit integer experts; GPT-OSS's biased experts with
the clamped SwiGLU in bf16 and fp16: ``-k biased``; GPT-OSS's MXFP4 experts at gpt-oss-20b's
and gpt-oss-120b's shapes, the op engine-triton does not register until these pass: ``-k
mxfp4``), inside CUDA graphs, and tiny MoE models through the engine (decode graphs)
token-exact against the CPU path (a GPTQ one against its dequantized twin); the expert-load
counters inside captured graphs."""

from __future__ import annotations

import gc
import json
import math
import random

import pytest
import torch
from kernel_tolerance import close, close_to_scale

from engine.kernels import reference as ref

pytestmark = pytest.mark.gpu

SHAPES = {  # experts, top-k, hidden, intermediate
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}
TOKENS = {"qwen3-30b-a3b": [1, 3, 4, 5, 64, 333, 2048], "mixtral-8x7b": [1, 2, 7, 512]}


@pytest.fixture(scope="module", params=list(SHAPES))
def experts(request):
    e, k, h, i = SHAPES[request.param]
    torch.manual_seed(0)
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) * h**-0.5
    w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) * i**-0.5
    yield request.param, k, w13, w2
    del w13, w2
    torch.cuda.empty_cache()


def _route(t, e, k, device="cuda"):
    ids = torch.rand(t, e, device=device).topk(k, dim=-1).indices.to(torch.int32)
    w = torch.rand(t, k, device=device)
    return w / w.sum(-1, keepdim=True), ids


def test_fused_moe_matches_reference_at_model_sizes(experts, seed):
    from engine_triton.kernels import fused_moe as fm

    name, k, w13, w2 = experts
    e, _, h = w13.shape
    for t in TOKENS[name]:
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        weights, ids = _route(t, e, k)
        if t > 2:
            ids[1, 0] = -1  # an expert held by another rank
        expected = ref.fused_moe(x, w13, w2, weights, ids)
        variants = ["grouped"] + (["decode"] if t * k <= fm.DECODE_MAX_PAIRS else [])
        for variant in variants + [None]:
            out = fm.fused_moe(x, w13, w2, weights, ids, variant=variant)
            close(out, expected, torch.bfloat16, f"{seed} {name} T={t} {variant}")


def test_fused_moe_replays_in_a_cuda_graph(experts):
    """No host synchronisation inside: captured once per variant, replayed on new routing
    written into the captured buffers, equal to the eager result."""
    from engine_triton.kernels import fused_moe as fm

    name, k, w13, w2 = experts
    e, _, h = w13.shape
    for t, variant in ((1, "decode"), (4, "decode"), (96, "grouped")):
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        weights, ids = _route(t, e, k)
        fm.fused_moe(x, w13, w2, weights, ids, variant=variant)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fm.fused_moe(x, w13, w2, weights, ids, variant=variant)
        new_w, new_ids = _route(t, e, k)
        weights.copy_(new_w)
        ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        eager = fm.fused_moe(x, w13, w2, weights, ids, variant=variant)
        assert torch.equal(out, eager), (name, t, variant)


# ---- FP8 experts (weight-only) ----------------------------------------------------------------
def _fp8_experts(w13, w2, scheme):
    """The bf16 experts as ``fused_moe_fp8`` takes them: (w13, w2, s13, s2, block_size)."""
    from engine.quantization.fp8_moe import quantize_fp8_experts, quantize_fp8_experts_blocks

    if scheme == "channel":
        q13, s13 = quantize_fp8_experts(w13)
        q2, s2 = quantize_fp8_experts(w2)
        return q13, q2, s13, s2, None
    q13, s13 = quantize_fp8_experts_blocks(w13, (128, 128), slices=2)
    q2, s2 = quantize_fp8_experts_blocks(w2, (128, 128))
    return q13, q2, s13, s2, (128, 128)


@pytest.mark.parametrize("scheme", ["block128", "channel"])
def test_fused_moe_fp8_matches_reference_at_model_sizes(experts, scheme, seed):
    """Qwen3-30B-A3B-FP8's and an FP8 Mixtral's expert shapes (128x128 blocks or per-channel
    scales), both paths and the rule's choice, against the dequantizing reference; then each
    path captured in a CUDA graph and replayed on new routing."""
    from engine_triton.kernels import fused_moe as fm

    name, k, w13, w2 = experts
    q13, q2, s13, s2, block = _fp8_experts(w13, w2, scheme)
    e, _, h = w13.shape
    for t in TOKENS[name]:
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        weights, ids = _route(t, e, k)
        if t > 2:
            ids[1, 0] = -1  # an expert held by another rank
        expected = ref.fused_moe_fp8(x, q13, q2, weights, ids, s13, s2, block)
        variants = ["grouped"] + (["decode"] if t * k <= fm.DECODE_MAX_PAIRS else [])
        for variant in variants + [None]:
            out = fm.fused_moe_fp8(x, q13, q2, weights, ids, s13, s2, block, variant=variant)
            close(out, expected, torch.bfloat16, f"{seed} {name} {scheme} T={t} {variant}")
    for t, variant in ((1, "decode"), (96, "grouped")):
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        weights, ids = _route(t, e, k)
        args = (x, q13, q2, weights, ids, s13, s2, block)
        fm.fused_moe_fp8(*args, variant=variant)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fm.fused_moe_fp8(*args, variant=variant)
        new_w, new_ids = _route(t, e, k)
        weights.copy_(new_w)
        ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fm.fused_moe_fp8(*args, variant=variant)), (name, t, variant)
    del q13, q2
    torch.cuda.empty_cache()


# ---- integer experts (W4A16 / W8A16) -------------------------------------------------------------
WNA16_SCHEMES = {  # bits, group size (-1: one per row), symmetric, act-order
    "w4-g128-sym": (4, 128, True, False),  # Qwen3-30B-A3B-GPTQ-Int4
    "w4-g128-zp": (4, 128, False, False),  # AWQ, asymmetric GPTQ
    "w4-g32-zp-act-order": (4, 32, False, True),  # GPTQ desc_act
    "w8-row-sym": (8, -1, True, False),
}


@pytest.mark.parametrize("scheme", list(WNA16_SCHEMES))
def test_fused_moe_wna16_matches_reference_at_model_sizes(experts, scheme, seed):
    """Qwen3-30B-A3B-GPTQ-Int4's and a 4/8-bit Mixtral's expert shapes (groups of 128 and 32,
    with and without zero points, act-order, 8-bit with one group per row), both paths and the
    rule's choice, against the dequantizing reference; then each path captured in a CUDA
    graph and replayed on new routing."""
    from engine.quantization.wna16_moe import quantize_wna16_experts
    from engine_triton.kernels import fused_moe as fm

    name, k, w13, w2 = experts
    bits, group, sym, act_order = WNA16_SCHEMES[scheme]
    q13, s13, z13 = quantize_wna16_experts(w13, bits, group, sym)
    q2, s2, z2 = quantize_wna16_experts(w2, bits, group, sym)
    e, _, h = w13.shape
    perms = (None, None)
    if act_order:  # random orders: the stored experts stand for permuted ones
        perms = tuple(
            torch.stack([torch.randperm(n, device="cuda") for _ in range(e)]).to(torch.int32)
            for n in (h, w2.shape[2])
        )
    for t in TOKENS[name]:
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        weights, ids = _route(t, e, k)
        if t > 2:
            ids[1, 0] = -1  # an expert held by another rank
        args = (x, q13, q2, weights, ids, s13, s2, z13, z2, bits, *perms)
        expected = ref.fused_moe_wna16(*args)
        variants = ["grouped"] + (["decode"] if t * k <= fm.DECODE_MAX_PAIRS else [])
        for variant in variants + [None]:
            out = fm.fused_moe_wna16(*args, variant=variant)
            close(out, expected, torch.bfloat16, f"{seed} {name} {scheme} T={t} {variant}")
    for t, variant in ((1, "decode"), (96, "grouped")):
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        weights, ids = _route(t, e, k)
        args = (x, q13, q2, weights, ids, s13, s2, z13, z2, bits, *perms)
        fm.fused_moe_wna16(*args, variant=variant)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fm.fused_moe_wna16(*args, variant=variant)
        new_w, new_ids = _route(t, e, k)
        weights.copy_(new_w)
        ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fm.fused_moe_wna16(*args, variant=variant)), (name, t, variant)
    del q13, q2, s13, s2, z13, z2
    torch.cuda.empty_cache()


# ---- experts with biases and GPT-OSS's clamped SwiGLU (fused_moe_biased) -----------------------
GPT_OSS = (32, 4, 2880, 2880)  # gpt-oss-20b: experts, top-k, hidden, expert intermediate
GPT_OSS_TOKENS = [1, 2, 3, 5, 64, 333, 2048]
ALPHA, LIMIT = 1.702, 7.0


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def biased_experts(request):
    """gpt-oss-20b's expert stacks and biases in bf16 or fp16: gate/up values of std ~3 plus
    biases of std 1 (a few percent of them past the clamp at 7, on each side), down
    projections of unit gain, down biases of std 1. The reference's matmuls run without
    cuBLAS's reduced-precision reductions, so that it is the float32-accumulating spec."""
    e, k, h, i = GPT_OSS
    dtype = request.param
    torch.manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, device="cuda") * 3 * h**-0.5).to(dtype)
    w2 = (torch.randn(e, h, i, device="cuda") * i**-0.5).to(dtype)
    b13 = torch.randn(e, 2 * i, device="cuda").to(dtype)
    b2 = torch.randn(e, h, device="cuda").to(dtype)
    matmul = torch.backends.cuda.matmul
    saved = (
        matmul.allow_bf16_reduced_precision_reduction,
        matmul.allow_fp16_reduced_precision_reduction,
    )
    matmul.allow_bf16_reduced_precision_reduction = False
    matmul.allow_fp16_reduced_precision_reduction = False
    yield dtype, k, w13, w2, b13, b2
    (
        matmul.allow_bf16_reduced_precision_reduction,
        matmul.allow_fp16_reduced_precision_reduction,
    ) = saved
    del w13, w2, b13, b2
    torch.cuda.empty_cache()


@pytest.mark.parametrize("activation", ["swigluoai", "silu"])
def test_fused_moe_biased_matches_reference_at_gpt_oss_size(biased_experts, activation, seed):
    """gpt-oss-20b's experts with their biases, both activations, at decode and prefill
    batches: both paths and the rule's choice (its grouped configurations), against the
    reference, one rounding apart relative to the outputs' scale (``close_to_scale``)."""
    from engine_triton.kernels import fused_moe as fm

    dtype, k, w13, w2, b13, b2 = biased_experts
    e, _, h = w13.shape
    for t in GPT_OSS_TOKENS:
        x = torch.randn(t, h, device="cuda", dtype=dtype)
        weights, ids = _route(t, e, k)
        if t > 2:
            ids[1, 0] = -1  # an expert held by another rank
        args = (x, w13, w2, weights, ids, b13, b2, activation, ALPHA, LIMIT)
        expected = ref.fused_moe_biased(*args)
        variants = ["grouped"] + (["decode"] if t * k <= fm.DECODE_MAX_PAIRS else [])
        for variant in variants + [None]:
            out = fm.fused_moe_biased(*args, variant=variant)
            assert out.dtype == dtype
            close_to_scale(out, expected, dtype, f"{seed} {dtype} {activation} T={t} {variant}")
    # The clamp bit: token 0's gate/up values for its first choice go past +-LIMIT.
    expert = int(ids[0, 0])
    gate, up = (x[0].float() @ w13[expert].float().T + b13[expert].float()).chunk(2)
    assert (gate > LIMIT).any() and (up > LIMIT).any() and (up < -LIMIT).any()


def test_fused_moe_biased_replays_in_a_cuda_graph(biased_experts):
    """GPT-OSS's experts inside a captured graph (what its decode graphs need): captured once
    per variant, replayed on new routing, equal to the eager result."""
    from engine_triton.kernels import fused_moe as fm

    dtype, k, w13, w2, b13, b2 = biased_experts
    e, _, h = w13.shape
    for t, variant in ((1, "decode"), (4, "decode"), (96, "grouped")):
        x = torch.randn(t, h, device="cuda", dtype=dtype)
        weights, ids = _route(t, e, k)
        args = (x, w13, w2, weights, ids, b13, b2, "swigluoai", ALPHA, LIMIT)
        fm.fused_moe_biased(*args, variant=variant)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fm.fused_moe_biased(*args, variant=variant)
        new_w, new_ids = _route(t, e, k)
        weights.copy_(new_w)
        ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fm.fused_moe_biased(*args, variant=variant)), (dtype, t, variant)


def test_gpt_oss_moe_layer_biased_in_a_cuda_graph():
    """GPT-OSS's ``FusedMoE`` layer (routing and experts, engine-triton's kernels bound for
    cuda) names no reason against decode graphs, captures, and replays on new inputs to the
    same result as eagerly, within one rounding of the layer on the torch references."""
    from engine.kernels.registry import KernelRegistry
    from engine.layers.fused_moe import FusedMoE
    from engine_triton.kernels import register

    registry = KernelRegistry()
    register(registry)
    e, k, h, i, dtype = 16, 4, 256, 384, torch.bfloat16

    def layer(kernels):
        with torch.device("cuda"):
            moe = FusedMoE(e, k, h, i, renormalize=True, kernels=kernels, dtype=dtype,
                           activation="swigluoai", bias=True)  # fmt: skip
        torch.manual_seed(1)
        for name, std in (("w13_weight", 3 * h**-0.5), ("w2_weight", i**-0.5),
                          ("w13_bias", 1.0), ("w2_bias", 1.0)):  # fmt: skip
            param = getattr(moe, name)
            param.data.copy_(torch.randn(param.shape) * std)
        return moe

    moe, reference = layer(registry.resolve("cuda")), layer(KernelRegistry().resolve("cuda"))
    assert moe.quant_method.graph_capture_problem(moe) is None
    assert reference.quant_method.graph_capture_problem(reference) is not None
    x = torch.randn(8, h, device="cuda", dtype=dtype)
    logits = torch.randn(8, e, device="cuda", dtype=dtype)
    moe(x, logits)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe(x, logits)
    x.copy_(torch.randn_like(x))
    logits.copy_(torch.randn_like(logits))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, moe(x, logits))
    close_to_scale(out, reference(x, logits), dtype, "layer")


# ---- GPT-OSS's experts as released: MXFP4 (fused_moe_mxfp4, not registered yet) -------------
# gpt-oss-20b's and gpt-oss-120b's experts: count, top-k, hidden, expert intermediate.
GPT_OSS_MXFP4 = {"gpt-oss-20b": (32, 4, 2880, 2880), "gpt-oss-120b": (128, 4, 2880, 2880)}


def _mxfp4(e, n, k, std):
    """Random MXFP4 experts ``[E, N, K]`` on the GPU (every byte value) whose products with
    unit inputs have about ``std``: exponents within one of the one giving it (E2M1's random
    codes have an RMS of about 2.93). Returns (uint8 ``[E, N, K / 2]``, uint8 ``[E, N, K /
    32]``)."""
    center = 127 + round(math.log2(std / (2.93 * math.sqrt(k))))
    blocks = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device="cuda")
    scales = torch.randint(center - 1, center + 2, (e, n, k // 32), dtype=torch.uint8,
                           device="cuda")  # fmt: skip
    return blocks, scales


@pytest.fixture(scope="module", params=list(GPT_OSS_MXFP4))
def mxfp4_experts(request):
    """GPT-OSS's MXFP4 expert stacks (bf16 biases): gate/up values of std ~3 plus biases of
    std 1 (some past the clamp at 7, on each side), down projections of about unit gain, down
    biases of std 1. The reference's matmuls (on the dequantized bf16 weights) run without
    cuBLAS's reduced-precision reductions, so that it is the float32-accumulating spec."""
    e, k, h, i = GPT_OSS_MXFP4[request.param]
    torch.manual_seed(0)
    w13, s13 = _mxfp4(e, 2 * i, h, 3.0)
    w2, s2 = _mxfp4(e, h, i, 1.0)
    b13 = torch.randn(e, 2 * i, device="cuda").to(torch.bfloat16)
    b2 = torch.randn(e, h, device="cuda").to(torch.bfloat16)
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = False
    yield request.param, k, w13, w2, s13, s2, b13, b2
    matmul.allow_bf16_reduced_precision_reduction = saved
    del w13, w2, s13, s2, b13, b2
    torch.cuda.empty_cache()


def test_mxfp4_decode_is_bit_exact_on_the_gpu():
    """The kernels' in-register E2M1 decode, compiled for this GPU: all 256 bytes at exponents
    2..252 equal ``dequantize_mxfp4_experts``'s float32 values bit for bit."""
    from e2m1_decode import decode_mxfp4, every_byte_at_every_exponent

    from engine.kernels.quantized import dequantize_mxfp4_experts

    blocks, scales = every_byte_at_every_exponent()
    out = decode_mxfp4(blocks.cuda(), scales.cuda()).cpu()
    want = dequantize_mxfp4_experts(blocks[None], scales[None])[0]
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("activation", ["swigluoai", "silu"])
def test_fused_moe_mxfp4_matches_reference_at_gpt_oss_size(mxfp4_experts, activation, seed):
    """GPT-OSS's MXFP4 experts with their biases (bf16), both activations, at decode and
    prefill batches: both paths and the rule's choice (``MXFP4_DECODE``, the general grouped
    tilings), against the reference (which dequantizes the experts to bf16, exactly), one
    rounding apart relative to the outputs' scale (``close_to_scale``)."""
    from engine_triton.kernels import fused_moe as fm

    name, k, w13, w2, s13, s2, b13, b2 = mxfp4_experts
    e, _, h2 = w13.shape
    h = 2 * h2
    for t in GPT_OSS_TOKENS:
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        weights, ids = _route(t, e, k)
        if t > 2:
            ids[1, 0] = -1  # an expert held by another rank
        args = (x, w13, w2, weights, ids, s13, s2, b13, b2, activation, ALPHA, LIMIT)
        expected = ref.fused_moe_mxfp4(*args)
        variants = ["grouped"] + (["decode"] if t * k <= fm.DECODE_MAX_PAIRS else [])
        for variant in variants + [None]:
            out = fm.fused_moe_mxfp4(*args, variant=variant)
            assert out.dtype == torch.bfloat16
            close_to_scale(out, expected, torch.bfloat16, f"{seed} {name} {activation} T={t} "
                                                          f"{variant}")  # fmt: skip
    # The clamp bit: token 0's gate/up values for its first choice go past +-LIMIT.
    from engine.kernels.quantized import dequantize_mxfp4_experts

    expert = int(ids[0, 0])
    dq = dequantize_mxfp4_experts(w13[expert], s13[expert])
    gate, up = (x[0].float() @ dq.T + b13[expert].float()).chunk(2)
    assert (gate > LIMIT).any() and (up > LIMIT).any() and (up < -LIMIT).any()


def test_fused_moe_mxfp4_replays_in_a_cuda_graph(mxfp4_experts):
    """GPT-OSS's MXFP4 experts inside a captured graph (what its decode graphs need once the
    op is registered): captured once per variant, replayed on new routing and activations,
    equal to the eager result."""
    from engine_triton.kernels import fused_moe as fm

    name, k, w13, w2, s13, s2, b13, b2 = mxfp4_experts
    e, _, h2 = w13.shape
    for t, variant in ((1, "decode"), (4, "decode"), (96, "grouped")):
        x = torch.randn(t, 2 * h2, device="cuda", dtype=torch.bfloat16)
        weights, ids = _route(t, e, k)
        args = (x, w13, w2, weights, ids, s13, s2, b13, b2, "swigluoai", ALPHA, LIMIT)
        fm.fused_moe_mxfp4(*args, variant=variant)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fm.fused_moe_mxfp4(*args, variant=variant)
        new_w, new_ids = _route(t, e, k)
        weights.copy_(new_w)
        ids.copy_(new_ids)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fm.fused_moe_mxfp4(*args, variant=variant)), (name, t, variant)


def test_gpt_oss_mxfp4_moe_layer_in_a_cuda_graph():
    """GPT-OSS's ``FusedMoE`` layer with its experts kept in MXFP4 (``Mxfp4MoEMethod``), on
    engine-triton's kernels with ``fused_moe_mxfp4`` registered for cuda by hand (``register``
    leaves it out until this file passes): names no reason against decode graphs, captures,
    and replays on new inputs to the same result as eagerly, within one rounding of the layer
    on the torch references."""
    from engine.kernels.registry import KernelRegistry
    from engine.layers.fused_moe import FusedMoE
    from engine.quantization.mxfp4 import Mxfp4MoEMethod
    from engine_triton.kernels import PRIORITY, PROVIDER, register
    from engine_triton.kernels.fused_moe import fused_moe_mxfp4

    registry = KernelRegistry()
    register(registry)
    registry.register("fused_moe_mxfp4", fused_moe_mxfp4, platforms=("cuda",),
                      priority=PRIORITY, provider=PROVIDER)  # fmt: skip
    e, k, h, i, dtype = 16, 4, 256, 384, torch.bfloat16
    torch.manual_seed(1)
    w13, s13 = _mxfp4(e, 2 * i, h, 3.0)
    w2, s2 = _mxfp4(e, h, i, 1.0)

    def layer(kernels):
        with torch.device("cuda"):
            moe = FusedMoE(e, k, h, i, renormalize=True, kernels=kernels, dtype=dtype,
                           quant_method=Mxfp4MoEMethod(), prefix="mlp.experts",
                           activation="swigluoai", bias=True)  # fmt: skip
        torch.manual_seed(2)
        for name, value in (("w13_weight", w13), ("w2_weight", w2), ("w13_weight_scale", s13),
                            ("w2_weight_scale", s2), ("w13_bias", torch.randn(e, 2 * i)),
                            ("w2_bias", torch.randn(e, h))):  # fmt: skip
            getattr(moe, name).data.copy_(value)
        return moe

    moe, reference = layer(registry.resolve("cuda")), layer(KernelRegistry().resolve("cuda"))
    assert moe.w13_weight.dtype == torch.uint8
    assert moe.quant_method.graph_capture_problem(moe) is None
    assert reference.quant_method.graph_capture_problem(reference) is not None
    x = torch.randn(8, h, device="cuda", dtype=dtype)
    logits = torch.randn(8, e, device="cuda", dtype=dtype)
    moe(x, logits)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe(x, logits)
    x.copy_(torch.randn_like(x))
    logits.copy_(torch.randn_like(logits))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, moe(x, logits))
    close_to_scale(out, reference(x, logits), dtype, "mxfp4 layer")


@pytest.mark.parametrize("e,k", [(128, 8), (8, 2), (60, 4)])
def test_topk_softmax_matches_reference(e, k):
    from engine_triton.kernels.fused_moe import moe_topk_softmax

    t = 4097
    logits = (torch.stack([torch.randperm(e) for _ in range(t)]).float() / 8 - 4).bfloat16()
    for renorm in (True, False):
        w, ids = moe_topk_softmax(logits.cuda(), k, renorm)
        exp_w, exp_ids = ref.moe_topk_softmax(logits, k, renorm)
        assert torch.equal(ids.cpu(), exp_ids)
        torch.testing.assert_close(w.cpu(), exp_w, atol=1e-6, rtol=1e-5)


# ---- the engine -------------------------------------------------------------------------------
NUM_NEW = 16


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "qwen2_moe"])
def tiny_moe(request, tmp_path_factory):
    from engine.testing.tiny_models import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp(request.param), request.param))


def _prompts():
    rng = random.Random(0)
    return [[rng.randrange(10, 300) for _ in range(n)] for n in (1, 3, 7, 17, 40, 100, 129, 333)]


def _run(path, **kwargs):
    from engine import LLM, SamplingParams

    llm = LLM(path, dtype="float32", block_size=16, max_num_batched_tokens=256, **kwargs)
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]
    graphs = llm.llm_engine.runner.graphs is not None
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, graphs


def test_moe_models_on_triton_with_cuda_graphs_match_cpu(tiny_moe):
    cpu, _ = _run(tiny_moe, platform="cpu", attention_backend="torch")
    gpu, graphs = _run(tiny_moe, platform="cuda", attention_backend="triton",
                       num_gpu_blocks_override=512)  # fmt: skip
    assert graphs, "decode graphs were not captured"
    assert gpu == cpu


@pytest.mark.parametrize("async_flag", ["--no-async-scheduling", "--async-scheduling"])
def test_expert_load_is_counted_inside_decode_graphs(tiny_moe, tmp_path, async_flag):
    """``engine bench throughput --expert-load`` recaptures the decode graphs with the
    counters: every routed token of the run is counted once, and the padding rows of a
    captured batch (5 requests run in the 8-row graph) are not. (Asynchronous scheduling may
    run a request one step past its last token, whose sample it discards: at most one extra
    token per request.)"""
    from transformers import AutoConfig

    from engine.benchmarks import throughput
    from engine.models.registry import ModelRegistry

    out = tmp_path / "r.json"
    # --num-gpu-blocks-override: test files run side by side on one GPU (run_all.sh).
    argv = ["--model", tiny_moe, "--dtype", "float32", "--num-prompts", "5", "--input-len", "20",
            "--output-len", "9", "--no-warmup", "--expert-load", async_flag,
            "--num-gpu-blocks-override", "512", "--json", str(out)]  # fmt: skip
    assert throughput.main(argv) == 0
    result = json.loads(out.read_text())
    load = result["step_split"]["expert_load"]
    config = AutoConfig.from_pretrained(tiny_moe)
    spec = ModelRegistry().resolve(config.architectures)[1].moe_spec(config)
    layers = sum(spec.is_sparse(i) for i in range(config.num_hidden_layers))
    assert result["step_split"]["decode_graph_by_batch"], "no decode step replayed a graph"
    exact = (5 * 20 + 5 * 8) * spec.top_k * layers
    if async_flag == "--no-async-scheduling":
        assert load["routed_tokens"] == exact
    else:
        assert exact <= load["routed_tokens"] <= exact + 5 * spec.top_k * layers


def test_fp8_moe_models_on_triton_with_cuda_graphs_match_cpu(tiny_moe, tmp_path):
    """A block-wise (128x128) fp8 checkpoint of the tiny MoE model with only its experts
    quantized (the dense layers would run W8A8 on the GPU and weight-only on the CPU): the
    experts through engine-triton's fused_moe_fp8 inside decode graphs give the CPU's
    (reference) greedy tokens."""
    from pathlib import Path

    from engine.testing import quantized_models as qm

    state = qm._load_state(Path(tiny_moe))
    dense = [m for m in qm.quantized_linears(state) if ".experts." not in m]
    fp8, _ = qm.write_fp8(tiny_moe, tmp_path / "fp8", None, block=(128, 128), ignored_layers=dense)
    cpu, _ = _run(str(fp8), platform="cpu", attention_backend="torch")
    gpu, graphs = _run(str(fp8), platform="cuda", attention_backend="triton",
                       num_gpu_blocks_override=512)  # fmt: skip
    assert graphs, "decode graphs were not captured"
    assert gpu == cpu


def test_gptq_moe_models_on_triton_with_cuda_graphs_match_dequantized(tiny_moe, tmp_path):
    """A GPTQ checkpoint of the tiny MoE model (4-bit with zero points, groups of 32, or one
    per row where the tiny Qwen2-MoE's 48-wide experts hold no whole group): the experts
    through engine-triton's ``fused_moe_wna16`` and the dense layers through ``wna16_linear``,
    inside decode graphs, give the greedy tokens of its dequantized twin (every quantized
    weight replaced by its exact dequantized value, run unquantized) on the same GPU."""
    from engine.testing import quantized_models as qm

    group = -1 if "qwen2_moe" in tiny_moe else 32
    gptq, dequantized = qm.write_gptq(
        tiny_moe, tmp_path / "gptq", tmp_path / "dequantized", group_size=group, sym=False
    )
    want, _ = _run(str(dequantized), platform="cuda", attention_backend="triton",
                   num_gpu_blocks_override=512)  # fmt: skip
    got, graphs = _run(str(gptq), platform="cuda", attention_backend="triton",
                       num_gpu_blocks_override=512)  # fmt: skip
    assert graphs, "decode graphs were not captured"
    assert got == want
