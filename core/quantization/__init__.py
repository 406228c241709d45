"""Quantization methods: a registry of named methods (``--quantization NAME``, or the
checkpoint's ``quantization_config``), each creating, loading and multiplying the weights of the
linear layers through ``engine.layers.linear.LinearMethod`` and the kernel registry's quantized
ops. See docs/quantization.md."""

from engine.quantization.base import (
    QuantizationConfig,
    QuantizationError,
    QuantizationSpec,
)
from engine.quantization.registry import (
    QuantizationRegistry,
    checkpoint_quantization_config,
)

__all__ = [
    "QuantizationConfig",
    "QuantizationError",
    "QuantizationSpec",
    "QuantizationRegistry",
    "checkpoint_quantization_config",
]
