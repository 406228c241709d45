"""The plugin module named by the entry point. Keep it import-light: the engine imports it on
every start-up, so it imports neither torch nor the backend; classes are returned lazily."""

from __future__ import annotations

from engine.hookspecs import hookimpl

# The plugin API this plugin was built against: 1.1 added engine_communicator, which we use.
ENGINE_PLUGIN_API = "1.1"


@hookimpl
def engine_platform():
    """Our platform class (returned even when the device is absent: it explains why)."""
    from engine_example_vendor.platform import ExampleVendorPlatform

    return ExampleVendorPlatform


@hookimpl
def engine_attention_backends() -> dict[str, str]:
    """Our attention backend, by qualified name: imported only if it is selected."""
    return {"example": "engine_example_vendor.attention:ExampleAttentionBackend"}


@hookimpl
def engine_communicator(platform, group):
    """Collectives for our platform only. The simulated device computes on the host, so gloo
    through torch.distributed; a real vendor returns its own Communicator subclass here."""
    if platform.name != "examplevendor":
        return None
    from engine.distributed import TorchDistributedCommunicator

    return TorchDistributedCommunicator(group, backend="gloo")
