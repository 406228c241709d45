"""Pooling models: which runner a model gets, how its hidden states become one vector.

A *pooling* model runs prefill only: each request's prompt goes through the model in one
step (the scheduler never splits a pooling prompt into chunks, see ``engine.scheduler``), its
hidden states are pooled on the device into one vector (the last token's, the first
token's or their mean), optionally truncated to the first ``dimensions`` values (matryoshka
models) and L2-normalised, and only that float32 vector leaves the model runner.

``resolve_pooler_config`` reads what a checkpoint says about this, from the
sentence-transformers files next to ``config.json``:

* ``modules.json``: the module list; a ``Normalize`` module
  turns normalisation on by default; a ``Pooling`` module names its folder;
* ``<pooling folder>/config.json`` (usually ``1_Pooling/``): ``pooling_mode_cls_token``,
  ``pooling_mode_mean_tokens``, ``pooling_mode_lasttoken`` (or ``pooling_mode`` by name);
* ``sentence_bert_config.json``: ``max_seq_length``, the prompt length the model was meant for;
* ``config.json``: ``is_matryoshka`` / ``matryoshka_dimensions`` (which ``dimensions`` a
  request may ask for).

Without them an encoder (BERT family) pools the CLS token and a decoder the last token, and
normalises (vLLM's defaults for embedding models).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.config import ConfigError
from engine.errors import InvalidRequestError
from engine.pooling_params import PoolingParams

if TYPE_CHECKING:
    import torch

POOLING_TYPES = ("LAST", "CLS", "MEAN")

# Sequence classifiers: class probabilities out (``/classify``); with one label, cross-encoders
# (a text pair in, its relevance score out: ``/score``, ``/rerank``). The BERT family pools
# the first token, the decoders the last.
ENCODER_CLASSIFIERS = frozenset(
    {
        "BertForSequenceClassification",
        "RobertaForSequenceClassification",
        "XLMRobertaForSequenceClassification",
    }
)
SEQUENCE_CLASSIFIER_ARCHITECTURES = ENCODER_CLASSIFIERS | {
    "LlamaForSequenceClassification",
    "Qwen2ForSequenceClassification",
    "Qwen3ForSequenceClassification",
}
# Architectures that have no LM head: they can only embed (or score).
POOLING_ONLY_ARCHITECTURES = (
    frozenset({"BertModel", "RobertaModel", "XLMRobertaModel", "Qwen3Model"})
    | SEQUENCE_CLASSIFIER_ARCHITECTURES
)
ENCODER_ARCHITECTURES = (
    frozenset({"BertModel", "RobertaModel", "XLMRobertaModel"}) | ENCODER_CLASSIFIERS
)

_ST_MODES = {
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_lasttoken": "LAST",
}
_ST_MODE_NAMES = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}


@dataclass
class PoolerConfig:
    """How a pooling model pools: ``pooling_type`` (LAST | CLS | MEAN), whether it normalises
    by default, and the matryoshka dimensions it supports (``None``: any up to the hidden
    size when ``is_matryoshka``; ``dimensions`` is refused when not ``is_matryoshka``)."""

    pooling_type: str
    normalize: bool = True
    # "embed": the pooled vector is the output; "classify": a sequence-classification head
    # turns the pooled first token into class probabilities (``finish_classes``); with one
    # label it is a cross-encoder, whose probability is a text pair's relevance score.
    task: str = "embed"
    # A classifier's label names by class index (config.json's id2label).
    labels: list[str] | None = None
    hidden_size: int = 0
    is_matryoshka: bool = False
    matryoshka_dimensions: list[int] | None = None
    # Where the choice came from, for the log line and error messages.
    source: str = "default"

    def check(self, params: PoolingParams) -> None:
        """Raise ``InvalidRequestError`` for options this model cannot honour."""
        dims = params.dimensions
        if dims is None:
            return
        if not self.is_matryoshka:
            raise InvalidRequestError(
                "this model does not support matryoshka representation (its config.json "
                "declares no is_matryoshka / matryoshka_dimensions): 'dimensions' cannot be "
                "set",
                "dimensions",
            )
        if self.matryoshka_dimensions and dims not in self.matryoshka_dimensions:
            raise InvalidRequestError(
                f"dimensions={dims} is not supported by this model; it supports "
                f"{self.matryoshka_dimensions}",
                "dimensions",
            )
        if dims > self.hidden_size:
            raise InvalidRequestError(
                f"dimensions={dims} exceeds the model's embedding size {self.hidden_size}",
                "dimensions",
            )


def has_sentence_transformers_config(model_dir: Path | None) -> bool:
    """Whether ``model_dir`` holds a sentence-transformers ``modules.json`` with a pooling
    module (an embedding model, whatever its ``architectures``)."""
    return bool(model_dir is not None and _pooling_module(model_dir) is not None)


def resolve_runner(
    runner: str, architectures: list[str], model_dir: Path | None
) -> tuple[str, str]:
    """``(generate | pooling, why)`` for ``--runner runner`` (auto: pooling for an
    architecture without an LM head or a sentence-transformers checkpoint)."""
    if runner != "auto":
        return runner, f"--runner {runner}"
    pooling_only = [a for a in architectures if a in POOLING_ONLY_ARCHITECTURES]
    if pooling_only:
        return "pooling", f"{pooling_only[0]} has no LM head (an embedding model)"
    if has_sentence_transformers_config(model_dir):
        return "pooling", "the checkpoint is a sentence-transformers model (modules.json)"
    return "generate", "a generative architecture"


def resolve_pooler_config(
    model_dir: Path | None, hf_config: Any, architectures: list[str]
) -> PoolerConfig:
    """The pooler of a checkpoint (see the module docstring)."""
    encoder = any(a in ENCODER_ARCHITECTURES for a in architectures)
    cfg = PoolerConfig("CLS" if encoder else "LAST", hidden_size=int(hf_config.hidden_size))
    if any(a in SEQUENCE_CLASSIFIER_ARCHITECTURES for a in architectures):
        cfg.task, cfg.normalize, cfg.source = "classify", False, "classification head"
        num_labels = int(getattr(hf_config, "num_labels", 1) or 1)
        id2label = getattr(hf_config, "id2label", None) or {}
        cfg.labels = [str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}")))
                      for i in range(num_labels)]  # fmt: skip
        return cfg
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    cfg.is_matryoshka = bool(getattr(hf_config, "is_matryoshka", False) or dims)
    cfg.matryoshka_dimensions = sorted(int(d) for d in dims) if dims else None
    if model_dir is None:
        return cfg
    modules = _read_json(model_dir / "modules.json")
    if not isinstance(modules, list):
        return cfg
    cfg.normalize = any(_module_kind(m) == "Normalize" for m in modules)
    cfg.source = "modules.json"
    folder = _pooling_module(model_dir)
    pooling = _read_json(model_dir / folder / "config.json") if folder is not None else None
    if isinstance(pooling, dict):
        chosen = [kind for key, kind in _ST_MODES.items() if pooling.get(key)]
        if pooling.get("pooling_mode") in _ST_MODE_NAMES:
            chosen = [_ST_MODE_NAMES[pooling["pooling_mode"]]]
        other = [
            k
            for k, v in pooling.items()
            if k.startswith("pooling_mode_") and k not in _ST_MODES and v
        ]
        if other or len(chosen) > 1:
            raise ConfigError(
                f"{model_dir / folder / 'config.json'}: pooling modes "
                f"{sorted(set(other) | {k for k in _ST_MODES if pooling.get(k)})} are not "
                "supported; one of cls, mean, lasttoken is"
            )
        if chosen:
            cfg.pooling_type = chosen[0]
            cfg.source = f"{folder}/config.json"
    return cfg


def _pooling_module(model_dir: Path) -> str | None:
    modules = _read_json(model_dir / "modules.json")
    if not isinstance(modules, list):
        return None
    for m in modules:
        if _module_kind(m) == "Pooling":
            return str(m.get("path") or "1_Pooling")
    return None


def _module_kind(module: Any) -> str:
    """The class name of a ``modules.json`` entry: ``sentence_transformers.models.Pooling``
    (sentence-transformers < 6) and ``...sentence_transformer.modules.pooling.Pooling`` (6)
    both name ``Pooling``."""
    if not isinstance(module, dict):
        return ""
    return str(module.get("type", "")).rsplit(".", 1)[-1]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def sentence_transformers_max_len(model_dir: Path | None) -> int | None:
    """``max_seq_length`` of ``sentence_bert_config.json`` (None when absent)."""
    if model_dir is None:
        return None
    data = _read_json(model_dir / "sentence_bert_config.json")
    value = data.get("max_seq_length") if isinstance(data, dict) else None
    return int(value) if isinstance(value, int) and value > 0 else None


# ----------------------------------------------------------------------- on the device
def pool(
    hidden: torch.Tensor,
    starts: list[int],
    ends: list[int],
    pooling_type: str,
) -> torch.Tensor:
    """Pool rows ``starts[i]:ends[i]`` of ``hidden`` [T, H] into one float32 vector each:
    [N, H]. ``LAST``: the last row; ``CLS``: the first; ``MEAN``: their mean."""
    import torch

    device = hidden.device
    if pooling_type == "LAST":
        return hidden[torch.tensor([e - 1 for e in ends], device=device)].float()
    if pooling_type == "CLS":
        return hidden[torch.tensor(starts, device=device)].float()
    if pooling_type == "MEAN":
        lens = torch.tensor([e - s for s, e in zip(starts, ends, strict=True)], device=device)
        owner = torch.repeat_interleave(torch.arange(len(starts), device=device), lens)
        rows = torch.cat(
            [torch.arange(s, e, device=device) for s, e in zip(starts, ends, strict=True)]
        )
        sums = torch.zeros(len(starts), hidden.shape[1], dtype=torch.float32, device=device)
        sums.index_add_(0, owner, hidden[rows].float())
        return sums / lens[:, None].float()
    raise ValueError(f"unknown pooling type {pooling_type!r}; one of {POOLING_TYPES}")


def finish_classes(logits: torch.Tensor) -> list[torch.Tensor]:
    """A classifier's class probabilities per prompt: the softmax of its logits, or with one
    label the sigmoid of the logit (a cross-encoder's relevance score, what
    sentence-transformers' ``CrossEncoder`` and vLLM's score API return)."""
    import torch

    logits = logits.float()
    if logits.shape[-1] == 1:
        return list(torch.sigmoid(logits))
    return list(torch.softmax(logits, dim=-1))


def finish_embeddings(
    pooled: torch.Tensor, params: list[PoolingParams], default_normalize: bool
) -> list[torch.Tensor]:
    """Per request: truncate to ``dimensions`` then L2-normalise (when asked), on the device."""
    import torch

    out = []
    for row, p in zip(pooled, params, strict=True):
        if p.dimensions is not None:
            row = row[: p.dimensions]
        if default_normalize if p.normalize is None else p.normalize:
            row = torch.nn.functional.normalize(row, p=2, dim=0)
        out.append(row)
    return out
