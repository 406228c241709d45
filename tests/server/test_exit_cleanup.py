"""The server freezes the objects it loaded (``gc.freeze``: the garbage collector then skips
them on every collection) and must give them back when it stops: frozen objects are never
collected, not even at interpreter exit, so cycles among extension objects outlive their
modules. With Triton 3.9 (nanobind bindings, what xgrammar's unpinned ``triton`` installs)
that printed a 40-line "nanobind: leaked 4 instances! ... ir.attribute" dump after every
`engine serve`."""

from __future__ import annotations

import gc

import pytest
from fake_engine import FakeEngine
from server_harness import RunningServer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from engine.testing.tiny_models import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def test_stopped_server_leaves_nothing_frozen(tokenizer):
    gc.unfreeze()
    with RunningServer(lambda: FakeEngine(tokenizer)):
        assert gc.get_freeze_count() > 0  # what the loaded engine brought in
    assert gc.get_freeze_count() == 0
