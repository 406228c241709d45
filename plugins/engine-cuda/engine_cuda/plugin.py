"""Entry point of engine-cuda (``cuda = "engine_cuda.plugin"``). Import-light: no torch."""

from __future__ import annotations

from engine.hookspecs import hookimpl

ENGINE_PLUGIN_API = "1"


@hookimpl
def engine_platform():
    """The CUDA platform (its ``unavailable_reasons`` say when there is no usable GPU)."""
    from engine_cuda.platform import CudaPlatform

    return CudaPlatform
