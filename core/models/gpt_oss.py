"""GPT-OSS (``openai/gpt-oss-20b``, ``-120b``): a mixture-of-experts decoder in Llama's
pre-norm layout with four differences, each as transformers' ``GptOssForCausalLM`` computes it:

* **attention sinks**: every query head has a learned logit that joins its softmax as one
  more score with no value (``self_attn.sinks``), so the model needs an attention backend that
  declares ``supports_attention_sinks`` (the class attribute ``attention_sinks`` below asks
  for one);
* layers alternate a 128-token sliding window and full attention (``layer_types``), with
  biased q/k/v/o projections and YaRN rotary embeddings;
* the router is a biased linear whose top-k logits are softmaxed (the same weights as a
  softmax over all experts renormalised over the chosen ones, which is what runs here);
* each expert has biased projections and a clamped SwiGLU, ``(clamp(up, -l, l) + 1) *
  g * sigmoid(alpha * g)`` with ``g = min(gate, l)`` (``FusedMoE(activation="swigluoai")``).

Checkpoints store the experts stacked per layer: ``mlp.experts.gate_up_proj [E, H, 2I]`` whose
columns interleave gate and up (gate at even indices), ``down_proj [E, I, H]`` and the biases
``gate_up_proj_bias [E, 2I]`` (interleaved too) and ``down_proj_bias [E, H]``; the released
checkpoints hold the two weights in MXFP4 instead (``gate_up_proj_blocks`` / ``_scales``,
``[E, 2I, H / 32, 16]`` bytes and ``[E, 2I, H / 32]`` exponents), which stay in MXFP4 where a
plugin provides ``fused_moe_mxfp4`` and are dequantized at load elsewhere
(``engine.quantization.mxfp4``). The loader turns every form into ``FusedMoE``'s layout
(``w13 [E, 2I, H]``, gate rows then up rows; ``w2 [E, H, I]``; MXFP4 bytes likewise).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from engine.layers import load_named_weights
from engine.layers.fused_moe import ExpertCheckpointMapping, FusedMoE
from engine.layers.weight_utils import ModelLoadError, materialize
from engine.models.llama import FUSED_WEIGHTS
from engine.models.moe import MoEForCausalLM, MoESpec, config_num_experts
from engine.quantization.mxfp4 import Mxfp4MoEMethod, dequantize_mxfp4, mxfp4_dequantized_shape

# Checkpoint name fragments -> ours: the router is ``gate`` in ``SparseMoeBlock``; the sinks
# live on the ``Attention`` layer.
_RENAMES = ((".mlp.router.", ".mlp.gate."), (".self_attn.sinks", ".self_attn.attn.sinks"))
_EXPERT_TENSORS = ("gate_up_proj", "down_proj")


def split_interleaved(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Gate/up interleaved along ``dim`` (gate at even indices) -> all gate, then all up."""
    return torch.cat((t[_every(t, dim, 0)], t[_every(t, dim, 1)]), dim=dim)


def _every(t: torch.Tensor, dim: int, start: int) -> tuple[slice, ...]:
    """An index taking every other element of ``dim`` from ``start``."""
    index = [slice(None)] * t.dim()
    index[dim] = slice(start, None, 2)
    return tuple(index)


class GptOssForCausalLM(MoEForCausalLM):
    """GPT-OSS 20B / 120B."""

    #: The runtime picks an attention backend that supports attention sinks.
    attention_sinks = True

    @classmethod
    def attention_options(cls, hf_config: Any) -> dict[str, bool]:
        bias = bool(getattr(hf_config, "attention_bias", True))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False, "sinks": True}

    @classmethod
    def moe_spec(cls, hf_config: Any) -> MoESpec:
        return MoESpec(
            num_experts=config_num_experts(hf_config),
            top_k=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.intermediate_size,
            renormalize=True,
            router_bias=True,
            activation="swigluoai",
            expert_bias=True,
            swiglu_alpha=float(getattr(hf_config, "swiglu_alpha", 1.702)),
            swiglu_limit=float(getattr(hf_config, "swiglu_limit", 7.0)),
        )

    def load_weights(self, weights: Any) -> set[str]:
        """The stacked (or MXFP4) expert tensors into the ``FusedMoE`` layers, the rest as in
        Llama with the router and sinks renamed (see the module docstring)."""
        layers = {name: m for name, m in self.named_modules() if isinstance(m, FusedMoE)}
        loaded: set[str] = set()
        experts = ExpertCheckpointMapping(self)
        converted = self._convert(self.stage_weights(weights), layers, loaded)
        loaded |= load_named_weights(
            self, experts.filter(converted), FUSED_WEIGHTS, self.ignore_checkpoint_tensor
        )
        return loaded | experts.loaded()

    def _convert(
        self,
        weights: Iterable[tuple[str, Any]],
        layers: dict[str, FusedMoE],
        loaded: set[str],
    ) -> Iterator[tuple[str, Any]]:
        """Rename the router and sinks; turn the experts' stacked weights into ``FusedMoE``'s
        layout (MXFP4 pairs dequantized) and load their biases; pass the rest on."""
        pending: dict[str, dict[str, Any]] = {}  # MXFP4 blocks waiting for their scales
        for name, tensor in weights:
            for old, new in _RENAMES:
                name = name.replace(old, new)
            layer_name, _, leaf = name.rpartition(".")
            layer = layers.get(layer_name)
            if layer is None:
                yield name, tensor
                continue
            proj, _, kind = leaf.partition("_proj")
            proj += "_proj"
            if proj not in _EXPERT_TENSORS or kind not in ("", "_bias", "_blocks", "_scales"):
                yield name, tensor
                continue
            shard = "w13" if proj == "gate_up_proj" else "w2"
            if kind == "_bias":
                t = materialize(tensor)
                if shard == "w13":
                    t = split_interleaved(t, 1)
                loaded.add(f"{layer_name}.{layer.load_bias(shard, t)}")
                continue
            if kind == "":
                # transformers' layout [E, in, out] -> ours [E, out, in].
                t = materialize(tensor).transpose(1, 2)
            else:
                parts = pending.setdefault(f"{layer_name}.{proj}", {})
                parts[kind] = materialize(tensor)
                if len(parts) < 2:
                    continue
                del pending[f"{layer_name}.{proj}"]
                blocks, scales = parts["_blocks"], parts["_scales"]
                if isinstance(layer.quant_method, Mxfp4MoEMethod):
                    # Kept in MXFP4: the gate/up rows de-interleaved like a weight's.
                    if shard == "w13":
                        blocks, scales = split_interleaved(blocks, 1), split_interleaved(scales, 1)
                    names = layer.quant_method.load(layer, shard, blocks, scales)
                    loaded.update(f"{layer_name}.{n}" for n in names)
                    continue
                # Dequantized in the layer's dtype: [E, out, in], already our layout. The
                # loader's dry run (meta tensors in the model dtype) checks shapes only.
                dtype = layer.w13_weight.dtype
                if blocks.is_meta:
                    shape = mxfp4_dequantized_shape(blocks.shape, scales.shape)
                    t = torch.empty(shape, dtype=dtype, device="meta")
                else:
                    # On the layer's device: a GPU decodes the blocks far faster than the CPU.
                    device = layer.w13_weight.device
                    t = dequantize_mxfp4(blocks.to(device), scales.to(device), dtype)
            if shard == "w13":
                t = split_interleaved(t, 1)
            yield f"{layer_name}.{proj}", t.contiguous()
        if pending:
            raise ModelLoadError(
                "MXFP4 expert weights without their other half (blocks and scales go in pairs): "
                + ", ".join(f"{name} ({', '.join(parts)} only)" for name, parts in pending.items())
            )
