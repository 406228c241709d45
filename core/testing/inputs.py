"""Random inputs for the conformance checks: kernel arguments and multi-step paged-attention
batches that follow the conventions in ``engine.attention_backends.interface``."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.attention_backends.interface import BatchLayout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# (rtol, atol) per compute dtype. Kernels compare against the reference computed on the CPU in
# the same dtype; attention against the reference computed in float32 from the same inputs.
KERNEL_TOLERANCE = {"float32": (1e-4, 1e-4), "bfloat16": (2e-2, 2e-2), "float16": (2e-3, 2e-3)}
ATTENTION_TOLERANCE = {"float32": (1e-3, 1e-3), "bfloat16": (3e-2, 3e-2), "float16": (4e-3, 4e-3)}


def rope_cache(max_position: int, rot_dim: int, base: float = 10000.0) -> torch.Tensor:
    """A float32 ``[max_position, rot_dim]`` cos/sin cache in the layout the kernels expect."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


@dataclass(frozen=True)
class KernelInputs:
    """How the conformance kit checks one named kernel: ``cases(dtype, gen)`` returns
    ``(case id, args)`` pairs on the CPU (the kit moves tensors to the device and calls the
    reference with copies); ``in_place`` are the positions of arguments the kernel writes
    (judged by what it writes, not by its return value); ``kind`` groups it in reports
    (``"kernel"``, ``"moe"``, ...)."""

    name: str
    cases: Callable[[torch.dtype, torch.Generator], list[tuple[str, tuple]]]
    in_place: tuple[int, ...] = ()
    kind: str = "kernel"


KERNEL_INPUTS: dict[str, KernelInputs] = {}


def register_kernel_inputs(
    name: str,
    cases: Callable[[torch.dtype, torch.Generator], list[tuple[str, tuple]]],
    *,
    in_place: tuple[int, ...] = (),
    kind: str = "kernel",
) -> None:
    """Teach the conformance kit a named kernel (see ``KernelInputs``). Every name in
    ``engine.kernels.registry.KERNEL_NAMES`` must have inputs here (a test checks it), so a new
    kernel — the MoE kernels, say — is checked in every plugin that overrides it."""
    if name in KERNEL_INPUTS:
        raise ValueError(f"conformance inputs for kernel {name!r} are registered twice")
    KERNEL_INPUTS[name] = KernelInputs(name, cases, tuple(in_place), kind)


def kernel_cases(name: str, dtype: torch.dtype, gen: torch.Generator) -> list[tuple[str, tuple]]:
    """``(case id, args)`` pairs for kernel ``name``, on the CPU (the caller moves tensors)."""
    try:
        inputs = KERNEL_INPUTS[name]
    except KeyError:
        raise KeyError(
            f"the conformance kit has no inputs for kernel {name!r}; register them with "
            "engine.testing.inputs.register_kernel_inputs"
        ) from None
    return inputs.cases(dtype, gen)


def _randn(gen: torch.Generator, dtype: torch.dtype, *shape: int, scale: float = 1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _weight(gen: torch.Generator, dtype: torch.dtype, h: int) -> torch.Tensor:
    return (1.0 + 0.1 * torch.randn(h, generator=gen)).to(dtype)


def _rms_norm_cases(dtype, gen):
    return [
        (f"T{t}-H{h}", (_randn(gen, dtype, t, h), _weight(gen, dtype, h), 1e-6))
        for t, h in ((7, 64), (1, 256))
    ]


def _fused_add_rms_norm_cases(dtype, gen):
    return [
        (
            f"T{t}-H{h}",
            (_randn(gen, dtype, t, h), _randn(gen, dtype, t, h), _weight(gen, dtype, h), 1e-6),
        )
        for t, h in ((7, 64), (1, 256))
    ]


def _rotary_cases(dtype, gen):
    cases = []
    for is_neox in (True, False):
        for rot_dim in (64, 32):  # full and partial rotary
            positions = torch.randint(0, 64, (5,), generator=gen, dtype=torch.int64)
            args = (
                positions,
                _randn(gen, dtype, 5, 4 * 64),
                _randn(gen, dtype, 5, 2 * 64),
                rope_cache(64, rot_dim),
                64,
                is_neox,
            )
            cases.append((f"neox{int(is_neox)}-rot{rot_dim}", args))
    return cases


def _qk_norm_rotary_cases(dtype, gen):
    # q and k are column slices of one fused qkv output (strided rows), 4 query / 2 KV heads.
    cases = []
    for norm in (True, False):
        for is_neox, rot_dim in ((True, 64), (False, 64), (True, 32)):
            qkv = _randn(gen, dtype, 5, (4 + 2 * 2) * 64)
            positions = torch.randint(0, 64, (5,), generator=gen, dtype=torch.int64)
            weights = (_weight(gen, dtype, 64), _weight(gen, dtype, 64)) if norm else (None, None)
            args = (
                positions,
                qkv[:, : 4 * 64],
                qkv[:, 4 * 64 : 6 * 64],
                rope_cache(64, rot_dim),
                64,
                is_neox,
                *weights,
                1e-6,
            )
            cases.append((f"norm{int(norm)}-neox{int(is_neox)}-rot{rot_dim}", args))
    return cases


def _gated_activation_cases(dtype, gen):
    return [(f"T{t}-I{i}", (_randn(gen, dtype, t, 2 * i),)) for t, i in ((7, 48), (1, 128))]


# ---- FP8 from the norm / activation: inputs whose results are exact in e4m3 -------------------
# The fused ops quantize their own output, so a 1-ulp difference in that output between two
# correct implementations (a bf16 rounding, the GPU's rsqrt) could move an e4m3 value a whole
# step. These inputs make every intermediate exact: rows of +-c with c a power of two and
# eps = 0 normalise to exactly +-1, so the normed row is +-weight; the weight (and SiLU's up
# half, with gate 32 or 64 where silu(gate) == gate in float32) are e4m3 values times a power
# of two with +-448 in every row, so the scale is a power of two and every quotient is e4m3.
# Random inputs are checked bit-for-bit against each plugin's own unfused ops in its tests.
def _fp8_exact_weight(gen: torch.Generator, dtype: torch.dtype, h: int) -> torch.Tensor:
    return (_fp8_rows(1, h, gen)[0].float() * 2.0**-8).to(dtype)


def _unit_rows(gen: torch.Generator, t: int, h: int) -> torch.Tensor:
    sign = torch.where(torch.rand(t, h, generator=gen) < 0.5, -1.0, 1.0)
    return sign * _pow2((t, 1), -2, 3, gen)


def _rms_norm_quant_fp8_cases(dtype, gen):
    return [
        (f"T{t}-H{h}", (_unit_rows(gen, t, h).to(dtype), _fp8_exact_weight(gen, dtype, h), 0.0))
        for t, h in ((7, 96), (1, 256))
    ]


def _fused_add_rms_norm_quant_fp8_cases(dtype, gen):
    cases = []
    for t, h in ((7, 96), (1, 256)):
        summed = _unit_rows(gen, t, h)
        x = summed * (torch.randint(1, 4, (t, h), generator=gen).float() / 4)
        args = (x.to(dtype), (summed - x).to(dtype), _fp8_exact_weight(gen, dtype, h), 0.0)
        cases.append((f"T{t}-H{h}", args))
    return cases


def _silu_and_mul_quant_fp8_cases(dtype, gen):
    cases = []
    for t, i in ((7, 48), (1, 128), (3, 200)):
        gate = _pow2((t, 1), 5, 7, gen).expand(t, i)
        up = _fp8_rows(t, i, gen).float() * _pow2((t, 1), -9, -6, gen)
        cases.append((f"T{t}-I{i}", (torch.cat([gate, up], dim=-1).to(dtype),)))
    return cases


def _write_kv_cache_cases(dtype, gen):
    num_blocks, block_size, kv_heads, head = 5, 8, 2, 32  # an odd number of blocks
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:6].to(torch.int64)
    slots[3] = -1  # a padding token: must not be written
    cache = _randn(gen, dtype, 2, num_blocks, block_size, kv_heads, head)
    args = (_randn(gen, dtype, 6, kv_heads, head), _randn(gen, dtype, 6, kv_heads, head))
    cases = [("T6-pad", (*args, cache, slots))]
    # An FP8 cache with per-layer scales: values e4m3-exact after the (power-of-two)
    # scaling, some past +-448 to check saturation.
    k = (_fp8_rows(6, kv_heads * head, gen).float() * 2.0**-3).view(6, kv_heads, head)
    v = (_fp8_rows(6, kv_heads * head, gen).float() * 2.0**-2).view(6, kv_heads, head)
    v[0, 0, :4] = 1000.0
    fp8_cache = torch.zeros(2, num_blocks, block_size, kv_heads, head).to(torch.float8_e4m3fn)
    args = (k.to(dtype), v.to(dtype), fp8_cache, slots.clone(), 2.0**-3, 2.0**-2)
    cases.append(("T6-pad-fp8-scaled", args))
    return cases


def _linear_cases(dtype, gen):
    # Decode-sized (the Triton override's skinny kernel) and prefill-sized rows; odd sizes.
    cases = []
    for t, n, k, bias in ((3, 40, 72, True), (1, 33, 64, False), (20, 24, 48, True)):
        args = (
            _randn(gen, dtype, t, k),
            _randn(gen, dtype, n, k, scale=k**-0.5),
            _randn(gen, dtype, n) if bias else None,
        )
        cases.append((f"T{t}-N{n}-K{k}-bias{int(bias)}", args))
    return cases


def _argmax_cases(dtype, gen):
    # Odd vocabularies; a tie planted far apart (the first index wins), an all -inf row
    # (index 0), and rows of a padded-vocabulary view (row stride != V).
    cases = []
    for n, v in ((1, 4099), (5, 1000), (17, 333)):
        x = _randn(gen, dtype, n, v)
        x[0, v // 3] = x[0, v - 2] = x[0].max() + 1
        if n > 1:
            x[1] = float("-inf")
        cases.append((f"N{n}-V{v}", (x,)))
    cases.append(("N3-V999-view", (_randn(gen, dtype, 3, 1024)[:, :999],)))
    return cases


def _moe_topk_softmax_cases(dtype, gen):
    # Distinct logits, exactly representable in every dtype (multiples of 1/8 below 8), so
    # the chosen experts are unambiguous and must match exactly.
    cases = []
    for t, e, k, renorm in ((5, 8, 2, True), (3, 64, 8, False), (1, 60, 6, True)):
        logits = torch.stack([torch.randperm(e, generator=gen) for _ in range(t)])
        logits = ((logits - e // 2).float() / 8).to(dtype)
        cases.append((f"T{t}-E{e}-top{k}-renorm{int(renorm)}", (logits, k, renorm)))
    return cases


def _moe_routing(gen: torch.Generator, t: int, e: int, k: int) -> tuple[torch.Tensor, ...]:
    """Top-``k`` routing of ``t`` tokens over ``e`` experts, renormalised: expert 1 popular,
    the last never chosen, token 0's last choice held by another expert-parallel rank (-1)."""
    scores = torch.rand(t, e, generator=gen)
    scores[:, 1] += 0.5  # a popular expert
    scores[:, e - 1] = -1.0  # never chosen
    weights, ids = torch.topk(scores, k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).float()
    ids = ids.to(torch.int32)
    ids[0, -1] = -1  # held elsewhere
    return weights, ids


def _fused_moe_cases(dtype, gen):
    # Odd sizes; experts that get no token, one expert that gets most of them, and choices
    # held by another expert-parallel rank (-1); decode-sized and prefill-sized batches.
    cases = []
    for t, e, k, h, i in ((3, 8, 2, 40, 24), (1, 16, 8, 64, 48), (33, 8, 2, 48, 40)):
        x = _randn(gen, dtype, t, h)
        w13 = _randn(gen, dtype, e, 2 * i, h, scale=h**-0.5)
        w2 = _randn(gen, dtype, e, h, i, scale=i**-0.5)
        weights, ids = _moe_routing(gen, t, e, k)
        cases.append((f"T{t}-E{e}-top{k}-H{h}-I{i}", (x, w13, w2, weights, ids)))
    return cases


def _fused_moe_biased_cases(dtype, gen):
    # Both activations, with and without biases; gate/up values large enough (scale 2) that
    # GPT-OSS's clamp at +-limit (here 2.0, so that it bites) is exercised on both sides.
    cases = []
    for t, e, k, h, i in ((3, 8, 2, 40, 24), (17, 4, 4, 32, 16)):
        x = _randn(gen, dtype, t, h)
        w13 = _randn(gen, dtype, e, 2 * i, h, scale=2 * h**-0.5)
        w2 = _randn(gen, dtype, e, h, i, scale=i**-0.5)
        b13 = _randn(gen, dtype, e, 2 * i)
        b2 = _randn(gen, dtype, e, h)
        weights, ids = _moe_routing(gen, t, e, k)
        for act in ("swigluoai", "silu"):
            args = (x, w13, w2, weights, ids, b13, b2, act, 1.702, 2.0)
            cases.append((f"T{t}-E{e}-top{k}-{act}-bias", args))
        cases.append((f"T{t}-E{e}-top{k}-swigluoai", (x, w13, w2, weights, ids, None, None,
                                                       "swigluoai", 1.702, 2.0)))  # fmt: skip
    return cases


def _mxfp4_experts(gen, e, n, k):
    """Random MXFP4 experts [E, N, K]: every byte value, exponents 2**-6 .. 2**-2."""
    blocks = torch.randint(0, 256, (e, n, k // 2), generator=gen, dtype=torch.uint8)
    scales = torch.randint(121, 126, (e, n, k // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


def _fused_moe_mxfp4_cases(dtype, gen):
    # Random E2M1 codes (every byte value) with exponents around 2**-4, so gate/up reach the
    # clamp (limit 2.0 here); sizes whose rows hold one and three blocks of 32; biases on and
    # off, both activations.
    cases = []
    for t, e, k, h, i in ((3, 8, 2, 32, 64), (17, 4, 4, 96, 32)):
        x = _randn(gen, dtype, t, h)

        w13, s13 = _mxfp4_experts(gen, e, 2 * i, h)
        w2, s2 = _mxfp4_experts(gen, e, h, i)
        b13 = _randn(gen, dtype, e, 2 * i)
        b2 = _randn(gen, dtype, e, h)
        weights, ids = _moe_routing(gen, t, e, k)
        for act in ("swigluoai", "silu"):
            args = (x, w13, w2, weights, ids, s13, s2, b13, b2, act, 1.702, 2.0)
            cases.append((f"T{t}-E{e}-top{k}-H{h}-I{i}-{act}-bias", args))
        args = (x, w13, w2, weights, ids, s13, s2, None, None, "swigluoai", 1.702, 2.0)
        cases.append((f"T{t}-E{e}-top{k}-H{h}-I{i}-swigluoai", args))
    return cases


def _fp8_expert_scales(gen, e, n, k, std, block, slices=1):
    """Positive float32 scales of FP8 experts ``[E, N, K]`` whose e4m3 values have std 64:
    per channel ``[E, N]``, or per block (``block`` rows per ``slices`` part, see
    ``engine.kernels.quantized.dequantize_fp8_experts``)."""
    if block is None:
        shape: tuple[int, ...] = (e, n)
    else:
        bn, bk = block
        shape = (e, slices * -(-(n // slices) // bn), -(-k // bk))
    return (std / 64.0) * (0.5 + torch.rand(shape, generator=gen))


def _fused_moe_fp8_cases(dtype, gen):
    # FP8 experts with per-channel or block scales (128x128 as real checkpoints, with sizes
    # that leave partial blocks; a small block so every expert has several), and the routing
    # of the unquantized cases: idle experts, a popular one, a choice held elsewhere.
    cases = []
    for t, e, k, h, i, block in (
        (3, 8, 2, 40, 24, None),
        (1, 16, 8, 64, 48, (128, 128)),
        (33, 8, 2, 48, 40, (16, 32)),
        (5, 4, 2, 160, 72, (128, 128)),
    ):
        x = _randn(gen, dtype, t, h)
        w13 = (torch.randn(e, 2 * i, h, generator=gen) * 64).clamp(-448, 448)
        w2 = (torch.randn(e, h, i, generator=gen) * 64).clamp(-448, 448)
        w13, w2 = w13.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn)
        s13 = _fp8_expert_scales(gen, e, 2 * i, h, h**-0.5, block, slices=2)
        s2 = _fp8_expert_scales(gen, e, h, i, i**-0.5, block)
        weights, ids = _moe_routing(gen, t, e, k)
        how = "channel" if block is None else f"block{block[0]}x{block[1]}"
        cases.append(
            (f"T{t}-E{e}-top{k}-H{h}-I{i}-{how}", (x, w13, w2, weights, ids, s13, s2, block))
        )
    return cases


def _wna16_experts(gen, e, n, k, bits, group, symmetric):
    """Random ``fused_moe_wna16`` experts ``[E, N, K]``: packed int32 values, float16 scales
    per ``group`` input features (-1: the row) giving dequantized weights of std ~K^-0.5, and
    uint8 zero points (None when ``symmetric``) near the middle of the range, as min-max
    quantization of centred weights gives them (zero points anywhere in the range made the
    weights' mean far from 0 and outputs up to ~17 for unit inputs, where bf16's rounding of
    the intermediates alone exceeds the kit's absolute tolerance)."""
    from engine.kernels.quantized import pack_int32

    maxq = (1 << bits) - 1
    groups = 1 if group == -1 else k // group
    q = torch.randint(0, maxq + 1, (e, n, k), generator=gen, dtype=torch.uint8)
    std = {4: 4.6, 8: 74.0}[bits]
    scales = (k**-0.5 / std) * (0.5 + torch.rand(e, n, groups, generator=gen))
    zeros = None
    if not symmetric:
        mid, spread = (maxq + 1) // 2, (maxq + 1) // 8
        zeros = torch.randint(mid - spread, mid + spread + 1, (e, n, groups), generator=gen)
        zeros = zeros.to(torch.uint8)
    return pack_int32(q, bits, dim=2), scales.to(torch.float16), zeros


def _fused_moe_wna16_cases(dtype, gen):
    # 4- and 8-bit experts, groups of 32/64/128 and one per row, symmetric (no zero points)
    # and with zero points; odd token counts and the routing of the unquantized cases (idle
    # experts, a popular one, a choice held elsewhere).
    # Act-order experts: every expert's input features in an order of its own.
    cases = []
    for t, e, k, h, i, bits, group, sym, act_order in (
        (3, 8, 2, 64, 32, 4, 32, False, False),
        (1, 16, 8, 128, 64, 4, 64, True, False),
        (33, 8, 2, 128, 128, 4, 128, False, False),
        (2, 8, 2, 64, 40, 4, -1, False, False),
        (5, 4, 2, 64, 96, 8, 32, False, False),
        (1, 8, 2, 64, 64, 8, 64, True, False),
        (7, 8, 2, 64, 64, 4, 32, False, True),
    ):
        x = _randn(gen, dtype, t, h)
        q13, s13, z13 = _wna16_experts(gen, e, 2 * i, h, bits, group, sym)
        q2, s2, z2 = _wna16_experts(gen, e, h, i, bits, group, sym)
        weights, ids = _moe_routing(gen, t, e, k)
        how = f"w{bits}-g{group}-{'sym' if sym else 'zp'}" + ("-act-order" if act_order else "")
        args: tuple = (x, q13, q2, weights, ids, s13, s2, z13, z2, bits)
        if act_order:
            perms = [
                torch.stack([torch.randperm(n, generator=gen) for _ in range(e)]) for n in (h, i)
            ]
            args += tuple(p.to(torch.int32) for p in perms)
        cases.append((f"T{t}-E{e}-top{k}-H{h}-I{i}-{how}", args))
    # GGUF experts as a GPU runs them (``engine.kernels.gguf.integer_planes``): float offsets
    # instead of zero points, the down projection in its own width (Q4_K_M: Q4_K gate/up in 4
    # bits, groups of 32; Q6_K down in bytes, groups of 16).
    from engine.kernels import gguf
    from engine.testing.tiny_gguf import random_blocks

    t, e, k, h, i = 3, 4, 2, 256, 256
    planes = []
    for name, rows, cols in (("Q4_K", 2 * i, h), ("Q6_K", h, i)):
        qt = gguf.gguf_type(name)
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
        raw = torch.from_numpy(random_blocks(e * rows, cols, name, seed=seed).copy())
        planes.append(gguf.integer_planes(raw.view(e, rows, -1, qt.type_size), name))
    (q13, s13, o13), (q2, s2, o2) = planes
    weights, ids = _moe_routing(gen, t, e, k)
    args = (_randn(gen, dtype, t, h), q13, q2, weights, ids, s13, s2, None, None, 4, None, None,
            o13, o2, 8)  # fmt: skip
    cases.append((f"T{t}-E{e}-top{k}-H{h}-I{i}-gguf-q4k-q6k", args))
    return cases


# ---- the quantized matmuls --------------------------------------------------------------------
# Inputs are built so that quantizing the activations is exact (every row's largest magnitude
# is the type's maximum and scales are powers of two): an implementation that computes the
# dynamic scale a little differently (a reciprocal, a fused reduction) still rounds every
# element the same way, and the comparison measures the product alone.
def _fp8_rows(rows: int, cols: int, gen: torch.Generator, group: int | None = None):
    """Random e4m3 values with +-448 in every row (every ``group``-wide group of a row)."""
    values = (torch.randn(rows, cols, generator=gen) * 96).clamp(-448, 448)
    width = group or cols
    for start in range(0, cols, width):
        pos = torch.randint(start, start + width, (rows,), generator=gen)
        sign = torch.where(torch.rand(rows, generator=gen) < 0.5, -1.0, 1.0)
        values[torch.arange(rows), pos] = 448.0 * sign
    return values.to(torch.float8_e4m3fn)


def _pow2(shape: tuple[int, ...], lo: int, hi: int, gen: torch.Generator) -> torch.Tensor:
    return torch.pow(2.0, torch.randint(lo, hi, shape, generator=gen).float())


def _fp8_linear_cases(dtype: torch.dtype, gen: torch.Generator) -> list[tuple[str, tuple]]:
    cases = []
    # (rows, N, K, per-channel weight scale, static input scale, W8A8, bias)
    for t, n, k, channel, static, act, bias in (
        (3, 40, 64, True, False, True, True),
        (1, 33, 64, False, False, True, False),
        (20, 24, 96, True, True, True, True),
        (17, 48, 128, True, False, True, False),
        (5, 32, 64, True, False, False, True),
    ):
        weight = _fp8_rows(n, k, gen)
        w_scale = _pow2((n,) if channel else (1,), -12, -9, gen)
        if static:
            s = 2.0**-5
            xq = (torch.randn(t, k, generator=gen) * 96).clamp(-448, 448).to(torch.float8_e4m3fn)
            x, input_scale = (xq.float() * s).to(dtype), torch.tensor([s])
        else:
            x = (_fp8_rows(t, k, gen).float() * _pow2((t, 1), -7, -4, gen)).to(dtype)
            input_scale = None
        b = torch.randn(n, generator=gen).to(dtype) if bias else None
        case = f"T{t}-N{n}-K{k}-{'ch' if channel else 'tensor'}-{'static' if static else 'dyn'}"
        cases.append(
            (case + ("" if act else "-weight-only"), (x, weight, w_scale, input_scale, b, act))
        )
    return cases


def _fp8_block_cases(dtype: torch.dtype, gen: torch.Generator) -> list[tuple[str, tuple]]:
    cases = []
    for t, n, k, (bn, bk), act in (
        (3, 64, 128, (32, 32), True),
        (1, 40, 64, (16, 32), True),
        (18, 32, 64, (32, 32), True),
        (4, 32, 64, (32, 32), False),
    ):
        weight = _fp8_rows(n, k, gen)
        scale = _pow2((-(-n // bn), k // bk), -12, -9, gen)
        x = (
            _fp8_rows(t, k, gen, group=bk).float()
            * _pow2((t, k // bk), -7, -4, gen).repeat_interleave(bk, 1)
        ).to(dtype)
        case = f"T{t}-N{n}-K{k}-b{bn}x{bk}" + ("" if act else "-weight-only")
        cases.append((case, (x, weight, scale, (bn, bk), None, act)))
    return cases


def _int8_linear_cases(dtype: torch.dtype, gen: torch.Generator) -> list[tuple[str, tuple]]:
    cases = []
    for t, n, k, channel, static, zero in (
        (3, 40, 64, True, False, False),
        (1, 33, 64, False, False, False),
        (20, 24, 96, True, True, False),
        (6, 32, 64, True, True, True),
    ):
        weight = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        w_scale = _pow2((n,) if channel else (1,), -12, -9, gen)
        if static:
            s = 2.0**-5
            zp = torch.tensor([5], dtype=torch.int32) if zero else None
            q = torch.randint(-128, 128, (t, k), generator=gen)
            x = ((q - (5 if zero else 0)).float() * s).to(dtype)
            args = (x, weight, w_scale, torch.tensor([s]), zp, None)
        else:
            q = torch.randint(-126, 127, (t, k), generator=gen).float()
            q[torch.arange(t), torch.randint(0, k, (t,), generator=gen)] = 127.0
            x = (q * _pow2((t, 1), -7, -4, gen)).to(dtype)
            args = (x, weight, w_scale, None, None, torch.randn(n, generator=gen).to(dtype))
        kind = ("static-zp" if zero else "static") if static else "dyn"
        cases.append((f"T{t}-N{n}-K{k}-{'ch' if channel else 'tensor'}-{kind}", args))
    return cases


def _wna16_cases(dtype: torch.dtype, gen: torch.Generator) -> list[tuple[str, tuple]]:
    """Args ``(x, qweight, scales, zeros, bits, group_size, perm, bias)``: the canonical
    tensors ``prepack`` takes (see ``checks.call_kernel``)."""
    cases = []
    for t, n, k, bits, group, act_order, bias in (
        (3, 40, 64, 4, 32, False, True),  # N not a multiple of 16
        (1, 64, 128, 4, 64, False, False),
        (18, 48, 128, 4, 128, True, False),  # act-order permutation
        (2, 32, 64, 4, 64, False, True),  # one group per row (group_size -1)
        (5, 32, 64, 8, 32, False, False),
        (1, 48, 64, 8, 64, False, False),  # 8-bit per channel
    ):
        maxq = (1 << bits) - 1
        q = torch.randint(0, maxq + 1, (n, k), generator=gen, dtype=torch.uint8)
        groups = k // group
        scales = (torch.rand(n, groups, generator=gen) * 0.02 + 0.005).to(torch.float16)
        zeros = torch.randint(0, maxq + 1, (n, groups), generator=gen, dtype=torch.uint8)
        if bits == 8 and group == k:
            zeros.fill_(128)  # symmetric
        perm = torch.randperm(k, generator=gen) if act_order else None
        x = torch.randn(t, k, generator=gen).to(dtype)
        b = torch.randn(n, generator=gen).to(dtype) if bias else None
        case = f"T{t}-N{n}-K{k}-w{bits}-g{group}" + ("-act-order" if act_order else "")
        cases.append((case, (x, q, scales, zeros, bits, group, perm, b)))
    return cases


def _gguf_linear_cases(dtype: torch.dtype, gen: torch.Generator) -> list[tuple[str, tuple]]:
    """Args ``(x, blocks, qtype, bias)``: raw GGUF blocks ``uint8 [N, K / block, type_size]``
    of each kept type (random valid blocks, as ``engine.testing.tiny_gguf`` makes them; K a
    multiple of the K-quants' 256-value super-block), one and several rows, with and without a
    bias; ``checks.call_kernel`` runs ``prepack`` first."""
    from engine.kernels import gguf as ref
    from engine.testing.tiny_gguf import RANDOM_BLOCK_TYPES, random_blocks

    cases = []
    for name in RANDOM_BLOCK_TYPES:
        t = ref.gguf_type(name)
        for rows, n, k, bias in ((1, 40, 256, False), (5, 32, 512, True)):
            seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
            raw = random_blocks(n, k, name, seed=seed)
            blocks = torch.from_numpy(raw.copy()).view(n, k // t.block_size, t.type_size)
            x = torch.randn(rows, k, generator=gen).to(dtype)
            b = torch.randn(n, generator=gen).to(dtype) if bias else None
            cases.append((f"{name}-T{rows}-N{n}-K{k}", (x, blocks, t.ggml_type, b)))
    return cases


def _add_lora_linear_cases(dtype, gen):
    """Mixed batches: tokens of several adapter slots and tokens without one (-1), fused q/k/v
    and gate/up slices and a single one, odd sizes, decode- and prefill-sized batches, a rank
    padded past what the adapter uses (zero rows of A, zero columns of B)."""
    from engine.lora.mapping import group_by_slot

    cases = []
    for t, k, slices, rank, slots in (
        (1, 64, (40, 24, 24), 16, 4),
        (7, 72, (48,), 8, 3),
        (40, 48, (56, 56), 16, 4),
    ):
        n, s = sum(slices), len(slices)
        x = _randn(gen, dtype, t, k)
        lora_a = _randn(gen, dtype, slots, s * rank, k, scale=k**-0.5)
        lora_b = _randn(gen, dtype, slots, n, rank, scale=rank**-0.5)
        lora_a[:, -2:] = 0  # the last slice's padded rank
        lora_b[..., -2:] = 0
        token_slots = torch.randint(-1, slots, (t,), generator=gen, dtype=torch.int32)
        token_slots[0] = slots - 1  # the decode case has an adapter
        sorted_tokens, starts = group_by_slot(token_slots.numpy(), slots)
        args = (
            _randn(gen, dtype, t, n),
            x,
            lora_a,
            lora_b,
            token_slots,
            torch.from_numpy(sorted_tokens),
            torch.from_numpy(starts),
            slices,
        )
        cases.append((f"T{t}-K{k}-N{'+'.join(map(str, slices))}-R{rank}-L{slots}", args))
    return cases


def _lora_expand_augmented_cases(dtype, gen):
    """The base GEMM's output with every slot's shrunk values appended; mixed slots and
    tokens without an adapter (their rows must come back unchanged)."""
    from engine.lora.mapping import group_by_slot

    cases = []
    for t, slices, rank, slots in (
        (1, (40, 24, 24), 16, 4),
        (9, (48,), 8, 3),
        (33, (56, 56), 16, 2),
    ):
        n, s = sum(slices), len(slices)
        y_aug = _randn(gen, dtype, t, n + slots * s * rank)
        lora_b = _randn(gen, dtype, slots, n, rank, scale=rank**-0.5)
        token_slots = torch.randint(-1, slots, (t,), generator=gen, dtype=torch.int32)
        token_slots[0] = slots - 1
        sorted_tokens, starts = group_by_slot(token_slots.numpy(), slots)
        args = (
            y_aug,
            n,
            lora_b,
            token_slots,
            torch.from_numpy(sorted_tokens),
            torch.from_numpy(starts),
            slices,
        )
        cases.append((f"T{t}-N{'+'.join(map(str, slices))}-R{rank}-L{slots}", args))
    return cases


register_kernel_inputs("rms_norm", _rms_norm_cases)
register_kernel_inputs("fused_add_rms_norm", _fused_add_rms_norm_cases)
register_kernel_inputs("rotary_embedding", _rotary_cases)
register_kernel_inputs("qk_norm_rotary", _qk_norm_rotary_cases, in_place=(1, 2))
register_kernel_inputs("silu_and_mul", _gated_activation_cases)
register_kernel_inputs("gelu_tanh_and_mul", _gated_activation_cases)
register_kernel_inputs("rms_norm_quant_fp8", _rms_norm_quant_fp8_cases)
register_kernel_inputs("fused_add_rms_norm_quant_fp8", _fused_add_rms_norm_quant_fp8_cases)
register_kernel_inputs("silu_and_mul_quant_fp8", _silu_and_mul_quant_fp8_cases)
register_kernel_inputs("write_kv_cache", _write_kv_cache_cases, in_place=(2,))
register_kernel_inputs("linear", _linear_cases)
register_kernel_inputs("argmax", _argmax_cases)
register_kernel_inputs("moe_topk_softmax", _moe_topk_softmax_cases, kind="moe")
register_kernel_inputs("fused_moe", _fused_moe_cases, kind="moe")
register_kernel_inputs("fused_moe_biased", _fused_moe_biased_cases, kind="moe")
register_kernel_inputs("fused_moe_mxfp4", _fused_moe_mxfp4_cases, kind="moe")
register_kernel_inputs("fused_moe_fp8", _fused_moe_fp8_cases, kind="moe")
register_kernel_inputs("fused_moe_wna16", _fused_moe_wna16_cases, kind="moe")
register_kernel_inputs("fp8_linear", _fp8_linear_cases)
register_kernel_inputs("fp8_block_linear", _fp8_block_cases)
register_kernel_inputs("int8_linear", _int8_linear_cases)
register_kernel_inputs("wna16_linear", _wna16_cases)  # canonical tensors: see checks.call_kernel
register_kernel_inputs("gguf_linear", _gguf_linear_cases)  # raw blocks: see checks.call_kernel
register_kernel_inputs("add_lora_linear", _add_lora_linear_cases, in_place=(0,), kind="lora")
register_kernel_inputs("lora_expand_augmented", _lora_expand_augmented_cases, kind="lora")


def to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return value


# fp8 KV-cache dtypes the kit knows (torch dtype names); a backend declares the ones it stores.
FP8_DTYPES = {
    name: getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
    if hasattr(torch, name)
}


@dataclass
class AttentionCase:
    """One attention configuration to check a backend on."""

    dtype: str
    num_heads: int = 4
    num_kv_heads: int = 2  # GQA
    head_size: int = 64
    block_size: int = 16
    sliding_window: int | None = None
    logit_softcap: float | None = None
    kv_cache_dtype: str | None = None  # None: the model dtype; else an FP8_DTYPES name
    # Attention sinks (GPT-OSS): random float32 per-head logits, some large (``attention_sinks``)
    attention_sinks: bool = False

    @property
    def id(self) -> str:
        parts = [
            self.dtype,
            f"H{self.num_heads}/{self.num_kv_heads}",
            f"D{self.head_size}",
            f"B{self.block_size}",
        ]
        if self.sliding_window:
            parts.append(f"window{self.sliding_window}")
        if self.logit_softcap:
            parts.append(f"softcap{self.logit_softcap:g}")
        if self.kv_cache_dtype:
            parts.append(f"kv-{self.kv_cache_dtype}")
        if self.attention_sinks:
            parts.append("sinks")
        return "-".join(parts)

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_size)


def attention_sinks(num_heads: int, gen: torch.Generator) -> torch.Tensor:
    """Random float32 sinks ``[num_heads]`` for the conformance cases: a few units around 0
    (comparable to the scores), the first large and positive (it takes nearly all of its head's
    weight: that head's output nearly vanishes) and, with two heads or more, the last large and
    negative (it changes nothing), the extremes a backend's softmax must survive."""
    sinks = torch.randn(num_heads, generator=gen) * 2.0
    sinks[0] = 20.0
    if num_heads > 1:
        sinks[-1] = -20.0
    return sinks.float()


@dataclass
class PagedBatchPlan:
    """A multi-step schedule over a shared block pool, as the model runner would produce it.

    Each step is a list of ``(request, num_new_tokens)`` with decodes (1 token) first.
    ``prefixes[req] = (other, n)`` makes ``req`` start with a cached prefix: the first ``n``
    (full) blocks of ``other``'s table, already written by ``other`` in an earlier step, as
    prefix caching shares them; its first chunk then starts at position ``n * block_size``.
    """

    block_size: int
    num_blocks: int
    steps: list[list[tuple[int, int]]]
    gen: torch.Generator
    prefixes: dict[int, tuple[int, int]] = field(default_factory=dict)
    _tables: dict[int, list[int]] = field(default_factory=dict)
    _lens: dict[int, int] = field(default_factory=dict)
    _free: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._free = torch.randperm(self.num_blocks, generator=self.gen).tolist()

    def layouts(self) -> list[BatchLayout]:
        """The ``BatchLayout`` of every step (allocating blocks in a shuffled order)."""
        out = []
        for step in self.steps:
            query_lens, seq_lens, tables, slots = [], [], [], []
            num_decodes = sum(1 for req, n in step if n == 1 and self._lens.get(req, 0) > 0)
            for req, n in step:
                if req not in self._tables and req in self.prefixes:
                    other, shared = self.prefixes[req]
                    assert self._lens[other] >= shared * self.block_size, "prefix not written"
                    self._tables[req] = list(self._tables[other][:shared])
                    self._lens[req] = shared * self.block_size
                start = self._lens.get(req, 0)
                table = self._tables.setdefault(req, [])
                while len(table) * self.block_size < start + n:
                    table.append(self._free.pop())
                for pos in range(start, start + n):
                    slots.append(
                        table[pos // self.block_size] * self.block_size + pos % self.block_size
                    )
                self._lens[req] = start + n
                query_lens.append(n)
                seq_lens.append(start + n)
                tables.append(list(table))
            out.append(
                BatchLayout(query_lens, seq_lens, tables, slots, self.block_size, num_decodes)
            )
        return out


def default_plan(block_size: int, gen: torch.Generator) -> PagedBatchPlan:
    """Four steps mixing full prefills, chunked prefill, a cached prefix, decodes and late
    arrivals, over a pool with an odd number of blocks allocated in shuffled order:

    1. prefill r0 (two full blocks and 3 more tokens), r1's first chunk (21), r2 (3);
    2. decode r0, r2; finish r1 (11 more); start r3 (6); start r4 on r0's first two blocks as
       a cached prefix with a chunk of 5 new tokens;
    3. decode r0..r3; r4's next chunk (4);
    4. decode all five.
    """
    r0 = 2 * block_size + 3
    steps = [
        [(0, r0), (1, 21), (2, 3)],
        [(0, 1), (2, 1), (1, 11), (3, 6), (4, 5)],
        [(0, 1), (1, 1), (2, 1), (3, 1), (4, 4)],
        [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1)],
    ]
    total = {0: r0 + 3, 1: 34, 2: 6, 3: 8, 4: 10}  # r4's new tokens only: its prefix is shared
    need = sum(-(-n // block_size) + 1 for n in total.values())
    num_blocks = need + 4
    num_blocks += 1 - num_blocks % 2  # odd
    return PagedBatchPlan(block_size, num_blocks, steps, gen, prefixes={4: (0, 2)})
