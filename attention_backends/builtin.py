"""The core's own plugin: the portable torch reference attention backend.

It is registered by ``engine.plugins.PluginManager`` directly (not through an entry point), so
the reference backend exists whatever ``ENGINE_PLUGINS`` says. The backend is named by qualified
name: nothing is imported until it is selected.
"""

from __future__ import annotations

from engine.hookspecs import hookimpl

ENGINE_PLUGIN_API = "1"

TORCH_REFERENCE_BACKEND = "engine.attention_backends.torch_ref:TorchReferenceBackend"


@hookimpl
def engine_attention_backends() -> dict[str, str]:
    """The portable reference backend, ``torch``: runs anywhere torch runs."""
    return {"torch": TORCH_REFERENCE_BACKEND}
