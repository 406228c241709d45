"""Entry point of engine-llm-tpu (``tpu = "engine_tpu.plugin"``). Import-light: no torch_xla."""

from __future__ import annotations

from engine.hookspecs import hookimpl

ENGINE_PLUGIN_API = "1"


@hookimpl
def engine_platform():
    """The TPU platform (its ``unavailable_reasons`` say when torch_xla or a device is missing)."""
    from engine_tpu.platform import TpuPlatform

    return TpuPlatform


@hookimpl
def engine_attention_backends() -> dict[str, str]:
    """``pallas`` (torch_xla's Pallas kernel, TPUs only) and ``xla`` (static shapes, any XLA
    device), by qualified name: nothing is imported until one is selected."""
    return {
        "pallas": "engine_tpu.attention:PallasAttentionBackend",
        "xla": "engine_tpu.attention:XlaAttentionBackend",
    }


@hookimpl
def engine_communicator(platform, group):
    """torch_xla's ``xm`` collectives (traced into the XLA graph), for the tpu platform."""
    if platform.name != "tpu":
        return None
    from engine_tpu.communicator import XlaCommunicator

    return XlaCommunicator(group)
