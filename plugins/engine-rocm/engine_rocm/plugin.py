"""Entry point of engine-llm-rocm (``rocm = "engine_rocm.plugin"``). Import-light: no torch."""

from __future__ import annotations

from engine.hookspecs import hookimpl

ENGINE_PLUGIN_API = "1"


@hookimpl
def engine_platform():
    """The ROCm platform (its ``unavailable_reasons`` say when there is no usable AMD GPU)."""
    from engine_rocm.platform import RocmPlatform

    return RocmPlatform
