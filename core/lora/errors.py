"""Errors of LoRA adapters."""

from __future__ import annotations

from engine.errors import InvalidRequestError


class LoRAAdapterError(InvalidRequestError):
    """An adapter that cannot be served: a missing file, an unsupported PEFT feature, a rank
    above ``--max-lora-rank``, a module the model does not have, a shape that does not fit.
    The message names the adapter and the reason; nothing of it was loaded."""

    def __init__(self, message: str, param: str | None = "lora_path") -> None:
        super().__init__(message, param)
