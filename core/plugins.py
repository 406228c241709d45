"""The plugin manager: discovers ``engine`` entry points and registers them with pluggy.

One ``PluginManager`` is created per engine or CLI invocation (``PluginManager.from_env()``) and
passed to whatever needs plugins; it holds every piece of plugin state (the pluggy manager, the
collected platforms, attention backends and kernels), so there is no hidden module-level state.
``default_plugin_manager()`` is a cached convenience for callers that have no manager at hand.

Loading is strict. For each entry point of the ``engine`` group (in name order) the manager

1. imports it — any exception becomes a ``PluginLoadError`` naming the distribution, the entry
   point and the cause;
2. checks that it declares ``ENGINE_PLUGIN_API`` with the major version of
   ``engine.version.PLUGIN_API_VERSION``;
3. registers it with pluggy, which validates every ``@engine.hookimpl`` against the
   specifications in ``engine.hookspecs`` (unknown hook names and unknown arguments fail here);
4. refuses functions named like a hook that forgot the ``@engine.hookimpl`` marker (they would
   otherwise be ignored silently).

``ENGINE_PLUGINS=a,b`` restricts loading to the named entry points; an empty value loads none.
The core's own builtin plugin (``engine.attention_backends.builtin``) is always registered.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import re
import sys
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pluggy

from engine import hookspecs
from engine.attention_backends.registry import AttentionBackendRegistry
from engine.attention_backends.selector import select_attention_backend
from engine.errors import PluginLoadError
from engine.platforms.resolve import PlatformEntry, collect_platforms, resolve_platform
from engine.plugin_info import PluginInfo
from engine.version import (
    DISTRIBUTION_NAME,
    FORMER_DISTRIBUTION_NAMES,
    PLUGIN_API_MAJOR,
    PLUGIN_API_MINOR,
    PLUGIN_API_VERSION,
    __version__,
)

if sys.version_info >= (3, 12):
    from importlib import metadata
else:  # pragma: no cover - depends on the interpreter
    try:
        import importlib_metadata as metadata
    except ImportError:
        from importlib import metadata

if TYPE_CHECKING:
    from engine.attention_backends.interface import AttentionBackend, AttentionSpec
    from engine.config import EngineConfig
    from engine.distributed import Communicator
    from engine.kernels.registry import KernelRegistry
    from engine.platforms.interface import Platform
    from engine.quantization.registry import QuantizationRegistry

ENTRY_POINT_GROUP = hookspecs.PROJECT_NAME
ENGINE_PLUGINS_ENV = "ENGINE_PLUGINS"
BUILTIN_PLUGIN_NAME = "builtin"
BUILTIN_PLUGIN_MODULE = "engine.attention_backends.builtin"

_HOOK_NAMES = frozenset(
    name
    for name in dir(hookspecs)
    if name.startswith("engine_") and callable(getattr(hookspecs, name))
)


@dataclass(frozen=True)
class CommunicatorEntry:
    """A platform's communicator and who supplied it: a plugin's ``engine_communicator`` hook
    (``plugin`` is its entry-point name) or the platform's default (``plugin`` None)."""

    communicator: Communicator
    provider: str  # a distribution name, or "<platform> platform default"
    plugin: str | None


def _signature(fn: Any) -> str:
    return f"{fn.__name__}({', '.join(inspect.signature(fn).parameters)})"


def _hook_mismatch(plugin: Any, pm: pluggy.PluginManager) -> str | None:
    """Say, in words, which of ``plugin``'s hook implementations (functions marked
    ``@hookimpl``) pluggy refused: a name that is no hook (with the closest valid name) or
    arguments the specification does not have."""
    import difflib

    problems = []
    for name in sorted(dir(plugin)):
        fn = getattr(plugin, name, None)
        if not callable(fn) or pm.parse_hookimpl_opts(plugin, name) is None:
            continue
        if name not in _HOOK_NAMES:
            close = difflib.get_close_matches(name, sorted(_HOOK_NAMES), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            problems.append(f"{name} is not a hook{hint}")
            continue
        spec = getattr(hookspecs, name)
        try:
            extra = [a for a in inspect.signature(fn).parameters if a not in _args(spec)]
        except (TypeError, ValueError):
            continue
        if extra:
            problems.append(
                f"{_signature(fn)} takes {', '.join(map(repr, extra))}, which the specification "
                f"{_signature(spec)} does not have"
            )
    return "; ".join(problems) or None


def _args(fn: Any) -> list[str]:
    return list(inspect.signature(fn).parameters)


def parse_enabled_plugins(environ: Mapping[str, str] | None = None) -> list[str] | None:
    """The entry-point names ``ENGINE_PLUGINS`` allows, or None when it is unset (load all).

    An empty value allows none; names are comma-separated and surrounding spaces are ignored.
    """
    env = os.environ if environ is None else environ
    raw = env.get(ENGINE_PLUGINS_ENV)
    if raw is None:
        return None
    return [n.strip() for n in raw.split(",") if n.strip()]


def _entry_point_distribution(ep: Any) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "<unknown distribution>", "?"
    return dist.metadata["Name"] or dist.name, dist.version


def _describe_dist(ep: Any) -> str:
    return " ".join(_entry_point_distribution(ep))


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def duplicate_entry_points_message(
    clashes: Mapping[str, list[str]], installed: Collection[str] | None = None
) -> str:
    """The error for entry-point names declared twice (``clashes``: name -> the distributions,
    as ``"name version"``). When a clash involves a distribution under its name from before
    the engine-llm rename (``FORMER_DISTRIBUTION_NAMES``), every such distribution installed
    (``installed``: names, by default read from the environment) is named for uninstalling."""
    pairs = "; ".join(f"{name!r} by {' and '.join(dists)}" for name, dists in clashes.items())
    message = (
        f"Installed distributions declare the same {ENTRY_POINT_GROUP!r} entry point: {pairs}. "
        "Entry-point names must be unique."
    )
    named = {d.rsplit(" ", 1)[0] for dists in clashes.values() for d in dists}
    if not any(_canonical(n) in FORMER_DISTRIBUTION_NAMES for n in named):
        return message + (
            " Uninstall one of each, or ask the vendor of one to rename its entry point."
        )
    if installed is None:
        installed = [d.metadata["Name"] or "" for d in metadata.distributions()]
    stale = sorted(
        {n for n in (*named, *installed) if _canonical(n) in FORMER_DISTRIBUTION_NAMES},
        key=_canonical,
    )
    successors = [FORMER_DISTRIBUTION_NAMES[_canonical(n)] for n in stale]
    return message + (
        f" {', '.join(stale)} {'is' if len(stale) == 1 else 'are'} left over from before the "
        f"packages were renamed {DISTRIBUTION_NAME}*: uninstall "
        f"{'it' if len(stale) == 1 else 'them'} (pip uninstall {' '.join(stale)}), then "
        "reinstall their successors, whose files the old distributions shared and pip removes "
        f"with them (pip install --force-reinstall --no-deps {' '.join(successors)})."
    )


def _api_major(declared: Any) -> int | None:
    try:
        return int(str(declared).strip().split(".")[0])
    except ValueError:
        return None


def _api_minor(declared: Any) -> int | None:
    """The declared minor version, or None for ``"1"`` / ``"1.x"`` (any minor)."""
    parts = str(declared).strip().split(".")
    try:
        return int(parts[1]) if len(parts) > 1 else None
    except ValueError:
        return None


class PluginManager:
    """The loaded plugins of one engine/CLI invocation and everything derived from them.

    Args:
        enabled: entry-point names to load (None: all installed; empty: none). Usually taken
            from ``ENGINE_PLUGINS`` by ``from_env``.
        environ: the environment used for ``ENGINE_PLATFORM`` when resolving the platform
            (defaults to ``os.environ``).
    """

    def __init__(
        self,
        enabled: Collection[str] | None = None,
        *,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.enabled = None if enabled is None else list(enabled)
        self.environ = os.environ if environ is None else environ
        self._pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self._infos: dict[str, PluginInfo] = {}
        # Derived state, computed on first use and kept for this manager's lifetime.
        self._platforms: list[PlatformEntry] | None = None
        self._backends: AttentionBackendRegistry | None = None
        self._kernels: KernelRegistry | None = None
        self._quantization: QuantizationRegistry | None = None
        self._register_builtin()
        self._load_entry_points()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PluginManager:
        """A manager loading what ``ENGINE_PLUGINS`` in ``environ`` (default: os.environ) allows."""
        return cls(parse_enabled_plugins(environ), environ=environ)

    # ---- loading ------------------------------------------------------------------------
    def _register_builtin(self) -> None:
        module = importlib.import_module(BUILTIN_PLUGIN_MODULE)
        info = PluginInfo(
            BUILTIN_PLUGIN_NAME,
            DISTRIBUTION_NAME,
            __version__,
            BUILTIN_PLUGIN_MODULE,
            str(getattr(module, "ENGINE_PLUGIN_API", PLUGIN_API_VERSION)),
        )
        self._register(module, info)

    def _load_entry_points(self) -> None:
        eps = sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)
        seen: dict[str, Any] = {}
        clashes: dict[str, list[str]] = {}  # entry-point name -> "dist version" declaring it
        for ep in eps:
            if ep.name in seen or ep.name == BUILTIN_PLUGIN_NAME:
                first = seen.get(ep.name)
                first_dist = "engine (the core)" if first is None else _describe_dist(first)
                clashes.setdefault(ep.name, [first_dist]).append(_describe_dist(ep))
            seen[ep.name] = ep
        if clashes:
            raise PluginLoadError(duplicate_entry_points_message(clashes))
        if self.enabled is not None:
            unknown = [n for n in self.enabled if n not in seen]
            if unknown:
                raise PluginLoadError(
                    f"{ENGINE_PLUGINS_ENV} names {', '.join(map(repr, unknown))}, but no "
                    f"installed distribution provides an {ENTRY_POINT_GROUP!r} entry point of "
                    f"that name. Installed plugins: {', '.join(sorted(seen)) or 'none'}. Fix "
                    f"{ENGINE_PLUGINS_ENV} or install the missing plugin."
                )
            eps = [ep for ep in eps if ep.name in self.enabled]
        for ep in eps:
            self._load_entry_point(ep)

    def _load_entry_point(self, ep: Any) -> None:
        dist_name, dist_version = _entry_point_distribution(ep)
        where = (
            f"plugin {ep.name!r} (entry point {ep.name} = {ep.value} of distribution "
            f"{dist_name} {dist_version})"
        )
        try:
            plugin = ep.load()
        except Exception as exc:
            raise PluginLoadError(
                f"Could not import {where}: {type(exc).__name__}: {exc}. Fix or reinstall "
                f"{dist_name}, or leave it out with {ENGINE_PLUGINS_ENV}=<the plugins you want>."
            ) from exc
        declared = getattr(plugin, "ENGINE_PLUGIN_API", None)
        if declared is None and not inspect.ismodule(plugin):
            declared = getattr(inspect.getmodule(plugin), "ENGINE_PLUGIN_API", None)
        fits = f"{PLUGIN_API_MAJOR} or {PLUGIN_API_MAJOR}.x"
        if declared is None:
            raise PluginLoadError(
                f"Refusing {where}: it does not declare which plugin API it was built for. "
                f"This engine {__version__} speaks plugin API {PLUGIN_API_VERSION}; the plugin "
                f'module must set ENGINE_PLUGIN_API = "{PLUGIN_API_MAJOR}" (versions that fit: '
                f"{fits}). Upgrade {dist_name} or ask its vendor to declare the version."
            )
        if _api_major(declared) != PLUGIN_API_MAJOR:
            raise PluginLoadError(
                f"Refusing {where}: it was built for plugin API {declared!s}, but this engine "
                f"{__version__} speaks plugin API {PLUGIN_API_VERSION} (versions that fit: "
                f"{fits}). Install a release of {dist_name} built for plugin API "
                f"{PLUGIN_API_MAJOR}, or an engine release that speaks API {declared!s}."
            )
        minor = _api_minor(declared)
        if minor is not None and minor > PLUGIN_API_MINOR:
            raise PluginLoadError(
                f"Refusing {where}: it was built for plugin API {declared!s}, newer than the "
                f"plugin API {PLUGIN_API_VERSION} of this engine {__version__} (it may use hooks "
                f"this engine lacks). Upgrade the engine, or install a release of {dist_name} "
                f"built for plugin API {PLUGIN_API_VERSION} or older."
            )
        info = PluginInfo(ep.name, dist_name, dist_version, ep.value, str(declared))
        self._register(plugin, info)

    def _register(self, plugin: Any, info: PluginInfo) -> None:
        where = info.describe()
        try:
            self._pm.register(plugin, name=info.name)
            self._pm.check_pending()
        except pluggy.PluginValidationError as exc:
            if self._pm.is_registered(plugin):
                self._pm.unregister(plugin)
            detail = _hook_mismatch(plugin, self._pm) or " ".join(str(exc).split())
            raise PluginLoadError(
                f"Refusing {where}: a hook implementation does not match the hook "
                f"specifications in engine.hookspecs: {detail}. Valid hooks: "
                f"{', '.join(sorted(_HOOK_NAMES))}. Fix the plugin's hook names and arguments."
            ) from exc
        forgotten = sorted(
            name
            for name in _HOOK_NAMES
            if callable(getattr(plugin, name, None))
            and self._pm.parse_hookimpl_opts(plugin, name) is None
        )
        if forgotten:
            self._pm.unregister(plugin)
            raise PluginLoadError(
                f"Refusing {where}: {', '.join(forgotten)} looks like a hook implementation but "
                "is not decorated with @engine.hookimpl, so it would be ignored. Decorate it."
            )
        self._infos[info.name] = info

    # ---- what is loaded -----------------------------------------------------------------
    @property
    def hook(self) -> Any:
        """pluggy's hook relay, e.g. ``pm.hook.engine_add_cli_args(parser=parser)``."""
        return self._pm.hook

    @property
    def plugins(self) -> list[PluginInfo]:
        """Every registered plugin, the builtin one first, then entry points by name."""
        return list(self._infos.values())

    def plugin(self, name: str) -> PluginInfo:
        return self._infos[name]

    def call_hook(self, hook_name: str, **kwargs: Any) -> Iterator[tuple[PluginInfo, Any]]:
        """Call ``hook_name`` on each plugin in load order, yielding ``(plugin, result)``.

        Unlike ``pm.hook.<name>()`` this keeps track of which plugin answered what, so every
        later error can name it; an exception inside a hook becomes a ``PluginLoadError``.
        """
        for info, impl in self._hookimpls(hook_name):
            yield info, self._invoke(info, impl, hook_name, kwargs)

    def _hookimpls(self, hook_name: str) -> list[tuple[PluginInfo, Any]]:
        impls = getattr(self._pm.hook, hook_name).get_hookimpls()
        order = {name: i for i, name in enumerate(self._infos)}
        impls = sorted(impls, key=lambda i: order.get(i.plugin_name, len(order)))
        return [(self._infos[i.plugin_name], i) for i in impls]

    def _invoke(self, info: PluginInfo, impl: Any, hook_name: str, kwargs: dict[str, Any]) -> Any:
        args = {name: kwargs[name] for name in impl.argnames}
        try:
            return impl.function(**args)
        except Exception as exc:
            raise PluginLoadError(
                f"{info.describe()} raised {type(exc).__name__}: {exc} in its {hook_name}() "
                f"hook. Fix or reinstall {info.distribution}, or leave it out with "
                f"{ENGINE_PLUGINS_ENV}=<the plugins you want>."
            ) from exc

    # ---- derived registries -------------------------------------------------------------
    def platforms(self) -> list[PlatformEntry]:
        """Every platform the loaded plugins provide (available or not)."""
        if self._platforms is None:
            self._platforms = collect_platforms(self.call_hook("engine_platform"))
        return self._platforms

    def resolve_platform_entry(self, requested: str | None = None) -> PlatformEntry:
        """The platform to run on: ``requested`` (``--platform``), else ``ENGINE_PLATFORM``,
        else the highest-priority available one. See ``engine.platforms.resolve``."""
        return resolve_platform(self.platforms(), requested, self.environ)

    def resolve_platform(self, requested: str | None = None) -> type[Platform]:
        """Like ``resolve_platform_entry`` but returns the Platform class itself."""
        return self.resolve_platform_entry(requested).cls

    def attention_backends(self) -> AttentionBackendRegistry:
        """Every named attention backend the loaded plugins provide."""
        if self._backends is None:
            self._backends = AttentionBackendRegistry.from_hook_results(
                self.call_hook("engine_attention_backends")
            )
        return self._backends

    def select_attention_backend(
        self,
        name: str | None,
        spec: AttentionSpec,
        platform: type[Platform],
        config: EngineConfig | None = None,
    ) -> type[AttentionBackend]:
        """``--attention-backend NAME`` (or ``auto``) for ``spec`` on ``platform``."""
        return select_attention_backend(
            name, spec, platform, registry=self.attention_backends(), config=config
        )

    def communicator_entry(self, platform: type[Platform], group: Any = None) -> CommunicatorEntry:
        """The communicator for ``platform`` over ``group`` and who supplied it.

        Every loaded plugin's ``engine_communicator(platform, group)`` is asked; at most one may
        answer (two answers are an error naming both plugins). With no answer the platform's own
        ``Platform.communicator(group)`` serves (torch.distributed on ``dist_backend``).
        """
        from engine.distributed import Communicator

        answers = []
        for info, result in self.call_hook("engine_communicator", platform=platform, group=group):
            if result is None:
                continue
            if not isinstance(result, Communicator):
                raise PluginLoadError(
                    f"{info.describe()} returned {result!r} from engine_communicator() for "
                    f"platform {platform.name!r}; it must return an instance of "
                    "engine.distributed.Communicator (or None). Fix the plugin."
                )
            answers.append(CommunicatorEntry(result, info.distribution, info.name))
        if len(answers) > 1:
            a, b = answers[0], answers[1]
            raise PluginLoadError(
                f"Two plugins supply a communicator for platform {platform.name!r}: "
                f"{self._infos[a.plugin].describe()} ({a.communicator.describe()}) and "
                f"{self._infos[b.plugin].describe()} ({b.communicator.describe()}). At most one "
                "may: uninstall one of the two distributions or exclude one with "
                f"{ENGINE_PLUGINS_ENV}."
            )
        if answers:
            return answers[0]
        comm = platform.communicator(group)
        if not isinstance(comm, Communicator):
            raise PluginLoadError(
                f"Platform {platform.name!r} returned {comm!r} from communicator(); it must "
                "return an instance of engine.distributed.Communicator. Fix the plugin."
            )
        return CommunicatorEntry(comm, f"{platform.name} platform default", None)

    def communicator(self, platform: type[Platform], group: Any = None) -> Communicator:
        """The ``Communicator`` for ``platform`` over ``group`` (see ``communicator_entry``)."""
        return self.communicator_entry(platform, group).communicator

    def kernel_registry(self) -> KernelRegistry:
        """The kernel registry: torch references plus every plugin's ``engine_kernels``
        registrations (imports torch)."""
        if self._kernels is None:
            from engine.kernels.registry import KernelRegistry

            registry = KernelRegistry()
            for info, impl in self._hookimpls("engine_kernels"):
                # Registrations that do not name a provider are credited to this plugin.
                with registry.providing(info.distribution):
                    self._invoke(info, impl, "engine_kernels", {"registry": registry})
            self._kernels = registry
        return self._kernels

    def quantization_methods(self) -> QuantizationRegistry:
        """The quantization methods: the core's plus every plugin's
        ``engine_quantization_methods`` registrations (nothing is imported until a method
        is used)."""
        if self._quantization is None:
            from engine.quantization.registry import QuantizationRegistry

            registry = QuantizationRegistry()
            for info, impl in self._hookimpls("engine_quantization_methods"):
                with registry.providing(info.distribution):
                    self._invoke(info, impl, "engine_quantization_methods", {"registry": registry})
            self._quantization = registry
        return self._quantization


@functools.cache
def default_plugin_manager() -> PluginManager:
    """A process-wide manager built from ``os.environ`` on first use.

    Prefer creating a ``PluginManager`` per engine and passing it along; this accessor exists for
    callers with nothing at hand. ``default_plugin_manager.cache_clear()`` forgets it.
    """
    return PluginManager.from_env()
