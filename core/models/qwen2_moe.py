"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): the Qwen2 decoder (q/k/v bias) with sparse MoE
blocks that add a shared expert.

As transformers' ``Qwen2MoeSparseMoeBlock``: routed experts (softmax in float32, top-k,
renormalised when ``norm_topk_prob``) plus ``sigmoid(shared_expert_gate(x)) *
shared_expert(x)``, a SwiGLU MLP of ``shared_expert_intermediate_size``. Dense layers follow
``mlp_only_layers`` / ``decoder_sparse_step`` as in Qwen3-MoE.
"""

from __future__ import annotations

from typing import Any

from engine.models.moe import MoEForCausalLM, MoESpec
from engine.models.qwen3_moe import qwen_moe_spec


class Qwen2MoeForCausalLM(MoEForCausalLM):
    """Qwen2-MoE models (shared expert with a sigmoid gate)."""

    @classmethod
    def attention_options(cls, hf_config: Any) -> dict[str, bool]:
        return {"qkv_bias": bool(getattr(hf_config, "qkv_bias", True)), "o_bias": False,
                "qk_norm": False}  # fmt: skip

    @classmethod
    def moe_spec(cls, hf_config: Any) -> MoESpec:
        return qwen_moe_spec(hf_config, shared=True)
