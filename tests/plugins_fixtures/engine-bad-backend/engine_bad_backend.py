"""A plugin whose attention backend cannot be imported."""

from engine.hookspecs import hookimpl

ENGINE_PLUGIN_API = "1"


@hookimpl
def engine_attention_backends():
    return {"bad": "engine_bad_backend_impl.does_not_exist:Backend"}
