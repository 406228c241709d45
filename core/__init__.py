"""engine: an LLM inference and serving engine with pluggable hardware backends.

``import engine`` stays cheap (no torch): the heavy entry points are loaded on first use.
"""

from engine.version import PLUGIN_API_VERSION, __version__

__all__ = [
    "LLM",
    "SamplingParams",
    "BeamSearchParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "LoRARequest",
    "PoolingParams",
    "EmbeddingRequestOutput",
    "__version__",
    "PLUGIN_API_VERSION",
    "hookimpl",
]

_LAZY = {
    "LLM": ("engine.llm", "LLM"),
    "SamplingParams": ("engine.sampling_params", "SamplingParams"),
    "BeamSearchParams": ("engine.beam_search", "BeamSearchParams"),
    "StructuredOutputsParams": ("engine.sampling_params", "StructuredOutputsParams"),
    "RequestOutput": ("engine.outputs", "RequestOutput"),
    "CompletionOutput": ("engine.outputs", "CompletionOutput"),
    "LoRARequest": ("engine.lora.request", "LoRARequest"),
    "hookimpl": ("engine.hookspecs", "hookimpl"),
    "PoolingParams": ("engine.pooling_params", "PoolingParams"),
    "EmbeddingRequestOutput": ("engine.outputs", "EmbeddingRequestOutput"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
