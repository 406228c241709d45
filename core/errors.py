"""Errors raised by the plugin framework: each message is one paragraph naming the culprit
(plugin, distribution, entry point, platform or backend) and the fix.

The CLI prints ``str(error)`` of any ``PluginError`` to stderr and exits with status 2, without a
traceback, so messages must stand on their own.
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
