"""Mixture-of-experts decoders: the Llama decoder with a sparse MoE block in place of the MLP
on some or all layers. Mixtral, Qwen2-MoE and Qwen3-MoE subclass ``MoEForCausalLM`` and say
how their config describes the experts (``moe_spec``) and how their checkpoints name them.

A sparse block is a router (``gate``, a plain linear in the model dtype, as transformers
computes it), the routed experts (``experts``, a ``FusedMoE``: softmax in float32, top-k,
optional renormalisation, the fused expert kernel) and, in Qwen2-MoE, a shared expert whose
output is scaled by ``sigmoid(shared_expert_gate(x))`` and added.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.attention_backends.interface import AttentionMetadata
from engine.layers import ReplicatedLinear, RMSNorm, RotaryEmbedding, load_named_weights
from engine.layers.fused_moe import (
    QWEN_EXPERT_NAMES,
    ExpertCheckpointMapping,
    FusedMoE,
    moe_parallel_from_context,
)
from engine.layers.linear import UNQUANTIZED
from engine.models.base import add_and_norm
from engine.models.context import ModelContext
from engine.models.llama import FUSED_WEIGHTS, LlamaAttention, LlamaForCausalLM, LlamaMLP


@dataclass(frozen=True)
class MoESpec:
    """What a model's config says about its experts.

    ``intermediate_size`` is one routed expert's; ``dense_intermediate_size`` the MLP's on
    layers that are not sparse; ``shared_expert_intermediate_size`` 0 when there is no shared
    expert. Layer ``i`` is sparse unless it is in ``mlp_only_layers`` or ``(i + 1)`` is not a
    multiple of ``decoder_sparse_step`` (Qwen's rules; Mixtral's layers are all sparse).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    dense_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    block_name: str = "mlp"
    #: the checkpoint's names of an expert's gate, up and down projections
    expert_proj_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    #: GPT-OSS: the router has a bias; the experts have biases and a clamped SwiGLU
    #: (``FusedMoE``'s ``activation``, ``bias``, ``swiglu_alpha`` and ``swiglu_limit``)
    router_bias: bool = False
    activation: str = "silu"
    expert_bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def is_sparse(self, layer_idx: int) -> bool:
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ the shared expert and its sigmoid gate when the spec has
    one): ``forward(hidden [T, H]) -> [T, H]``."""

    def __init__(self, ctx: ModelContext, spec: MoESpec, prefix: str = "") -> None:
        super().__init__()
        cfg = ctx.hf_config
        hidden = cfg.hidden_size
        parallel, communicator = moe_parallel_from_context(ctx)
        # Routers stay unquantized (as in vLLM): replicated, in the model dtype.
        self.gate = ReplicatedLinear(
            hidden, spec.num_experts, spec.router_bias, ctx=ctx, prefix=f"{prefix}.gate",
            quant_method=UNQUANTIZED,
        )  # fmt: skip
        # A router's product is small: it keeps its plain weight for the platform's ``linear``
        # (on the CPU a compiled kernel that native plans record; oneDNN's packed op is not one).
        self.gate.keep_plain_weight = True
        has_shared = spec.shared_expert_intermediate_size > 0
        self.experts = FusedMoE(
            spec.num_experts,
            spec.top_k,
            hidden,
            spec.intermediate_size,
            renormalize=spec.renormalize,
            kernels=ctx.kernels,
            dtype=ctx.dtype,
            parallel=parallel,
            communicator=communicator,
            quant_config=getattr(ctx, "quant_config", None),
            prefix=f"{prefix}.experts",
            proj_names=spec.expert_proj_names,
            # With a shared expert the block adds its (tensor-parallel partial) output first
            # and reduces once.
            reduce_results=not has_shared,
            activation=spec.activation,
            bias=spec.expert_bias,
            swiglu_alpha=spec.swiglu_alpha,
            swiglu_limit=spec.swiglu_limit,
        )
        if has_shared:
            self.shared_expert = LlamaMLP(
                hidden,
                spec.shared_expert_intermediate_size,
                cfg.hidden_act,
                ctx,
                prefix=f"{prefix}.shared_expert",
                reduce_results=False,
            )
            self.shared_expert_gate = ReplicatedLinear(
                hidden, 1, ctx=ctx, prefix=f"{prefix}.shared_expert_gate",
                quant_method=UNQUANTIZED,
            )  # fmt: skip
        else:
            self.shared_expert = None

    def forward(self, hidden: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        out = self.experts(hidden, self.gate(hidden), token_mask)
        if self.shared_expert is not None:
            shared = torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
            if self.experts.parallel.tokens_partitioned:
                # Each rank's own tokens: the experts' sums come back by reduce-scatter, the
                # shared expert's are this rank's (completed over its tensor-parallel group).
                if self.shared_expert.down_proj.tp_size > 1:
                    shared = self.shared_expert.down_proj.parallel.tp.all_reduce(shared)
                out = self.experts.reduce(out) + shared
            else:
                out = self.experts.reduce(out + shared)  # one collective for both partial sums
        return out


class MoEDecoderLayer(nn.Module):
    """Llama's pre-norm block with a ``SparseMoeBlock`` (registered as ``spec.block_name``,
    the checkpoint's name for it) on sparse layers and a dense ``LlamaMLP`` (``mlp``) on the
    others."""

    #: The input norm feeds ``qkv_proj`` alone, so with FP8 W8A8 linears it may write their
    #: FP8 input (``engine.layers.fp8_input``). The post-attention norm does so only on a
    #: dense layer (added per instance): on a sparse one it feeds the router and the experts,
    #: which take bf16 (the FP8 experts are weight-only).
    fp8_input_producers: tuple[tuple[str, str], ...] = (("input_layernorm", "self_attn.qkv_proj"),)

    def __init__(
        self,
        ctx: ModelContext,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        attention_options: dict[str, bool],
        spec: MoESpec,
    ) -> None:
        super().__init__()
        cfg = ctx.hf_config
        prefix = f"model.layers.{layer_idx}"
        self.self_attn = LlamaAttention(
            ctx, layer_idx, rotary_emb, **attention_options, prefix=f"{prefix}.self_attn"
        )
        self.sparse = spec.is_sparse(layer_idx)
        if self.sparse:
            self.ffn_name = spec.block_name
            block: nn.Module = SparseMoeBlock(ctx, spec, f"{prefix}.{spec.block_name}")
        else:
            self.ffn_name = "mlp"
            block = LlamaMLP(cfg.hidden_size, spec.dense_intermediate_size, cfg.hidden_act, ctx,
                             prefix=f"{prefix}.mlp")  # fmt: skip
        self.add_module(self.ffn_name, block)
        if not self.sparse:
            self.fp8_input_producers = (
                *type(self).fp8_input_producers,
                ("post_attention_layernorm", "mlp.gate_up_proj"),
            )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.kernels, ctx.dtype)
        self.post_attention_layernorm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, ctx.kernels, ctx.dtype
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        attn_metadata: list[AttentionMetadata],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = add_and_norm(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(positions, hidden, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        block = getattr(self, self.ffn_name)
        if not self.sparse:
            return block(hidden), residual
        token_mask = None
        if block.experts.expert_load is not None:
            # Padding rows of a captured decode graph write no cache (slot -1): not counted.
            token_mask = attn_metadata[0].slot_mapping >= 0
        return block(hidden, token_mask), residual


class MoEForCausalLM(LlamaForCausalLM):
    """Base of the MoE models: subclasses give ``moe_spec`` (from the HF config),
    ``attention_options`` and the checkpoint's per-expert projection names
    (``expert_proj_names``)."""

    expert_proj_names: dict[str, str] = QWEN_EXPERT_NAMES

    @classmethod
    def moe_spec(cls, hf_config: Any) -> MoESpec:
        raise NotImplementedError

    def build_layer(
        self,
        ctx: ModelContext,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        attention_options: dict[str, bool],
    ) -> nn.Module:
        return MoEDecoderLayer(
            ctx, layer_idx, rotary_emb, attention_options, self.moe_spec(ctx.hf_config)
        )

    def load_weights(self, weights: Any) -> set[str]:
        """Expert tensors (per expert or stacked) go into the ``FusedMoE`` layers; the rest
        loads as in Llama (q/k/v and gate/up fused)."""
        experts = ExpertCheckpointMapping(self, self.expert_proj_names)
        loaded = load_named_weights(
            self,
            experts.filter(self.stage_weights(weights)),
            FUSED_WEIGHTS,
            self.ignore_checkpoint_tensor,
        )
        return loaded | experts.loaded()


def config_num_experts(hf_config: Any) -> int:
    """``num_experts`` (Qwen) or ``num_local_experts`` (Mixtral), whichever the config has."""
    for key in ("num_experts", "num_local_experts"):
        value = getattr(hf_config, key, None)
        if value is not None:
            return int(value)
    raise ValueError(f"{type(hf_config).__name__} declares no num_experts / num_local_experts")
