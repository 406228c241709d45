"""Phi-3 / Phi-3.5 / Phi-4 (``Phi3ForCausalLM``): the Llama decoder with the checkpoint's fused
projections and LongRoPE.

What differs from Llama, all read from the HF config or checkpoint:

* the checkpoint stores q/k/v as one ``self_attn.qkv_proj`` tensor and gate/up as one
  ``mlp.gate_up_proj`` tensor (gate rows first); they load whole into ``QKVParallelLinear`` /
  ``MergedColumnParallelLinear`` (``shard_id=None``), which split them into their slices, and
  per rank under tensor parallelism;
* partial rotary (``partial_rotary_factor``, 0.75 in Phi-4-mini);
* LongRoPE (``rope_type`` ``longrope``, or ``su`` in older configs: Phi-3-*-128k, Phi-3.5,
  Phi-4-mini): short factors while a request's context is within
  ``original_max_position_embeddings``, long factors beyond it, both with transformers'
  attention factor (``engine.layers.rotary.LongRopeRotaryEmbedding`` says how that is applied
  per request and what happens to keys cached before the switch);
* ``sliding_window``, when set (Phi-3-mini-4k: 2047), applies to every layer, as transformers'
  Phi-3 passes it to every layer.
"""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3, Phi-3.5 and Phi-4 text models (mini, small-dense, medium, Phi-4 14B)."""

    # The checkpoint names the fused tensors themselves, so a missing one is reported by its
    # own name.
    packed_modules_mapping: dict[str, list[str]] = {}
