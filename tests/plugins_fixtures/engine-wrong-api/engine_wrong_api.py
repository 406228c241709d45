"""A plugin built for plugin API 2."""

from engine.hookspecs import hookimpl

ENGINE_PLUGIN_API = "2.0"


@hookimpl
def engine_attention_backends():
    return {}
