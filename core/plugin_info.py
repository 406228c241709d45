"""``PluginInfo``: where a loaded plugin came from, for every message that must name it.

It sits below the plugin manager (``engine.plugins``) so that the registries the manager fills
(attention backends, platforms) can name plugins without importing the manager: dependencies
point one way, manager -> registries -> this.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PluginInfo:
    """Where a loaded plugin came from: enough to name it in any message."""

    name: str  # entry-point name, e.g. "cpu"; "builtin" for the core's own plugin
    distribution: str  # e.g. "engine-llm-cpu"
    version: str  # the distribution's version
    value: str  # the entry point's target, e.g. "engine_cpu.plugin"
    api_version: str  # what the plugin declared in ENGINE_PLUGIN_API

    def describe(self) -> str:
        """``plugin 'cpu' (entry point cpu = engine_cpu.plugin of engine-llm-cpu 0.1.0)``."""
        return (
            f"plugin {self.name!r} (entry point {self.name} = {self.value} of distribution "
            f"{self.distribution} {self.version})"
        )

    def as_dict(self) -> dict[str, str]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "entry_point": f"{self.name} = {self.value}",
            "api_version": self.api_version,
        }
