"""Errors of LoRA adapters."""

from __future__ import annotations

from engine.errors import InvalidRequestError


class LoRAAdapterError(InvalidRequestError):
    """An adapter that cannot be served: a missing file, an unsupported PEFT feature, a rank
    above ``--max-lora-rank``, a module the model does not have, a shape that does not fit.
    The message names the adapter and the reason; nothing of it was loaded."""

    def __init__(self, message: str, param: str | None = "lora_path") -> None:
        super().__init__(message, param)


class LoRAAdapterNotLoadedError(InvalidRequestError):
    """A served request names an adapter no longer (or not yet) loaded in the engine core:
    the server answers 404 ``model_not_found`` (``code``), as for any unknown model."""

    code = "model_not_found"

    def __init__(self, lora_name: str) -> None:
        super().__init__(
            f"The model `{lora_name}` does not exist (no LoRA adapter has that name).", "model"
        )
        self.lora_name = lora_name
