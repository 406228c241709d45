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

``--override-generation-config JSON`` (vLLM's) sets defaults over the file's, in its names
(``{"temperature": 0.6, "max_new_tokens": 2048}``); with ``--generation-config vllm`` they are
the only defaults.
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


def load_generation_config(model_path: str | None, source: str | None = None) -> Any:
    """The ``transformers.GenerationConfig`` in ``source`` (a directory named by
    ``--generation-config DIR``; ``ConfigError`` when it has none), or else next to the model
    (None when there is none, or for a GGUF model)."""
    if source is not None:
        if not os.path.isdir(source):
            raise ConfigError(f"--generation-config {source!r} is not a directory")
        if not os.path.isfile(os.path.join(source, "generation_config.json")):
            raise ConfigError(f"--generation-config: no generation_config.json in {source!r}")
    else:
        source = model_path
        if source is None or not os.path.isfile(os.path.join(source, "generation_config.json")):
            return None
    from transformers import GenerationConfig

    return GenerationConfig.from_pretrained(source, local_files_only=True)


def sampling_defaults(generation_config: Any) -> dict[str, Any]:
    """``SamplingParams`` keyword defaults from the fields the generation config sets
    (only those that differ from transformers' own defaults, as vLLM takes them)."""
    if generation_config is None:
        return {}
    changed = generation_config.to_diff_dict()
    return {ours: changed[theirs] for theirs, ours in SAMPLING_FIELDS.items() if theirs in changed}


def resolve(
    model_path: str | None, option: str = "auto", overrides: dict[str, Any] | None = None
) -> tuple[Any, dict[str, Any]]:
    """``(eos_token_id, sampling defaults)`` for the model at ``model_path`` under ``option``
    (``"auto"``, ``"vllm"`` or a directory) and the ``overrides`` (generation-config names,
    see ``check_overrides``); the EOS entry is the config's int, list or None, as
    ``engine.tokenizer.eos_token_ids`` takes it."""
    gen = load_generation_config(model_path, None if option in ("auto", "vllm") else option)
    eos = getattr(gen, "eos_token_id", None)
    defaults = {} if option == "vllm" else sampling_defaults(gen)
    if defaults:
        logger.info(
            "default sampling parameters from the model's generation_config.json: %s "
            "(requests that set a field override it; --generation-config vllm ignores them)",
            ", ".join(f"{k}={v}" for k, v in sorted(defaults.items())),
        )
    if overrides:
        given = {SAMPLING_FIELDS[k]: v for k, v in check_overrides(overrides).items()}
        defaults = {**defaults, **given}
        logger.info(
            "default sampling parameters from --override-generation-config: %s",
            ", ".join(f"{k}={v}" for k, v in sorted(given.items())),
        )
    return eos, defaults


def check_overrides(overrides: Any) -> dict[str, Any]:
    """``--override-generation-config``: an object of generation-config fields the engine
    takes as sampling defaults (``SAMPLING_FIELDS``) with values ``SamplingParams`` accepts;
    ``ConfigError`` naming what is wrong otherwise."""
    if not isinstance(overrides, dict):
        raise ConfigError(
            f"--override-generation-config must be a JSON object, got {type(overrides).__name__}"
        )
    unknown = sorted(set(overrides) - set(SAMPLING_FIELDS))
    if unknown:
        raise ConfigError(
            f"--override-generation-config: unknown fields {unknown}; the fields read are "
            f"{', '.join(SAMPLING_FIELDS)}"
        )
    from engine.sampling_params import SamplingParams

    try:
        SamplingParams(**{SAMPLING_FIELDS[k]: v for k, v in overrides.items()})
    except (TypeError, ValueError) as e:
        raise ConfigError(f"--override-generation-config: {e}") from None
    return overrides
