"""Entry point of engine-llm-cpu (``[project.entry-points.engine] cpu = "engine_cpu.plugin"``).

Kept import-light: the platform class module imports neither torch nor psutil at top level.
"""

from __future__ import annotations

from engine.hookspecs import hookimpl

ENGINE_PLUGIN_API = "1"


@hookimpl
def engine_platform():
    """The CPU platform (always available)."""
    from engine_cpu.platform import CpuPlatform

    return CpuPlatform


@hookimpl
def engine_attention_backends() -> dict[str, str]:
    """The ``cpu`` backend (compiled decode attention), by qualified name (imported when used)."""
    return {"cpu": "engine_cpu.attention:CpuAttentionBackend"}


@hookimpl
def engine_kernels(registry) -> None:
    """CPU kernel overrides (``engine_cpu.kernels``): exact, only faster."""
    from engine_cpu import kernels

    kernels.register(registry)


@hookimpl
def engine_communicator(platform, group):
    """gloo collectives through torch.distributed, for the cpu platform."""
    if platform.name != "cpu":
        return None
    from engine.distributed import TorchDistributedCommunicator

    return TorchDistributedCommunicator(group, backend="gloo")
