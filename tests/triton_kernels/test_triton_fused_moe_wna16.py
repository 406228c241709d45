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
from kernel_tolerance import close
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
