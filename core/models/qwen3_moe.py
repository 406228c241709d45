"""Qwen3-MoE: the Qwen3 decoder (per-head q/k RMSNorm) with sparse MoE blocks.

Routing as transformers' ``Qwen3MoeSparseMoeBlock``: softmax in float32, top-k, renormalised
when ``norm_topk_prob``. Layers in ``mlp_only_layers``, and those where ``(i + 1)`` is not a
multiple of ``decoder_sparse_step``, keep a dense MLP of ``intermediate_size``.
"""

from __future__ import annotations

from typing import Any

from engine.models.moe import MoEForCausalLM, MoESpec, config_num_experts


def qwen_moe_spec(hf_config: Any, shared: bool) -> MoESpec:
    """The ``MoESpec`` of a Qwen2-MoE or Qwen3-MoE config."""
    return MoESpec(
        num_experts=config_num_experts(hf_config),
        top_k=hf_config.num_experts_per_tok,
        intermediate_size=hf_config.moe_intermediate_size,
        renormalize=bool(getattr(hf_config, "norm_topk_prob", False)),
        dense_intermediate_size=hf_config.intermediate_size,
        shared_expert_intermediate_size=(
            int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0) if shared else 0
        ),
        decoder_sparse_step=int(getattr(hf_config, "decoder_sparse_step", 1) or 1),
        mlp_only_layers=tuple(getattr(hf_config, "mlp_only_layers", None) or ()),
    )


class Qwen3MoeForCausalLM(MoEForCausalLM):
    """Qwen3-30B-A3B, Qwen3-235B-A22B and their kin."""

    @classmethod
    def attention_options(cls, hf_config: Any) -> dict[str, bool]:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}

    @classmethod
    def moe_spec(cls, hf_config: Any) -> MoESpec:
        return qwen_moe_spec(hf_config, shared=False)
