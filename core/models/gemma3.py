"""Gemma 3 text decoder: ``Gemma3ForCausalLM`` (270M, 1B) and the text half of
``Gemma3ForConditionalGeneration`` (4B, 12B, 27B; the vision half is in ``gemma3_mm``).

What sets it apart from Llama, all read from the HF config:

* layers alternate sliding-window and global attention (``layer_types``; 5 local then 1 global
  in every released size), each kind with its own rotary table: ``rope_theta`` 1e4 on local
  layers, 1e6 (plus ``rope_scaling``, e.g. linear x8 on 4B+) on global ones;
* per-head RMSNorm on queries and keys before the rotary embedding;
* four norms per layer: before and after attention, before and after the MLP;
* GeGLU MLP with tanh-approximated GELU (``kernels.gelu_tanh_and_mul``);
* embeddings multiplied by ``sqrt(hidden_size)`` rounded to the model dtype (as HF does);
* attention scale ``query_pre_attn_scalar ** -0.5`` rather than ``head_dim ** -0.5``;
* optional attention / final logit soft-capping; tied LM head.

**RMSNorm convention.** Gemma's norm computes ``x_normed * (1 + w)`` where HF checkpoints store
``w``. ``load_weights`` stores ``1 + w`` (in float32, from the checkpoint's value in the load
dtype, the same arithmetic as HF's ``1.0 + weight.float()``), so the standard ``rms_norm`` /
``fused_add_rms_norm`` kernels apply with no per-step offset. The norm parameters therefore stay
float32 in every model dtype (the kernels multiply by ``weight.float()`` anyway).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.attention_backends.interface import AttentionMetadata
from engine.layers import (
    Attention,
    ParallelLMHead,
    RMSNorm,
    RotaryEmbedding,
    VocabParallelEmbedding,
    load_named_weights,
    rope_parameters,
)
from engine.layers.weight_utils import (
    check_shape,
    materialize,
    set_weight_loader,
)
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
from engine.models.llama import FUSED_WEIGHTS, LlamaMLP

SLIDING = "sliding_attention"
FULL = "full_attention"


def gemma3_layer_types(cfg: Any) -> list[str]:
    """``layer_types`` from the config, or the released pattern (every 6th layer global) for
    configs written before the field existed."""
    types = getattr(cfg, "layer_types", None)
    if types:
        return list(types)
    pattern = getattr(cfg, "sliding_window_pattern", None) or getattr(
        cfg, "_sliding_window_pattern", 6
    )
    return [SLIDING if (i + 1) % pattern else FULL for i in range(cfg.num_hidden_layers)]


def gemma3_rope(cfg: Any, layer_type: str) -> dict[str, Any]:
    """Rotary parameters of one layer kind. transformers 5 nests them per layer type in
    ``rope_parameters``; transformers 4 configs keep ``rope_theta`` + ``rope_scaling`` for global
    layers and ``rope_local_base_freq`` (unscaled) for local ones."""
    nested = getattr(cfg, "rope_parameters", None)
    if isinstance(nested, dict) and isinstance(nested.get(layer_type), dict):
        return rope_parameters(cfg, layer_type)
    if layer_type == SLIDING:
        theta = getattr(cfg, "rope_local_base_freq", 10_000.0)
        return {"rope_type": "default", "rope_theta": theta}
    return rope_parameters(cfg)


def _gemma_norm(size: int, cfg: Any, ctx: ModelContext, eps: float | None = None) -> RMSNorm:
    """A float32 RMSNorm whose loader stores ``1 + w`` (see the module docstring); ``eps``
    defaults to the config's ``rms_norm_eps``."""
    norm = RMSNorm(size, cfg.rms_norm_eps if eps is None else eps, ctx.kernels, torch.float32)
    set_weight_loader(norm.weight, _load_gemma_norm)
    return norm


def _load_gemma_norm(param: nn.Parameter, loaded: Any) -> None:
    check_shape("norm weight", param.shape, tuple(loaded.shape))
    param.data.copy_(materialize(loaded).float() + 1.0)


class Gemma3Attention(SelfAttention):
    """Fused QKV projection, per-head q/k RMSNorm, rotary, paged attention, output projection."""

    #: per-head q/k RMSNorm (Gemma 2 has none)
    qk_norm = True

    def __init__(
        self, ctx: ModelContext, layer_idx: int, layer_type: str, rotary_emb: RotaryEmbedding
    ) -> None:
        super().__init__()
        cfg = ctx.hf_config
        bias = bool(getattr(cfg, "attention_bias", False))
        self._build_projections(ctx, bias, bias, f"model.layers.{layer_idx}.self_attn")
        if self.qk_norm:
            self.q_norm = _gemma_norm(self.head_dim, cfg, ctx)
            self.k_norm = _gemma_norm(self.head_dim, cfg, ctx)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = rotary_emb
        scalar = getattr(cfg, "query_pre_attn_scalar", None) or self.head_dim
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.num_kv_heads,
            float(scalar) ** -0.5,
            ctx.attn_backend_cls,
            sliding_window=cfg.sliding_window if layer_type == SLIDING else None,
            logit_softcap=getattr(cfg, "attn_logit_softcapping", None),
        )

    # forward: SelfAttention's (the q/k norms hold float32 ``1 + w``).


class Gemma3DecoderLayer(nn.Module):
    """``x += post_attn_norm(attn(input_norm(x))); x += post_ffw_norm(mlp(pre_ffw_norm(x)))``.

    The residual stream travels beside the hidden state so that the two norms that follow a
    residual add use ``fused_add_rms_norm``.
    """

    attention_cls: type[Gemma3Attention] = Gemma3Attention

    def __init__(
        self, ctx: ModelContext, layer_idx: int, layer_type: str, rotary_emb: RotaryEmbedding
    ) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.layer_type = layer_type
        self.self_attn = self.attention_cls(ctx, layer_idx, layer_type, rotary_emb)
        # GeGLU: the Llama MLP with tanh-approximated GELU.
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
        self.mlp = LlamaMLP(
            cfg.hidden_size,
            cfg.intermediate_size,
            act or "gelu_pytorch_tanh",
            ctx,
            prefix=f"model.layers.{layer_idx}.mlp",
        )
        self.input_layernorm = _gemma_norm(cfg.hidden_size, cfg, ctx)
        self.post_attention_layernorm = _gemma_norm(cfg.hidden_size, cfg, ctx)
        self.pre_feedforward_layernorm = _gemma_norm(cfg.hidden_size, cfg, ctx)
        self.post_feedforward_layernorm = _gemma_norm(cfg.hidden_size, cfg, ctx)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        attn_metadata: list[AttentionMetadata],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = add_and_norm(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(positions, hidden, attn_metadata)
        hidden = self.post_attention_layernorm(hidden)
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        hidden = self.mlp(hidden)
        hidden = self.post_feedforward_layernorm(hidden)
        return hidden, residual


class Gemma3Model(DecoderModel):
    """Scaled embedding, decoder layers, final norm (HF's ``model.`` sub-module)."""

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.parallel = parallel = ctx.parallel
        self.embed_tokens = on_first_stage(
            parallel,
            lambda: VocabParallelEmbedding(
                cfg.vocab_size,
                cfg.hidden_size,
                ctx.dtype,
                embed_scale=cfg.hidden_size**0.5,
                parallel=parallel,
            ),
        )
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        types = gemma3_layer_types(cfg)
        # One rotary table per layer kind, shared by the layers of that kind.
        rotary = {
            kind: RotaryEmbedding(
                head_dim, cfg.max_position_embeddings, gemma3_rope(cfg, kind), ctx.kernels
            )
            for kind in sorted(set(types))
        }
        self.start_layer, self.end_layer, self.layers = make_layers(
            len(types), lambda i: Gemma3DecoderLayer(ctx, i, types[i], rotary[types[i]]), parallel
        )
        if parallel.pp_size == 1:
            self.end_layer = None  # every layer: no per-step slicing
        self.norm = on_last_stage(parallel, lambda: _gemma_norm(cfg.hidden_size, cfg, ctx))


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3 text models (270M, 1B, and the text decoder of 4B/12B/27B)."""

    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self, ctx: ModelContext, *, tie_word_embeddings: bool | None = None) -> None:
        """``tie_word_embeddings`` overrides the config's (a multimodal wrapper's config decides
        it for its text model)."""
        super().__init__()
        cfg = ctx.hf_config
        self.config = cfg
        self.model = Gemma3Model(ctx)
        if tie_word_embeddings is None:
            tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", True))
        self.tie_word_embeddings = tie_word_embeddings
        self.lm_head = on_last_stage(
            ctx.parallel,
            lambda: ParallelLMHead(
                cfg.vocab_size,
                cfg.hidden_size,
                ctx.dtype,
                final_logit_softcap=getattr(cfg, "final_logit_softcapping", None),
                kernels=ctx.kernels,
                parallel=ctx.parallel,
            ),
        )
        if self.tie_word_embeddings and ctx.parallel.pp_size == 1:
            self.lm_head.tie(self.model.embed_tokens)

    def load_weights(self, weights: Any) -> set[str]:
        """Copy HF-named tensors in (q/k/v and gate/up into their fused slices, norms as
        ``1 + w``); returns the names of the parameters loaded."""

        def ignore(name: str) -> bool:
            return "rotary_emb.inv_freq" in name  # (a tied head's: dropped by stage_weights)

        return load_named_weights(self, self.stage_weights(weights), FUSED_WEIGHTS, ignore)
