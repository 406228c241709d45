"""A plugin with a misspelled hook name."""

from engine.hookspecs import hookimpl

ENGINE_PLUGIN_API = "1"


@hookimpl
def engine_platfrom():
    return None
