"""The model's ``generation_config.json``: its end-of-sequence ids and its sampling defaults.

Model creators ship recommended sampling settings (Qwen3: temperature 0.6, top_p 0.95, top_k
20) and, for many instruct models, end-of-turn ids that ``config.json`` does not list (Llama 3
Instruct ends turns with ``<|eot_id|>``, Qwen 2.5 with ``<|im_end|>``). As in vLLM
(``--generation-config auto``, the default):

- its ``eos_token_id`` entries end generation, like the config's and the tokenizer's;
- its ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and
  ``max_new_tokens`` (as ``max_tokens``) become the defaults of requests that do not set them:
  ``LLM.get_default_sampling_params()``, ``LLM.generate`` without sampling parameters, and
  every server request.

``--generation-config vllm`` ignores the sampling defaults (the end-of-sequence ids still count:
without them an instruct model would not stop), and ``--generation-config DIR`` reads the file
from another directory. A GGUF file carries no generation config.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from engine.config import ConfigError

logger = logging.getLogger(__name__)

# generation_config.json field -> SamplingParams field.
SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def load_generation_config(model_path: str | None, option: str = "auto") -> Any:
    """The ``transformers.GenerationConfig`` for ``option``: ``"auto"`` reads
    ``generation_config.json`` next to the model, a directory path reads it there, ``"vllm"``
    reads none (None is also returned when there is no file, or for a GGUF model)."""
    if option == "vllm":
        return None
    source = model_path if option == "auto" else option
    if source is None or not os.path.isdir(source):
        if option not in ("auto", "vllm"):
            raise ConfigError(f"--generation-config {option!r} is not a directory")
        return None
    if not os.path.isfile(os.path.join(source, "generation_config.json")):
        if option != "auto":
            raise ConfigError(f"--generation-config: no generation_config.json in {source!r}")
        return None
    from transformers import GenerationConfig

    return GenerationConfig.from_pretrained(source, local_files_only=True)


def eos_token_ids(generation_config: Any) -> list[int]:
    """The end-of-sequence ids the generation config lists (an int or a list)."""
    value = getattr(generation_config, "eos_token_id", None)
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def sampling_defaults(generation_config: Any) -> dict[str, Any]:
    """``SamplingParams`` keyword defaults from the fields the generation config sets
    (only those that differ from transformers' own defaults, as vLLM takes them)."""
    if generation_config is None:
        return {}
    changed = generation_config.to_diff_dict()
    return {ours: changed[theirs] for theirs, ours in SAMPLING_FIELDS.items() if theirs in changed}


def resolve(model_path: str | None, option: str = "auto") -> tuple[list[int], dict[str, Any]]:
    """``(eos ids, sampling defaults)`` for the model at ``model_path`` under ``option``."""
    gen = load_generation_config(model_path, "auto" if option == "vllm" else option)
    eos = eos_token_ids(gen)
    defaults = {} if option == "vllm" else sampling_defaults(gen)
    if defaults:
        logger.info(
            "default sampling parameters from the model's generation_config.json: %s "
            "(requests that set a field override it; --generation-config vllm ignores them)",
            ", ".join(f"{k}={v}" for k, v in sorted(defaults.items())),
        )
    return eos, defaults
