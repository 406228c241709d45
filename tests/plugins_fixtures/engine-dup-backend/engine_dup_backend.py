"""A plugin that provides an attention backend under a name the core already uses."""

from engine.hookspecs import hookimpl

ENGINE_PLUGIN_API = "1"


@hookimpl
def engine_attention_backends():
    return {"torch": "engine_dup_backend:Missing"}
