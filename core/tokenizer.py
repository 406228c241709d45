"""Loading the tokenizer that goes with a model, offline."""

from __future__ import annotations

from typing import Any

from engine.config import ModelConfig


class TokenizerLoadError(ValueError):
    """The tokenizer could not be loaded; the message names the path and the cause."""


def load_tokenizer(model_config: ModelConfig) -> Any:
    """Return a Hugging Face tokenizer for ``model_config`` (a local directory, a model id in
    the local HF cache, or a .gguf file whose converted tokenizer is cached)."""
    source = model_config.tokenizer or model_config.model
    if source is None:
        raise TokenizerLoadError("no model or tokenizer given")
    if model_config.tokenizer is None:
        from engine.loader import resolve_model_path

        source = str(resolve_model_path(source))  # a local dir, .gguf, or HF-cache snapshot
    if str(source).endswith(".gguf"):
        from engine.loader.gguf_loader import load_tokenizer as load_gguf_tokenizer

        return load_gguf_tokenizer(source)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            source, trust_remote_code=model_config.trust_remote_code, local_files_only=True
        )
    except Exception as e:  # transformers raises many types here; name the source
        raise TokenizerLoadError(f"cannot load a tokenizer from {source!r}: {e}") from e


def eos_token_ids(tokenizer: Any, hf_config: Any, generation_eos: Any = None) -> list[int]:
    """Every token id that ends generation: the tokenizer's EOS plus the config's (Llama 3 and
    others list several; a multimodal config may give them at the top level or in its
    ``text_config``) plus ``generation_eos``, those of the model's generation config (see
    ``engine.generation_config``). ``tokenizer`` is None with ``skip_tokenizer_init``."""
    ids: list[int] = []
    text = getattr(hf_config, "text_config", None)
    sources = (
        getattr(hf_config, "eos_token_id", None),
        getattr(text, "eos_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
        generation_eos,
    )
    for source in sources:
        if source is None:
            continue
        for token_id in source if isinstance(source, (list, tuple)) else [source]:
            if token_id is not None and int(token_id) not in ids:
                ids.append(int(token_id))
    return ids
