"""``--attention-backend NAME``: picking the backend that serves a model on a platform.

* ``auto`` walks ``platform.default_attention_backends()`` in order and takes the first backend
  whose ``supports(spec)`` returns no reasons; when none can, the error lists every candidate
  with its reasons.
* An explicit name is taken if its backend can serve the spec, else refused with its reasons
  (never replaced by another backend).
* An unknown name is refused with the list of valid names.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from engine.attention_backends.interface import AttentionBackend, AttentionSpec
from engine.errors import AttentionBackendError

if TYPE_CHECKING:
    from engine.attention_backends.registry import AttentionBackendRegistry
    from engine.config import EngineConfig
    from engine.platforms.interface import Platform

AUTO = "auto"


def spec_for_platform(spec: AttentionSpec, platform: type[Platform]) -> AttentionSpec:
    """``spec`` with its device type filled in from ``platform`` when it is not set."""
    if spec.device_type is None:
        return dataclasses.replace(spec, device_type=platform.device_type)
    return spec


def select_attention_backend(
    name: str | None,
    spec: AttentionSpec,
    platform: type[Platform],
    registry: AttentionBackendRegistry,
    config: EngineConfig | None = None,
) -> type[AttentionBackend]:
    """The backend class to use for ``spec`` on ``platform``.

    Args:
        name: a backend name, or ``"auto"``/None for the platform's preference order.
        spec: what the model and cache need.
        platform: the chosen Platform class.
        registry: the backends to choose from (``PluginManager.attention_backends()``; the
            manager's ``select_attention_backend`` passes its own).
        config: passed to ``platform.default_attention_backends`` for ``auto``.
    """
    spec = spec_for_platform(spec, platform)

    if name and name != AUTO:
        entry = registry.entry(name)
        reasons = entry.supports(spec)
        if reasons:
            raise AttentionBackendError(
                f"Attention backend {name!r} (from {entry.plugin.distribution}) cannot serve "
                f"this model on platform {platform.name!r}: {'; '.join(reasons)}. Choose "
                "another with --attention-backend (or 'auto'; `engine plugins` lists which "
                "backends can run here)."
            )
        return entry.load()

    candidates = list(platform.default_attention_backends(config))
    rejected: list[str] = []
    for candidate in candidates:
        if candidate not in registry:
            rejected.append(f"{candidate}: not installed (no loaded plugin provides it)")
            continue
        entry = registry.entry(candidate)
        reasons = entry.supports(spec)
        if not reasons:
            return entry.load()
        rejected.append(f"{candidate}: {'; '.join(reasons)}")
    raise AttentionBackendError(
        f"No attention backend can serve this model on platform {platform.name!r} "
        f"(tried {', '.join(candidates) or 'nothing: the platform lists no backends'}). "
        f"Reasons — {' | '.join(rejected) or 'none'}. Install a plugin with a suitable backend, "
        "choose one with --attention-backend, or change the model settings (dtype, block size)."
    )
