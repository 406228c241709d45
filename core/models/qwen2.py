"""Qwen2 / Qwen2.5: the Llama decoder with biases on the q/k/v projections."""

from __future__ import annotations

from typing import Any

from engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 and Qwen2.5 (optional per-layer sliding window from ``layer_types``)."""

    @classmethod
    def attention_options(cls, hf_config: Any) -> dict[str, bool]:
        return {"qkv_bias": True, "o_bias": False, "qk_norm": False}


def _qwen2_classifier() -> type:
    from engine.models.pooling_adapter import as_classifier_model

    return as_classifier_model(Qwen2ForCausalLM)


# ``Qwen2ForSequenceClassification``: reward models and classifiers on the Qwen2 trunk.
Qwen2ForSequenceClassification = _qwen2_classifier()
