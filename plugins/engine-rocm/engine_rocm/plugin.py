"""Entry point of engine-llm-rocm (``rocm = "engine_rocm.plugin"``). Import-light: no torch."""

from __future__ import annotations

from engine.hookspecs import hookimpl

ENGINE_PLUGIN_API = "1"


@hookimpl
def engine_platform():
    """The ROCm platform (its ``unavailable_reasons`` say when there is no usable AMD GPU)."""
    from engine_rocm.platform import RocmPlatform

    return RocmPlatform


@hookimpl
def engine_attention_backends() -> dict[str, str]:
    """``triton-rocm``: engine-triton's paged attention with AMD launch configurations per gfx
    family (``engine_rocm.tuning``), by qualified name (imported only when selected)."""
    return {"triton-rocm": "engine_rocm.attention:RocmTritonAttentionBackend"}


@hookimpl
def engine_communicator(platform, group):
    """RCCL collectives (torch.distributed's ``nccl`` backend on a ROCm build), for rocm."""
    if platform.name != "rocm":
        return None
    from engine_rocm.communicator import RcclCommunicator

    return RcclCommunicator(group)
