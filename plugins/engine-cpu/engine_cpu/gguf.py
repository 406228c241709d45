"""``gguf_linear`` on the CPU (spec: ``engine.kernels.gguf.GGUFLinear``).

Every kept type decodes to ``W = scale * v + offset`` per group (``engine.kernels.gguf``). At
load the blocks are repacked for torch's CPU int4 kernel (``_weight_int4pack_mm_for_cpu``,
which dequantizes in registers, ``(q - 8) * s + z`` per group of 32):

* 4-bit types (Q4_0, Q4_1, Q4_K): ``v`` as is, ``s = scale``, ``z = offset + 8 * scale``;
  0.5 byte per weight plus the group scales, one int4 product per call;
* 5-, 6- and 8-bit types with groups of 32 (Q5_0, Q5_1, Q5_K, Q8_0): ``v = lo + 16 * hi``
  split into two 4-bit planes side by side along K, the high plane scaled by ``16 * scale``
  (``z = 128 * scale`` makes its offset vanish); the input is repeated along K, so one int4
  product of twice the depth computes both (1 byte per weight);
* Q6_K, whose 16-value groups the int4 kernel does not take (it accepts 32/64/128/256): the
  weight is dequantized once at load into the activation dtype and multiplied densely (2 bytes
  per weight in bf16; said in the log once per process);
* float32 activations: every type dense in float32 at load (the log says so). torch's int4
  kernel has no vectorized float32 path: on this project's 2-core Zen 4, one thread, a
  2048 x 640 product at batch 1 took 6.9 ms through it in float32 against 0.31 ms dense
  (bf16: 0.17 ms int4, 0.20 ms oneDNN-packed dense; the two-plane 5/8-bit form 0.26 ms).

The scales are kept in the activation dtype (the kernel's requirement), so in bf16 the product
differs from the float32 dequantization by the rounding of the scales; float32 is exact to the
summation order. Output features are padded to a multiple of 16 (the kernel's tile).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from engine.kernels import gguf as ref

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


class CpuGGUFLinear:
    """``gguf_linear`` on the CPU (see the module docstring)."""

    def prepack(
        self, blocks: torch.Tensor, *, qtype: int, dtype: torch.dtype | None = None
    ) -> dict[str, torch.Tensor]:
        t = ref.gguf_type(qtype)
        dtype = dtype or torch.float32
        values, scale, offset = ref.unpack(blocks, qtype)
        if t.group != 32 or dtype == torch.float32:
            why = (
                "the int4 kernel is not vectorized for float32 activations"
                if dtype == torch.float32
                else f"groups of {t.group} values, the int4 kernel takes 32 or more"
            )
            if (t.name, dtype) not in _warned_dense:
                _warned_dense.add((t.name, dtype))
                logger.info(
                    "gguf_linear on the CPU: %s layers are dequantized at load into %s (%s)",
                    t.name,
                    dtype,
                    why,
                )
            w = ref.dequantize_planes(values, scale, offset, t.group)
            return {"dense": w.to(dtype).contiguous()}
        if t.bits == 4:
            return _int4pack(values, scale, offset + 8.0 * scale, dtype)
        lo, hi = values & 0x0F, values >> 4
        planes = torch.cat((lo, hi), dim=1)  # [N, 2K]
        s = torch.cat((scale, 16.0 * scale), dim=1)
        z = torch.cat((offset + 8.0 * scale, 128.0 * scale), dim=1)
        packed = _int4pack(planes, s, z, dtype)
        packed["repeat"] = torch.tensor(2)
        return packed

    def __call__(
        self,
        x: torch.Tensor,
        packed: dict[str, torch.Tensor],
        *,
        qtype: int,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        shape = x.shape
        if "dense" in packed:
            w = packed["dense"]
            y = F.linear(x.reshape(-1, shape[-1]).to(w.dtype), w)
        else:
            sz = packed["scales_zeros"]
            x2 = x.reshape(-1, shape[-1]).to(sz.dtype)
            if "repeat" in packed:
                x2 = torch.cat((x2, x2), dim=-1)
            x2 = x2.contiguous()
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed["int4"], 32, sz)
            n = int(packed["out_features"])
            if y.shape[-1] != n:
                y = y[:, :n]
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.to(x.dtype).view(*shape[:-1], y.shape[-1])


gguf_linear = CpuGGUFLinear()
