"""Triton kernel tests: on the CPU they run in Triton's interpreter, with a GPU on the GPU.

Triton reads ``TRITON_INTERPRET`` when ``triton.language`` is imported (its own library
functions are decorated then), so it is set here, while collecting, before anything imports
Triton. It changes nothing for the rest of the suite: engine-llm-triton registers its kernels for
GPU platforms only, and its attention backend is never the CPU's default.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # paged_reference, shared with tests/gpu

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.triton)


@pytest.fixture(autouse=True)
def _needs_triton():
    pytest.importorskip("triton")


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def seed() -> int:
    """Fresh random inputs for every test: seed torch from the OS and return the seed, which
    assertion messages print so a failure can be replayed (``ENGINE_TEST_SEED=N``)."""
    value = int(os.environ.get("ENGINE_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    torch.manual_seed(value)
    return value
