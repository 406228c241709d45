"""Mixtral: the Mistral decoder with a sparse MoE block (``block_sparse_moe``) on every layer.

Routing as transformers' ``MixtralSparseMoeBlock``: softmax over the experts in float32, top-k
(``num_experts_per_tok``), always renormalised; each expert is a SwiGLU MLP of
``intermediate_size`` whose checkpoint tensors are ``experts.<e>.w1`` (gate), ``w3`` (up) and
``w2`` (down).
"""

from __future__ import annotations

from typing import Any

from engine.layers.fused_moe import MIXTRAL_EXPERT_NAMES
from engine.models.moe import MoEForCausalLM, MoESpec, config_num_experts


class MixtralForCausalLM(MoEForCausalLM):
    """Mixtral 8x7B / 8x22B (with or without a sliding window)."""

    expert_proj_names = MIXTRAL_EXPERT_NAMES

    @classmethod
    def attention_options(cls, hf_config: Any) -> dict[str, bool]:
        return {"qkv_bias": False, "o_bias": False, "qk_norm": False}

    @classmethod
    def moe_spec(cls, hf_config: Any) -> MoESpec:
        return MoESpec(
            num_experts=config_num_experts(hf_config),
            top_k=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.intermediate_size,
            renormalize=True,
            block_name="block_sparse_moe",
            expert_proj_names=("w1", "w3", "w2"),
        )
