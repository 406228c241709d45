"""``gguf_linear`` on the CPU (spec: ``engine.kernels.gguf.GGUFLinear``).

Every kept type decodes to ``W = scale * v + offset`` per group (``engine.kernels.gguf``). At
load the blocks are repacked:

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

import torch
import torch.nn.functional as F

from engine.kernels import gguf as ref
from engine.layers.cpu_packed_linear import packing_supported, return_freed_memory

logger = logging.getLogger(__name__)

_warned_dense: set[tuple[str, torch.dtype]] = set()


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
    """``gguf_linear`` on the CPU (see the module docstring)."""

    def keeps_vocabulary(self, qtype: int, dtype: torch.dtype) -> bool:
        """A tied Q8_0 embedding / LM head keeps its lookup table in 8 bits in bf16 (see
        ``_vocab_pack``)."""
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
    ) -> torch.Tensor:
        shape = x.shape
        if "onednn" in packed:
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
        return y.to(x.dtype).view(*shape[:-1], y.shape[-1])

    def embedding(
        self,
        ids: torch.Tensor,
        packed: dict[str, torch.Tensor],
        *,
        qtype: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """The rows ``ids`` dequantized into ``dtype``, bit for bit the reference's."""
        if "vocab_q" not in packed:
            return ref.gguf_linear.embedding(ids, packed, qtype=qtype, dtype=dtype)
        flat = ids.reshape(-1)
        rows = _q8_rows(
            packed["vocab_q"].index_select(0, flat), packed["vocab_d"].index_select(0, flat)
        )
        return rows.to(dtype).view(*ids.shape, -1)


gguf_linear = CpuGGUFLinear()
