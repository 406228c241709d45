"""A MoE layer's routing on the CPU in compiled kernels (``csrc/cpu_ops.c``), so that its decode
steps can run as native plans (``engine_cpu.plan``), which refuse the torch ops of the
references:

* ``linear`` for a router's product (``SparseMoeBlock.gate``: a few hundred outputs at most,
  left unpacked by ``engine.layers.cpu_packed_linear`` for this reason): ``cpu_dense_linear``,
  float32 sums of bfloat16 or float32 operands, rounded once to the activations' dtype, for up
  to ``MAX_ROWS`` rows and ``MAX_OUTPUTS`` outputs; anything else is ``F.linear``.
* ``moe_topk_softmax``: ``cpu_topk_softmax``, the float32 softmax, the top k in descending order
  (ties to the lower expert index) and the renormalisation in one call per layer, as
  ``engine.kernels.reference.moe_topk_softmax`` computes them (its exponentials may differ from
  torch's in the last bit).

Without the AVX2 library (``engine_cpu.native``) both are the references.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels import reference as ref
from engine_cpu import native

MAX_ROWS = 64  # the largest decode batch a native plan records (engine_cpu.plan.MAX_PLAN_BATCH)
MAX_OUTPUTS = 1024  # routers: 8 to 512 experts
_DTYPES = (torch.float32, torch.bfloat16)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """See ``engine.kernels.reference.linear``: ``x @ weight.T + bias``."""
    n, k = weight.shape if weight.dim() == 2 else (0, 0)
    rows = x.numel() // k if k else 0
    lib = native.load("avx2") if 0 < rows <= MAX_ROWS and 0 < n <= MAX_OUTPUTS else None
    if (
        lib is None
        or bias is not None
        or x.dtype not in _DTYPES
        or weight.dtype != x.dtype
        or x.device.type != "cpu"
        or not weight.is_contiguous()
        or weight.layout != torch.strided
        or weight.is_mkldnn
    ):
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(rows, n, dtype=x.dtype)
    bf16 = int(x.dtype == torch.bfloat16)  # x, weight and y share the dtype
    lib.cpu_dense_linear(
        x2.data_ptr(), x2.stride(0), bf16, rows, k, weight.data_ptr(), bf16, n, y.data_ptr(), n,
        bf16,
    )  # fmt: skip
    return y.view(*x.shape[:-1], n)


def moe_topk_softmax(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``engine.kernels.reference.moe_topk_softmax``."""
    lib = native.load("avx2")
    if (
        lib is None
        or router_logits.dim() != 2
        or router_logits.dtype not in _DTYPES
        or router_logits.device.type != "cpu"
        or router_logits.stride(-1) != 1
        or not 0 < top_k <= router_logits.shape[1]
    ):
        return ref.moe_topk_softmax(router_logits, top_k, renormalize)
    t, e = router_logits.shape
    weights = torch.empty(t, top_k, dtype=torch.float32)
    ids = torch.empty(t, top_k, dtype=torch.int32)
    if t:
        lib.cpu_topk_softmax(
            router_logits.data_ptr(), router_logits.stride(0),
            int(router_logits.dtype == torch.bfloat16), t, e, top_k, int(renormalize),
            weights.data_ptr(), ids.data_ptr(),
        )  # fmt: skip
    return weights, ids


ROUTING_KERNELS = {"linear": linear, "moe_topk_softmax": moe_topk_softmax}
