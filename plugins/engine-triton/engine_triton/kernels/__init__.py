"""engine-llm-triton's kernels: Triton implementations of the named ops and of paged attention.

``register(registry)`` is called from the plugin's ``engine_kernels`` hook. It overrides every
named op for the GPU platforms (``cuda``, ``rocm``) at priority 10. Tests that run the engine
in Triton's CPU interpreter pass ``platforms=("cpu",)`` explicitly: an environment variable
alone never reroutes the CPU platform's kernels. Importing this package imports Triton, so the
plugin imports it only inside the hook.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from engine_triton.kernels._interpreter import patch_if_interpreting

if TYPE_CHECKING:
    from engine.kernels.registry import KernelRegistry

patch_if_interpreting()

PROVIDER = "engine-llm-triton"
PRIORITY = 10
GPU_PLATFORMS = ("cuda", "rocm")


def register(registry: KernelRegistry, platforms: Iterable[str] = GPU_PLATFORMS) -> None:
    """Register every Triton kernel with the engine's kernel registry for ``platforms``."""
    from engine_triton.kernels.activation import (
        gelu_tanh_and_mul,
        silu_and_mul,
        silu_and_mul_quant_fp8,
    )
    from engine_triton.kernels.argmax import argmax
    from engine_triton.kernels.fp8_linear import fp8_block_linear, fp8_linear
    from engine_triton.kernels.fused_moe import (
        fused_moe,
        fused_moe_biased,
        fused_moe_fp8,
        fused_moe_wna16,
        moe_topk_softmax,
    )
    from engine_triton.kernels.gguf_linear import gguf_linear
    from engine_triton.kernels.int8_linear import int8_linear
    from engine_triton.kernels.kv_cache import write_kv_cache
    from engine_triton.kernels.linear import linear
    from engine_triton.kernels.lora import add_lora_linear, lora_expand_augmented
    from engine_triton.kernels.norm import (
        fused_add_rms_norm,
        fused_add_rms_norm_quant_fp8,
        rms_norm,
        rms_norm_quant_fp8,
    )
    from engine_triton.kernels.rotary import qk_norm_rotary, rotary_embedding
    from engine_triton.kernels.wna16_linear import wna16_linear

    ops = {
        "rms_norm": rms_norm,
        "fused_add_rms_norm": fused_add_rms_norm,
        "rotary_embedding": rotary_embedding,
        "qk_norm_rotary": qk_norm_rotary,
        "silu_and_mul": silu_and_mul,
        "gelu_tanh_and_mul": gelu_tanh_and_mul,
        "rms_norm_quant_fp8": rms_norm_quant_fp8,
        "fused_add_rms_norm_quant_fp8": fused_add_rms_norm_quant_fp8,
        "silu_and_mul_quant_fp8": silu_and_mul_quant_fp8,
        "write_kv_cache": write_kv_cache,
        "linear": linear,
        "argmax": argmax,
        "moe_topk_softmax": moe_topk_softmax,
        "fused_moe": fused_moe,
        "fused_moe_biased": fused_moe_biased,
        "fused_moe_fp8": fused_moe_fp8,
        "fused_moe_wna16": fused_moe_wna16,
        "fp8_linear": fp8_linear,
        "fp8_block_linear": fp8_block_linear,
        "int8_linear": int8_linear,
        "wna16_linear": wna16_linear,
        "add_lora_linear": add_lora_linear,
        "lora_expand_augmented": lora_expand_augmented,
        "gguf_linear": gguf_linear,
    }
    for name, fn in ops.items():
        registry.register(
            name, fn, platforms=tuple(platforms), priority=PRIORITY, provider=PROVIDER
        )
