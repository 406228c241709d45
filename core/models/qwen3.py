"""Qwen3: the Llama decoder with per-head RMSNorm on queries and keys before rotary."""

from __future__ import annotations

from typing import Any

from engine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense models (``q_norm``/``k_norm`` over head_dim; biases per ``attention_bias``)."""

    @classmethod
    def attention_options(cls, hf_config: Any) -> dict[str, bool]:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}


def _qwen3_embedding() -> type:
    from engine.models.pooling_adapter import as_pooling_model

    return as_pooling_model(Qwen3ForCausalLM)


# ``Qwen3Model`` checkpoints (Qwen3-Embedding saved without an LM head): last-token pooling.
Qwen3EmbeddingModel = _qwen3_embedding()


def _qwen3_classifier() -> type:
    from engine.models.pooling_adapter import as_classifier_model

    return as_classifier_model(Qwen3ForCausalLM)


# ``Qwen3ForSequenceClassification``: reward models, classifiers, converted rerankers.
Qwen3ForSequenceClassification = _qwen3_classifier()
