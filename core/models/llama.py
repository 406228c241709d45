"""Llama-family decoder (Llama 2/3/3.1, Mistral); Qwen2 and Qwen3 reuse it with options.

The layout mirrors transformers' ``LlamaForCausalLM`` so checkpoint names map one to one, except
that q/k/v and gate/up are fused into ``qkv_proj`` and ``gate_up_proj`` (their loaders copy each
checkpoint tensor into its slice).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from engine.attention_backends.interface import AttentionMetadata
from engine.layers import (
    Attention,
    GatedActivation,
    MergedColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    load_named_weights,
    rope_parameters,
)
from engine.layers.rotary import LongRopeRotaryEmbedding, get_rope
from engine.layers.weight_utils import check_shape, materialize, narrow, set_weight_loader
from engine.models.base import (
    CausalLM,
    DecoderModel,
    SelfAttention,
    add_and_norm,
    make_layers,
    on_first_stage,
    on_last_stage,
)
from engine.models.context import ModelContext
from engine.parallel import IntermediateTensors

# Checkpoint name fragments -> our fused parameters (fragment, checkpoint fragment, shard).
FUSED_WEIGHTS = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
)


def layer_sliding_window(hf_config: Any, layer_idx: int) -> int | None:
    """The sliding window of layer ``layer_idx`` (None: full attention).

    ``layer_types`` (transformers >= 4.53) decides when present; older Qwen2-style configs use
    ``use_sliding_window`` + ``max_window_layers``; Mistral's window applies to every layer.
    """
    window = getattr(hf_config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    if getattr(hf_config, "use_sliding_window", True) is False:
        return None
    max_window_layers = getattr(hf_config, "max_window_layers", None)
    if max_window_layers is not None and layer_idx < max_window_layers:
        return None
    return window


class LlamaAttention(SelfAttention):
    """Self-attention: fused QKV projection, optional per-head q/k RMSNorm (Qwen3), rotary
    embedding, paged attention, output projection."""

    def __init__(
        self,
        ctx: ModelContext,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        prefix: str = "",
        sinks: bool = False,
    ) -> None:
        """``sinks``: every query head has a learned softmax logit (GPT-OSS), read from the
        checkpoint's ``self_attn.sinks`` (this rank's heads)."""
        super().__init__()
        cfg = ctx.hf_config
        self._build_projections(ctx, qkv_bias, o_bias, prefix)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, ctx.kernels, ctx.dtype)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, ctx.kernels, ctx.dtype)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.num_kv_heads,
            self.head_dim**-0.5,
            ctx.attn_backend_cls,
            sliding_window=layer_sliding_window(cfg, layer_idx),
            sinks=sinks,
        )
        if sinks:
            set_weight_loader(self.attn.sinks, self._load_sinks)

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """All heads' sinks ``[total_heads]`` -> this tensor-parallel rank's."""
        qkv = self.qkv_proj
        check_shape("attention sinks", (qkv.total_num_heads,), loaded.shape)
        mine = narrow(loaded, 0, qkv.tp_rank * self.num_heads, self.num_heads)
        param.data.copy_(materialize(mine))


class LlamaMLP(nn.Module):
    """Gated MLP: ``down(act(gate(x)) * up(x))`` with gate and up fused (column-parallel, each
    split over the ranks) and down row-parallel."""

    #: The activation feeds the down projection alone: it may write FP8 for it
    #: (``engine.layers.fp8_input``).
    fp8_input_producers: ClassVar[tuple[tuple[str, str], ...]] = (("act_fn", "down_proj"),)

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        ctx: ModelContext,
        bias: bool = False,
        prefix: str = "",
        reduce_results: bool = True,
    ) -> None:
        """``reduce_results=False`` leaves the down projection's tensor-parallel partial sum
        unreduced (a MoE block adds it to the experts' and reduces once)."""
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size,
            [intermediate_size, intermediate_size],
            bias,
            ctx=ctx,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.act_fn = GatedActivation(hidden_act, ctx.kernels)
        self.down_proj = RowParallelLinear(
            intermediate_size,
            hidden_size,
            bias,
            ctx=ctx,
            prefix=f"{prefix}.down_proj",
            reduce_results=reduce_results,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is carried separately so that each norm fuses the
    residual add (``fused_add_rms_norm``)."""

    #: Each norm's output feeds one linear alone (the residual is carried separately): with
    #: FP8 W8A8 linears the norm may write their FP8 input (``engine.layers.fp8_input``).
    fp8_input_producers: ClassVar[tuple[tuple[str, str], ...]] = (
        ("input_layernorm", "self_attn.qkv_proj"),
        ("post_attention_layernorm", "mlp.gate_up_proj"),
    )

    def __init__(
        self,
        ctx: ModelContext,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        attention_options: dict[str, bool],
    ) -> None:
        super().__init__()
        cfg = ctx.hf_config
        prefix = f"model.layers.{layer_idx}"
        self.self_attn = LlamaAttention(
            ctx, layer_idx, rotary_emb, **attention_options, prefix=f"{prefix}.self_attn"
        )
        self.mlp = LlamaMLP(
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.hidden_act,
            ctx,
            bias=getattr(cfg, "mlp_bias", False),
            prefix=f"{prefix}.mlp",
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
        return self.mlp(hidden), residual


class LlamaModel(DecoderModel):
    """Embedding, decoder layers, final norm (HF's ``model.`` sub-module)."""

    def __init__(
        self,
        ctx: ModelContext,
        attention_options: dict[str, bool],
        build_layer: Callable[..., nn.Module] | None = None,
    ) -> None:
        """``build_layer(ctx, layer_idx, rotary_emb, attention_options)`` makes each decoder
        layer (default ``LlamaDecoderLayer``; MoE models build sparse layers)."""
        super().__init__()
        cfg = ctx.hf_config
        build_layer = build_layer or LlamaDecoderLayer
        self.parallel = parallel = ctx.parallel
        self.embed_tokens = on_first_stage(
            parallel,
            lambda: VocabParallelEmbedding(
                cfg.vocab_size, cfg.hidden_size, ctx.dtype, parallel=parallel
            ),
        )
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # One rotary table shared by all layers.
        rotary_emb = get_rope(
            head_dim, cfg.max_position_embeddings, rope_parameters(cfg), ctx.kernels
        )
        self.start_layer, self.end_layer, self.layers = make_layers(
            cfg.num_hidden_layers,
            lambda i: build_layer(ctx, i, rotary_emb, attention_options),
            parallel,
        )
        if parallel.pp_size == 1:
            self.end_layer = None  # every layer: no per-step slicing
        self.norm = on_last_stage(
            parallel, lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.kernels, ctx.dtype)
        )
        # LongRoPE picks its table per request from the step's metadata (see forward).
        self._long_rope = rotary_emb if isinstance(rotary_emb, LongRopeRotaryEmbedding) else None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: list[AttentionMetadata],
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        if self._long_rope is not None:
            # Every pipeline stage sees the same metadata, so each picks the same table.
            md = attn_metadata[0]
            positions = self._long_rope.rope_positions(positions, md.query_start_loc, md.seq_lens)
        return super().forward(input_ids, positions, attn_metadata, intermediate)


class LlamaForCausalLM(CausalLM):
    """Llama 2/3/3.1 and Mistral (with or without sliding window).

    Subclasses change ``attention_options`` to express their variant (Qwen2: q/k/v bias;
    Qwen3: per-head q/k norm).
    """

    # Which checkpoint tensors feed each fused parameter (the loader names missing ones).
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    @classmethod
    def attention_options(cls, hf_config: Any) -> dict[str, bool]:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False}

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.config = cfg
        self.model = LlamaModel(ctx, self.attention_options(cfg), self.build_layer)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = on_last_stage(
            ctx.parallel,
            lambda: ParallelLMHead(
                cfg.vocab_size,
                cfg.hidden_size,
                ctx.dtype,
                kernels=ctx.kernels,
                parallel=ctx.parallel,
            ),
        )
        if self.tie_word_embeddings and ctx.parallel.pp_size == 1:
            self.lm_head.tie(self.model.embed_tokens)

    def build_layer(
        self,
        ctx: ModelContext,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        attention_options: dict[str, bool],
    ) -> nn.Module:
        """Decoder layer ``layer_idx`` (subclasses with other layers override this)."""
        return LlamaDecoderLayer(ctx, layer_idx, rotary_emb, attention_options)

    def ignore_checkpoint_tensor(self, name: str) -> bool:
        """Rotary inverse frequencies are recomputed (a tied head's checkpoint tensors, and
        those of parts another pipeline stage holds, are dropped by ``stage_weights``)."""
        return "rotary_emb.inv_freq" in name

    def load_weights(self, weights: Any) -> set[str]:
        """Copy HF-named checkpoint tensors into the parameters; returns the names loaded."""
        return load_named_weights(
            self, self.stage_weights(weights), FUSED_WEIGHTS, self.ignore_checkpoint_tensor
        )


def _llama_classifier() -> type:
    from engine.models.pooling_adapter import as_classifier_model

    return as_classifier_model(LlamaForCausalLM)


# ``LlamaForSequenceClassification``: reward models and classifiers on the Llama trunk.
LlamaForSequenceClassification = _llama_classifier()
