"""What the conformance kit checks, as *suites*: the kit's extension point.

A suite discovers what a plugin registers — through the plugin manager, never from a list the
vendor keeps — and turns each thing into checks. ``pytest --engine-conformance=NAME`` builds
a ``ConformanceTarget`` for plugin ``NAME`` and runs every suite in ``SUITES`` on it:

==============  ===========================================================================
suite           what it discovers and checks
==============  ===========================================================================
platform        the plugin's platform: attributes, detection (stable, available, cheap in a
                fresh interpreter), device facts, memory profiling, ``check_config`` reasons,
                ``auto`` backend selection, the fp8 flavour
communicator    the platform's communicator (from ``engine_communicator``): one rank, then
                ``--engine-conformance-ranks`` processes (default 2)
backend         every attention backend the plugin provides or its platform lists, against
                the torch reference on random paged batches
kernel / moe    every kernel override the plugin registers (and, for a platform plugin, every
                override serving its platform), against ``engine.kernels.reference``; the
                report groups them by the kind their inputs were registered with
==============  ===========================================================================

Adding a kind of thing to check — quantization methods when plugins can register them, say —
is one class and one line: subclass ``ConformanceSuite``, implement ``checks(target)`` (ask
``target.pm`` what ``target.plugin`` registered; yield one ``ConformanceCheck`` per property),
and add its qualified name to ``SUITES`` (or call ``register_suite`` from a pytest plugin or
conftest). New *kernels*, the MoE ones included, need no suite: registering their inputs with
``engine.testing.inputs.register_kernel_inputs(name, cases, kind="moe")`` is enough.

This module imports no torch: ``engine plugins`` lists the suites.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from engine.platforms.resolve import PlatformEntry
    from engine.plugin_info import PluginInfo
    from engine.plugins import PluginManager


@dataclass
class ConformanceTarget:
    """One kit run: the plugin under test and the platform whose device runs the checks."""

    pm: PluginManager
    plugin: PluginInfo
    platform: PlatformEntry
    owns_platform: bool  # the plugin provides ``platform``
    platform_explicit: bool  # --engine-conformance-platform chose it
    ranks: int  # processes for the communicator check (< 2: skip it)
    environ: dict[str, str]

    def provides(self, distribution_or_plugin: str) -> bool:
        """Whether a registration credited to ``distribution_or_plugin`` is this plugin's."""
        return distribution_or_plugin in (self.plugin.name, self.plugin.distribution)


@dataclass
class ConformanceCheck:
    """One property of one subject: a test item, and a row of the report.

    ``run(seed)`` raises ``AssertionError`` saying what is wrong (or calls ``pytest.skip``);
    ``skip`` set means it is reported as skipped with that reason without running.
    """

    suite: str  # "platform", "communicator", "backend", "kernel", "moe", ...
    subject: str  # the platform, backend or kernel name
    property: str  # what is checked, e.g. "memory-profiling" or "float32-H4/2-D64-B16"
    run: Callable[[int], None]
    skip: str | None = None
    provider: str = ""  # who registered the subject (a distribution)

    @property
    def id(self) -> str:
        return f"{self.suite}[{self.subject}]::{self.property}"


class ConformanceSuite(ABC):
    """A kind of thing the kit checks. Subclasses set ``name`` and ``description`` and yield
    checks for what ``target.plugin`` registered."""

    name: ClassVar[str]
    description: ClassVar[str]

    @abstractmethod
    def checks(self, target: ConformanceTarget) -> Iterator[ConformanceCheck]:
        """The checks for ``target`` (discover subjects through ``target.pm``)."""


# The suites every kit run uses, by qualified name (imported only when the kit runs). The
# quantization work adds its suite here.
SUITES: list[str] = [
    "engine.testing.builtin_suites:PlatformSuite",
    "engine.testing.builtin_suites:CommunicatorSuite",
    "engine.testing.builtin_suites:AttentionSuite",
    "engine.testing.builtin_suites:KernelSuite",
]


def register_suite(qualname: str) -> None:
    """Add a suite (``"module:Class"``) to every later kit run in this process."""
    if ":" not in qualname:
        raise ValueError(f"a suite is named 'module:Class', not {qualname!r}")
    if qualname not in SUITES:
        SUITES.append(qualname)


def load_suites() -> list[ConformanceSuite]:
    """An instance of every suite in ``SUITES``."""
    suites = []
    for qualname in SUITES:
        module, _, attr = qualname.partition(":")
        cls: Any = getattr(importlib.import_module(module), attr)
        if not (isinstance(cls, type) and issubclass(cls, ConformanceSuite)):
            raise TypeError(f"conformance suite {qualname} is not a ConformanceSuite subclass")
        suites.append(cls())
    return suites


def describe_suites() -> list[dict[str, str]]:
    """Name, description and qualified name of each suite, for ``engine plugins``."""
    out = []
    for qualname in SUITES:
        module, _, attr = qualname.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
            out.append({"name": cls.name, "description": cls.description, "qualname": qualname})
        except Exception as exc:  # listed, not hidden: a broken suite is worth seeing
            out.append({"name": attr, "description": f"cannot import: {exc}", "qualname": qualname})
    return out
