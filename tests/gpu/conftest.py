"""GPU tests: every test marked ``gpu`` is skipped without a CUDA device.

``paged_reference`` (the float64 paged-attention oracle) is shared with ``tests/triton_kernels``.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "triton_kernels"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture
def seed() -> int:
    """Fresh random inputs per test; the seed goes into assertion messages for replays
    (``ENGINE_TEST_SEED=N`` replays one)."""
    value = int(os.environ.get("ENGINE_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    torch.manual_seed(value)
    return value
