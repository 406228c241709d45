"""Gemma 2 (``Gemma2ForCausalLM``: 2B, 9B, 27B), built from Gemma 3's pieces.

Shared with Gemma 3 (``engine.models.gemma3``): four ``(1 + w)`` RMSNorms per layer (before and
after attention, before and after the MLP), the GeGLU MLP, embeddings scaled by
``sqrt(hidden_size)`` in the model dtype, the attention scale ``query_pre_attn_scalar ** -0.5``
and a tied LM head. Gemma 2's own:

* layers alternate sliding-window (even layers) and global attention (``layer_types``; older
  configs without it follow the released alternation);
* **attention logit soft-capping** (``attn_logit_softcapping``, 50 in the released models):
  scores become ``cap * tanh(score / cap)`` before the softmax, in the attention backend;
* **final logit soft-capping** (``final_logit_softcapping``, 30) in the LM head;
* no per-head q/k norm, and one rotary table for all layers.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from engine.layers import ParallelLMHead, VocabParallelEmbedding, rope_parameters
from engine.layers.rotary import RotaryEmbedding
from engine.models.base import DecoderModel, make_layers, on_first_stage, on_last_stage
from engine.models.context import ModelContext
from engine.models.gemma3 import (
    FULL,
    SLIDING,
    Gemma3Attention,
    Gemma3DecoderLayer,
    Gemma3ForCausalLM,
    _gemma_norm,
)


def gemma2_layer_types(cfg: Any) -> list[str]:
    """``layer_types`` from the config, or the released alternation (layer 0 sliding)."""
    types = getattr(cfg, "layer_types", None)
    if types:
        return list(types)
    return [SLIDING if (i + 1) % 2 else FULL for i in range(cfg.num_hidden_layers)]


class Gemma2Attention(Gemma3Attention):
    """Gemma 3's attention without the per-head q/k norm (scale, window and soft-cap are read
    from the config the same way)."""

    qk_norm = False


class Gemma2DecoderLayer(Gemma3DecoderLayer):
    """Gemma 3's four-norm layer with ``Gemma2Attention``."""

    attention_cls = Gemma2Attention


class Gemma2Model(DecoderModel):
    """Scaled embedding, alternating sliding/global layers, final norm; under pipeline
    parallelism only this stage's part (``make_layers``, ``on_first_stage``,
    ``on_last_stage``)."""

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
        rotary = RotaryEmbedding(
            head_dim, cfg.max_position_embeddings, rope_parameters(cfg), ctx.kernels
        )
        types = gemma2_layer_types(cfg)
        self.start_layer, self.end_layer, self.layers = make_layers(
            len(types), lambda i: Gemma2DecoderLayer(ctx, i, types[i], rotary), parallel
        )
        if parallel.pp_size == 1:
            self.end_layer = None  # every layer: no per-step slicing
        self.norm = on_last_stage(parallel, lambda: _gemma_norm(cfg.hidden_size, cfg, ctx))


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2 text models; loading (fused q/k/v and gate/up, norms stored as ``1 + w``, tied
    head, a pipeline stage's tensors only) is Gemma 3's."""

    def __init__(self, ctx: ModelContext) -> None:
        nn.Module.__init__(self)
        cfg = ctx.hf_config
        self.config = cfg
        self.model = Gemma2Model(ctx)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", True))
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
        # A last stage without the embedding loads the tied weight into its own head
        # (CausalLM.stage_weights).
        if self.tie_word_embeddings and ctx.parallel.pp_size == 1:
            self.lm_head.tie(self.model.embed_tokens)
