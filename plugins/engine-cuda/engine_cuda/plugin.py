"""Entry point of engine-llm-cuda (``cuda = "engine_cuda.plugin"``). Import-light: no torch."""

from __future__ import annotations

from engine.hookspecs import hookimpl

ENGINE_PLUGIN_API = "1"


@hookimpl
def engine_platform():
    """The CUDA platform (its ``unavailable_reasons`` say when there is no usable GPU)."""
    from engine_cuda.platform import CudaPlatform

    return CudaPlatform


@hookimpl
def engine_attention_backends() -> dict[str, str]:
    """``sdpa`` (torch SDPA over gathered pages, a fall-back) and ``flash-attn`` (only where the
    flash_attn package is installed), by qualified name: nothing is imported until selected."""
    return {
        "sdpa": "engine_cuda.sdpa_backend:SdpaAttentionBackend",
        "flash-attn": "engine_cuda.flash_attn_backend:FlashAttnBackend",
    }


@hookimpl
def engine_communicator(platform, group):
    """NCCL collectives through torch.distributed, for the cuda platform."""
    if platform.name != "cuda":
        return None
    from engine.distributed import TorchDistributedCommunicator

    return TorchDistributedCommunicator(group, backend="nccl")
