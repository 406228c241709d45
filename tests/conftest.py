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


@pytest.fixture
def torch_cpu_kernels(monkeypatch):
    """The CPU plugin without its compiled kernels (``ENGINE_CPU_NATIVE=0``: GGUF layers on
    torch's int4 kernel or dense, exact in float32), as on CPUs that have neither AMX nor AVX2.
    For tests of model loading against an exact reference; the compiled kernels, which quantize
    activations to int8 as llama.cpp does, are tested in tests/test_cpu_gguf_{amx,avx2}.py."""
    monkeypatch.setenv("ENGINE_CPU_NATIVE", "0")


@pytest.fixture(scope="session")
def tiny_gemma3_gguf_file(tmp_path_factory) -> Path:
    """A tiny random Gemma 3 GGUF (the embedded default model's architecture and format)."""
    from engine.testing.tiny_gguf import write_tiny_gemma3_gguf

    return write_tiny_gemma3_gguf(tmp_path_factory.mktemp("tiny-default") / "tiny.gguf", seed=3)


@pytest.fixture
def tiny_default_model(tiny_gemma3_gguf_file, tmp_path, monkeypatch):
    """The embedded default model replaced by a tiny Gemma 3 GGUF: a stand-in chunk package
    whose ``assemble`` copies the tiny file, and a fresh ``ENGINE_CACHE_DIR``. Commands that
    default to the embedded model then run the real resolution and loading code, quickly.
    Yields the path the model is assembled to."""
    import shutil
    import types

    import engine.default_model as dm

    def assemble(output_path=None, overwrite=False):
        shutil.copyfile(tiny_gemma3_gguf_file, output_path)
        return output_path

    module = types.ModuleType("tiny_default_model_chunks")
    module.MODEL_NAME = "tiny-default.gguf"
    module.assemble = assemble
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(dm, "DEFAULT_MODEL_PACKAGE", module.__name__)
    monkeypatch.setattr(dm, "DEFAULT_MODEL_SIZE", tiny_gemma3_gguf_file.stat().st_size)
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "engine-cache"))
    return tmp_path / "engine-cache" / "models" / module.MODEL_NAME


@pytest.fixture
def triton_sinks_declared(monkeypatch):
    """engine-triton's attention backend (and engine-rocm's subclass) declaring attention
    sinks, which its kernels take but which it declares only once they have run on a GPU
    (``engine_triton.attention.TritonAttentionBackend.supports_attention_sinks``): the tests of
    that path, under the interpreter and on a GPU, run with it declared."""
    attention = pytest.importorskip("engine_triton.attention")
    monkeypatch.setattr(attention.TritonAttentionBackend, "supports_attention_sinks", True)
