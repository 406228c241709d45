"""CPU implementations of the quantized matmuls (``engine.kernels.quantized`` is their spec).

* ``wna16_linear``: 4-bit weights are repacked at load into the tiles of torch's CPU int4
  kernel (``_convert_weight_to_int4pack_for_cpu``, then ``_weight_int4pack_mm_for_cpu`` per
  call, which dequantizes in registers); symmetric per-channel 8-bit weights go to
  ``_weight_int8pack_mm``. Both keep the weights packed (0.5 / 1 byte per weight). The int4
  kernel computes ``(q - 8) * s + m`` per group, so a zero point ``z`` becomes
  ``m = (8 - z) * s``; it takes groups of 32/64/128/256 (a larger group is the same scale
  repeated) and a multiple of 16 output features (others are padded with zero rows). Other
  layouts (8-bit groups, asymmetric 8-bit) run the reference, which dequantizes per call.
* ``int8_linear``: activations quantized per token in torch, the product in int32 by
  ``torch._int_mm`` (exact), scaled in float32.
* ``fp8_linear`` / ``fp8_block_linear``: the CPU has no FP8 arithmetic; the weight-only path
  converts the e4m3 weights to the activation dtype per call (per-channel scales applied to the
  product, block scales to the weight). With ``activation_quant`` (W8A8 asked for explicitly)
  the reference runs.

Measured on this project's 2-core Zen 4 (``python -m engine.benchmarks.quant_cpu``; see
docs/benchmarks.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels import quantized as reference

INT4_GROUPS = (256, 128, 64, 32)


def _int4_group(group_size: int, k: int) -> int | None:
    """The int4 kernel's group size for a checkpoint group (the same scales repeated), or None
    when the kernel cannot take it."""
    for g in INT4_GROUPS:
        if group_size % g == 0 and k % g == 0:
            return g
    return None


class CpuWNA16Linear:
    """``wna16_linear`` on the CPU (see the module docstring)."""

    def prepack(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        *,
        bits: int,
        group_size: int,
        perm: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> dict[str, torch.Tensor]:
        n, k = qweight.shape
        dtype = dtype or torch.float32
        packed: dict[str, torch.Tensor] = {}
        g = _int4_group(group_size, k) if bits == 4 else None
        if g is not None:
            reps = group_size // g
            s = scales.float().repeat_interleave(reps, dim=1)  # [N, K / g]
            z = zeros.float().repeat_interleave(reps, dim=1)
            pad = -n % 16
            q = qweight.to(torch.int32)
            if pad:
                q = torch.cat([q, torch.full((pad, k), 8, dtype=torch.int32)])
                s = torch.cat([s, torch.zeros(pad, s.shape[1])])
                z = torch.cat([z, torch.full((pad, z.shape[1]), 8.0)])
            sz = torch.stack((s, (8.0 - z) * s), dim=-1).transpose(0, 1)  # [K / g, N, 2]
            packed["int4"] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
            packed["scales_zeros"] = sz.to(dtype).contiguous()
            packed["out_features"] = torch.tensor(n)
        elif bits == 8 and group_size == k and bool((zeros == 128).all()):
            packed["int8"] = (qweight.to(torch.int16) - 128).to(torch.int8).contiguous()
            packed["int8_scales"] = scales.reshape(n).to(dtype).contiguous()
        else:
            return reference.wna16_linear.prepack(
                qweight, scales, zeros, bits=bits, group_size=group_size, perm=perm, dtype=dtype
            )
        if perm is not None:
            packed["perm"] = perm.to(torch.int64)
        return packed

    def __call__(
        self,
        x: torch.Tensor,
        packed: dict[str, torch.Tensor],
        *,
        bits: int,
        group_size: int,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if "int4" not in packed and "int8" not in packed:
            return reference.wna16_linear(x, packed, bits=bits, group_size=group_size, bias=bias)
        x2 = reference.wna16_activations(x, packed)
        if "int4" in packed:
            sz = packed["scales_zeros"]
            k = packed["int4"].shape[1] * 2
            x2 = x2.to(sz.dtype).contiguous()
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed["int4"], k // sz.shape[0], sz)
            n = int(packed["out_features"])
            if y.shape[-1] != n:
                y = y[:, :n]
        else:
            scales = packed["int8_scales"]
            y = torch._weight_int8pack_mm(x2.to(scales.dtype).contiguous(), packed["int8"], scales)
        return reference.finish_linear(y, bias, x)


wna16_linear = CpuWNA16Linear()


def int8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    input_zero_point: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """See ``engine.kernels.quantized.int8_linear``; the integer product by ``torch._int_mm``."""
    q, sx = reference.int8_quantize_activations(
        x.reshape(-1, x.shape[-1]), input_scale, input_zero_point
    )
    acc = torch._int_mm(q.to(torch.int8), weight.t())
    if input_scale is not None and input_zero_point is not None:
        # (q - zp) @ W^T = q @ W^T - zp * rowsum(W): q - zp may leave the int8 range.
        zp = input_zero_point.to(torch.int32).reshape(1, 1)
        acc = acc - zp * weight.sum(dim=1, dtype=torch.int32)
    y = acc.float() * sx * weight_scale.float().reshape(1, -1)
    return reference.finish_linear(y, bias, x)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation_quant: bool = True,
) -> torch.Tensor:
    """See ``engine.kernels.quantized.fp8_linear``: weight-only in the activation dtype."""
    if activation_quant:
        return reference.fp8_linear(x, weight, weight_scale, input_scale, bias, True)
    y = F.linear(x, weight.to(x.dtype)) * weight_scale.to(x.dtype)
    return y + bias if bias is not None else y


def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block_size: tuple[int, int] | list[int],
    bias: torch.Tensor | None = None,
    activation_quant: bool = True,
) -> torch.Tensor:
    """See ``engine.kernels.quantized.fp8_block_linear``: weight-only in the activation
    dtype (the block scales applied to the converted weight)."""
    if activation_quant:
        return reference.fp8_block_linear(x, weight, weight_scale_inv, block_size, bias, True)
    n, k = weight.shape
    scale = reference.expand_block_scales(weight_scale_inv.to(x.dtype), block_size, n, k)
    return F.linear(x, weight.to(x.dtype) * scale, bias)


from engine_cpu.gguf import gguf_linear  # noqa: E402  (after this module's own kernels)

QUANTIZED_KERNELS = {
    "gguf_linear": gguf_linear,
    "wna16_linear": wna16_linear,
    "int8_linear": int8_linear,
    "fp8_linear": fp8_linear,
    "fp8_block_linear": fp8_block_linear,
}
