"""Tiny random sentence-transformers models for the pooling tests: a transformers encoder or
decoder trunk saved with ``Pooling`` (and optionally ``Normalize``) modules, so the engine loads
the folder exactly as a user's bge / e5 / Qwen3-Embedding download.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TEXTS = [
    "hello world",
    "a much longer sentence with many more tokens in it, so the batch mixes lengths",
    "x",
    "def main(): return sum(x * x for x in range(10))",
]


def import_sentence_transformers() -> Any:
    """``sentence_transformers`` and its module classes (imported where a test needs them:
    the package is a test dependency only)."""
    import sentence_transformers
    import sentence_transformers.models  # noqa: F401  (the module classes, deprecated name)

    return sentence_transformers


def save_st_model(
    out_dir: Path,
    kind: str,
    pooling: str,
    normalize: bool,
    seed: int = 0,
    config_extra: dict[str, Any] | None = None,
    max_position_embeddings: int = 128,
) -> Path:
    """Build ``kind`` (``bert`` | ``xlm-roberta`` | ``qwen3``: a head-less ``BertModel`` /
    ``XLMRobertaModel`` / ``Qwen3Model``) with random weights and save it as a
    sentence-transformers model with ``pooling`` (cls | mean | lasttoken) in ``out_dir/st``.
    ``config_extra`` lands in config.json (e.g. ``matryoshka_dimensions``)."""
    import torch
    import transformers

    from engine.testing.tiny_models import build_tokenizer

    st = import_sentence_transformers()
    hf = out_dir / "hf"
    tok = build_tokenizer(hf)
    # sentence-transformers 6 applies a tokenizer's chat template to text inputs: an
    # encoder's tokenizer has none.
    (hf / "chat_template.jinja").unlink(missing_ok=True)
    common = dict(
        vocab_size=len(tok),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=tok.pad_token_id,
        **(config_extra or {}),
    )
    if kind == "bert":
        config = transformers.BertConfig(**common)
        model_cls = transformers.BertModel
    elif kind == "xlm-roberta":
        config = transformers.XLMRobertaConfig(**common)
        model_cls = transformers.XLMRobertaModel
    elif kind == "qwen3":
        config = transformers.Qwen3Config(num_key_value_heads=1, head_dim=16, **common)
        model_cls = transformers.Qwen3Model
    else:
        raise ValueError(f"unknown kind {kind!r}")
    torch.manual_seed(seed)
    model_cls(config).to(torch.float32).save_pretrained(hf)
    import importlib

    modules = importlib.import_module("sentence_transformers.models")
    trunk = modules.Transformer(str(hf))
    parts = [trunk, modules.Pooling(config.hidden_size, pooling_mode=pooling)]
    if normalize:
        parts.append(modules.Normalize())
    path = out_dir / "st"
    st.SentenceTransformer(modules=parts, device="cpu").save(str(path))
    if config_extra:  # keep the declaration (sentence-transformers rewrites config.json)
        cfg = json.loads((path / "config.json").read_text())
        cfg.update(config_extra)
        (path / "config.json").write_text(json.dumps(cfg))
    return path


def st_embeddings(path: Path, texts: list[str], normalize: bool | None = None) -> Any:
    """sentence-transformers' float32 embeddings of ``texts`` (a torch tensor)."""
    st = import_sentence_transformers()
    model = st.SentenceTransformer(str(path), device="cpu")
    return model.encode(
        texts, convert_to_tensor=True, normalize_embeddings=bool(normalize), batch_size=len(texts)
    ).float()


def save_cross_encoder(
    out_dir: Path, kind: str, seed: int = 0, max_len: int = 128, labels: list[str] | None = None
) -> Path:
    """A tiny random cross-encoder (``BertForSequenceClassification`` with two token types, or
    ``XLMRobertaForSequenceClassification`` with one; one label, or ``labels``: a classifier)
    saved with a tokenizer that writes pairs as BERT (``<s> A </s> B </s>``, types 0 then 1)
    or RoBERTa (``<s> A </s> </s> B </s>``) do, in ``out_dir``."""
    import torch
    import transformers
    from tokenizers import processors

    from engine.testing.tiny_models import build_tokenizer

    tok = build_tokenizer(out_dir)
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)
    cls, sep = tok.bos_token_id, tok.eos_token_id
    if kind == "bert":
        pair = "<s>:0 $A:0 </s>:0 $B:1 </s>:1"
    elif kind == "xlm-roberta":
        pair = "<s> $A </s> </s> $B </s>"
    else:
        raise ValueError(f"unknown kind {kind!r}")
    backend = tok.backend_tokenizer
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair=pair, special_tokens=[("<s>", cls), ("</s>", sep)]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        cls_token="<s>",
        sep_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )
    fast.save_pretrained(str(out_dir))
    common = dict(
        vocab_size=len(fast),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        pad_token_id=fast.pad_token_id,
        num_labels=len(labels) if labels else 1,
    )
    if labels:
        common["id2label"] = dict(enumerate(labels))
        common["label2id"] = {name: i for i, name in enumerate(labels)}
    if kind == "bert":
        config = transformers.BertConfig(max_position_embeddings=max_len, type_vocab_size=2,
                                         **common)  # fmt: skip
        model_cls = transformers.BertForSequenceClassification
    else:
        config = transformers.XLMRobertaConfig(
            max_position_embeddings=max_len + fast.pad_token_id + 1, **common
        )
        model_cls = transformers.XLMRobertaForSequenceClassification
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    with torch.no_grad():  # weights large enough for the scores of pairs to differ
        for param in model.parameters():
            param.normal_(0, 0.3)
    model.save_pretrained(out_dir)
    return out_dir


def save_decoder_classifier(
    out_dir: Path, kind: str, labels: list[str], seed: int = 0, max_len: int = 256
) -> Path:
    """A tiny random decoder sequence classifier (``Qwen3ForSequenceClassification`` or
    ``LlamaForSequenceClassification``: the trunk, then a ``score`` head on the last token)
    with ``labels``, saved with its tokenizer in ``out_dir``."""
    return save_tiny_decoder(
        out_dir,
        kind,
        "ForSequenceClassification",
        seed,
        max_len,
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id={name: i for i, name in enumerate(labels)},
    )


def save_tiny_decoder(
    out_dir: Path, kind: str, head: str, seed: int = 0, max_len: int = 256, **config: Any
) -> Path:
    """A tiny random ``qwen3`` or ``llama`` decoder with ``head`` (``"ForCausalLM"``,
    ``"ForSequenceClassification"``), ``config`` added to its transformers config, weights
    drawn from N(0, 0.2) (large enough for classes and tokens to differ), saved with its
    tokenizer in ``out_dir``."""
    import torch
    import transformers

    from engine.testing.tiny_models import build_tokenizer

    tok = build_tokenizer(out_dir)
    common = dict(
        vocab_size=len(tok),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=max_len,
        pad_token_id=tok.pad_token_id,
        **config,
    )
    if kind == "qwen3":
        hf_config = transformers.Qwen3Config(head_dim=16, **common)
        model_cls = getattr(transformers, "Qwen3" + head)
    elif kind == "llama":
        hf_config = transformers.LlamaConfig(**common)
        model_cls = getattr(transformers, "Llama" + head)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    torch.manual_seed(seed)
    model = model_cls(hf_config).to(torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
    model.save_pretrained(out_dir)
    return out_dir
