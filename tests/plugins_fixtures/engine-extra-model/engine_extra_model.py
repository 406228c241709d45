"""A plugin that serves a new architecture name with the built-in Llama implementation."""

from engine.hookspecs import hookimpl

ENGINE_PLUGIN_API = "1"


@hookimpl
def engine_models(registry):
    registry.register("ExtraLlamaForCausalLM", "engine.models.llama:LlamaForCausalLM")
