"""The attention backend registry: every named backend that any loaded plugin provides.

Plugins name backends by qualified name (``"module:Class"``) or give the class itself; qualified
names are imported only when a backend is first used, so listing and ``auto`` selection over
backends that are never picked cost nothing. A name provided by two plugins is a load error.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.attention_backends.interface import AttentionBackend, AttentionSpec
from engine.errors import AttentionBackendError, PluginLoadError
from engine.lazy_class import LazyClass, qualified_name

if TYPE_CHECKING:
    from engine.plugin_info import PluginInfo

RESERVED_NAMES = frozenset({"auto"})


@dataclass(eq=False)
class BackendEntry(LazyClass[AttentionBackend]):
    """One named backend: where it comes from and (once imported) its class."""

    base = AttentionBackend
    error = AttentionBackendError

    plugin: PluginInfo

    def label(self) -> str:
        return f"attention backend {self.name!r} ({self.qualname}, from {self.plugin.describe()})"

    def advice(self) -> str:
        return (
            f" Fix or reinstall {self.plugin.distribution}, or pick another backend with "
            "--attention-backend."
        )

    def supports(self, spec: AttentionSpec) -> list[str]:
        """The backend's reasons it cannot serve ``spec`` (imports the backend)."""
        cls = self.load()
        try:
            return [str(r) for r in cls.supports(spec)]
        except Exception as exc:
            raise AttentionBackendError(
                f"{self.label()} raised {type(exc).__name__}: {exc} in supports(). This is a "
                f"bug in {self.plugin.distribution}; pick another backend with "
                "--attention-backend meanwhile."
            ) from exc


class AttentionBackendRegistry:
    """Named attention backends, unique across all plugins."""

    def __init__(self) -> None:
        self._entries: dict[str, BackendEntry] = {}

    @classmethod
    def from_hook_results(
        cls, results: Iterable[tuple[PluginInfo, Any]]
    ) -> AttentionBackendRegistry:
        """A registry of every backend in the ``engine_attention_backends()`` answers, given as
        ``(plugin, result)`` pairs (``PluginManager.call_hook`` yields them)."""
        registry = cls()
        for info, result in results:
            for name, target in _normalize(result, info):
                registry.add(name, target, info)
        return registry

    def add(self, name: str, target: type[AttentionBackend] | str, plugin: PluginInfo) -> None:
        """Register ``target`` under ``name`` for ``plugin``; duplicate names are refused."""
        if not isinstance(name, str) or not name or name in RESERVED_NAMES:
            raise PluginLoadError(
                f"{plugin.describe()} provides an attention backend named {name!r}; names must "
                f"be non-empty strings other than {', '.join(sorted(RESERVED_NAMES))}. Fix the "
                "plugin."
            )
        if isinstance(target, str) and ":" not in target:
            raise PluginLoadError(
                f"{plugin.describe()} names attention backend {name!r} as {target!r}; a "
                "qualified name has the form 'package.module:ClassName'. Fix the plugin."
            )
        if name in self._entries:
            other = self._entries[name]
            raise AttentionBackendError(
                f"Attention backend {name!r} is provided twice: by {other.plugin.describe()} "
                f"({other.qualname}) and by {plugin.describe()} ({_target_name(target)}). "
                "Backend names must be unique across plugins: uninstall one of the two "
                "distributions or exclude one with ENGINE_PLUGINS."
            )
        self._entries[name] = BackendEntry(name, target, plugin)

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[BackendEntry]:
        return iter(self._entries.values())

    def entry(self, name: str) -> BackendEntry:
        """The entry for ``name``; an unknown name lists the valid ones."""
        try:
            return self._entries[name]
        except KeyError:
            raise AttentionBackendError(
                f"Unknown attention backend {name!r}. Valid names: auto, "
                f"{', '.join(self._entries) or '(none loaded)'}. Pass one of these to "
                "--attention-backend, or install the plugin that provides "
                f"{name!r}."
            ) from None

    def get(self, name: str) -> type[AttentionBackend]:
        """The backend class registered as ``name`` (imported on first use)."""
        return self.entry(name).load()


def _target_name(target: Any) -> str:
    return target if isinstance(target, str) else qualified_name(target)


def _normalize(result: Any, plugin: PluginInfo) -> list[tuple[str, Any]]:
    """A hook result as ``(name, class-or-qualname)`` pairs."""
    if result is None:
        return []
    if isinstance(result, Mapping):
        return list(result.items())
    if isinstance(result, (str, bytes)) or not isinstance(result, Iterable):
        raise PluginLoadError(
            f"{plugin.describe()} returned {result!r} from engine_attention_backends(); return "
            "a mapping {name: 'module:Class'} or a list of AttentionBackend classes."
        )
    pairs = []
    for item in result:
        if isinstance(item, type) and issubclass(item, AttentionBackend):
            pairs.append((item.name, item))
        else:
            raise PluginLoadError(
                f"{plugin.describe()} returned {item!r} in its engine_attention_backends() "
                "list; list items must be AttentionBackend subclasses (use a mapping "
                "{name: 'module:Class'} for qualified names)."
            )
    return pairs
