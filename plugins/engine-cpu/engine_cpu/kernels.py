"""CPU kernel overrides: where a different torch op computes exactly the reference's result,
faster on the CPU.

``argmax``: ``torch.max(dim=-1)`` returns the same index as ``torch.argmax`` (the first
maximum when tied, a NaN counting as the maximum), but its CPU kernel is vectorized for
bfloat16 and ``argmax``'s is not. On a 2-core EPYC, the greedy step of the embedded Gemma 3
(262,144-entry vocabulary) at batch 32 took 15.5 ms with ``argmax`` and 3.6 ms with ``max``
(float32: 3.7 and 4.2 ms, so float32 keeps ``argmax``). Where the AVX2 kernels are built, float32
takes ``cpu_argmax_f32`` (``csrc/cpu_ops.c``): one 262,144-entry row in 255 us through
``torch.argmax``, a single thread, which a greedy batch-1 step paid after its LM head.
"""

from __future__ import annotations

import torch

from engine_cpu import native


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """See ``engine.kernels.reference.argmax``: [N, V] -> int64 [N], the first maximum."""
    if logits.dtype in (torch.bfloat16, torch.float16):
        return logits.max(dim=-1).indices
    if (
        logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.shape[0] > 0
        and logits.shape[1] > 0
        and logits.stride(-1) == 1
        and logits.device.type == "cpu"
    ):
        lib = native.load("avx2")
        if lib is not None:
            out = torch.empty(logits.shape[0], dtype=torch.int64)
            lib.cpu_argmax_f32(
                logits.data_ptr(),
                logits.shape[0],
                logits.shape[1],
                logits.stride(0),
                out.data_ptr(),
            )
            return out
    return logits.argmax(dim=-1)


def register(registry) -> None:
    """Register the CPU overrides for the ``cpu`` platform (the norms and rotary are in
    ``engine_cpu.norms``, the gated activations in ``engine_cpu.activations``, the quantized
    matmuls in ``engine_cpu.quantized``, a MoE layer's routing in ``engine_cpu.routing``)."""
    from engine_cpu.activations import ACTIVATION_KERNELS
    from engine_cpu.norms import NORM_KERNELS
    from engine_cpu.quantized import QUANTIZED_KERNELS
    from engine_cpu.routing import ROUTING_KERNELS

    registry.register("argmax", argmax, platforms=("cpu",), provider="engine-llm-cpu")
    kernels = {**NORM_KERNELS, **ACTIVATION_KERNELS, **QUANTIZED_KERNELS, **ROUTING_KERNELS}
    for name, fn in kernels.items():
        registry.register(name, fn, platforms=("cpu",), provider="engine-llm-cpu")
