"""Entry point of engine-llm-tpu (``tpu = "engine_tpu.plugin"``). Import-light: no torch_xla."""

from __future__ import annotations

from engine.hookspecs import hookimpl

ENGINE_PLUGIN_API = "1"


@hookimpl
def engine_platform():
    """The TPU platform (its ``unavailable_reasons`` say when torch_xla or a device is missing)."""
    from engine_tpu.platform import TpuPlatform

    return TpuPlatform
