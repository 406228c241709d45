"""Errors of the engine, each message one paragraph naming the culprit and the fix.

Plugin framework errors (``PluginError`` and subclasses) name the plugin, distribution, entry
point, platform or backend; the CLI prints ``str(error)`` to stderr and exits with status 2,
without a traceback, so messages must stand on their own. Request errors
(``InvalidRequestError`` and subclasses) are shared by the offline API and the HTTP server.
"""

from __future__ import annotations


class PluginError(Exception):
    """Base class for every error caused by plugins, platforms or attention backends."""


class PluginLoadError(PluginError):
    """A plugin could not be loaded: its entry point failed to import, it implements a hook
    with a wrong name or signature, it declares an incompatible plugin API version, or a hook
    raised or returned something malformed."""


class PlatformError(PluginError):
    """No platform can be chosen: an unknown or unavailable name was asked for, nothing is
    available, or two plugins claim the same device with the same priority."""


class AttentionBackendError(PluginError):
    """An attention backend is unknown, cannot be imported, is registered twice, or cannot
    serve the requested model/device."""


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
