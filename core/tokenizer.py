"""Loading the tokenizer that goes with a model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import ModelConfig


class TokenizerLoadError(ValueError):
    """The tokenizer could not be loaded; the message names the path and the cause."""


def load_tokenizer(model_config: ModelConfig) -> Any:
    """Return a Hugging Face tokenizer for ``model_config`` (a local directory, a Hugging Face
    Hub id, cached or downloaded, or a .gguf file whose converted tokenizer is cached): the
    ``tokenizer`` when given (at ``tokenizer_revision``), else the model's own (at
    ``tokenizer_revision`` when given, else at the model's ``revision``)."""
    source = model_config.tokenizer or model_config.model
    if source is None:
        raise TokenizerLoadError("no model or tokenizer given")
    from engine.loader import locate_model
    from engine.loader.hub import hub_snapshot, is_hub_id

    if model_config.tokenizer is None and model_config.tokenizer_revision is None:
        source = str(locate_model(model_config))  # a local dir, .gguf, or Hub snapshot
    elif not Path(source).expanduser().exists():  # a Hub id: its tokenizer files only
        if not is_hub_id(source):
            raise TokenizerLoadError(
                f"tokenizer path {source} does not exist; pass a tokenizer directory or a "
                "Hugging Face Hub id (org/name)"
            )
        source = str(
            hub_snapshot(
                source,
                revision=model_config.tokenizer_revision,
                download_dir=model_config.download_dir,
                code=model_config.trust_remote_code,
                tokenizer_only=True,
            )
        )
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


@dataclass(frozen=True)
class TokenIdRange:
    """Which token ids a request may name, and the error when one is out of range.

    As in vLLM, a token id is valid below ``max(tokenizer size, model vocabulary)``: a model's
    embedding often has more rows than its tokenizer has tokens (Qwen3: 151,936 rows for
    151,669 tokens; vocabularies padded to a multiple of 64 or 128), and those ids are
    legitimate. Ids that index the model's rows (prompt ids: embeddings; ``logit_bias``:
    logits) must also be below ``model_vocab``, which only differs when the tokenizer is the
    larger one; a stop token id needs no row (one the model cannot produce never matches).
    """

    tokenizer_size: int
    model_vocab: int

    @classmethod
    def of(cls, tokenizer: Any, hf_config: Any) -> TokenIdRange:
        """The range of a model (its Hugging Face config; None: the tokenizer's size) and its
        tokenizer (None: none)."""
        size = len(tokenizer) if tokenizer is not None else 0
        text = getattr(hf_config, "text_config", None) or hf_config
        vocab = getattr(text, "vocab_size", None)
        return cls(size, int(vocab) if vocab is not None else size)

    @property
    def limit(self) -> int:
        """One more than the largest valid id."""
        return max(self.tokenizer_size, self.model_vocab)

    def check(self, ids: Any, param: str, *, needs_row: bool = False) -> None:
        """Raise ``InvalidRequestError`` (naming ``param``) unless every id is valid."""
        from engine.errors import InvalidRequestError

        limit = self.limit
        ids = list(ids)
        # The common case in C: all ints, within range (a prompt may have 100k ids).
        if ids and set(map(type, ids)) == {int}:
            bound = self.model_vocab if needs_row else limit
            if min(ids) >= 0 and max(ids) < min(bound, limit):
                return
        for token in ids:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < limit:
                raise InvalidRequestError(
                    f"{param}: token id {token!r} is out of range; token ids are integers in "
                    f"0..{limit - 1} (the larger of the tokenizer's {self.tokenizer_size} "
                    f"tokens and the model's vocabulary of {self.model_vocab})",
                    param,
                )
            if needs_row and token >= self.model_vocab:
                raise InvalidRequestError(
                    f"{param}: token id {token} is a tokenizer token the model has no row for; "
                    f"the model's vocabulary is 0..{self.model_vocab - 1}",
                    param,
                )
