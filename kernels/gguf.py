"""GGUF quantization blocks in torch, and the torch reference of ``gguf_linear``.

llama.cpp stores a quantized matrix ``[N, K]`` row by row, each row as ``K / block_size``
blocks of ``type_size`` bytes (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md; the
block layouts are ggml's ``block_q4_0`` ... ``block_q6_K``). Every type kept quantized here
decodes to the same canonical form: unsigned integer ``values`` ``[N, K]`` and, per *group* of
16 or 32 consecutive values along K, a float32 ``scale`` and ``offset``, so that

    W[n, k] = scale[n, k // group] * values[n, k] + offset[n, k // group]

========  =====  =====  =====================================================================
type      bits   group  scale / offset (d, dmin: float16 per block; sc, m: small integers)
========  =====  =====  =====================================================================
Q4_0      4      32     d, -8 d
Q4_1      4      32     d, m (float16)
Q5_0      5      32     d, -16 d
Q5_1      5      32     d, m (float16)
Q8_0      8      32     d, -128 d (values stored as q + 128)
Q4_K      4      32     d * sc, -dmin * m (sc, m: 6 bits, 8 groups per 256-value super-block)
Q5_K      5      32     d * sc, -dmin * m
Q6_K      6      16     d * sc, -32 d * sc (sc: int8, 16 groups per super-block)
========  =====  =====  =====================================================================

Every scale and offset is a product of a float16 and an integer of at most 8 bits, so it is
exact in float32, and so is ``scale * values`` (at most 24 significant bits); one rounding of
``scale * values + offset`` (an FMA, or the product then the sum) therefore gives bit for bit
the float32 value of ``gguf.quants.dequantize`` (tests/test_gguf_quantized.py checks every
type on random blocks).

``GGUFLinear`` (the registry's ``gguf_linear``) is an op with its own weight layout, like
``wna16_linear``: ``prepack(blocks, qtype, dtype)`` takes the raw blocks ``uint8 [N, K /
block_size, type_size]`` once at load and returns the tensors ``__call__(x, packed, qtype=...,
bias=...)`` multiplies. This reference keeps the raw blocks and dequantizes on every call
(float32); its ``embedding(ids, packed, qtype=..., dtype=...)`` dequantizes only the rows
``ids`` (the lookup of a quantized embedding). The model's embeddings and LM head are
dequantized at load unless an override also has ``keeps_vocabulary(qtype, dtype) -> bool``
and says yes: a tied embedding / LM head matrix is then handed to ``prepack(...,
vocabulary=True)`` and served by that packing's ``embedding`` (exact: the dequantized rows in
``dtype``) and ``__call__`` (the logits, within the override's stated error). Overrides without
``keeps_vocabulary`` need neither (see ``engine.quantization.gguf``). An override may also
offer ``routed_experts(hidden, topk_weights, topk_ids, gate_up, down)``: a GGUF MoE layer's
experts in one call, its packings stacked over the experts (``engine.quantization.gguf_moe``
documents it); returning None sends the layer to the loop over experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QK = 32  # values per block of the legacy types
QK_K = 256  # values per super-block of the K-quants


@dataclass(frozen=True)
class GGUFType:
    """One GGML quantization type kept quantized: its layout and canonical form."""

    name: str
    ggml_type: int  # gguf.GGMLQuantizationType value
    block_size: int  # values per block
    type_size: int  # bytes per block
    bits: int  # bits per value
    group: int  # values per (scale, offset) group

    @property
    def symmetric(self) -> bool:
        """Whether every offset is ``-2**(bits-1)`` times its scale (the table above: Q4_0,
        Q5_0, Q8_0, Q6_K), so the weights are ``(values - 2**(bits-1)) * scale``."""
        return self.name in ("Q4_0", "Q5_0", "Q8_0", "Q6_K")


# The GGML type numbers are part of the file format (ggml.h); gguf.GGMLQuantizationType agrees.
GGUF_TYPES: dict[int, GGUFType] = {
    t.ggml_type: t
    for t in (
        GGUFType("Q4_0", 2, QK, 18, 4, 32),
        GGUFType("Q4_1", 3, QK, 20, 4, 32),
        GGUFType("Q5_0", 6, QK, 22, 5, 32),
        GGUFType("Q5_1", 7, QK, 24, 5, 32),
        GGUFType("Q8_0", 8, QK, 34, 8, 32),
        GGUFType("Q4_K", 12, QK_K, 144, 4, 32),
        GGUFType("Q5_K", 13, QK_K, 176, 5, 32),
        GGUFType("Q6_K", 14, QK_K, 210, 6, 16),
    )
}
GGUF_TYPE_NAMES = {t.name: t for t in GGUF_TYPES.values()}


def gguf_type(qtype: int | str) -> GGUFType:
    """The kept type ``qtype`` (a GGML type number or name); ``ValueError`` naming the kept
    types otherwise."""
    found = GGUF_TYPE_NAMES.get(qtype) if isinstance(qtype, str) else GGUF_TYPES.get(int(qtype))
    if found is None:
        raise ValueError(
            f"GGML type {qtype!r} is not one of the types gguf_linear multiplies quantized "
            f"({', '.join(GGUF_TYPE_NAMES)})"
        )
    return found


# ---- unpacking ---------------------------------------------------------------------------------
def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at bytes ``[start, start + 2)`` of every block, as float32 ``[..., 1]``."""
    return blocks[..., start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Bytes ``[..., n]`` -> ``[..., 2n]``: the n low nibbles, then the n high nibbles."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """Little-endian bit planes: bytes ``[..., count / 8]`` -> ``[..., count]`` of 0/1."""
    shifts = torch.arange(8, device=qh.device, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).flatten(-2)[..., :count]


def k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: a block's 12 packed scale bytes ``[..., 12]`` -> (sc, m), ``[..., 8]`` six-bit
    values each (ggml's ``get_scale_min_k4``); a sub-block's scale is ``d * sc``, its offset
    ``-(dmin * m)``. Public for the plugins that keep the scales in this integer form."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def unpack(
    blocks: torch.Tensor, qtype: int | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw blocks ``uint8 [N, K / block_size, type_size]`` -> ``(values uint8 [N, K], scale
    float32 [N, K / group], offset float32 [N, K / group])`` (the module docstring's form)."""
    t = gguf_type(qtype)
    if blocks.dtype != torch.uint8 or blocks.dim() != 3 or blocks.shape[-1] != t.type_size:
        raise ValueError(
            f"{t.name} blocks must be uint8 [rows, blocks, {t.type_size}], got "
            f"{tuple(blocks.shape)} {blocks.dtype}"
        )
    n, nb = blocks.shape[0], blocks.shape[1]
    name = t.name
    if name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        d = _f16(blocks, 0)  # [N, nb, 1]
        if name == "Q8_0":
            values = blocks[..., 2:] ^ 0x80  # int8 q -> q + 128
            offset = -128.0 * d
        else:
            has_min = name.endswith("_1")
            start = 4 if has_min else 2
            if name.startswith("Q5"):
                high = _bits(blocks[..., start : start + 4], 32)
                start += 4
            values = _nibbles(blocks[..., start:])
            if name.startswith("Q5"):
                values = values | (high << 4)
            if has_min:
                offset = _f16(blocks, 2)
            else:
                offset = (-8.0 if name == "Q4_0" else -16.0) * d
        return values.reshape(n, -1), d.reshape(n, nb), offset.reshape(n, nb)
    if name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        sc, mn = k_scale_min(blocks[..., 4:16])  # [N, nb, 8]
        qs = blocks[..., -128:].reshape(n, nb, 4, 32)
        values = _nibbles(qs).reshape(n, nb, 8, 32)  # group 2i: low nibbles of chunk i
        if name == "Q5_K":
            qh = blocks[..., 16:48]  # [N, nb, 32]: bit j of byte e is group j's element e
            shifts = torch.arange(8, device=blocks.device, dtype=torch.uint8)
            high = (qh.unsqueeze(-2) >> shifts.view(8, 1)) & 1  # [N, nb, 8, 32]
            values = values | (high << 4)
        scale = d * sc.float()
        offset = -(dmin * mn.float())
        return values.reshape(n, -1), scale.reshape(n, -1), offset.reshape(n, -1)
    # Q6_K: ql [128], qh [64], scales int8 [16], d float16
    ql = blocks[..., 0:128].reshape(n, nb, 2, 64)
    qh = blocks[..., 128:192].reshape(n, nb, 2, 32)
    low = torch.stack((ql & 0x0F, ql >> 4), dim=-2).reshape(n, nb, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], device=blocks.device, dtype=torch.uint8)
    high = ((qh.unsqueeze(-2) >> shifts.view(4, 1)) & 3).reshape(n, nb, 8, 32)
    values = (low | (high << 4)).reshape(n, -1)
    sc = blocks[..., 192:208].contiguous().view(torch.int8).float()  # [N, nb, 16]
    scale = _f16(blocks, 208) * sc
    return values, scale.reshape(n, -1), (-32.0 * scale).reshape(n, -1)


def dequantize_planes(
    values: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int
) -> torch.Tensor:
    """``scale * values + offset`` per group, float32 ``[N, K]`` (one rounding, see above)."""
    n, k = values.shape
    v = values.float().view(n, k // group, group)
    return torch.addcmul(offset.unsqueeze(-1), scale.unsqueeze(-1), v).view(n, k)


def integer_planes(
    blocks: torch.Tensor,
    qtype: int | str,
    bits: int | None = None,
    group: int | None = None,
    offsets: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Raw blocks ``[..., N, K / block_size, type_size]`` (a stack of experts too) ->
    ``fused_moe_wna16``'s operands: ``(qweight int32 [..., N, K * bits / 32], scale float32
    [..., N, K / group], offset float32 [..., N, K / group] or None)``, the values packed
    ``32 / bits`` to a word along K, lowest bits first.

    With offsets the weights are ``scale * q + offset``, exactly as ``unpack`` gives them. The
    symmetric types (``GGUFType.symmetric``) need none by default: their values are moved up
    by ``2**(bits-1) - 2**(type bits-1)`` so that the weights are ``(q - 2**(bits-1)) *
    scale``, the kernels' symmetric form (also exact: at most 24 significant bits), which
    saves the offsets' 4 bytes a group. ``offsets=True`` keeps them anyway (a gate and an up
    stack of one product must share one form).

    ``bits`` defaults to 4 for the 4-bit types and 8 for the rest (5-, 6- and 8-bit values in
    bytes); ``group`` to the type's. A wider ``bits`` or a smaller ``group`` (one dividing the
    type's; the scales and offsets repeated) gives two types one form, as a gate and an up
    stack of different types need to share one product."""
    from engine.kernels.quantized import pack_int32

    t = gguf_type(qtype)
    bits = bits or (4 if t.bits == 4 else 8)
    group = group or t.group
    offsets = not t.symmetric if offsets is None else offsets
    if bits not in (4, 8) or bits < t.bits or t.group % group or not (offsets or t.symmetric):
        raise ValueError(
            f"{t.name} ({t.bits}-bit values in groups of {t.group}) cannot be held as {bits}-bit "
            f"words in groups of {group}" + ("" if offsets else " without offsets")
        )
    lead, (n, nb, size) = blocks.shape[:-3], blocks.shape[-3:]
    values, scale, offset = unpack(blocks.reshape(-1, nb, size), qtype)
    if not offsets:
        values = values + ((1 << (bits - 1)) - (1 << (t.bits - 1)))
    if group != t.group:
        scale = scale.repeat_interleave(t.group // group, dim=-1)
        offset = offset.repeat_interleave(t.group // group, dim=-1)
    k = values.shape[-1]
    return (
        pack_int32(values, bits, dim=1).reshape(*lead, n, k * bits // 32),
        scale.reshape(*lead, n, -1),
        offset.reshape(*lead, n, -1) if offsets else None,
    )


def dequantize(blocks: torch.Tensor, qtype: int | str) -> torch.Tensor:
    """Raw blocks ``[N, K / block_size, type_size]`` -> float32 ``[N, K]``, bit for bit what
    ``gguf.quants.dequantize`` returns."""
    values, scale, offset = unpack(blocks, qtype)
    return dequantize_planes(values, scale, offset, gguf_type(qtype).group)


# ---- the reference op ---------------------------------------------------------------------------
class GGUFLinear:
    """``gguf_linear``: ``x @ W^T + bias`` with ``W`` a matrix of GGUF blocks of one kept type
    (see the module docstring); the embedding lookup of the same weight.

    ``prepack(blocks, qtype=..., dtype=...)``: ``blocks`` ``uint8 [N, K / block_size,
    type_size]`` (``dtype``, the activations' dtype, is a hint). ``__call__(x, packed, *,
    qtype, bias)`` -> ``[..., N]`` in ``x``'s dtype; ``embedding(ids, packed, *, qtype,
    dtype)`` -> ``[*ids.shape, K]`` in ``dtype``, the dequantized rows. This reference keeps
    the blocks and dequantizes per call in float32.
    """

    def prepack(
        self,
        blocks: torch.Tensor,
        *,
        qtype: int,
        dtype: torch.dtype | None = None,
        vocabulary: bool = False,
    ) -> dict[str, torch.Tensor]:
        """``vocabulary``: the matrix is a tied embedding / LM head (the blocks serve both)."""
        gguf_type(qtype)
        return {"blocks": blocks.contiguous()}

    def __call__(
        self,
        x: torch.Tensor,
        packed: dict[str, torch.Tensor],
        *,
        qtype: int,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        w = dequantize(packed["blocks"], qtype)
        y = x.reshape(-1, x.shape[-1]).float() @ w.T
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).view(*x.shape[:-1], w.shape[0])

    def embedding(
        self,
        ids: torch.Tensor,
        packed: dict[str, torch.Tensor],
        *,
        qtype: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        rows = packed["blocks"].index_select(0, ids.reshape(-1))
        return dequantize(rows, qtype).to(dtype).view(*ids.shape, -1)


gguf_linear = GGUFLinear()
