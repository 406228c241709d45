"""Choosing the platform to run on from the platforms that plugins provide.

Priorities (``Platform.priority``), highest available wins:

* 200 and up — out-of-tree vendor plugins, so that installing a vendor's package for a device
  takes over from the built-in plugin for the same device;
* 100 — the built-in accelerators (cuda, rocm, tpu);
* 0 — the CPU, always available, chosen when nothing else is.

Two *available* platforms with the same top priority are ambiguous and refused with an error
naming both distributions, unless the user picks one with ``--platform NAME`` or
``ENGINE_PLATFORM=NAME``. An explicit choice that is unknown or unavailable is an error too —
the engine never falls back silently to another platform.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.errors import PlatformError, PluginLoadError
from engine.platforms.interface import Platform

if TYPE_CHECKING:
    from engine.plugin_info import PluginInfo

ENGINE_PLATFORM_ENV = "ENGINE_PLATFORM"
AUTO = "auto"


@dataclass(eq=False)
class PlatformEntry:
    """A platform class together with the plugin that provided it."""

    cls: type[Platform]
    plugin: PluginInfo
    _reasons: list[str] | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.cls.name

    @property
    def priority(self) -> int:
        return self.cls.priority

    def unavailable_reasons(self) -> list[str]:
        """The platform's reasons (cached: detection runs once per manager). A detection that
        raises is reported as a reason naming the distribution, never swallowed."""
        if self._reasons is None:
            try:
                self._reasons = [str(r) for r in self.cls.unavailable_reasons()]
            except Exception as exc:
                self._reasons = [
                    f"detection raised {type(exc).__name__}: {exc} (a bug in "
                    f"{self.plugin.distribution} {self.plugin.version})"
                ]
        return list(self._reasons)

    @property
    def available(self) -> bool:
        return not self.unavailable_reasons()

    def describe(self) -> dict[str, Any]:
        """JSON-friendly facts for ``engine plugins``."""
        reasons = self.unavailable_reasons()
        return {
            "name": self.name,
            "device_type": self.cls.device_type,
            "priority": self.priority,
            "available": not reasons,
            "reasons": reasons,
            "distribution": self.plugin.distribution,
            "plugin": self.plugin.name,
            "dist_backend": self.cls.dist_backend,
            "supported_dtypes": list(self.cls.supported_dtypes),
            "supports_graph_capture": self.cls.supports_graph_capture,
        }

    def label(self) -> str:
        return f"{self.name!r} (distribution {self.plugin.distribution} {self.plugin.version})"


def collect_platforms(results: Iterable[tuple[PluginInfo, Any]]) -> list[PlatformEntry]:
    """Validate the ``engine_platform()`` answers, given as ``(plugin, result)`` pairs
    (``PluginManager.call_hook`` yields them), into platform entries."""
    entries: list[PlatformEntry] = []
    by_name: dict[str, PlatformEntry] = {}
    for info, result in results:
        if result is None:
            continue
        if not (isinstance(result, type) and issubclass(result, Platform)):
            raise PluginLoadError(
                f"{info.describe()} returned {result!r} from engine_platform(); it must return "
                "a subclass of engine.platforms.Platform (or None). Fix the plugin."
            )
        entry = PlatformEntry(result, info)
        if entry.name in by_name:
            other = by_name[entry.name]
            raise PluginLoadError(
                f"Two plugins provide a platform named {entry.name!r}: {other.plugin.describe()} "
                f"and {info.describe()}. Platform names must be unique: uninstall one of the two "
                "distributions or exclude one with ENGINE_PLUGINS."
            )
        by_name[entry.name] = entry
        entries.append(entry)
    return entries


def requested_platform(
    requested: str | None, environ: Mapping[str, str] | None = None
) -> tuple[str, str]:
    """The platform name asked for and where it came from (``--platform`` first, then
    ``ENGINE_PLATFORM``); ``("auto", ...)`` when neither says."""
    if requested and requested != AUTO:
        return requested, "--platform"
    env = os.environ if environ is None else environ
    env_value = env.get(ENGINE_PLATFORM_ENV, "").strip()
    if env_value and env_value != AUTO:
        return env_value, ENGINE_PLATFORM_ENV
    return AUTO, "automatic detection"


def resolve_platform(
    entries: list[PlatformEntry],
    requested: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> PlatformEntry:
    """The platform to run on. Raises ``PlatformError`` with the reasons when there is none."""
    name, source = requested_platform(requested, environ)
    valid = ", ".join(f"{e.name} ({e.plugin.distribution})" for e in entries) or "none"
    if name != AUTO:
        matches = [e for e in entries if e.name == name]
        if not matches:
            raise PlatformError(
                f"Unknown platform {name!r} (asked for with {source}). Valid platforms: {valid}. "
                f"Pass one of these to --platform or {ENGINE_PLATFORM_ENV}, or install the plugin "
                f"that provides {name!r}."
            )
        entry = matches[0]
        reasons = entry.unavailable_reasons()
        if reasons:
            others = [e.name for e in entries if e is not entry and e.available]
            raise PlatformError(
                f"Platform {entry.label()} was asked for with {source} but is not available "
                f"here: {'; '.join(reasons)}. Fix that, or choose an available platform"
                f"{': ' + ', '.join(others) if others else ''}."
            )
        return entry

    available = [e for e in entries if e.available]
    if not available:
        if not entries:
            raise PlatformError(
                "No platform is available: no loaded plugin provides one. Install engine-llm-cpu "
                "(always available) or the plugin for your accelerator, and check that "
                "ENGINE_PLUGINS, if set, names it."
            )
        details = "; ".join(f"{e.name}: {', '.join(e.unavailable_reasons())}" for e in entries)
        raise PlatformError(
            f"No platform is available ({details}). Install engine-llm-cpu (always available) or "
            "fix the cause reported for your accelerator's platform."
        )
    top = max(e.priority for e in available)
    best = [e for e in available if e.priority == top]
    if len(best) > 1:
        a, b = best[0], best[1]
        same_device = a.cls.device_type == b.cls.device_type
        claim = (
            f"both claim device type {a.cls.device_type!r}"
            if same_device
            else f"claim device types {a.cls.device_type!r} and {b.cls.device_type!r}"
        )
        raise PlatformError(
            f"Cannot choose a platform: {a.label()} and {b.label()} are both available, {claim} "
            f"and have the same priority {top}. Pass --platform {a.name} or --platform {b.name} "
            f"(or set {ENGINE_PLATFORM_ENV}), or uninstall one of the two distributions."
        )
    return best[0]
