"""CPU overrides of the gated activations (``act(gate) * up``): one compiled call
(``cpu_gated_act`` in ``csrc/cpu_ops.c``) in place of torch's chunk, activation and product.

GELU with the tanh approximation is computed as ``g / (1 + exp(-2u))``, the same function as
the reference's ``0.5 g (1 + tanh(u))``, with a vectorized ``exp``, so a value can differ from
torch's in the last bits (as the compiled norms can); the product rounds as the reference's two
ops do. Other dtypes and layouts, CPUs without AVX2 and ``ENGINE_CPU_NATIVE=0`` keep the torch
reference.
"""

from __future__ import annotations

import torch

from engine.kernels import reference
from engine_cpu import native

_SILU, _GELU_TANH = 0, 1


def _gated(x: torch.Tensor, act: int) -> torch.Tensor | None:
    if x.dtype not in (torch.float32, torch.bfloat16) or x.stride(-1) != 1 or not x.is_cpu:
        return None
    lib = native.load("avx2")
    if lib is None:
        return None
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if x2.stride(-1) != 1:
        return None
    inter = x2.shape[1] // 2
    out = torch.empty(x2.shape[0], inter, dtype=x.dtype)
    lib.cpu_gated_act(
        x2.data_ptr(),
        x2.stride(0),
        out.data_ptr(),
        inter,
        int(x.dtype == torch.bfloat16),
        x2.shape[0],
        inter,
        act,
    )
    return out.view(*x.shape[:-1], inter)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """See ``engine.kernels.reference.silu_and_mul``."""
    out = _gated(x, _SILU)
    return reference.silu_and_mul(x) if out is None else out


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """See ``engine.kernels.reference.gelu_tanh_and_mul``."""
    out = _gated(x, _GELU_TANH)
    return reference.gelu_tanh_and_mul(x) if out is None else out


ACTIVATION_KERNELS = {"silu_and_mul": silu_and_mul, "gelu_tanh_and_mul": gelu_tanh_and_mul}
