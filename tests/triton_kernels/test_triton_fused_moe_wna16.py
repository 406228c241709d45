"""engine-triton's ``fused_moe_wna16`` (4/8-bit integer experts, weight-only) against the torch
reference ``engine.kernels.reference.fused_moe_wna16``.

Both ways through the experts (the decode GEMVs and the grouped GEMMs) with 4 and 8 bits,
groups of 32 and 128 and one group per row, symmetric (no zero-point tensor) and with zero
points, act-order permutations; decode batches of 1-4 tokens, odd token counts, experts with
no token, every token on one expert, a choice held by another expert-parallel rank, top-1/2/8;
bf16, fp16 (the grouped GEMMs' two tensor-core operand tricks) and float32 activations. The
launch configurations are small (the interpreter runs every program in Python) but still make
K steps span groups (decode), cut to the group (grouped) and end past K (masks).
tests/gpu/test_fused_moe_gpu.py runs the real model shapes.
"""

from __future__ import annotations

import pytest
import torch
from kernel_tolerance import ONE_ROUNDING, close
from moe_routing import route

from engine.kernels import reference as ref

DECODE = {"gate_up_n": 16, "gate_up_k": 64, "down_n": 16, "down_k": 32, "num_stages": 1}
GROUPED = {"block_m": 16, "block_n": 16, "block_k": 64, "group_m": 2, "num_stages": 1,
           "gate_up_n": 32}  # fmt: skip

# tokens, experts, top-k, hidden, intermediate, bits, group (-1: one per row), zero points,
# act-order, activation dtype, popular expert, unused experts, variants
CASES = {
    "b1-top8-w4-g32-zp": (1, 16, 8, 64, 32, 4, 32, True, False, torch.bfloat16, None, (),
                          ("decode", "grouped")),
    "t2-w8-g32-sym-act-order": (2, 8, 2, 64, 64, 8, 32, False, True, torch.float32, None, (),
                                ("decode", "grouped")),
    "t4-w4-g128-zp-fp16": (4, 8, 2, 128, 128, 4, 128, True, False, torch.float16, None, (),
                           ("decode", "grouped")),
    "t5-idle-experts-w4-row-zp": (5, 8, 2, 64, 40, 4, -1, True, False, torch.bfloat16, None,
                                  (0, 6, 7), ("decode", "grouped")),
    "t9-one-expert-w8-row-sym": (9, 8, 1, 48, 32, 8, -1, False, False, torch.float32, 3, (),
                                 ("grouped",)),
    "t7-act-order-w4-g32-zp": (7, 8, 2, 64, 64, 4, 32, True, True, torch.bfloat16, None, (),
                               ("grouped",)),
}  # fmt: skip


def _experts(e, h, i, bits, group, zero_points):
    """Random packed experts, scales and zero points in ``fused_moe_wna16``'s layout (the
    conformance inputs' generator: dequantized weights of std ~K^-0.5, float16 scales)."""
    from engine.testing.inputs import _wna16_experts

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    q13, s13, z13 = _wna16_experts(gen, e, 2 * i, h, bits, group, not zero_points)
    q2, s2, z2 = _wna16_experts(gen, e, h, i, bits, group, not zero_points)
    return q13, q2, s13, s2, z13, z2


def _case_args(case):
    t, e, k, h, i, bits, group, zp, act_order, dtype, popular, unused, _ = CASES[case]
    x = torch.randn(t, h).to(dtype)
    q13, q2, s13, s2, z13, z2 = _experts(e, h, i, bits, group, zp)
    weights, ids = route(t, e, k, popular, unused)
    if unused:
        ids[2, 1] = -1  # held by another expert-parallel rank
    perms = (None, None)
    if act_order:
        perms = tuple(
            torch.stack([torch.randperm(n) for _ in range(e)]).to(torch.int32) for n in (h, i)
        )
    return (x, q13, q2, weights, ids, s13, s2, z13, z2, bits, *perms)


@pytest.mark.parametrize(
    "case,variant", [(c, v) for c, spec in CASES.items() for v in spec[-1]]
)  # fmt: skip
def test_fused_moe_wna16_matches_reference(case, variant, device, seed):
    from engine_triton.kernels.fused_moe import DecodeConfig, GroupedConfig, fused_moe_wna16

    args = _case_args(case)
    out = fused_moe_wna16(
        *(a.to(device) if isinstance(a, torch.Tensor) else a for a in args),
        variant=variant,
        decode_config=DecodeConfig(**DECODE),
        config=GroupedConfig(**GROUPED),
    )
    x = args[0]
    assert out.shape == x.shape and out.dtype == x.dtype
    expected = ref.fused_moe_wna16(*args)
    close(out, expected, x.dtype, f"{seed} {case} {variant}")


def test_fused_moe_wna16_default_dispatch(device, seed):
    """Without overrides: batch 1 takes the decode kernels with ``WNA16_DECODE[4]`` (K steps
    of 512 and 256 here reaching past H and I: masked), a bigger batch the grouped rule's
    tiling."""
    from engine_triton.kernels import fused_moe as fm

    e, k, h, i, bits = 8, 2, 64, 32, 4
    q13, q2, s13, s2, z13, z2 = _experts(e, h, i, bits, 32, True)
    for t in (1, 12):
        x = torch.randn(t, h).to(torch.bfloat16)
        weights, ids = route(t, e, k)
        args = (x, q13, q2, weights, ids, s13, s2, z13, z2, bits)
        out = fm.fused_moe_wna16(
            *(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
        )
        close(out, ref.fused_moe_wna16(*args), torch.bfloat16, f"{seed} T={t}")


def test_four_bit_experts_take_their_own_dispatch_rule():
    """4-bit experts stay on the decode kernels to 60% expected re-reads (the general rule: 15%)
    and take 4-stage grouped tilings; 8-bit experts keep the general rule."""
    from engine_triton.kernels import fused_moe as fm

    # Qwen3-30B-A3B, 8 tokens: 64 pairs over about 51.8 distinct experts (1.24x re-read).
    assert fm.use_decode(8, 8, 128, bits=4) and not fm.use_decode(8, 8, 128)
    assert not fm.use_decode(8, 8, 128, bits=8)
    # Mixtral: 4 tokens (1.52x) decode, 8 tokens (2.34x) grouped.
    assert fm.use_decode(4, 2, 8, bits=4) and not fm.use_decode(8, 2, 8, bits=4)
    for pairs in (64, 4096, 16384):
        assert fm.grouped_config(pairs, 8, bits=4).num_stages == 4
        assert fm.grouped_config(pairs, 8, bits=8) == fm.grouped_config(pairs, 8)


def test_fused_moe_wna16_rejects_what_it_cannot_run(device):
    from engine_triton.kernels.fused_moe import fused_moe_wna16

    t, e, k, h, i = 2, 4, 2, 64, 32
    x = torch.randn(t, h, device=device)
    q13, q2, s13, s2, z13, z2 = (a.to(device) for a in _experts(e, h, i, 4, 32, True))
    weights, ids = (a.to(device) for a in route(t, e, k))
    with pytest.raises(ValueError, match="scales do not fit"):
        fused_moe_wna16(x, q13, q2, weights, ids, s13[:, :i], s2, z13, z2)
    with pytest.raises(ValueError, match="scales do not fit"):  # zero points: both or neither
        fused_moe_wna16(x, q13, q2, weights, ids, s13, s2, z13, None)
    with pytest.raises(ValueError, match="shapes do not fit"):  # packed for 4 bits, not 8
        fused_moe_wna16(x, q13, q2, weights, ids, s13, s2, z13, z2, 8)
    with pytest.raises(ValueError, match="4- or 8-bit"):
        fused_moe_wna16(x, q13, q2, weights, ids, s13, s2, z13, z2, 3)
    with pytest.raises(ValueError, match="int32-packed experts"):
        fused_moe_wna16(x, q13.float(), q2, weights, ids, s13, s2, z13, z2)
    perm = torch.arange(i, device=device, dtype=torch.int32).repeat(e, 1)  # w2's, not w13's
    with pytest.raises(ValueError, match=r"w13 permutation \(4, 32\) does not fit \(4, 64\)"):
        fused_moe_wna16(x, q13, q2, weights, ids, s13, s2, z13, z2, 4, perm, perm)
    o13, o2 = s13.float(), s2.float()
    with pytest.raises(ValueError, match="offsets take the zero points' place"):
        fused_moe_wna16(x, q13, q2, weights, ids, s13, s2, z13, z2, 4, None, None, o13, o2)
    with pytest.raises(ValueError, match="scales do not fit"):  # offsets in the scales' shape
        fused_moe_wna16(x, q13, q2, weights, ids, s13, s2, None, None, 4, None, None, o13[:, :i])
    s13_8, s2_8 = s13.repeat_interleave(4, -1), s2.repeat_interleave(4, -1)  # groups of 8
    with pytest.raises(ValueError, match="groups of 8 input features need a multiple of 16"):
        fused_moe_wna16(x, q13, q2, weights, ids, s13_8, s2_8)


def test_conformance_kit_accepts_the_override():
    """The kit's own kernel check on its ``fused_moe_wna16`` inputs (4/8 bits, groups of
    32-128 and one per row, sym/asym, act-order), with the default dispatch and tilings."""
    from engine.testing.checks import check_kernel
    from engine_triton.kernels import fused_moe as fm

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check_kernel("fused_moe_wna16", fm.fused_moe_wna16, device, "bfloat16")


def test_integer_experts_are_served_by_triton_on_gpu_platforms():
    """With engine-triton registered, ``fused_moe_wna16`` on CUDA/ROCm is its kernel, so a
    GPTQ MoE layer builds there (the start-up refusal meets only a reference-only GPU
    platform) and logs no slow path."""
    from engine.kernels.registry import KernelRegistry
    from engine.layers.fused_moe import FusedMoE
    from engine.quantization.gptq import GPTQConfig
    from engine.quantization.wna16_moe import WNA16MoEMethod
    from engine_triton.kernels import register

    registry = KernelRegistry()
    register(registry)
    for platform in ("cuda", "rocm"):
        kernels = registry.resolve(platform)
        assert kernels.provider("fused_moe_wna16") == "engine-llm-triton"
        assert not kernels.is_reference("fused_moe_wna16")
        with torch.device("meta"):
            layer = FusedMoE(
                8, 2, 256, 256, renormalize=True, kernels=kernels, dtype=torch.bfloat16,
                quant_config=GPTQConfig(4, 32, False, True, True),
                prefix="model.layers.0.mlp.experts",
            )  # fmt: skip
        assert isinstance(layer.quant_method, WNA16MoEMethod)


# GGUF experts (``engine.kernels.gguf.integer_planes``: float offsets instead of zero points
# for the types with a minimum, the symmetric ones shifted to the symmetric form; the down
# projection in its own width): tokens, experts, top-k, hidden, intermediate, gate/up
# type, down type, activation dtype, variants. K-quants need rows of 256 values.
GGUF_CASES = {
    "b1-q4k-q6k-bf16": (1, 8, 2, 256, 256, "Q4_K", "Q6_K", torch.bfloat16, ("decode", "grouped")),
    "t5-q8_0-q4_0-fp16": (5, 4, 2, 64, 96, "Q8_0", "Q4_0", torch.float16, ("decode", "grouped")),
    "t3-q5k-q4k-f32": (3, 4, 2, 256, 256, "Q5_K", "Q4_K", torch.float32, ("decode", "grouped")),
    "t6-q5_0-q4_1-bf16": (6, 4, 1, 64, 64, "Q5_0", "Q4_1", torch.bfloat16, ("grouped",)),
}  # fmt: skip


def gguf_experts(e, n, k, name, seed):
    """A stack of ``e`` random ``[n, k]`` GGUF matrices of type ``name`` as
    ``fused_moe_wna16``'s (words, scales, offsets, bits), and their exact float32 weights."""
    from engine.kernels import gguf
    from engine.testing.tiny_gguf import random_blocks

    t = gguf.gguf_type(name)
    raw = torch.from_numpy(random_blocks(e * n, k, name, seed=seed).copy())
    blocks = raw.view(e, n, k // t.block_size, t.type_size)
    q, s, o = gguf.integer_planes(blocks, name)
    exact = gguf.dequantize(blocks.reshape(e * n, -1, t.type_size), name).view(e, n, k)
    return q, s, o, 4 if t.bits == 4 else 8, exact


@pytest.mark.parametrize(
    "case,variant", [(c, v) for c, spec in GGUF_CASES.items() for v in spec[-1]]
)  # fmt: skip
def test_gguf_experts_match_the_exact_weights(case, variant, device, seed):
    """Offsets and a down projection of its own width: the kernels against the reference on
    the same operands, and the reference against ``fused_moe`` on the GGUF blocks' exact
    float32 weights (``gguf.quants``' dequantization, bit for bit)."""
    from engine_triton.kernels.fused_moe import DecodeConfig, GroupedConfig, fused_moe_wna16

    t, e, k, h, i, gate_up, down, dtype, _ = GGUF_CASES[case]
    q13, s13, o13, bits, w13 = gguf_experts(e, 2 * i, h, gate_up, seed)
    q2, s2, o2, bits2, w2 = gguf_experts(e, h, i, down, seed + 1)
    x = torch.randn(t, h).to(dtype)
    weights, ids = route(t, e, k)
    args = (x, q13, q2, weights, ids, s13, s2, None, None, bits, None, None, o13, o2, bits2)
    expected = ref.fused_moe_wna16(*args)
    close(expected, ref.fused_moe(x, w13, w2, weights, ids), dtype, f"{seed} {case} exact")
    out = fused_moe_wna16(
        *(a.to(device) if isinstance(a, torch.Tensor) else a for a in args),
        variant=variant,
        decode_config=DecodeConfig(**DECODE),
        config=GroupedConfig(**{**GROUPED, "block_k": 32}),
    )
    slack = None
    if dtype == torch.float32:
        # The kernels fold each group's offset in as s (x . q) + o sum(x): float32 rounds those
        # terms, which are on the scale of the largest outputs, not of a small one (seed
        # 218234983: 1.7e-5 off at outputs up to 5.05, against 1e-5). One rounding of the
        # largest output, then.
        slack = torch.full(expected.shape, ONE_ROUNDING[dtype]) * expected.abs().max().cpu()
    close(out, expected, dtype, f"{seed} {case} {variant}", slack)


def test_gguf_moe_layers_run_the_triton_kernel_on_gpu_platforms(device, seed):
    """With engine-triton registered, a GGUF MoE layer on CUDA/ROCm takes the fused kernel
    (``GGUFConfig.get_moe_method``: integer form), and the layer built on its kernels (a Q4_K_M
    stack set: 4-bit gate/up, Q6_K down) equals the same layer on the torch reference."""
    from types import SimpleNamespace

    from engine.benchmarks.gguf_moe_cpu import build_gguf_moe_layer
    from engine.kernels.registry import KernelRegistry
    from engine.quantization.base import QuantizationSpec
    from engine.quantization.gguf import GGUFConfig
    from engine.quantization.gguf_moe import GGUFMoEMethod
    from engine_triton.kernels import register

    registry = KernelRegistry()
    register(registry)
    types = ("Q4_K", "Q4_K", "Q6_K")
    names = {f"m.experts.{p}_proj": t for p, t in zip(("gate", "up", "down"), types, strict=True)}
    for platform in ("cuda", "rocm"):
        config = GGUFConfig(names)
        config.bind(QuantizationSpec(platform=platform, device_type="cuda"))
        kernels = registry.resolve(platform)
        method = config.get_moe_method(SimpleNamespace(kernels=kernels), "m.experts")
        assert isinstance(method, GGUFMoEMethod) and method.integer
    built = {}
    for name, kernels in (
        ("triton", registry.resolve("cuda")),
        ("ref", KernelRegistry().resolve("cpu")),
    ):
        with torch.device(device if name == "triton" else "cpu"):
            built[name], _ = build_gguf_moe_layer(
                types, experts=4, hidden=256, inter=256, top_k=2, seed=seed % 1000,
                kernels=kernels, integer=True, dtype=torch.bfloat16,
            )  # fmt: skip
    x = torch.randn(3, 256).to(torch.bfloat16)
    weights, ids = route(3, 4, 2)
    with torch.inference_mode():
        want = built["ref"].quant_method.apply(built["ref"], x, weights, ids)
        got = built["triton"].quant_method.apply(
            built["triton"], x.to(device), weights.to(device), ids.to(device)
        )
    close(got, want, torch.bfloat16, f"{seed}")
