"""BERT-family encoders (``BertModel``, ``RobertaModel``, ``XLMRobertaModel``) for embeddings.

Post-norm transformer layers with biases and GELU, learned absolute positions (RoBERTa's
start after the padding id), token-type embeddings (type 0: one text per request, as a
sentence-transformers model feeds them). Attention is bidirectional: the model runner gives
every request one bidirectional span over its whole prompt (``engine.pooling``), which the
paged attention backends implement (the span mechanism Gemma 3's image tokens use). A
pooling request runs whole in one step, so the span always lies inside the step's tokens.

Module names follow transformers' so a checkpoint loads by name (``bert.`` / ``roberta.``
prefixes of a task model are dropped, its heads and the unused ``pooler`` skipped).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.attention_backends.interface import AttentionMetadata
from engine.layers.attention import Attention
from engine.layers.weight_utils import ModelLoadError
from engine.models.context import ModelContext


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        # RoBERTa numbers positions from padding_idx + 1 (transformers'
        # create_position_ids_from_input_ids on an unpadded sequence).
        roberta = cfg.model_type in ("roberta", "xlm-roberta", "camembert")
        self.position_offset = (cfg.pad_token_id or 0) + 1 if roberta else 0

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, types: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``types``: each token's type; None gives every token type 0."""
        x = self.word_embeddings(input_ids)
        x = x + self.position_embeddings(positions + self.position_offset)
        if types is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(types)
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, ctx: ModelContext) -> None:
        super().__init__()
        cfg = ctx.hf_config
        heads = cfg.num_attention_heads
        head_dim = cfg.hidden_size // heads
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.attn = Attention(heads, head_dim, heads, head_dim**-0.5, ctx.attn_backend_cls)

    def forward(self, x: torch.Tensor, attn_metadata: list[AttentionMetadata]) -> torch.Tensor:
        return self.attn(self.query(x), self.key(x), self.value(x), attn_metadata)


class BertDenseNorm(nn.Module):
    """``LayerNorm(dense(x) + residual)``: the post-norm output of a BERT sub-block."""

    def __init__(self, cfg: Any, in_features: int) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, ctx: ModelContext) -> None:
        super().__init__()
        # ``self`` is the checkpoint's name for the attention projections.
        setattr(self, "self", BertSelfAttention(ctx))  # noqa: B010
        self.output = BertDenseNorm(ctx.hf_config, ctx.hf_config.hidden_size)

    def forward(self, x: torch.Tensor, attn_metadata: list[AttentionMetadata]) -> torch.Tensor:
        return self.output(self.self(x, attn_metadata), x)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act = ACT2FN[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, ctx: ModelContext) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.attention = BertAttention(ctx)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertDenseNorm(cfg, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, attn_metadata: list[AttentionMetadata]) -> torch.Tensor:
        x = self.attention(x, attn_metadata)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, ctx: ModelContext) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(ctx) for _ in range(ctx.hf_config.num_hidden_layers))


class BertModel(nn.Module):
    """A BERT / RoBERTa / XLM-RoBERTa encoder: token ids -> last hidden states [T, hidden]."""

    is_pooling_model = True
    # The model runner makes each request's prompt one bidirectional span; the runtime picks
    # an attention backend that supports such spans.
    bidirectional_attention = True
    skip_checkpoint_prefixes = ("pooler.", "cls.", "lm_head.", "classifier.")
    skip_checkpoint_reason = "heads an embedding model does not run"

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__()
        cfg = ctx.hf_config
        if getattr(cfg, "position_embedding_type", "absolute") not in (None, "absolute"):
            raise ModelLoadError(
                f"position_embedding_type={cfg.position_embedding_type!r} is not supported "
                "(absolute positions only)"
            )
        if ctx.parallel.world_size > 1:
            raise ModelLoadError("BERT-family encoders run on one device (no TP/PP)")
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(ctx)
        self.to(ctx.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: list[AttentionMetadata],
        intermediate: Any = None,
    ) -> torch.Tensor:
        hidden = self.embeddings(input_ids, positions, self.token_types(input_ids, positions))
        for layer in self.encoder.layer:
            hidden = layer(hidden, attn_metadata)
        return hidden

    def token_types(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """Each token's type (None: all type 0, one text per prompt)."""
        return None

    def attention_layers(self) -> list[Attention]:
        return [layer.attention.self.attn for layer in self.encoder.layer]

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        raise RuntimeError("an encoder computes no logits")

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            for prefix in ("bert.", "roberta.", "model."):
                name = name.removeprefix(prefix)
            if name.startswith(self.skip_checkpoint_prefixes) or name.endswith(
                ("position_ids", "token_type_ids")
            ):
                continue
            _copy_tensor(params, name, tensor, self)
            loaded.add(name)
        return loaded


def _copy_tensor(params: dict[str, nn.Parameter], name: str, tensor: Any, model: Any) -> None:
    """Copy checkpoint tensor ``name`` into its parameter (a ``ModelLoadError`` for an unknown
    name or a wrong shape)."""
    param = params.get(name)
    if param is None:
        raise ModelLoadError(f"unexpected checkpoint tensor {name!r} for {type(model)}")
    if tuple(param.shape) != tuple(tensor.shape):
        raise ModelLoadError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the model "
            f"expects {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(tensor)


class BertForSequenceClassification(BertModel):
    """A BERT / RoBERTa / XLM-RoBERTa sequence classifier (``*ForSequenceClassification``):
    the encoder, then the classification head on the first token's hidden state
    (``engine.pooling`` pools it, the model runner calls ``classify``). With one label it is a
    cross-encoder (the bge-reranker and ms-marco MiniLM rerankers) whose probability scores a
    text pair.

    BERT's head is its pooler (dense + tanh) and ``classifier``; RoBERTa's is
    ``classifier.dense`` + tanh + ``classifier.out_proj``. A text pair comes as one prompt,
    ``[CLS] A [SEP] B [SEP]`` as its tokenizer writes it; for BERT (two token types) the
    tokens after the first separator are type 1, which is where BERT's tokenizer starts
    ``token_type_ids`` of the second text (RoBERTa's tokenizers give every token type 0).
    """

    skip_checkpoint_prefixes = ("cls.", "lm_head.")
    skip_checkpoint_reason = "heads a cross-encoder does not run"

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__(ctx)
        cfg = ctx.hf_config
        self.num_labels = int(getattr(cfg, "num_labels", 1))
        hidden = cfg.hidden_size
        self.roberta_head = cfg.model_type in ("roberta", "xlm-roberta", "camembert")
        if self.roberta_head:
            self.classifier = nn.ModuleDict(
                {"dense": nn.Linear(hidden, hidden), "out_proj": nn.Linear(hidden, self.num_labels)}
            )
        else:
            self.pooler = nn.ModuleDict({"dense": nn.Linear(hidden, hidden)})
            self.classifier = nn.Linear(hidden, self.num_labels)
        # The loader fills sep_token_id from the tokenizer when config.json lacks it.
        sep = getattr(cfg, "sep_token_id", None)
        self.sep_token_id = int(sep) if sep is not None else None
        type_vocab_size = int(getattr(cfg, "type_vocab_size", 1) or 1)
        # BERT's tokenizers give the second text type 1; RoBERTa's give every token type 0.
        self.pair_types = (
            not self.roberta_head and type_vocab_size > 1 and self.sep_token_id is not None
        )
        self.to(ctx.dtype)

    def token_types(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        if not self.pair_types:
            return None
        return _second_segment(input_ids, positions, self.sep_token_id)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """The head's logits ``[N, num_labels]`` (float32) of the pooled first tokens."""
        x = pooled.to(self.classifier_dtype)
        if self.roberta_head:
            x = torch.tanh(self.classifier["dense"](x))
            return self.classifier["out_proj"](x).float()
        x = torch.tanh(self.pooler["dense"](x))
        return self.classifier(x).float()

    @property
    def classifier_dtype(self) -> torch.dtype:
        return next(self.classifier.parameters()).dtype

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        head: list[tuple[str, Any]] = []

        def trunk() -> Iterable[tuple[str, Any]]:
            for name, tensor in weights:
                bare = name
                for prefix in ("bert.", "roberta.", "model."):
                    bare = bare.removeprefix(prefix)
                if bare.startswith(("classifier.", "pooler.")):
                    head.append((bare, tensor))
                else:
                    yield name, tensor

        loaded = super().load_weights(trunk())
        params = dict(self.named_parameters())
        for name, tensor in head:
            if self.roberta_head and name.startswith("pooler."):
                continue  # RoBERTa's unused pooler
            _copy_tensor(params, name, tensor, self)
            loaded.add(name)
        return loaded


def _second_segment(
    input_ids: torch.Tensor, positions: torch.Tensor, sep_token_id: int
) -> torch.Tensor:
    """Per token, 1 when a separator came before it in its own prompt (the second text of a
    pair), else 0. Prompts are told apart by their positions restarting at 0 (a pooling
    prompt runs whole in one step)."""
    is_sep = (input_ids == sep_token_id).to(torch.int64)
    before = torch.cumsum(is_sep, 0) - is_sep  # separators strictly before, over the batch
    starts = positions == 0
    owner = torch.cumsum(starts.to(torch.int64), 0) - 1  # the prompt each token belongs to
    base = before[starts]  # separators before each prompt's first token
    return ((before - base[owner]) > 0).to(torch.int64)
