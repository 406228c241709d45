"""A plugin that does not declare ENGINE_PLUGIN_API."""

from engine.hookspecs import hookimpl


@hookimpl
def engine_attention_backends():
    return {}
