"""Shared test configuration: GPU auto-skip and plugin-environment fixtures."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for plugin_helpers

pytest_plugins = ["pytester"]


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` are skipped when no CUDA device is present."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (none available)")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture
def plugin_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A directory on ``sys.path`` to install fake plugin distributions into.

    Yields the directory; modules imported from it are forgotten afterwards, and
    ``ENGINE_PLUGINS``/``ENGINE_PLATFORM`` are cleared so tests set exactly what they need.
    """
    target = tmp_path / "site"
    target.mkdir()
    monkeypatch.syspath_prepend(str(target))
    monkeypatch.delenv("ENGINE_PLUGINS", raising=False)
    monkeypatch.delenv("ENGINE_PLATFORM", raising=False)
    monkeypatch.delenv("EXAMPLE_VENDOR_DEVICE", raising=False)
    before = set(sys.modules)
    yield target
    for name in set(sys.modules) - before:
        module = sys.modules.get(name)
        if str(target) in str(getattr(module, "__file__", "") or ""):
            del sys.modules[name]
    importlib.invalidate_caches()
