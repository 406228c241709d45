"""The plugin contract: every hook a plugin may implement, validated by pluggy at load time.

A plugin is a module (or object) exposed under the ``engine`` entry-point group::

    [project.entry-points.engine]
    myvendor = "engine_myvendor.plugin"

It declares the contract version it was built for (``ENGINE_PLUGIN_API = "1"``) and implements
any subset of the hooks below, decorated with ``engine.hookimpl``. pluggy checks every
implementation's name and arguments against these specifications when the plugin registers, so a
misspelled hook or argument fails at load time naming the plugin.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import argparse
    from collections.abc import Iterable, Mapping

    from engine.attention_backends.interface import AttentionBackend
    from engine.distributed import Communicator
    from engine.kernels.registry import KernelRegistry
    from engine.models.registry import ModelRegistry
    from engine.platforms.interface import Platform
    from engine.quantization.registry import QuantizationRegistry

PROJECT_NAME = "engine"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def engine_platform() -> type[Platform] | None:
    """Return this plugin's ``Platform`` subclass (or None if it provides no platform).

    Return the class even when the device is absent: its ``unavailable_reasons()`` says why, and
    ``engine plugins`` shows it. Importing the class must be cheap (no torch device context).
    """


@hookspec
def engine_attention_backends() -> (
    Mapping[str, type[AttentionBackend] | str] | Iterable[type[AttentionBackend]]
):
    """Return the attention backends this plugin provides, any number, each under a unique name.

    Preferably a mapping from backend name to the class's qualified name, so that listing and
    selection import nothing until a backend is used::

        {"mybackend": "engine_myvendor.attention:MyBackend"}

    Classes are accepted too (as mapping values, or as a plain list whose names come from each
    class's ``name``). A name already provided by another plugin is a load error.
    """


@hookspec
def engine_kernels(registry: KernelRegistry) -> None:
    """Register kernel implementations with ``registry.register(name, fn, platforms=...,
    priority=..., provider=...)``. Called once, after the platform is chosen, and only on plugins
    that are loaded; import heavy kernel modules inside this hook, not at plugin import."""


@hookspec
def engine_communicator(platform: type[Platform], group: Any) -> Communicator | None:
    """Return the ``engine.distributed.Communicator`` that runs collectives for ``platform``
    over ``group``, or None when this plugin supplies none for that platform.

    ``platform`` is the chosen ``Platform`` class (answer for your own platforms only: compare
    ``platform.name`` or use ``issubclass``); ``group`` is the platform's process-group handle
    (a ``torch.distributed`` ``ProcessGroup`` on torch.distributed platforms, an XLA
    replica-group list on XLA; None means every rank). Called on every loaded plugin; at most
    one may answer for a platform (two answers are an error naming both). When none answers,
    ``platform.communicator(group)`` is used: torch.distributed on ``platform.dist_backend``.
    Constructing the communicator must be cheap and touch no device (``engine plugins`` builds
    one per platform to list it). The contract every communicator follows is in the docstring
    of ``engine.distributed``. Since plugin API 1.1.
    """


@hookspec
def engine_models(registry: ModelRegistry) -> None:
    """Register extra model architectures with ``registry.register(arch_name, "module:Class")``."""


@hookspec
def engine_quantization_methods(registry: QuantizationRegistry) -> None:
    """Register quantization methods with ``registry.register(name, "module:Class")``: each a
    ``engine.quantization.QuantizationConfig`` subclass (which checkpoint formats it reads,
    where it runs, with reasons; how it creates, loads and multiplies a linear layer's weights).
    Names are global (a name already registered is a load error) and become
    ``--quantization NAME``. A vendor bringing only a faster kernel for an existing method (its
    own INT4 GEMM for ``wna16_linear``) registers that kernel through ``engine_kernels``
    instead. Called once per engine; import heavy modules inside the hook."""


@hookspec
def engine_add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add plugin-specific options to ``engine serve``/``generate`` (prefix them with the plugin
    name to avoid clashes)."""
