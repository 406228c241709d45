"""Where the engine keeps files it derives once and reuses: assembled default models and
converted GGUF tokenizers.

``ENGINE_CACHE_DIR`` (default ``~/.cache/engine``) is the root; ``models/`` holds the assembled
default model, ``tokenizers/`` the tokenizers converted from GGUF metadata. Everything there can
be deleted at any time: it is rebuilt on the next start.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "ENGINE_CACHE_DIR"


def engine_cache_dir() -> Path:
    """The cache root: ``$ENGINE_CACHE_DIR``, else ``~/.cache/engine`` (not created here)."""
    value = os.environ.get(ENV_VAR)
    return Path(value).expanduser() if value else Path.home() / ".cache" / "engine"
