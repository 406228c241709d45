"""TPU plugin tests on torch_xla (``tox -e tpu``: torch 2.9.0 + torch-xla 2.9.0, XLA's CPU
device with ``PJRT_DEVICE=CPU``). Every test here is marked ``tpu``; without torch_xla they
are skipped."""

from __future__ import annotations

import importlib.util

import pytest


def pytest_collection_modifyitems(config, items):
    here = __file__.rsplit("/", 1)[0]
    missing = importlib.util.find_spec("torch_xla") is None
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.tpu)
            if missing:
                item.add_marker(pytest.mark.skip(reason="torch_xla is not installed (tox -e tpu)"))
