"""Errors raised for bad requests, shared by the offline API and the HTTP server."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine will not run; ``param`` names the offending field when known.

    Raised before any work starts, so the engine stays usable.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """The prompt leaves no room in the model's context for even one generated token."""

    def __init__(self, num_tokens: int, max_model_len: int) -> None:
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, the prompt "
            f"has {num_tokens} tokens, which leaves no room for a generated token. Shorten the "
            "prompt or start the engine with a larger --max-model-len.",
            param="prompt",
        )
        self.num_tokens = num_tokens
        self.max_model_len = max_model_len


class EngineDeadError(RuntimeError):
    """The engine loop failed; no further requests can be served by this engine."""
