"""The model's quantization config for an engine configuration: what the engine process and
every worker process (tensor / pipeline parallel ranks) resolve, the same way, from the same
flags, checkpoint and platform."""

from __future__ import annotations

from typing import Any

from engine.quantization.base import QuantizationSpec
from engine.quantization.registry import checkpoint_quantization_config


def resolve_quantization(
    config: Any, hf_config: Any, platform: Any, kernels: Any, plugins: Any
) -> Any:
    """The model's quantization configuration (None: unquantized), from ``--quantization``
    and the checkpoint's ``quantization_config``, checked against the device and the kernels
    bound on it. Raises ``QuantizationError`` (a ``ConfigError``) with what is supported."""
    capability = None
    if platform.device_type != "cpu":
        capability = platform.device_capability(0)
    spec = QuantizationSpec(
        platform=platform.name,
        device_type=platform.device_type,
        capability=capability,
        dtype=config.model.dtype,
        kernels=kernels,
    )
    registry = plugins.quantization_methods()
    return registry.resolve(
        config.model.quantization, checkpoint_quantization_config(hf_config), spec
    )
