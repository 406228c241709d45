"""``ModelRegistry``: HF ``architectures`` names -> model classes, imported lazily.

Built-in entries are ``"module:Class"`` strings so that listing what is supported imports no
model code. Plugins add architectures from their ``engine_models(registry)`` hook::

    registry.register("MyForCausalLM", "engine_myvendor.models:MyForCausalLM")
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

from engine.layers.weight_utils import ModelLoadError

_BUILTIN_MODELS = {
    # Embedding-only architectures (no LM head): served by the pooling runner.
    "BertModel": "engine.models.bert:BertModel",
    "RobertaModel": "engine.models.bert:BertModel",
    "XLMRobertaModel": "engine.models.bert:BertModel",
    "BertForSequenceClassification": "engine.models.bert:BertForSequenceClassification",
    "RobertaForSequenceClassification": "engine.models.bert:BertForSequenceClassification",
    "XLMRobertaForSequenceClassification": "engine.models.bert:BertForSequenceClassification",
    "LlamaForSequenceClassification": "engine.models.llama:LlamaForSequenceClassification",
    "Qwen2ForSequenceClassification": "engine.models.qwen2:Qwen2ForSequenceClassification",
    "Qwen3ForSequenceClassification": "engine.models.qwen3:Qwen3ForSequenceClassification",
    "Qwen3Model": "engine.models.qwen3:Qwen3EmbeddingModel",
    "Gemma2ForCausalLM": "engine.models.gemma2:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "engine.models.gemma3:Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration": "engine.models.gemma3_mm:Gemma3ForConditionalGeneration",
    "GptOssForCausalLM": "engine.models.gpt_oss:GptOssForCausalLM",
    "LlamaForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "MixtralForCausalLM": "engine.models.mixtral:MixtralForCausalLM",
    "Phi3ForCausalLM": "engine.models.phi3:Phi3ForCausalLM",
    "Qwen2ForCausalLM": "engine.models.qwen2:Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM": "engine.models.qwen2_moe:Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM": "engine.models.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "engine.models.qwen3_moe:Qwen3MoeForCausalLM",
}


class ModelRegistry:
    """Maps architecture names to model classes or lazy ``"module:Class"`` references."""

    def __init__(self, builtins: bool = True) -> None:
        self._entries: dict[str, str | type] = dict(_BUILTIN_MODELS) if builtins else {}

    def register(self, architecture: str, model: str | type, override: bool = True) -> None:
        """Add (or, with ``override``, replace) the class serving ``architecture``.

        ``model`` is a class or a ``"package.module:ClassName"`` string imported on first use.
        """
        if isinstance(model, str) and ":" not in model:
            raise ValueError(f"model reference {model!r} must look like 'package.module:Class'")
        if not override and architecture in self._entries:
            return
        self._entries[architecture] = model

    def supported(self) -> list[str]:
        """Every registered architecture name, sorted."""
        return sorted(self._entries)

    def __contains__(self, architecture: str) -> bool:
        return architecture in self._entries

    def resolve(self, architectures: str | Iterable[str]) -> tuple[str, type]:
        """The first of ``architectures`` that is registered, and its class.

        Raises ``ModelLoadError`` listing the supported architectures when none is, or naming
        the reference when its import fails.
        """
        names = [architectures] if isinstance(architectures, str) else list(architectures)
        for name in names:
            if name in self._entries:
                return name, self._load(name)
        raise ModelLoadError(
            f"unsupported model architecture {', '.join(names) or '(none in config.json)'}; "
            f"supported architectures: {', '.join(self.supported())}. Use a model of one of "
            "these, or install a plugin that adds it (`engine plugins` lists the installed ones)"
        )

    def _load(self, name: str) -> type:
        entry = self._entries[name]
        if not isinstance(entry, str):
            return entry
        module_name, _, class_name = entry.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as e:
            raise ModelLoadError(
                f"architecture {name}: cannot import {entry} ({type(e).__name__}: {e})"
            ) from e
        self._entries[name] = cls
        return cls

    @classmethod
    def with_plugins(cls, plugin_manager: Any = None) -> ModelRegistry:
        """The built-in registry plus what loaded plugins add through ``engine_models``."""
        registry = cls()
        if plugin_manager is None:
            return registry
        if hasattr(plugin_manager, "call_hook"):  # engine.plugins.PluginManager names culprits
            for _ in plugin_manager.call_hook("engine_models", registry=registry):
                pass
        else:  # a bare pluggy.PluginManager
            plugin_manager.hook.engine_models(registry=registry)
        return registry
