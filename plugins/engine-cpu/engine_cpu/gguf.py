"""``gguf_linear`` on the CPU (spec: ``engine.kernels.gguf.GGUFLinear``).

Every kept type decodes to ``W = scale * v + offset`` per group (``engine.kernels.gguf``). At
load the blocks are repacked:

* **On CPUs with AMX** (Intel Xeon since Sapphire Rapids; ``engine_cpu.native`` builds the
  kernels of ``csrc/gguf_amx.c`` on first use), every kept type with 16-bit activations, the
  tied embedding / LM head included: signed 8-bit values in AMX tile order with float32 scales
  (and offsets for the types with mins) per 16 or 32 values, about 1.1-1.3 bytes per weight
  (the embedded Gemma 3 270M Q4_K_M: 356 MiB of weights against 715 MiB dense). For 4-bit
  types that is about twice what torch's int4 packing holds (below); keeping their nibbles
  packed in the tiles' source is the next step. Up to
  ``BF16_ROWS`` activation rows (decode) are quantized per 32 values to int8, as llama.cpp
  and vLLM's GGUF kernels do, and multiplied in int8 tiles, scaled per group in float32; more
  rows (prefill) take a bfloat16 path that dequantizes each 16-row tile once per call into
  the weights the dense bf16 layer would hold, so its product is ``F.linear`` on the
  dequantized bf16 weight up to the order of the float32 sums. Embedding lookups dequantize
  rows of the same layout, bit for bit the reference's. Measured in docs/benchmarks.md
  ("CPU: GGUF layers on AMX").
* **On other x86-64 CPUs with AVX2** (Intel since Haswell, AMD since Zen; ``csrc/gguf_avx2.c``),
  and on AMX CPUs for float32 activations: every kept type in every activation dtype, the tied
  embedding / LM head included, row by row in 32-value blocks: the 4-bit types two values a
  byte, Q6_K and Q5_K in 6 and 5 bits (a nibble plane and a 2- or 1-bit plane), Q5_0 and Q5_1
  a byte each (unsigned, with float32 scales and offsets per group; no offsets where they are
  -z times the scale: Q4_0, Q5_0, Q6_K), Q8_0 as its signed bytes with float16 scales. The
  K-quants keep their scales compact, as the file holds them (per 256 values float16 ``d`` and
  ``dmin``, integer sub-scales and mins, ``_avx2_kscales``; the kernels' float32 ``d * sc`` and
  ``-(dmin * m)`` are exact, the same values as float32 scales and offsets): Q4_K 4.625 bits a
  weight (4.5 in the file; 6 with float32 scales and offsets), Q5_K 5.625 (5.5; 10), Q6_K
  6.5625 (6.5625; 10 with a byte a value and float32 scales). The embedded Gemma 3 270M Q4_K_M
  (mostly Q5_0): 326.0 MiB of weights as ``engine.benchmarks.gguf_decode`` counts them (334.7
  with float32 K-quant scales) against 1,087 MiB dense in float32, its default dtype on such a
  CPU. The
  activations are quantized per 32 values to int8, as on AMX, and multiplied with AVX2 byte
  dot products (``VPMADDUBSW``), scaled per group of 8 blocks in float32, up to
  ``AVX2_DENSE_ROWS`` rows (decode: 1.3-2.7x faster than the dense float32 product at one row
  on this project's 2-core EPYC, where the weights' bytes decide; prefill too); more rows take
  a float32 GEMM over tiles of the weight dequantized per call, the exact weights. Where the
  CPU also has AVX-512 VNNI (Zen 4 and later, Intel since Ice Lake), the products of 2 or more
  rows run as ``VPDPBUSD`` on 64 bytes (``csrc/gguf_vnni.c``, same layout; ``AVX2_ONLY`` keeps
  the AVX2 instructions for all); one row keeps the AVX2 ones, which read the weights faster
  there, so a row's result alone may differ in the last bits from its result in a batch.
  Measured in docs/benchmarks.md ("CPU: GGUF layers and the decode step compiled for AVX2",
  the seventh session's section, the eighth's and the ninth's).
* Without either (or with ``ENGINE_CPU_NATIVE=0``), as follows.
* 4-bit types (Q4_0, Q4_1, Q4_K) with 16-bit activations: for torch's CPU int4 kernel
  (``_weight_int4pack_mm_for_cpu``, which dequantizes in registers, ``(q - 8) * s + z`` per
  group of 32), ``v`` as is, ``s = scale``, ``z = offset + 8 * scale``; 0.5 byte per weight
  plus the group scales, one int4 product per call;
* 5-, 6- and 8-bit types (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0), and every type with float32
  activations: dequantized once at load into the activation dtype and prepacked for oneDNN
  (``torch.ops.mkldnn._reorder_linear_weight``, as ``engine.layers.cpu_packed_linear`` packs
  the unquantized layers); 2 bytes per weight in bf16, the product bit for bit ``F.linear`` on
  the dequantized weight (said in the log once per type and dtype).

Why the wider types are not kept: the int4 kernel can hold them as two 4-bit planes side by
side along K (``v = lo + 16 * hi``, the input repeated; 1 byte per weight plus 0.25 of bf16
scales), but its cost grows with the batch (it dequantizes the weight again for every 4 rows)
and doubles with the depth. On this project's 2-core Zen 4, 2 threads, a 2048 x 640 bf16
product took about 0.21 ms at batch 1 both ways, and at batch 4 / 8 / 16 0.40 / 0.95 / 1.79 ms
as two planes against 0.2-0.5 ms dense (oneDNN-packed). The embedded Gemma 3 270M Q4_K_M file
is mostly Q5_0 (q, k, gate and up projections), so the two-plane form made its batched steps
several times slower for a 46 MiB saving (docs/benchmarks.md, 2026-12-05). The 4-bit layers
stay on the int4 kernel (0.09 against 0.21 ms at batch 1; slower than dense from batch 4 up).
torch's int4 kernel has no vectorized float32 path (6.9 ms for that product against 0.31 ms
dense), hence dense float32.

The int4 scales are kept in the activation dtype (the kernel's requirement), so in bf16 the
product differs from the float32 dequantization by the rounding of the scales; float32 is
exact to the summation order. Output features are padded to a multiple of 16 (the kernel's
tile).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from engine.kernels import gguf as ref
from engine.layers.cpu_packed_linear import packing_supported, return_freed_memory
from engine_cpu import hugepages, native

logger = logging.getLogger(__name__)

_warned_dense: set[tuple[str, torch.dtype]] = set()
_logged_amx: set[bool] = set()

# The integer zero point of the types whose offset is -z * scale (engine.kernels.gguf): their
# values are kept as the signed u - z, so the AMX product needs no offset term.
_ZERO = {"Q4_0": 8, "Q5_0": 16, "Q8_0": 128, "Q6_K": 32}


def _amx() -> bool:
    """Whether the AMX kernels (engine_cpu/csrc/gguf_amx.c) are here; says which path in the
    log once."""
    lib = native.load("amx")
    if (lib is not None) not in _logged_amx:  # once per answer
        _logged_amx.add(lib is not None)
        if lib is not None:
            logger.info(
                "gguf_linear on the CPU: AMX int8 kernels on the GGUF values (activations "
                "quantized per 32 values, as llama.cpp's)"
            )
        else:
            logger.info(
                "gguf_linear on the CPU: no AMX kernels (%s)", native.unavailable_reason("amx")
            )
    return lib is not None


def _amx_serves(dtype: torch.dtype) -> bool:
    """Whether activations of ``dtype`` take the AMX layout: 16-bit ones where the kernels are
    here (float32 keeps the exact dense path)."""
    return dtype != torch.float32 and _amx()


def _amx_pack(blocks: torch.Tensor, t: ref.GGUFType) -> dict[str, torch.Tensor]:
    """The AMX layout (engine_cpu/csrc/gguf_amx.c) of raw blocks ``[N, K / block, size]``:
    signed 8-bit values in 16-row tiles of one group each, VNNI order, and float32 scales (and
    offsets where the type has mins) per tile row and group. Output rows are padded to a
    multiple of 16 with zero scales. Unpacked _VOCAB_CHUNK rows at a time, which bounds the
    load's peak for a vocabulary matrix."""
    n = blocks.shape[0]
    k = blocks.shape[1] * t.block_size
    g = t.group
    zero = _ZERO.get(t.name)
    tiles = -(-n // 16)
    values = torch.zeros(tiles, k // g, g // 4, 16, 4, dtype=torch.int8)
    scales = torch.zeros(tiles, k // g, 16)
    offsets = None if zero is not None else torch.zeros(tiles, k // g, 16)
    for start in range(0, n, _VOCAB_CHUNK):
        rows = blocks[start : start + _VOCAB_CHUNK]
        u, scale, offset = ref.unpack(rows, t.ggml_type)
        r = u.shape[0]
        pad = -r % 16  # only the last chunk (_VOCAB_CHUNK is a multiple of 16)
        v = u.to(torch.int16) - (zero or 0)
        if pad:
            v = torch.cat([v, torch.zeros(pad, k, dtype=v.dtype)])
            scale = torch.cat([scale, torch.zeros(pad, scale.shape[1])])
            offset = torch.cat([offset, torch.zeros(pad, offset.shape[1])])
        part = slice(start // 16, (start + r + pad) // 16)
        count = (r + pad) // 16
        values[part] = v.to(torch.int8).view(count, 16, k // g, g // 4, 4).permute(0, 2, 3, 1, 4)
        scales[part] = scale.view(count, 16, k // g).transpose(1, 2)
        if offsets is not None:
            offsets[part] = offset.view(count, 16, k // g).transpose(1, 2)
    packed = {"amx_values": values, "amx_scales": scales, "out_features": torch.tensor(n)}
    if offsets is not None:
        packed["amx_offsets"] = offsets
    return packed


def _amx_rows(packed: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of an AMX-packed weight dequantized, float32 ``[len(ids), K]``: bit for bit
    the reference's dequantization (``scale * (u - z)`` is exact in float32)."""
    values = packed["amx_values"]  # [T, K / G, G / 4, 16, 4]
    tiles, groups, quads, _, _ = values.shape
    t, j = ids // 16, ids % 16
    v = values[t, :, :, j, :].float().view(len(ids), groups, quads * 4)
    rows = v * packed["amx_scales"][t, :, j].unsqueeze(-1)
    if "amx_offsets" in packed:
        rows = rows + packed["amx_offsets"][t, :, j].unsqueeze(-1)
    return rows.view(len(ids), -1)


# Above this many activation rows a bfloat16 input takes the kernels' bfloat16 path (weights
# dequantized once per call, no per-group work per row); at or below it the int8 path, which
# reads only the packed bytes. On the 2-vCPU Sapphire Rapids VM of docs/benchmarks.md the
# int8 path was the faster one up to 16 rows.
BF16_ROWS = 16


def _amx_linear(x2: torch.Tensor, packed: dict[str, torch.Tensor]) -> torch.Tensor:
    """``x2 [M, K]`` times the packed weight, float32 ``[M, N]``."""
    lib = native.load("amx")
    values = packed["amx_values"]  # [T, K / G, G / 4, 16, 4]
    tiles, groups, quads, _, _ = values.shape
    group, k = quads * 4, groups * quads * 4
    n = int(packed["out_features"])
    m = x2.shape[0]
    offsets = packed.get("amx_offsets")
    weight = (
        values.data_ptr(),
        packed["amx_scales"].data_ptr(),
        None if offsets is None else offsets.data_ptr(),
        tiles * 16,
        n,
        k,
        group,
    )
    y = torch.empty(m, n)
    if m > BF16_ROWS and x2.dtype == torch.bfloat16:
        xb = x2.contiguous()
        scratch = torch.empty(torch.get_num_threads() * 2 * (k // 32) * 512, dtype=torch.int16)
        lib.gguf_amx_gemm_bf16(*weight, xb.data_ptr(), m, y.data_ptr(), n, scratch.data_ptr())
        return y
    bf16 = x2.dtype == torch.bfloat16
    xc = x2.contiguous() if bf16 else x2.float().contiguous()
    xq = torch.empty(m, k, dtype=torch.int8)
    xd = torch.empty(m, k // 32)
    xs = torch.empty(m, k // group)
    lib.gguf_quantize_rows(
        xc.data_ptr(), int(bf16), m, k, group, xq.data_ptr(), xd.data_ptr(), xs.data_ptr()
    )
    lib.gguf_amx_gemm(*weight, xq.data_ptr(), xd.data_ptr(), xs.data_ptr(), m, y.data_ptr(), n)
    return y


# ---- AVX2 (engine_cpu/csrc/gguf_avx2.c) ---------------------------------------------------------
# the kernel's packings (csrc/gguf_layout.h)
_PACK_U8, _PACK_U4, _PACK_S8, _PACK_U6, _PACK_U5 = 0, 1, 2, 3, 4
_logged_avx2: set[bool] = set()


def _avx2() -> bool:
    """Whether the AVX2 kernels (engine_cpu/csrc/gguf_avx2.c) are here; says so in the log once."""
    lib = native.load("avx2")
    if (lib is not None) not in _logged_avx2:
        _logged_avx2.add(lib is not None)
        if lib is not None:
            logger.info(
                "gguf_linear on the CPU: %s int8 kernels on the GGUF values (activations "
                "quantized per 32 values, as llama.cpp's)",
                "AVX-512 VNNI"
                if lib.gguf_avx2_vnni() and not AVX2_ONLY
                else "AVX2 (AVX-512 VNNI left unused: AVX2_ONLY, ENGINE_CPU_GGUF_AVX2_ONLY=1)"
                if lib.gguf_avx2_vnni()
                else "AVX2",
            )
        else:
            logger.info(
                "gguf_linear on the CPU: no AVX2 kernels (%s); 4-bit types use torch's int4 "
                "kernel in 16-bit dtypes, the others are dequantized at load",
                native.unavailable_reason("avx2"),
            )
    return lib is not None


# The zero points of the types whose offset is -z times the scale (engine.kernels.gguf): their
# offsets are not stored, the kernels derive them (a quarter less to read for Q6_K's 16-value
# groups, a tenth for Q5_0).
_AVX2_ZERO = {"Q4_0": 8, "Q5_0": 16, "Q6_K": 32}


def _avx2_order(k: int) -> torch.Tensor:
    """The interleaved order of a row of ``k`` values (``csrc/gguf_avx2.c``): entry p is the
    index of the value at unpacked position p. Each full group of 8 blocks of 32 is 8 vectors
    of 32 bytes whose lane l (4 bytes) holds values 4v .. 4v + 3 of block l in vector v; a
    group of 4 blocks after them, 4 vectors whose lanes l and l + 4 hold values 8v .. 8v + 3
    and 8v + 4 .. 8v + 7 of block l; the last ``k / 32 % 4`` blocks in their own order."""
    nb = k // 32
    n8 = nb - nb % 8
    n4 = n8 + 4 if nb % 8 >= 4 else n8
    order = torch.arange(k)
    v, lane, i = torch.meshgrid(torch.arange(8), torch.arange(8), torch.arange(4), indexing="ij")
    for g0 in range(0, n8, 8):  # position 32 v + 4 l + i <- block g0 + l, value 4 v + i
        order[32 * g0 : 32 * g0 + 256] = (32 * (g0 + lane) + 4 * v + i).flatten()
    if n4 > n8:  # position 32 v + 4 l + i <- block n8 + l % 4, value 8 v + 4 (l // 4) + i
        v, lane, i = v[:4], lane[:4], i[:4]
        order[32 * n8 : 32 * n4] = (32 * (n8 + lane % 4) + 8 * v + 4 * (lane // 4) + i).flatten()
    return order


def _avx2_nibbles(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For the 4-bit packing of a row of ``k`` values: the values (by index) in the low and
    the high nibble of each byte. A group of G blocks (8, 4, or 1 for the last blocks) takes
    16 G bytes, byte j holding positions j and 16 G + j of the group's interleaved order, so
    a 32-byte load unpacks (mask, shift) into two of its vectors."""
    order = _avx2_order(k)
    nb = k // 32
    n8 = nb - nb % 8
    n4 = n8 + 4 if nb % 8 >= 4 else n8
    sizes = [8] * (n8 // 8) + [4] * ((n4 - n8) // 4) + [1] * (nb - n4)
    low, high, at = [], [], 0
    for g in sizes:
        low.append(order[at : at + 16 * g])
        high.append(order[at + 16 * g : at + 32 * g])
        at += 32 * g
    return torch.cat(low), torch.cat(high)


def _avx2_pack(blocks: torch.Tensor, t: ref.GGUFType) -> dict[str, torch.Tensor]:
    """The AVX2 layout (engine_cpu/csrc/gguf_avx2.c) of raw blocks ``[N, K / block, size]``, row
    by row, the values in the interleaved order of ``_avx2_order``: Q8_0 as its signed bytes
    (with its float16 scales only); 4-bit types as two values a byte (``_avx2_nibbles``); Q6_K
    in 6 bits, Q5_K in 5 (``_avx2_split_planes``); Q5_0 and Q5_1 a byte each. Scales: for
    the K-quants (Q4_K, Q5_K, Q6_K) the compact records of ``_avx2_kscales`` (uint8
    ``[N, K / 256, 20 or 18]``, layout bit ``_KSCALES``, no offsets); for the others float32
    scales per group and, except for the types whose offset is -z times the scale
    (``_AVX2_ZERO``, whose z the layout word carries), float32 offsets. Unpacked _VOCAB_CHUNK
    rows at a time, which bounds the load's peak for a vocabulary matrix."""
    n = blocks.shape[0]
    k = blocks.shape[1] * t.block_size
    signed = t.name == "Q8_0"
    compact = t.name in _KQUANTS
    zero = _AVX2_ZERO.get(t.name, 0)
    pack = _PACK_S8 if signed else {4: _PACK_U4, 6: _PACK_U6}.get(t.bits, _PACK_U8)
    if t.name == "Q5_K":  # (whole groups of 8 blocks: not Q5_0 / Q5_1, whose rows may end early)
        pack = _PACK_U5
    # in huge pages: a decode step streams them, and 4 KiB pages cost a TLB miss each
    values = hugepages.empty((n, _avx2_row_bytes(pack, k)), torch.uint8)
    if compact:  # the file's super-block scales (_avx2_kscales)
        scales = hugepages.empty((n, k // 256, 18 if t.group == 16 else 20), torch.uint8)
    else:  # Q8_0's scales as the file holds them, float16 (exact; 2 bytes a block fewer)
        scales = hugepages.empty((n, k // t.group), torch.float16 if signed else torch.float32)
    offsets = None if signed or zero or compact else hugepages.empty((n, k // t.group))
    order = _avx2_order(k)
    low, high = _avx2_nibbles(k)
    for start in range(0, n, _VOCAB_CHUNK):
        part = slice(start, min(start + _VOCAB_CHUNK, n))
        u, scale, offset = ref.unpack(blocks[part], t.ggml_type)
        if signed:  # canonical u = q + 128, offset -128 d: keep q with no offset
            u = (u.to(torch.int16) - 128).to(torch.int8).view(torch.uint8)
        if pack == _PACK_U4:
            values[part] = u[:, low] | (u[:, high] << 4)
        elif pack == _PACK_U6:
            values[part] = _avx2_split_planes(u[:, order], 2)
        elif pack == _PACK_U5:
            values[part] = _avx2_split_planes(u[:, order], 1)
        else:
            values[part] = u[:, order]
        scales[part] = _avx2_kscales(blocks[part], t) if compact else scale
        if offsets is not None:
            offsets[part] = offset
    packed = {
        "avx2_values": values,
        "avx2_scales": scales,
        # the kernels' layout word: the packing, and the zero point in bits 16-23
        "avx2_layout": torch.tensor(
            [
                pack | zero << 16 | (_SCALES16 if signed else 0) | (_KSCALES if compact else 0),
                t.group,
            ]
        ),
    }
    if offsets is not None:
        packed["avx2_offsets"] = offsets
    return packed


def _avx2_kscales(blocks: torch.Tensor, t: ref.GGUFType) -> torch.Tensor:
    """The compact scales of K-quant blocks ``[n, K / 256, size]`` (``csrc/gguf_layout.h``),
    uint8 ``[n, K / 256, 20 or 18]``: per super-block, Q4_K / Q5_K's float16 ``d`` and ``dmin``
    (the block's first 4 bytes) then its 8 six-bit sub-scales and 8 mins a byte each; Q6_K's
    float16 ``d`` then its 16 int8 sub-scales. The kernels compute ``d * sc`` and
    ``-(dmin * m)`` in float32, exact, so the same scales and offsets as ``ref.unpack``'s."""
    if t.group == 16:
        return torch.cat((blocks[..., 208:210], blocks[..., 192:208]), dim=-1)
    sc, mn = ref.k_scale_min(blocks[..., 4:16])
    return torch.cat((blocks[..., 0:4], sc, mn), dim=-1)


def _avx2_split_planes(u: torch.Tensor, hb: int) -> torch.Tensor:
    """Q6_K's (``hb`` 2, values < 64) or Q5_K's (``hb`` 1, < 32) values ``u`` ``[n, K]``, in the
    interleaved order, as ``PACK_U6`` / ``PACK_U5``: per group of 256 (8 blocks), 128 bytes whose
    low / high nibbles hold the low 4 bits of positions j / 128 + j (as ``PACK_U4``), then
    ``32 hb`` bytes whose bits ``hb i`` .. ``hb i + hb - 1`` hold the top bits of position
    ``32 hb i + j``; ``4 + hb`` bits a value (``csrc/gguf_layout.h``'s ``split_plane_vec``)."""
    n, k = u.shape
    g = u.view(n, k // 256, 256)
    nib = (g[..., :128] & 0x0F) | ((g[..., 128:] & 0x0F) << 4)
    hi = (g >> 4).view(n, k // 256, 8 // hb, 32 * hb)
    top = torch.zeros_like(hi[..., 0, :])
    for i in range(8 // hb):
        top |= hi[..., i, :] << (hb * i)
    return torch.cat((nib, top), dim=-1).view(n, k // 8 * (4 + hb))


_ROW_BITS = {_PACK_U4: 4, _PACK_U6: 6, _PACK_U5: 5}  # bits a value (else 8)


def _avx2_row_bytes(pack: int, k: int) -> int:
    """Bytes of a packed row of ``k`` values"""
    return k * _ROW_BITS.get(pack & 0xFF, 8) // 8


def _avx2_nk(packed: dict[str, torch.Tensor], pack: int) -> tuple[int, int]:
    """The output and input features of an AVX2-packed weight (or of each expert of a
    stack), from its values (the scales' shape depends on their form)."""
    values = packed["avx2_values"]
    return values.shape[-2], values.shape[-1] * 8 // _ROW_BITS.get(pack & 0xFF, 8)


# The result dtypes the AVX2 products write themselves, and the layout word's bit for bfloat16
_AVX2_OUT = (torch.float32, torch.bfloat16)
_Y_BF16 = 1 << 8
# ... and the bit for float16 scales (Q8_0's)
_SCALES16 = 1 << 9
# ... and the bit for the K-quants' compact scales (Q4_K, Q5_K, Q6_K: per 256 values the file's
# float16 d (and dmin) and its integer sub-scales (and mins), csrc/gguf_layout.h)
_KSCALES = 1 << 11
_KQUANTS = ("Q4_K", "Q5_K", "Q6_K")
# ... and the bit that keeps the products to the AVX2 instructions on a CPU with AVX-512 VNNI
_AVX2_ONLY_BIT = 1 << 10
# Where the library has them (``gguf_avx2_vnni()``: compiled for a CPU with AVX-512 VNNI,
# csrc/gguf_vnni.c), the int8 products run in AVX-512 VNNI unless this is True: tests set it to
# check the AVX2 instructions on such a CPU too, and ``ENGINE_CPU_GGUF_AVX2_ONLY=1`` sets it
# for a process (an A/B of the two paths end to end, e.g. ``engine.benchmarks.gguf_decode``,
# whose model runs in spawned processes that read it on import; the log line of ``_avx2``
# says which path runs). The two paths add the same products in another order, so their
# results differ in the last bits.
AVX2_ONLY = os.environ.get("ENGINE_CPU_GGUF_AVX2_ONLY", "0") == "1"

# Above this many activation rows the product is float32 over tiles of the weight dequantized
# per call. Up to the 128 of the fifth session the int8 products lost from 512 rows (their per-
# block float work grew with the rows); since they scale a group of eight blocks at once and
# tile the rows (csrc/gguf_avx2.c), they are the faster product at every prefill size measured
# on the 2-core EPYC of docs/benchmarks.md (seventh session: at 2048 rows, one thread, 4096 x
# 640 Q5_0 96 against 156 ms, 640 x 1024 Q4_K 28 against 35), so only a step above the
# scheduler's default 8192 tokens takes the float32 path.
AVX2_DENSE_ROWS = 8192
# Weight rows dequantized at a time for that product (a scratch buffer reused across calls:
# a fresh one would page-fault on every call).
_TILE_VALUES = 1 << 20
_scratch: list[torch.Tensor] = []
# The int8 products' quantized activations (grown as needed; not thread-safe either).
_xscratch: list[torch.Tensor] = []
# routed_experts' work buffers (sorted pairs, gathered rows, intermediate products, float32
# sums), the newest first; grown by doubling, the old ones kept (a native plan may hold them).
_moe_work: list[torch.Tensor] = []
# Each layer's product descriptors are kept on its down product's values tensor (so they go
# with the layer), as ``_MOE_DESCRIPTOR``: the stacked tensors' addresses and the activations'
# dtype they were built for, the descriptor tensor (int64 words; its address is what a native
# plan records) and the down product's K. Built once, so that a step reads no tensor's value
# on the host.
_MOE_DESCRIPTOR = "_engine_cpu_moe_descriptor"


def _moe_descriptor(
    products: list[dict[str, torch.Tensor]], bf16: bool
) -> tuple[torch.Tensor, int]:
    """``gguf_avx2_moe``'s descriptors of ``products`` (the gate/up packings, then the down
    one) and its intermediate size."""
    down = products[-1]
    ptrs = tuple(p["avx2_values"].data_ptr() for p in products)
    found = getattr(down["avx2_values"], _MOE_DESCRIPTOR, None)
    if found is not None and found[0] == (ptrs, bf16):
        return found[1:]
    flags = (_Y_BF16 if bf16 else 0) | (_AVX2_ONLY_BIT if AVX2_ONLY else 0)
    words = []
    for p in products:
        pack, group = p["avx2_layout"][0].tolist()
        values, scales, offsets = p["avx2_values"], p["avx2_scales"], p.get("avx2_offsets")
        n, k = _avx2_nk(p, pack)
        words += [
            values.data_ptr(), pack | flags, scales.data_ptr(),
            0 if offsets is None else offsets.data_ptr(), n, k, group,
            values.stride(0) * values.element_size(),
            scales.stride(0) * scales.element_size(),
            0 if offsets is None else offsets.stride(0) * offsets.element_size(),
        ]  # fmt: skip
    inter = _avx2_nk(down, pack)[1]  # the down product's K
    desc = torch.tensor(words, dtype=torch.int64)
    setattr(down["avx2_values"], _MOE_DESCRIPTOR, ((ptrs, bf16), desc, inter))
    return desc, inter


def _avx2_dense_product(x2: torch.Tensor, packed: dict[str, torch.Tensor]) -> torch.Tensor:
    """``x2 [M, K]`` (as float32) times the weight dequantized tile by tile, float32 ``[M, N]``:
    the exact weights, so the product is ``F.linear`` on the dequantized float32 weight. Not
    thread-safe (one scratch buffer): a process runs its model's layers one at a time."""
    lib = native.load("avx2")
    pack, group = packed["avx2_layout"].tolist()
    scales = packed["avx2_scales"]
    n, k = _avx2_nk(packed, pack)
    rows = max(16, _TILE_VALUES // k)
    if not _scratch or _scratch[0].numel() < min(rows, n) * k:
        _scratch[:] = [torch.empty(min(rows, n) * k)]
    offsets = packed.get("avx2_offsets")
    x = x2.float().contiguous()
    y = torch.empty(x.shape[0], n) if n > rows else None
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        w = _scratch[0][: (n1 - n0) * k].view(n1 - n0, k)
        lib.gguf_avx2_dequantize(
            packed["avx2_values"].data_ptr(),
            pack,
            scales.data_ptr(),
            None if offsets is None else offsets.data_ptr(),
            n0,
            n1,
            k,
            group,
            w.data_ptr(),
        )
        if y is None:
            return torch.mm(x, w.t())
        y[:, n0:n1] = torch.mm(x, w.t())
    return y


def _avx2_linear(
    x2: torch.Tensor,
    packed: dict[str, torch.Tensor],
    out: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``x2 [M, K]`` times the packed weight, ``[M, N]`` in ``dtype`` (float32 or bfloat16):
    int8 dot products up to ``AVX2_DENSE_ROWS`` rows, the float32 product over dequantized
    tiles above. ``out``, a float32 or bfloat16 ``[M, N]`` view with unit column stride
    (columns of a wider output), receives the int8 products directly. A bfloat16 result is the
    float32 one rounded by the kernel as ``Tensor.to`` rounds it, so that a decode step in
    bfloat16 needs no torch op after the product (``engine_cpu.plan`` records only kernels)."""
    m = x2.shape[0]
    if m > AVX2_DENSE_ROWS:
        y = _avx2_dense_product(x2, packed)
        return y.to(dtype) if out is None else out.copy_(y)
    lib = native.load("avx2")
    pack, group = packed["avx2_layout"].tolist()  # (iterating the tensor costs ~8 us)
    scales = packed["avx2_scales"]
    n, k = _avx2_nk(packed, pack)
    bf16 = x2.dtype == torch.bfloat16
    xc = x2.contiguous() if bf16 else x2.float().contiguous()
    # The quantized activations in a scratch buffer reused across calls (three torch.empty
    # calls with a dtype cost ~15 us a product, ~100 products a decode step). A grown buffer
    # does not free the old one: a recorded plan (engine_cpu.plan) may still point at it.
    need = m * k + 4 * m * (k // 32 + k // 16) + 128  # xq, xd, xs (up to 16-value groups)
    if not _xscratch or _xscratch[0].numel() < need:
        _xscratch.insert(0, torch.empty(max(need, 1 << 16), dtype=torch.uint8))
    base = _xscratch[0].data_ptr()
    offsets = packed.get("avx2_offsets")
    y = torch.empty(m, n, dtype=dtype) if out is None else out
    lib.gguf_avx2_linear(
        xc.data_ptr(),
        int(bf16),
        packed["avx2_values"].data_ptr(),
        pack | (_Y_BF16 if y.dtype == torch.bfloat16 else 0) | (_AVX2_ONLY_BIT if AVX2_ONLY else 0),
        scales.data_ptr(),
        None if offsets is None else offsets.data_ptr(),
        n,
        k,
        group,
        m,
        base + (-base % 64),
        y.data_ptr(),
        y.stride(0),
    )
    return y


def _avx2_rows(
    packed: dict[str, torch.Tensor],
    ids: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    scale: float | None = None,
) -> torch.Tensor:
    """Rows ``ids`` of an AVX2-packed weight dequantized into ``dtype`` ``[len(ids), K]``: bit
    for bit the reference's dequantization (``scale * u + offset``, one rounding), then, with
    ``scale`` (already rounded to ``dtype``), times it as the embedding's multiply rounds."""
    pack, group = packed["avx2_layout"].tolist()
    scales = packed["avx2_scales"]
    k = _avx2_nk(packed, pack)[1]
    offsets = packed.get("avx2_offsets")
    bf16 = dtype == torch.bfloat16
    if dtype not in (torch.float32, torch.bfloat16):
        rows = _avx2_rows(packed, ids).to(dtype)
        return rows if scale is None else rows * scale
    ids = ids if ids.dtype == torch.int64 and ids.is_contiguous() else ids.long().contiguous()
    out = torch.empty(ids.shape[0], k, dtype=dtype)
    native.load("avx2").gguf_avx2_rows(
        packed["avx2_values"].data_ptr(),
        pack,
        scales.data_ptr(),
        None if offsets is None else offsets.data_ptr(),
        ids.data_ptr(),
        ids.shape[0],
        k,
        group,
        out.data_ptr(),
        int(bf16),
        int(scale is not None),
        1.0 if scale is None else scale,
    )
    return out


def _int4pack(
    values: torch.Tensor, s: torch.Tensor, z: torch.Tensor, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The int4 kernel's tensors for values ``[N, K]`` in [0, 16) and per-32 scales ``s`` /
    zeros ``z`` ``[N, K / 32]``."""
    n, k = values.shape
    pad = -n % 16
    q = values.to(torch.int32)
    if pad:
        q = torch.cat([q, torch.full((pad, k), 8, dtype=torch.int32)])
        s = torch.cat([s, torch.zeros(pad, s.shape[1])])
        z = torch.cat([z, torch.zeros(pad, z.shape[1])])
    sz = torch.stack((s, z), dim=-1).transpose(0, 1)  # [K / 32, N, 2]
    return {
        "int4": torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1),
        "scales_zeros": sz.to(dtype).contiguous(),
        "out_features": torch.tensor(n),
    }


def _dense(w: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A dequantized float32 weight in ``dtype``, oneDNN-prepacked where oneDNN can pack it
    (an opaque tensor: ``F.linear`` would reorder the plain one on every call)."""
    w = w.to(dtype).contiguous()
    if packing_supported(dtype, w.device):
        return {"onednn": torch.ops.mkldnn._reorder_linear_weight(w)}
    return {"dense": w}


_VOCAB_CHUNK = 16384  # rows dequantized at a time (bounds the float32 copy at load)


def _q8_rows(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Split Q8_0 rows dequantized, float32 ``[n, K]``: int8 values ``q`` ``[n, K]`` times their
    float16 block scales ``d`` ``[n, K / 32]`` (exact in float32)."""
    n, nb = d.shape
    return (q.float().view(n, nb, 32) * d.float().unsqueeze(-1)).view(n, nb * 32)


def _vocab_pack(held: list[torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A Q8_0 vocabulary matrix ``[V, K / 32, 34]`` (float16 ``d`` then 32 int8 ``q`` per
    block; handed over in a list, so that it can be released here): the file's int8 values and
    float16 block scales for exact row lookups (1.06 bytes per weight), and the matrix
    dequantized into ``dtype`` and oneDNN-prepacked for the logits (the product the dequantized
    tied head computes, bit for bit: ``d * q`` is exact in float32). The raw blocks are released
    as soon as they are split, which keeps the load's peak about one Q8_0 copy above the
    dequantized path's."""
    blocks = held.pop()  # the only reference left (see CpuGGUFLinear.prepack)
    rows, nb, _ = blocks.shape
    q = blocks[..., 2:].contiguous().view(torch.int8).view(rows, nb * 32)
    d = blocks[..., :2].contiguous().view(torch.float16).view(rows, nb)
    del blocks
    dense = torch.empty(rows, nb * 32, dtype=dtype)
    for start in range(0, rows, _VOCAB_CHUNK):
        part = slice(start, min(start + _VOCAB_CHUNK, rows))
        dense[part] = _q8_rows(q[part], d[part]).to(dtype)
    packed = {"vocab_q": q, "vocab_d": d, **_dense(dense, dtype)}
    del dense
    return_freed_memory()
    return packed


class CpuGGUFLinear:
    """``gguf_linear`` on the CPU (see the module docstring).

    Two optional capabilities of the op, for a decode step without torch ops between the
    compiled kernels (``engine_cpu.plan``): ``writes_out``, the product takes ``out=`` (a
    layer stored in runs of several types fills its columns of one output, no concatenation),
    and ``scales_embedding``, the lookup takes the embedding's ``scale=``. And one for GGUF
    mixture-of-experts layers: ``routed_experts``, a whole layer's experts in one call."""

    writes_out = True
    scales_embedding = True

    def conformance_tolerance(self, dtype: str) -> tuple[float, float] | None:
        """The conformance kit's bound for this op (``engine.testing.checks.check_kernel``):
        with the AMX kernels (16-bit activations) and the AVX2 kernels (every dtype), the
        activations are quantized to int8 per 32 values, which the bf16 tolerance (2e-2) does
        not cover. Over 60 seeds of the kit's cases the largest ``|got - want| / (1 + |want|)``
        was 0.0405 on AMX (2026-12-05); 6e-2 states that with a margin. Without either, the
        exact paths keep the kit's own tolerance."""
        if _amx_serves(getattr(torch, dtype)) or _avx2():
            return (6e-2, 6e-2)
        return None

    def keeps_vocabulary(self, qtype: int, dtype: torch.dtype) -> bool:
        """A tied embedding / LM head stays quantized with 16-bit activations where the AMX
        kernels run, and in every dtype where the AVX2 kernels run (every kept type: the
        lookups dequantize rows of the kernels' layout);
        elsewhere a Q8_0 one keeps its lookup table in 8 bits in bf16 (see
        ``_vocab_pack``)."""
        if _amx_serves(dtype) or _avx2():
            return True
        return (
            ref.gguf_type(qtype).name == "Q8_0"
            and dtype == torch.bfloat16
            and packing_supported(dtype, torch.device("cpu"))
        )

    def prepack(
        self,
        blocks: torch.Tensor,
        *,
        qtype: int,
        dtype: torch.dtype | None = None,
        vocabulary: bool = False,
    ) -> dict[str, torch.Tensor]:
        t = ref.gguf_type(qtype)
        dtype = dtype or torch.float32
        # 4-bit layers too, although torch's int4 kernel holds half the bytes: 16 concurrent
        # requests of the embedded model ran 9% faster with them on AMX (prefill steps: the
        # int4 kernel re-dequantizes per 4 rows), docs/benchmarks.md.
        if _amx_serves(dtype):
            return _amx_pack(blocks, t)
        if _avx2():
            return _avx2_pack(blocks, t)
        if vocabulary and self.keeps_vocabulary(qtype, dtype):
            held = [blocks]
            del blocks  # so that _vocab_pack can free the raw blocks early
            return _vocab_pack(held, dtype)
        values, scale, offset = ref.unpack(blocks, qtype)
        if t.bits == 4 and t.group == 32 and dtype != torch.float32:
            return _int4pack(values, scale, offset + 8.0 * scale, dtype)
        if (t.name, dtype) not in _warned_dense:
            _warned_dense.add((t.name, dtype))
            why = (
                "the int4 kernel is not vectorized for float32 activations"
                if dtype == torch.float32
                else f"{t.bits}-bit values, the int4 kernel takes 4"
            )
            logger.info(
                "gguf_linear on the CPU: %s layers are dequantized at load into %s (%s)",
                t.name,
                dtype,
                why,
            )
        return _dense(ref.dequantize_planes(values, scale, offset, t.group), dtype)

    def __call__(
        self,
        x: torch.Tensor,
        packed: dict[str, torch.Tensor],
        *,
        qtype: int,
        bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``out`` (``writes_out``): a ``[..., N]`` view in ``x``'s dtype, e.g. this run's
        columns of a layer stored in runs of several types, that receives the result."""
        shape = x.shape
        if out is not None and bias is None and "avx2_values" in packed:
            x2 = x.reshape(-1, shape[-1])
            y2 = out.view(x2.shape[0], out.shape[-1]) if out.dim() > 1 else None
            if y2 is not None and out.dtype in _AVX2_OUT and out.stride(-1) == 1:
                _avx2_linear(x2, packed, y2)
                return out
        if "amx_values" in packed:
            y = _amx_linear(x.reshape(-1, shape[-1]), packed)
        elif "avx2_values" in packed:
            # (with a bias, float32 until the bias is added, as before)
            dtype = x.dtype if x.dtype in _AVX2_OUT and bias is None else torch.float32
            y = _avx2_linear(x.reshape(-1, shape[-1]), packed, dtype=dtype)
        elif "onednn" in packed:
            x2 = x.reshape(-1, shape[-1]).to(packed["onednn"].dtype).contiguous()
            y = torch.ops.mkldnn._linear_pointwise(x2, packed["onednn"], None, "none", [], "")
        elif "dense" in packed:
            w = packed["dense"]
            y = F.linear(x.reshape(-1, shape[-1]).to(w.dtype), w)
        else:
            sz = packed["scales_zeros"]
            x2 = x.reshape(-1, shape[-1]).to(sz.dtype).contiguous()
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed["int4"], 32, sz)
            n = int(packed["out_features"])
            if y.shape[-1] != n:
                y = y[:, :n]
        if bias is not None:
            y = y + bias.to(y.dtype)
        y = y.to(x.dtype).view(*shape[:-1], y.shape[-1])
        return y if out is None else out.copy_(y)

    def routed_experts(
        self,
        hidden: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        gate_up: list[dict[str, torch.Tensor]],
        down: dict[str, torch.Tensor],
    ) -> torch.Tensor | None:
        """A MoE layer's routed experts in one compiled call (``gguf_avx2_moe``), for
        ``engine.quantization.gguf_moe``: ``gate_up`` the packed gate/up products and ``down``
        the down product, each tensor stacked over the experts (``[E, ...]``). The same kernels
        in the same order as the torch loop over experts, so the same result, without its torch
        ops. None where the AVX2 kernels do not hold the experts (AMX or torch packings) or the
        activations are neither float32 nor bfloat16: the caller loops over experts."""
        products = [*gate_up, down]
        if hidden.dtype not in _AVX2_OUT or not all("avx2_values" in p for p in products):
            return None
        t, h = hidden.shape
        if t > AVX2_DENSE_ROWS:  # the float32 product of _avx2_linear above these rows
            return None
        lib = native.load("avx2")
        bf16 = hidden.dtype == torch.bfloat16
        desc, inter = _moe_descriptor(products, bf16)
        k = max(h, inter)
        need = t * k + 4 * t * (k // 32 + k // 16) + 128
        if not _xscratch or _xscratch[0].numel() < need:
            _xscratch.insert(0, torch.empty(max(need, 1 << 16), dtype=torch.uint8))
        base = _xscratch[0].data_ptr()
        pairs = topk_ids.numel()
        # Sorted pairs, gathered rows, intermediate products, then the float32 sums.
        need = ((4 * pairs + 63) & ~63) + t * (2 * h + 3 * inter) * (2 if bf16 else 4)
        need = ((need + 63) & ~63) + 4 * t * h
        if not _moe_work or _moe_work[0].numel() < need:
            _moe_work.insert(0, torch.empty(max(need, 2 * _moe_work[0].numel() if _moe_work else 0),
                                            dtype=torch.uint8))  # fmt: skip
        work = _moe_work[0].data_ptr()
        x = hidden.contiguous() if bf16 else hidden.float().contiguous()
        ids = topk_ids.to(torch.int32).contiguous()
        weights = topk_weights.float().contiguous()
        out = torch.empty(t, h, dtype=hidden.dtype)
        acc = out.data_ptr() if not bf16 else work + need - 4 * t * h
        lib.gguf_avx2_moe(
            x.data_ptr(), int(bf16), t, h, ids.data_ptr(), weights.data_ptr(), ids.shape[1],
            down["avx2_values"].shape[0], desc.data_ptr(), len(gate_up), inter,
            base + (-base % 64), work, acc, out.data_ptr(),
        )  # fmt: skip
        return out

    def embedding(
        self,
        ids: torch.Tensor,
        packed: dict[str, torch.Tensor],
        *,
        qtype: int,
        dtype: torch.dtype,
        scale: float | None = None,
    ) -> torch.Tensor:
        """The rows ``ids`` dequantized into ``dtype``, bit for bit the reference's; times
        ``scale`` (``scales_embedding``: rounded to ``dtype`` by the caller) when given."""
        if "avx2_values" in packed:
            rows = _avx2_rows(packed, ids.reshape(-1), dtype, scale)
            return rows.view(*ids.shape, -1)
        if "amx_values" in packed:
            rows = _amx_rows(packed, ids.reshape(-1)).to(dtype).view(*ids.shape, -1)
        elif "vocab_q" not in packed:
            rows = ref.gguf_linear.embedding(ids, packed, qtype=qtype, dtype=dtype)
        else:
            flat = ids.reshape(-1)
            q8 = _q8_rows(
                packed["vocab_q"].index_select(0, flat), packed["vocab_d"].index_select(0, flat)
            )
            rows = q8.to(dtype).view(*ids.shape, -1)
        return rows if scale is None else rows * scale


gguf_linear = CpuGGUFLinear()
