"""Entry point of engine-llm-triton (``triton = "engine_triton.plugin"``).

Import-light: neither triton nor torch is imported until a hook needs them.
"""

from __future__ import annotations

from engine.hookspecs import hookimpl
from engine.platforms.detect import module_available

ENGINE_PLUGIN_API = "1"

TRITON_ATTENTION_BACKEND = "engine_triton.attention:TritonAttentionBackend"


@hookimpl
def engine_attention_backends() -> dict[str, str]:
    """The ``triton`` attention backend, by qualified name (imported only when used)."""
    return {"triton": TRITON_ATTENTION_BACKEND}


@hookimpl
def engine_kernels(registry) -> None:
    """Triton kernel overrides for the cuda and rocm platforms.

    Without the ``triton`` package there is nothing to register (the engine then uses the torch
    references, and ``engine plugins`` shows the triton backend's reason); with it,
    ``engine_triton.kernels.register`` adds the overrides.
    """
    if not module_available("triton"):
        return
    from engine_triton import kernels

    kernels.register(registry)
