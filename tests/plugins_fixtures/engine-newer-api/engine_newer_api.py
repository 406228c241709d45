"""A plugin built for a newer minor version of plugin API 1 than this engine speaks."""

from engine.hookspecs import hookimpl

ENGINE_PLUGIN_API = "1.99"


@hookimpl
def engine_attention_backends():
    return {}
