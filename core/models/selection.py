"""Which implementation serves a model: a native class or the transformers backend.

``ModelConfig.model_impl`` (``--model-impl``, ``LLM(model_impl=...)``; vLLM's flag) is one of

* ``auto`` (default): the native class registered for the config's architecture, else the
  transformers modeling backend (``engine.models.transformers_backend``) when it can serve the
  model;
* ``native``: the registered class only; an architecture without one is an error;
* ``transformers``: the transformers backend, even where a native class exists.

A model neither can serve fails with both sides' reasons. The choice is logged with its reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from engine.layers.weight_utils import ModelLoadError
from engine.models.registry import ModelRegistry

logger = logging.getLogger(__name__)

MODEL_IMPLS = ("auto", "native", "transformers")


@dataclass(frozen=True)
class ModelChoice:
    """The architecture name, the class that builds the model, which implementation it is
    (``native`` | ``transformers``) and why it was chosen."""

    architecture: str
    model_cls: type
    implementation: str
    reason: str


def select_model(
    hf_config: Any,
    model_impl: str = "auto",
    registry: ModelRegistry | None = None,
    trust_remote_code: bool = False,
    log: bool = False,
    runner: str = "generate",
) -> ModelChoice:
    """Pick the implementation for ``hf_config`` (see the module docstring). Raises
    ``ModelLoadError`` naming what is supported, and the transformers backend's reasons, when
    nothing can serve the model. ``log`` logs the choice at INFO. ``runner="pooling"`` serves
    a native decoder without its LM head (``engine.models.pooling_adapter``); pooling models
    run natively only."""
    if model_impl not in MODEL_IMPLS:
        raise ModelLoadError(
            f"model_impl={model_impl!r} is not supported; choose one of {', '.join(MODEL_IMPLS)}"
        )
    registry = registry or ModelRegistry()
    names = list(getattr(hf_config, "architectures", None) or [])
    shown = ", ".join(names) or f"(none in config.json; model_type {hf_config.model_type!r})"
    native = next((n for n in names if n in registry), None)
    if model_impl == "native" or (model_impl == "auto" and native is not None):
        try:
            architecture, cls = registry.resolve(names)
        except ModelLoadError as e:
            if model_impl != "native":
                raise
            raise ModelLoadError(
                f"{e} (model_impl=native; auto or transformers may run it)"
            ) from None
        choice = ModelChoice(
            architecture, cls, "native", f"{architecture} has a native implementation"
        )
    elif runner == "pooling":
        raise ModelLoadError(
            f"the pooling runner (embeddings) serves native architectures only, and {shown} "
            f"has none; pooling architectures: {', '.join(registry.supported())}"
        )
    else:
        from engine.models.transformers_backend import (
            TransformersForCausalLM,
            transformers_backend_problems,
        )

        problems = transformers_backend_problems(hf_config, trust_remote_code)
        if problems:
            if model_impl == "transformers":
                raise ModelLoadError(
                    f"model_impl=transformers cannot serve {shown}: " + "; ".join(problems)
                )
            raise ModelLoadError(
                f"unsupported model architecture {shown}: no native implementation (supported "
                f"architectures: {', '.join(registry.supported())}), and the transformers "
                "backend cannot serve it: " + "; ".join(problems) + ". Use a model of one of "
                "these, or install a plugin that adds it (`engine plugins` lists the installed "
                "ones)"
            )
        architecture = names[0] if names else hf_config.model_type
        why = (
            "requested with model_impl=transformers"
            if model_impl == "transformers"
            else f"{architecture} has no native implementation"
        )
        choice = ModelChoice(architecture, TransformersForCausalLM, "transformers", why)
    if runner == "pooling" and not getattr(choice.model_cls, "is_pooling_model", False):
        from engine.models.pooling_adapter import as_pooling_model

        choice = ModelChoice(
            choice.architecture,
            as_pooling_model(choice.model_cls),
            choice.implementation,
            choice.reason + ", served for pooling without its LM head",
        )
    if log:
        logger.info(
            "model %s: %s implementation (%s.%s): %s",
            choice.architecture,
            choice.implementation,
            choice.model_cls.__module__,
            choice.model_cls.__name__,
            choice.reason,
        )
    return choice
