"""``CausalLM``: what every decoder-only model wrapper shares."""

from __future__ import annotations

import torch
from torch import nn

from engine.attention_backends.interface import AttentionMetadata
from engine.layers import QKVParallelLinear, RowParallelLinear
from engine.layers.attention import Attention
from engine.models.context import ModelContext


class CausalLM(nn.Module):
    """Base for ``XForCausalLM`` wrappers: a decoder stack in ``self.model`` whose layers hold
    their attention in ``layer.self_attn.attn``, and an LM head in ``self.lm_head``.

    Subclasses build both in ``__init__`` and implement ``load_weights``.

    ``skip_checkpoint_prefixes`` names checkpoint tensors that belong to parts of the HF model
    this class does not run (e.g. a vision tower): the loader drops them by name, from the shard
    headers, so their data is never read, and logs ``skip_checkpoint_reason`` once.
    """

    model: nn.Module
    lm_head: nn.Module
    skip_checkpoint_prefixes: tuple[str, ...] = ()
    skip_checkpoint_reason: str = ""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: list[AttentionMetadata],
    ) -> torch.Tensor:
        """input_ids, positions: int64 [T] -> hidden states [T, hidden_size]."""
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """hidden [N, hidden_size] -> float32 logits [N, vocab_size] (``float32=False``: the
        model's dtype allowed, for a greedy argmax)."""
        return self.lm_head(hidden, float32)

    def attention_layers(self) -> list[Attention]:
        """The paged-attention layers, in layer order."""
        return [layer.self_attn.attn for layer in self.model.layers]


def add_and_norm(
    norm: nn.Module, hidden: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's first norm on the residual stream: ``residual += hidden`` then the norm (one
    fused kernel), or, in the first layer where there is no residual yet, the hidden state
    becomes the residual. Returns ``(normed, residual)``."""
    if residual is None:
        return norm(hidden), hidden
    return norm(hidden, residual)


class SelfAttention(nn.Module):
    """Base for a decoder layer's attention block: fused QKV projection, per-head q/k RMSNorm
    when the model has one, rotary, paged attention, output projection. Subclasses build
    ``qkv_proj`` and ``o_proj`` (``_build_projections``), ``q_norm``/``k_norm`` (None without
    q/k norm), ``rotary_emb`` and ``attn`` in ``__init__``."""

    qkv_proj: nn.Module
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    rotary_emb: nn.Module
    attn: Attention
    o_proj: nn.Module

    def _build_projections(
        self, ctx: ModelContext, qkv_bias: bool, o_bias: bool, prefix: str = ""
    ) -> None:
        """Head counts and size from the HF config (``num_key_value_heads`` defaulting to MHA,
        ``head_dim`` to ``hidden_size / heads``), then ``qkv_proj`` (column-parallel by head)
        and ``o_proj`` (row-parallel). ``num_heads`` / ``num_kv_heads`` are this rank's counts
        under tensor parallelism. ``prefix`` is this block's checkpoint name
        (``model.layers.N.self_attn``)."""
        cfg = ctx.hf_config
        total_heads = cfg.num_attention_heads
        total_kv_heads = getattr(cfg, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // total_heads
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            self.head_dim,
            total_heads,
            total_kv_heads,
            qkv_bias,
            ctx=ctx,
            prefix=f"{prefix}.qkv_proj",
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            total_heads * self.head_dim, cfg.hidden_size, o_bias, ctx=ctx, prefix=f"{prefix}.o_proj"
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        attn_metadata: list[AttentionMetadata],
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        # q/k norm (when the model has it) and rotary: one kernel, in place in the qkv output.
        q, k = self.rotary_emb(positions, q, k, self.q_norm, self.k_norm)
        return self.o_proj(self.attn(q, k, v, attn_metadata))


class DecoderModel(nn.Module):
    """Base for a decoder stack: ``embed_tokens``, ``layers`` (each called as
    ``layer(positions, hidden, residual, attn_metadata) -> (hidden, residual)``) and a final
    fused-residual ``norm``. Subclasses build the three in ``__init__``."""

    embed_tokens: nn.Module
    layers: nn.ModuleList
    norm: nn.Module

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: list[AttentionMetadata],
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``inputs_embeds`` [T, hidden] replaces the token embedding (a multimodal model
        passes text embeddings with image embeddings merged in)."""
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, attn_metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden
