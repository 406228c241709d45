"""INT8 W8A8: ``int8_linear`` on GPUs (spec: ``engine.kernels.quantized.int8_linear``).

The activations are quantized per token (or with the static scale and zero point) by torch ops,
the integer product runs on cuBLASLt's int8 tensor cores through ``torch._int_mm`` (int32
accumulation, exact), and the scales apply in float32. ``_int_mm`` needs more than 16 rows and
K, N multiples of 8: decode batches are padded to 32 rows. A static zero point is folded out
afterwards (``(q - z) W^T = q W^T - z * rowsum(W)``), at the cost of one pass over the weight
per call, since ``q - z`` can leave the int8 range.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.quantized import int8_dynamic_scale, int8_quantize

_MIN_ROWS = 32


def int8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    input_zero_point: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """See ``engine.kernels.quantized.int8_linear``."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    m = x2.shape[0]
    n, k = weight.shape
    if input_scale is None:
        sx = int8_dynamic_scale(x2)
        q = int8_quantize(x2, sx)
    else:
        sx = input_scale.float().reshape(1, 1)
        q = int8_quantize(x2, sx, input_zero_point)
    q = q.to(torch.int8)
    if x.device.type == "cuda" and k % 8 == 0 and n % 8 == 0:
        rows = max(m, _MIN_ROWS)
        if rows != m:
            q = F.pad(q, (0, 0, 0, rows - m))
        acc = torch._int_mm(q, weight.t())[:m]
    else:  # a layout cuBLASLt refuses: exact in float64 (slow, never silent: same result)
        acc = (q.double() @ weight.double().t()).to(torch.int64)
    if input_zero_point is not None:
        acc = acc - input_zero_point.to(acc.dtype).reshape(1, 1) * weight.sum(1, dtype=acc.dtype)
    y = acc.float() * sx * weight_scale.float().reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*shape[:-1], n)
