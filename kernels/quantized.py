"""Torch references of the quantized matmuls: the spec every override must match.

Each op computes ``x @ W^T + bias`` for one weight format, in float32, and returns ``x``'s
dtype. ``x`` is ``[..., K]`` (any leading shape); ``W`` is logically ``[N, K]``.

* ``fp8_linear`` — FP8 (e4m3) weights ``[N, K]`` with a per-tensor (``[1]``) or per-channel
  (``[N]``) float32 scale. With ``activation_quant`` (W8A8) the activations are quantized to
  e4m3 too: per token with a dynamic scale ``amax(|row|) / 448`` (``input_scale`` None), or
  with one static scale (``input_scale`` ``[1]``). Without it (weight-only, for devices with no
  FP8 arithmetic) ``x`` is multiplied as it is. An override may also take the weight-only
  product for a W8A8 call where quantizing the activations buys no speed (engine-triton does
  for decode batches of up to 16 rows): it is the more accurate of the two, and the
  conformance kit's activations are exact in e4m3, so both meet the reference there.
* ``fp8_block_linear`` — FP8 weights with one float32 scale per ``block_size = (bn, bk)``
  block (``weight_scale_inv`` ``[ceil(N / bn), ceil(K / bk)]``, the multiplier despite its
  checkpoint name), activations quantized per token and per ``bk``-wide group (dynamic).
* ``int8_linear`` — int8 weights ``[N, K]`` with a per-tensor / per-channel scale;
  activations quantized to int8 per token (dynamic, symmetric) or with a static scale and an
  optional zero point (asymmetric); the integer product is exact.
* ``wna16_linear`` — 4- or 8-bit integer weights in groups of ``group_size`` along K, each
  group with a scale and an integer zero point: ``W = (q - z) * s``, activations unquantized.
  It is the one op with its **own weight layout**: ``wna16_linear.prepack(...)`` turns the
  canonical tensors (below) into whatever the implementation multiplies, once at load, and
  ``wna16_linear(x, packed, ...)`` uses that. An override provides both (a callable object
  with a ``prepack`` method); the layer never looks inside ``packed``.

``fp8_linear`` also takes its activations already quantized (``Fp8Activation``: e4m3 values
and per-token dynamic scales, exactly what its own dynamic quantization of ``x`` would give),
so that the kernel producing ``x`` (an RMSNorm, SiLU-and-mul) can write e4m3 directly
(``*_quant_fp8`` ops in ``engine.kernels.reference``). An implementation that accepts one
says from how many rows with the attribute ``fp8_activation_min_rows`` on its callable (the
reference: 1; engine-triton: 17, since it multiplies up to 16 rows weight-only); a caller
passes one only from that many rows, and never to an implementation without the attribute.

Rounding to a quantized type is round-to-nearest-even with saturation at the type's range;
a dynamic scale is never below ``FP8_MIN_SCALE`` / ``INT8_MIN_SCALE`` (an all-zero row).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# The smallest dynamic FP8 scale (vLLM's): an all-zero row still gets a finite scale.
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
INT8_MIN_SCALE = 1e-10


# ---- activation quantization (what the ops do to x first) ------------------------------------
class Fp8Activation(NamedTuple):
    """Activations quantized to e4m3 per token by the kernel that produced them, handed to
    ``fp8_linear`` in place of ``x`` (W8A8 with dynamic per-token scales only).

    ``data``: e4m3, ``x``'s shape ``[..., K]``; ``scale``: float32 ``[M, 1]`` for the ``M``
    rows of ``data`` flattened, ``fp8_dynamic_scale`` of the unquantized rows; ``dtype``: the
    dtype ``x`` had, which the product is returned in. ``data * scale`` is exactly
    ``fp8_quantize(x, fp8_dynamic_scale(x)) * scale``: a linear gives the same result for
    either form of its input."""

    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        """The shape of the activations (that of ``data``)."""
        return self.data.shape

    def rows(self) -> torch.Tensor:
        """``data`` as ``[M, K]`` rows."""
        return self.data.reshape(-1, self.data.shape[-1])


def fp8_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` rounded to e4m3, saturated at +-448 (``scale`` broadcasts against ``x``)."""
    return (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def fp8_dynamic_scale(x2d: torch.Tensor, group_size: int | None = None) -> torch.Tensor:
    """Per-token dynamic FP8 scales of ``x2d`` ``[M, K]``: ``[M, 1]`` float32, or per token and
    ``group_size``-wide group ``[M, K / group_size]``."""
    xf = x2d.float().abs()
    if group_size is None:
        amax = xf.amax(dim=-1, keepdim=True)
    else:
        amax = xf.unflatten(-1, (-1, group_size)).amax(dim=-1)
    # A tensor divisor, not the Python float: torch's CUDA division by a CPU scalar multiplies
    # by its float32 reciprocal, one ulp off the quotient in about half the rows, and with
    # bf16 inputs (whose ratios often land on e4m3 midpoints) that turns ties the other way
    # than the kernels' IEEE division (a GPU test failed on one such row at 8B sizes).
    return (amax / torch.full_like(amax, FP8_MAX)).clamp(min=FP8_MIN_SCALE)


def fp8_quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., K]`` -> (e4m3 ``[..., K]``, float32 ``[M, 1]``): the dynamic per-token
    quantization ``fp8_linear`` applies to its activations (the ``*_quant_fp8`` ops' spec)."""
    x2 = x.reshape(-1, x.shape[-1])
    scale = fp8_dynamic_scale(x2)
    return fp8_quantize(x2, scale).view(x.shape), scale


def int8_quantize(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None = None
) -> torch.Tensor:
    """``round(x / scale) (+ zero_point)``, saturated to [-128, 127], as int32 values."""
    q = torch.round(x.float() / scale.float())
    if zero_point is not None:
        q = q + zero_point.float()
    return q.clamp(-128, 127).to(torch.int32)


def int8_dynamic_scale(x2d: torch.Tensor) -> torch.Tensor:
    """Per-token symmetric int8 scales of ``x2d`` ``[M, K]``: ``[M, 1]`` float32."""
    return (x2d.float().abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=INT8_MIN_SCALE)


def int8_quantize_activations(
    x2d: torch.Tensor, input_scale: torch.Tensor | None, input_zero_point: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``int8_linear``'s activations: ``(q, scale)``, int32 values in the int8 range and their
    float32 scale, per token and symmetric (``[M, 1]``) when ``input_scale`` is None, else the
    static ``input_scale`` (``[1, 1]``) with ``input_zero_point`` added to ``q``."""
    if input_scale is None:
        sx = int8_dynamic_scale(x2d)
        return int8_quantize(x2d, sx), sx
    sx = input_scale.float().reshape(1, 1)
    return int8_quantize(x2d, sx, input_zero_point), sx


# ---- weights and outputs -----------------------------------------------------------------------
def expand_block_scales(
    weight_scale_inv: torch.Tensor, block_size: tuple[int, int] | list[int], n: int, k: int
) -> torch.Tensor:
    """``fp8_block_linear``'s ``[..., ceil(N / bn), ceil(K / bk)]`` block scales as one scale
    per weight element ``[..., N, K]`` (in ``weight_scale_inv``'s dtype; leading dims, such as
    stacked experts, kept)."""
    bn, bk = int(block_size[0]), int(block_size[1])
    rows = weight_scale_inv.repeat_interleave(bn, -2)[..., :n, :]
    return rows.repeat_interleave(bk, -1)[..., :k]


def dequantize_fp8_experts(
    weight: torch.Tensor,
    scale: torch.Tensor,
    block_size: tuple[int, int] | list[int] | None = None,
    slices: int = 1,
) -> torch.Tensor:
    """FP8 expert weights ``[..., N, K]`` (one expert, or stacked) as float32 ``weight *
    scale``: ``scale`` is per output channel ``[..., N]`` (``block_size`` None) or per
    ``(bn, bk)`` block ``[..., slices * ceil(N / slices / bn), ceil(K / bk)]``, where the rows
    are ``slices`` equal parts with blocks of their own (``fused_moe_fp8``'s w13: gate, then
    up). The spec of ``fused_moe_fp8``'s weights."""
    w = weight.float()
    if block_size is None:
        return w * scale.float().unsqueeze(-1)
    n, k = w.shape[-2:]
    part = n // slices
    rows = -(-part // int(block_size[0]))
    s = scale.float()
    full = torch.cat(
        [
            expand_block_scales(s[..., i * rows : (i + 1) * rows, :], block_size, part, k)
            for i in range(slices)
        ],
        dim=-2,
    )
    return w * full


def unpack_int32(
    packed: torch.Tensor, bits: int, dim: int, size: int | None = None
) -> torch.Tensor:
    """Unpack ``packed`` int32 values along ``dim`` into ``32 // bits`` unsigned ``bits``-bit
    values each, the lowest bits first (GPTQ's and compressed-tensors' order); returns uint8
    with that dimension ``32 // bits`` times longer (cut to ``size`` when given)."""
    shifts = torch.arange(0, 32, bits, device=packed.device, dtype=torch.int32)
    p = packed.movedim(dim, -1).to(torch.int32)
    values = (p.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    values = values.flatten(-2)
    if size is not None:
        values = values[..., :size]
    return values.to(torch.uint8).movedim(-1, dim).contiguous()


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The inverse of ``unpack_int32`` (``values`` unsigned, that dimension a multiple of
    ``32 // bits``)."""
    per = 32 // bits
    v = values.movedim(dim, -1).to(torch.int64)
    v = v.unflatten(-1, (-1, per))
    shifts = torch.arange(0, 32, bits, device=values.device, dtype=torch.int64)
    word = (v << shifts).sum(-1)
    word = torch.where(word >= 1 << 31, word - (1 << 32), word)
    return word.to(torch.int32).movedim(-1, dim).contiguous()


def dequantize_wna16_experts(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Integer expert weights as float32 ``(q - z) * s``: the spec of ``fused_moe_wna16``'s
    weights. ``qweight`` int32 ``[..., N, K * bits / 32]`` (``32 / bits`` values per word
    along the input features, lowest bits first); ``scales`` ``[..., N, G]`` and ``zeros``
    uint8 ``[..., N, G]`` per group of ``K / G`` consecutive input features (``zeros`` None:
    symmetric, every zero point ``2**(bits-1)``). With float32 ``offsets`` ``[..., N, G]``
    instead of zero points (GGUF's blocks: ``W = d * q + m``, the minimum ``m`` not a whole
    number of steps), the weights are ``q * s + o`` (one rounding: ``torch.addcmul``).
    Returns ``[..., N, K]``."""
    q = unpack_int32(qweight, bits, dim=-1).float()
    group = q.shape[-1] // scales.shape[-1]
    s = scales.float().repeat_interleave(group, dim=-1)
    if offsets is not None:
        if zeros is not None:
            raise ValueError("integer experts take zero points or offsets, not both")
        return torch.addcmul(offsets.float().repeat_interleave(group, dim=-1), q, s)
    if zeros is None:
        return (q - float(1 << (bits - 1))) * s
    return (q - zeros.float().repeat_interleave(group, dim=-1)) * s


#: The 16 E2M1 values of MXFP4 (the OCP microscaling format), by 4-bit code (bit 3: sign).
E2M1_VALUES = tuple(sign * m for sign in (1.0, -1.0) for m in (0, 0.5, 1, 1.5, 2, 3, 4, 6))
#: MXFP4 values per scale: one E8M0 exponent byte per block of 32 along the input features.
MXFP4_BLOCK = 32


def dequantize_mxfp4_experts(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """MXFP4 weights as ``dtype``: the spec of ``fused_moe_mxfp4``'s weights.

    ``blocks`` uint8 ``[..., N, K / 2]``: two E2M1 codes a byte along the input features, the
    low nibble first; ``scales`` uint8 ``[..., N, K / 32]``: one E8M0 exponent per block of 32
    features. Value ``k`` of a row is ``E2M1_VALUES[code_k] * 2 ** (scales[k // 32] - 127)``,
    computed in float32 (exact: two significant bits times a power of two) and rounded once
    to ``dtype`` (exact in bfloat16 for the exponents checkpoints hold). Returns ``[..., N,
    K]``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
        )
    k = blocks.shape[-1] * 2
    if blocks.shape[:-1] != scales.shape[:-1] or scales.shape[-1] * MXFP4_BLOCK != k:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
            f"(expected [..., N, K / 2] bytes and [..., N, K / {MXFP4_BLOCK}] exponents)"
        )
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    # Each byte's two values (low nibble first), so that one lookup decodes a byte.
    codes = torch.arange(256, device=blocks.device)
    pairs = torch.stack((values[codes & 0x0F], values[codes >> 4]), dim=-1)  # [256, 2]
    w = pairs[blocks.long()].flatten(-2)  # [..., N, K]
    exponents = scales.to(torch.int32) - 127
    w = torch.ldexp(w.unflatten(-1, (-1, MXFP4_BLOCK)), exponents[..., None].float())
    return w.flatten(-2).to(dtype)


def wna16_activations(x: torch.Tensor, packed: dict[str, torch.Tensor]) -> torch.Tensor:
    """``x`` as ``[M, K]`` rows, its features in the packed weight's order (``packed["perm"]``,
    the act-order of a GPTQ checkpoint)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2.index_select(-1, packed["perm"]) if "perm" in packed else x2


def finish_linear(y: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """The product ``y`` ``[M, N]`` plus ``bias`` (in ``y``'s dtype), as ``x``'s dtype and
    leading shape ``[..., N]``."""
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype).view(*x.shape[:-1], y.shape[-1])


# ---- the ops ---------------------------------------------------------------------------------
def fp8_linear(
    x: torch.Tensor | Fp8Activation,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation_quant: bool = True,
) -> torch.Tensor:
    """``x @ (weight * weight_scale)^T + bias`` with FP8 ``weight`` ``[N, K]`` and float32
    ``weight_scale`` ``[1]`` or ``[N]``; see the module docstring for ``input_scale`` and
    ``activation_quant``, and for ``x`` given as an ``Fp8Activation``."""
    w = weight.float() * weight_scale.float().reshape(-1, 1)
    if isinstance(x, Fp8Activation):
        return finish_linear((x.rows().float() * x.scale) @ w.T, bias, x)
    x2 = x.reshape(-1, x.shape[-1])
    if activation_quant:
        sx = (
            fp8_dynamic_scale(x2)
            if input_scale is None
            else input_scale.float().reshape(1, 1).expand(x2.shape[0], 1)
        )
        xf = fp8_quantize(x2, sx).float() * sx
    else:
        xf = x2.float()
    return finish_linear(xf @ w.T, bias, x)


def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block_size: tuple[int, int] | list[int],
    bias: torch.Tensor | None = None,
    activation_quant: bool = True,
) -> torch.Tensor:
    """``x @ W^T + bias`` with FP8 ``weight`` ``[N, K]`` scaled per ``(bn, bk)`` block by
    ``weight_scale_inv`` ``[ceil(N / bn), ceil(K / bk)]``; with ``activation_quant`` the
    activations are quantized per token and ``bk``-wide group (K must be a multiple of bk)."""
    n, k = weight.shape
    w = weight.float() * expand_block_scales(weight_scale_inv.float(), block_size, n, k)
    bk = int(block_size[1])
    x2 = x.reshape(-1, k)
    if activation_quant:
        sx = fp8_dynamic_scale(x2, bk).repeat_interleave(bk, 1)
        xf = fp8_quantize(x2, sx).float() * sx
    else:
        xf = x2.float()
    return finish_linear(xf @ w.T, bias, x)


def int8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    input_zero_point: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ (weight * weight_scale)^T + bias`` with int8 ``weight`` ``[N, K]`` and float32
    ``weight_scale`` ``[1]`` or ``[N]``, the activations quantized to int8: per token and
    symmetric when ``input_scale`` is None, else with that static scale (``[1]``) and the
    optional static zero point ``input_zero_point`` (int32 ``[1]``)."""
    q, sx = int8_quantize_activations(x.reshape(-1, x.shape[-1]), input_scale, input_zero_point)
    if input_scale is not None and input_zero_point is not None:
        q = q - input_zero_point.to(torch.int32).reshape(1, 1)
    # Exact integer dot products (float64 holds them exactly for any practical K).
    acc = q.double() @ weight.double().T
    y = acc * sx.double() * weight_scale.double().reshape(1, -1)
    return finish_linear(y.float(), bias, x)


class WNA16Linear:
    """``wna16_linear``: weights of ``bits`` (4 or 8) bits, ``W = (q - z) * s`` per group of
    ``group_size`` input features, multiplied by unquantized activations.

    The canonical tensors a quantization method hands to ``prepack`` (whatever the checkpoint
    format was):

    * ``qweight``: uint8 ``[N, K]``, each value in ``[0, 2**bits)``;
    * ``scales``: ``[N, K / group_size]`` float (the checkpoint's dtype, usually float16);
    * ``zeros``: uint8 ``[N, K / group_size]``, the integer zero points (``2**(bits-1)`` for a
      symmetric format);
    * ``perm``: int64 ``[K]`` or None. With it (GPTQ act-order checkpoints, whose groups were
      formed in a permuted order), the weight's input features are stored in that order and the
      product reads ``x[..., perm]``.

    This reference keeps 4-bit values two to a byte and dequantizes on every call (float32).
    """

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
        """The tensors ``__call__`` reads (``dtype``, the activations' dtype, is a hint)."""
        q = qweight.to(torch.uint8)
        if bits == 4:
            q = q[:, 0::2] | (q[:, 1::2] << 4)
        packed = {"qweight": q.contiguous(), "scales": scales, "zeros": zeros.to(torch.uint8)}
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
        q = packed["qweight"]
        if bits == 4:
            q = torch.stack((q & 0xF, q >> 4), dim=-1).flatten(-2)
        w = (q.float() - packed["zeros"].float().repeat_interleave(group_size, dim=1)) * packed[
            "scales"
        ].float().repeat_interleave(group_size, dim=1)
        return finish_linear(wna16_activations(x, packed).float() @ w.T, bias, x)


wna16_linear = WNA16Linear()

# The reference takes an ``Fp8Activation`` at any row count (it always quantizes per token).
fp8_linear.fp8_activation_min_rows = 1  # type: ignore[attr-defined]

QUANTIZED_REFERENCE_KERNELS = {
    "fp8_linear": fp8_linear,
    "fp8_block_linear": fp8_block_linear,
    "int8_linear": int8_linear,
    "wna16_linear": wna16_linear,
}
