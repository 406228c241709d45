"""The conformance kit as a pytest plugin.

A vendor checks their plugin with::

    pytest -p engine.testing.conformance --engine-conformance=PLATFORM [-m conformance]

which adds, to whatever else pytest collects, one test item per check:

* ``platform`` — attributes, detection (stable, available here, imports nothing heavy in a fresh
  interpreter), device facts, memory profiling, ``check_config``, ``auto`` backend selection for
  each supported dtype, and the single-rank communicator; with
  ``--engine-conformance-distributed`` also a real 2-rank process group on the platform's
  ``dist_backend`` (needs two devices, or the CPU);
* ``backend[NAME]`` — every attention backend the platform's plugin provides or the platform
  lists in its ``auto`` order, against the torch reference backend on random paged batches, for
  each dtype and for sliding window / soft-capping when declared;
* ``kernel[NAME]`` — every kernel override serving the platform, against
  ``engine.kernels.reference``, in each supported dtype.

Items are marked ``conformance``. Plugins load as usual (``ENGINE_PLUGINS`` applies).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

MARKER = "conformance"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("engine-conformance", "engine plugin conformance kit")
    group.addoption(
        "--engine-conformance",
        metavar="PLATFORM",
        default=None,
        help="check the named platform, its attention backends and kernel overrides",
    )
    group.addoption(
        "--engine-conformance-distributed",
        action="store_true",
        default=False,
        help="also check the communicator with a real 2-rank process group",
    )
    group.addoption(
        "--engine-conformance-seed", type=int, default=0, help="seed of the random inputs"
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARKER}: engine plugin conformance checks")


def pytest_report_header(config: pytest.Config) -> str | None:
    name = config.getoption("--engine-conformance")
    return f"engine conformance: platform {name}" if name else None


class ConformanceItem(pytest.Item):
    """One conformance check: calls ``check()``; a ``pytest.skip`` inside skips it."""

    def __init__(self, *, check: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.check = check
        self.add_marker(MARKER)

    def runtest(self) -> None:
        self.check()

    def repr_failure(self, excinfo: Any, style: Any = None) -> str:
        if isinstance(excinfo.value, AssertionError):
            return f"{self.name}: {excinfo.value}"
        return super().repr_failure(excinfo, style)

    def reportinfo(self) -> tuple[Any, int, str]:
        return self.path, 0, f"engine conformance: {self.name}"


class ConformanceCollector(pytest.Collector):
    """Builds the items for one platform."""

    def __init__(self, *, platform_name: str, seed: int, distributed: bool, **kwargs: Any):
        super().__init__(**kwargs)
        self.platform_name = platform_name
        self.seed = seed
        self.distributed = distributed

    def _item(self, name: str, check: Callable[[], None]) -> ConformanceItem:
        return ConformanceItem.from_parent(self, name=name, check=check)

    def collect(self) -> list[ConformanceItem]:
        from engine.errors import PluginError
        from engine.plugins import PluginManager

        try:
            pm = PluginManager.from_env()
            entry = pm.resolve_platform_entry(self.platform_name)
        except PluginError as exc:
            message = str(exc)

            def fail() -> None:
                raise AssertionError(message)

            return [self._item("platform::load", fail)]
        return (
            list(self._platform_items(pm, entry))
            + list(self._backend_items(pm, entry))
            + list(self._kernel_items(pm, entry))
        )

    def _platform_items(self, pm: Any, entry: Any) -> Iterator[ConformanceItem]:
        from engine.testing import checks

        platform = entry.cls
        env = dict(os.environ)
        yield self._item(
            "platform::attributes", lambda: checks.check_platform_attributes(platform, entry.name)
        )
        yield self._item("platform::detection", lambda: checks.check_platform_detection(platform))
        yield self._item(
            "platform::detection-is-cheap",
            lambda: checks.check_detection_is_cheap(entry.name, env),
        )
        yield self._item("platform::device-facts", lambda: checks.check_device_facts(platform))
        yield self._item("platform::memory", lambda: checks.check_memory_profiling(platform))
        yield self._item("platform::check-config", lambda: checks.check_config_validation(platform))
        yield self._item(
            "platform::default-backends", lambda: checks.check_default_backends(platform, pm)
        )
        yield self._item(
            "platform::communicator", lambda: checks.check_single_rank_communicator(platform)
        )
        if self.distributed:
            from engine.testing.distributed import run_communicator_check

            yield self._item(
                "platform::communicator-2-ranks", lambda: run_communicator_check(platform, 2)
            )

    def _backend_items(self, pm: Any, entry: Any) -> Iterator[ConformanceItem]:
        from engine.errors import PluginError
        from engine.testing import checks

        platform = entry.cls
        registry = pm.attention_backends()
        names = [b.name for b in registry if b.plugin.name == entry.plugin.name]
        names += [n for n in platform.default_attention_backends(None) if n in registry]
        for name in dict.fromkeys(names):
            backend_entry = registry.entry(name)
            try:
                backend = backend_entry.load()
                reference = registry.get("torch")
            except PluginError as exc:
                message = str(exc)

                def fail(message: str = message) -> None:
                    raise AssertionError(message)

                yield self._item(f"backend[{name}]::import", fail)
                continue
            for case in checks.attention_cases(backend, platform):

                def run(backend=backend, reference=reference, case=case) -> None:
                    reasons = backend.supports(checks.spec_for_case(case, platform.device_type))
                    if reasons:
                        pytest.skip(f"{backend.name} cannot serve {case.id}: {'; '.join(reasons)}")
                    checks.check_attention_backend(
                        backend, reference, case, platform.torch_device(0), self.seed
                    )

                yield self._item(f"backend[{name}]::{case.id}", run)

    def _kernel_items(self, pm: Any, entry: Any) -> Iterator[ConformanceItem]:
        from engine.testing import checks

        platform = entry.cls
        for impl in pm.kernel_registry().overrides():
            if not impl.serves(platform.name):
                continue
            for dtype in platform.supported_dtypes:

                def run(impl=impl, dtype=dtype) -> None:
                    checks.check_kernel(
                        impl.name, impl.fn, platform.torch_device(0), dtype, self.seed
                    )

                yield self._item(f"kernel[{impl.name}]::{impl.provider}::{dtype}", run)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    """Append the conformance items before ``-m``/``-k`` deselection runs."""
    name = config.getoption("--engine-conformance")
    if not name:
        return
    collector = ConformanceCollector.from_parent(
        session,
        name=f"engine-conformance[{name}]",
        nodeid=f"engine-conformance[{name}]",
        platform_name=name,
        seed=config.getoption("--engine-conformance-seed"),
        distributed=config.getoption("--engine-conformance-distributed"),
    )
    # genitems reports the collection like pytest's own (so "collected N items" counts ours).
    items.extend(session.genitems(collector))
