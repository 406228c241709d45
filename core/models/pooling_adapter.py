"""Serve a native decoder (``XForCausalLM``) as an embedding model: the same trunk, no LM head.

``as_pooling_model(cls)`` is what ``--runner pooling`` does to a generative architecture
(Qwen3-Embedding ships ``Qwen3ForCausalLM`` in its config) and what the registry maps the
head-less architectures (``Qwen3Model``) to. The forward still returns the final-norm hidden
states; the model runner pools them (``engine.pooling``). Checkpoints saved from the head-less
transformers class name their tensors without the ``model.`` prefix (``layers.0...``); they
load as well as the ``model.``-prefixed ones, and an LM head in the checkpoint is skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from engine.models.base import PPMissingLayer

_ADAPTED: dict[type, type] = {}


def as_pooling_model(cls: type) -> type:
    """A subclass of the decoder class ``cls`` without its LM head (one per ``cls``)."""
    if cls in _ADAPTED:
        return _ADAPTED[cls]

    class PoolingModel(cls):  # type: ignore[misc, valid-type]
        is_pooling_model = True
        skip_checkpoint_prefixes = (*getattr(cls, "skip_checkpoint_prefixes", ()), "lm_head.")
        skip_checkpoint_reason = "an embedding model has no LM head"

        def __init__(self, ctx: Any) -> None:
            super().__init__(ctx)
            self.lm_head = PPMissingLayer()  # never built into the forward: hidden states out

        def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
            return super().load_weights(_with_model_prefix(weights))

        def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
            raise RuntimeError("a pooling model computes no logits")

    name = cls.__name__.removesuffix("ForCausalLM") + "ForEmbedding"
    PoolingModel.__name__ = PoolingModel.__qualname__ = name
    PoolingModel.__module__ = cls.__module__
    _ADAPTED[cls] = PoolingModel
    return PoolingModel


_CLASSIFIERS: dict[type, type] = {}


def as_classifier_model(cls: type) -> type:
    """The decoder class ``cls`` as a sequence classifier (``XForSequenceClassification``:
    reward models, classifiers, converted rerankers): the trunk without its LM head, then a
    ``score`` projection (no bias) of the last token's hidden state to ``num_labels`` logits,
    which the model runner turns into probabilities (``engine.pooling.finish_classes``)."""
    if cls in _CLASSIFIERS:
        return _CLASSIFIERS[cls]
    base = as_pooling_model(cls)

    class SequenceClassifier(base):  # type: ignore[misc, valid-type]
        skip_checkpoint_reason = "a sequence classifier has no LM head"

        def __init__(self, ctx: Any) -> None:
            super().__init__(ctx)
            cfg = ctx.hf_config
            self.num_labels = int(getattr(cfg, "num_labels", 1) or 1)
            self.score = nn.Linear(cfg.hidden_size, self.num_labels, bias=False, dtype=ctx.dtype)
            self.classifier_from_token_ids = getattr(cfg, "classifier_from_token_ids", None)
            self.classifier_method = getattr(cfg, "classifier_method", None)

        @classmethod
        def checkpoint_prefixes_to_skip(cls, ctx: Any) -> tuple[tuple[str, ...], str]:
            """As the decoder's, but a classifier made from the LM head's rows
            (``classifier_from_token``) reads ``lm_head.``."""
            parent = getattr(super(), "checkpoint_prefixes_to_skip", None)
            if parent is not None:
                prefixes, reason = parent(ctx)
            else:
                prefixes, reason = cls.skip_checkpoint_prefixes, cls.skip_checkpoint_reason
            if getattr(ctx.hf_config, "classifier_from_token_ids", None):
                prefixes = tuple(p for p in prefixes if p != "lm_head.")
            return tuple(prefixes), reason

        def classify(self, pooled: torch.Tensor) -> torch.Tensor:
            """The ``score`` head's logits ``[N, num_labels]`` (float32)."""
            return self.score(pooled.to(self.score.weight.dtype)).float()

        def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
            head: list[Any] = []
            # A classifier made from the LM head (engine.loader.model_loader's
            # _resolve_classifier_tokens): the head's (or the tied embedding's) rows.
            token_ids = self.classifier_from_token_ids
            vocab_rows: dict[str, Any] = {}

            def trunk() -> Iterator[tuple[str, Any]]:
                for name, tensor in weights:
                    if name == "score.weight" and token_ids is None:
                        head.append(tensor)
                        continue
                    if token_ids is not None and name.endswith(
                        ("lm_head.weight", "embed_tokens.weight")
                    ):
                        vocab_rows[name.rsplit(".", 2)[-2]] = tensor
                    if token_ids is None or not name.endswith("lm_head.weight"):
                        yield name, tensor

            loaded = super().load_weights(trunk())
            if token_ids is not None:
                rows = vocab_rows.get("lm_head", vocab_rows.get("embed_tokens"))
                if rows is None:
                    from engine.layers.weight_utils import ModelLoadError

                    raise ModelLoadError(
                        "classifier_from_token needs the checkpoint's lm_head.weight (or a "
                        "tied embed_tokens.weight); it has neither"
                    )
                picked = torch.as_tensor(rows[token_ids]).float()
                if self.classifier_method == "from_2_way_softmax":
                    picked = picked[1:2] - picked[0:1]
                head.append(picked)
            if len(head) != 1 or tuple(head[0].shape) != tuple(self.score.weight.shape):
                from engine.layers.weight_utils import ModelLoadError

                shapes = [tuple(t.shape) for t in head]
                raise ModelLoadError(
                    f"a sequence classifier needs one score.weight of shape "
                    f"{tuple(self.score.weight.shape)}; the checkpoint has {shapes or 'none'}"
                )
            with torch.no_grad():
                self.score.weight.copy_(head[0])
            loaded.add("score.weight")
            return loaded

    name = cls.__name__.removesuffix("ForCausalLM") + "ForSequenceClassification"
    SequenceClassifier.__name__ = SequenceClassifier.__qualname__ = name
    SequenceClassifier.__module__ = cls.__module__
    _CLASSIFIERS[cls] = SequenceClassifier
    return SequenceClassifier


def _with_model_prefix(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    for name, tensor in weights:
        if name.startswith("lm_head."):
            continue
        yield (name if name.startswith("model.") else f"model.{name}"), tensor
