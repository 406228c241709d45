"""A plugin whose hook takes an argument the hook specification does not have."""

from engine.hookspecs import hookimpl

ENGINE_PLUGIN_API = "1"


@hookimpl
def engine_kernels(registry, device):
    pass
