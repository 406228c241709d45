"""``CausalLM``: what every decoder-only model wrapper shares, pipeline stages included.

Under pipeline parallelism (``ModelContext.parallel.pp_size > 1``) each process builds one
stage: the decoder layers of ``parallel.layer_range``, the embedding on the first stage, the
final norm and LM head on the last. Everything else is a ``PPMissingLayer`` that holds no
weights, and ``CausalLM.stage_weights`` drops the checkpoint tensors of those parts before
their data is read. A stage's forward takes the previous stage's ``IntermediateTensors``
(hidden states and residual) and returns its own, except the last, which returns the hidden
states after the final norm.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from engine.attention_backends.interface import AttentionMetadata
from engine.layers import QKVParallelLinear, RowParallelLinear
from engine.layers.attention import Attention
from engine.models.context import ModelContext
from engine.parallel import SINGLE_PROCESS, IntermediateTensors, ParallelContext


class PPMissingLayer(nn.Module):
    """Stands for a part of the model another pipeline stage holds: no weights, never run."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("this layer lives on another pipeline stage")


def make_layers(
    num_layers: int, build: Callable[[int], nn.Module], parallel: ParallelContext
) -> tuple[int, int, nn.ModuleList]:
    """``(start, end, layers)``: the decoder layers of this pipeline stage built with
    ``build(index)``, the others ``PPMissingLayer`` placeholders (so layer ``i`` keeps its
    checkpoint name ``model.layers.i`` on every stage)."""
    start, end = parallel.layer_range(num_layers)
    layers = nn.ModuleList(
        build(i) if start <= i < end else PPMissingLayer() for i in range(num_layers)
    )
    return start, end, layers


def on_first_stage(parallel: ParallelContext, build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` on the first pipeline stage, a placeholder elsewhere (the embedding)."""
    return build() if parallel.is_first_stage else PPMissingLayer()


def on_last_stage(parallel: ParallelContext, build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` on the last pipeline stage, a placeholder elsewhere (final norm, LM head)."""
    return build() if parallel.is_last_stage else PPMissingLayer()


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
    tie_word_embeddings: bool = False

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: list[AttentionMetadata],
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """input_ids, positions: int64 [T] -> hidden states [T, hidden_size]; a pipeline stage
        other than the first reads ``intermediate`` instead of ``input_ids``, and one other than
        the last returns its ``IntermediateTensors``."""
        return self.model(input_ids, positions, attn_metadata, intermediate)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """hidden [N, hidden_size] -> float32 logits [N, vocab_size] (``float32=False``: the
        model's dtype allowed, for a greedy argmax)."""
        return self.lm_head(hidden, float32)

    def attention_layers(self) -> list[Attention]:
        """The paged-attention layers of this pipeline stage, in layer order."""
        return [
            layer.self_attn.attn
            for layer in self.model.layers
            if not isinstance(layer, PPMissingLayer)
        ]

    def stage_weights(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """``weights`` as this model (or pipeline stage) loads them: a tied LM head's own
        checkpoint tensors dropped, and the tensors of parts another stage holds dropped
        before their data is read. With tied embeddings a last stage that has no embedding
        of its own loads ``model.embed_tokens.weight`` into its LM head."""
        parallel = getattr(self.model, "parallel", SINGLE_PROCESS)
        absent = self.absent_prefixes()
        tied = self.tie_word_embeddings
        head_from_embedding = tied and parallel.is_last_stage and not parallel.is_first_stage
        for name, tensor in weights:
            if tied and name.startswith("lm_head."):
                continue  # a tied head has no weight of its own
            if head_from_embedding and name == "model.embed_tokens.weight":
                yield "lm_head.weight", tensor
                continue
            if absent and name.startswith(absent):
                continue
            yield name, tensor

    def absent_prefixes(self) -> tuple[str, ...]:
        """Checkpoint-name prefixes of the parts this pipeline stage does not hold."""
        prefixes = [
            f"model.layers.{i}."
            for i, layer in enumerate(self.model.layers)
            if isinstance(layer, PPMissingLayer)
        ]
        if isinstance(self.model.embed_tokens, PPMissingLayer):
            prefixes.append("model.embed_tokens.")
        if isinstance(self.model.norm, PPMissingLayer):
            prefixes.append("model.norm.")
        if isinstance(self.lm_head, PPMissingLayer):
            prefixes.append("lm_head.")
        return tuple(prefixes)


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
    fused-residual ``norm``. Subclasses build the three in ``__init__`` (with ``make_layers``,
    ``on_first_stage`` and ``on_last_stage`` so a pipeline stage builds only its part) and set
    ``parallel``, ``start_layer`` and ``end_layer``."""

    embed_tokens: nn.Module
    layers: nn.ModuleList
    norm: nn.Module
    parallel: ParallelContext = SINGLE_PROCESS
    start_layer: int = 0
    end_layer: int | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: list[AttentionMetadata],
        intermediate: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """``inputs_embeds`` [T, hidden] replaces the token embedding on the first stage (a
        multimodal model passes text embeddings with image embeddings merged in)."""
        if self.parallel.is_first_stage:
            hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            residual = None
        else:
            assert intermediate is not None, "a later pipeline stage needs the previous one's"
            hidden, residual = intermediate.hidden, intermediate.residual
        layers = self.layers
        if self.end_layer is not None:  # a pipeline stage: only its own layers
            layers = layers[self.start_layer : self.end_layer]
        for layer in layers:
            hidden, residual = layer(positions, hidden, residual, attn_metadata)
        if not self.parallel.is_last_stage:
            return IntermediateTensors(hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden
