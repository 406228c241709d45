"""Models and tokenizers named by Hugging Face Hub id: the local cache, else a download.

``engine serve Qwen/Qwen3-0.6B`` works as ``vllm serve`` does: the id resolves to its snapshot in
the Hugging Face cache (``HF_HUB_CACHE``, or ``--download-dir``), and what the cache lacks is
downloaded first, with huggingface_hub's progress bars, at ``--revision`` (a branch, tag or
commit; default ``main``). ``HF_HUB_OFFLINE=1`` downloads nothing: an id must then be cached.
``HF_TOKEN`` (or ``huggingface-cli login``) opens private and gated repositories.

Only the files the engine reads are fetched: configs and tokenizer files, the ``*.safetensors``
weights (none for ``load_format="dummy"``), Python files only with ``trust_remote_code``. A
snapshot already in the cache is used without asking the Hub as long as it holds a
``config.json`` and, where weights are needed, a ``*.safetensors`` file; so a server restarts
offline from its cache, and a second process of the same server (an engine core, a front end)
finds what the first downloaded.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from engine.layers.weight_utils import ModelLoadError

logger = logging.getLogger(__name__)

# Configs (config.json, generation_config.json, the safetensors index, tokenizer_config.json,
# preprocessor configs...), tokenizer files (sentencepiece, tiktoken, vocab/merges text) and
# chat templates.
CONFIG_PATTERNS = ("*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja")
WEIGHT_PATTERNS = ("*.safetensors",)
CODE_PATTERNS = ("*.py",)
# Llama's original/ (consolidated .pth) and Mistral's consolidated copies: never read here.
SKIPPED_PATTERNS = ("original/*", "consolidated*")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
ADAPTER_CONFIG = "adapter_config.json"
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


def is_hub_id(text: str) -> bool:
    """Whether ``text`` has the form of a Hub repository id (``name`` or ``org/name``)."""
    return bool(_HUB_ID.match(text)) and not text.startswith(".")


def hub_offline() -> bool:
    """Whether huggingface_hub may not reach the Hub (``HF_HUB_OFFLINE``)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


@dataclass(frozen=True)
class _Wanted:
    """What the engine reads from one kind of repository: the files to download, the files a
    cached snapshot must hold to be used as it is, and words for the errors."""

    what: str  # "model", "tokenizer", "LoRA adapter"
    patterns: tuple[str, ...]
    required: tuple[tuple[str, ...], ...]  # each group: at least one of these names or globs
    needed: str  # the required files, in words
    # Whether every shard the safetensors index names must be there too (a download cut off
    # between shards leaves a snapshot with some).
    all_shards: bool = False

    def complete(self, path: Path) -> bool:
        if not all(any(any(path.glob(name)) for name in group) for group in self.required):
            return False
        return not self.all_shards or _shards_present(path)


def _shards_present(path: Path) -> bool:
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return True
    import json

    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError):
        return True  # the loader reports a malformed index with its own words
    return all((path / shard).is_file() for shard in shards)


def _model(weights: bool, code: bool) -> _Wanted:
    patterns = (
        CONFIG_PATTERNS + (WEIGHT_PATTERNS if weights else ()) + (CODE_PATTERNS if code else ())
    )
    required = (("config.json",),) + ((WEIGHT_PATTERNS,) if weights else ())
    needed = "config.json" + (" and *.safetensors weights" if weights else "")
    needed += " (the engine reads Hugging Face safetensors checkpoints, or a local .gguf file)"
    return _Wanted("model", patterns, required, needed, all_shards=weights)


_TOKENIZER = _Wanted(
    "tokenizer",
    CONFIG_PATTERNS,
    (TOKENIZER_FILES,),
    "tokenizer files (tokenizer.json, tokenizer_config.json or tokenizer.model)",
)
_ADAPTER = _Wanted(
    "LoRA adapter",
    ("*.json", *WEIGHT_PATTERNS),
    ((ADAPTER_CONFIG,), WEIGHT_PATTERNS),
    f"{ADAPTER_CONFIG} and *.safetensors weights",
)


def hub_snapshot(
    repo_id: str,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    weights: bool = True,
    code: bool = False,
    tokenizer_only: bool = False,
) -> Path:
    """The local snapshot of Hub model (or, ``tokenizer_only``, tokenizer) repository
    ``repo_id``, downloaded first where the cache lacks it (see the module docstring). Raises
    ``ModelLoadError`` with the reason and the fix when it can be neither found nor
    downloaded."""
    wanted = _TOKENIZER if tokenizer_only else _model(weights, code)
    return _snapshot(repo_id, revision, download_dir, wanted)


def hub_adapter_snapshot(repo_id: str, *, download_dir: str | None = None) -> Path:
    """The local snapshot of a PEFT LoRA adapter on the Hub (``adapter_config.json`` and the
    safetensors weights), downloaded first where the cache lacks it."""
    return _snapshot(repo_id, None, download_dir, _ADAPTER)


def _snapshot(
    repo_id: str, revision: str | None, download_dir: str | None, wanted: _Wanted
) -> Path:
    from huggingface_hub import snapshot_download

    at = f" at revision {revision!r}" if revision else ""
    cached = None
    try:
        # The same patterns as the download: huggingface_hub (>= 1.x) judges a cached
        # snapshot complete against them, and the files never fetched must not count.
        cached = Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=download_dir,
                local_files_only=True,
                allow_patterns=list(wanted.patterns),
                ignore_patterns=list(SKIPPED_PATTERNS),
            )
        )
    except Exception:  # huggingface_hub raises several types for "not cached"
        pass
    if cached is not None and wanted.complete(cached):
        return cached
    if hub_offline():
        state = "only partly in" if cached is not None else "not in"
        raise ModelLoadError(
            f"{wanted.what} {repo_id!r}{at} is {state} the local Hugging Face cache, and "
            "HF_HUB_OFFLINE is set, so nothing is downloaded: unset it, or pass a local path"
        )
    logger.info(
        "downloading %s %s%s from the Hugging Face Hub (%s) into %s",
        wanted.what,
        repo_id,
        at,
        ", ".join(wanted.patterns),
        download_dir or "the Hugging Face cache",
    )
    try:
        path = Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=download_dir,
                allow_patterns=list(wanted.patterns),
                ignore_patterns=list(SKIPPED_PATTERNS),
            )
        )
    except Exception as e:
        raise ModelLoadError(_download_error(e, wanted.what, repo_id, revision)) from None
    if not wanted.complete(path):
        raise ModelLoadError(
            f"{wanted.what} {repo_id!r}{at} on the Hugging Face Hub has no {wanted.needed}"
        )
    return path


def _download_error(e: Exception, what: str, repo_id: str, revision: str | None) -> str:
    """One line for a failed download: what failed, why, and what to do."""
    from huggingface_hub import errors

    where = f"{what} {repo_id!r}"
    if isinstance(e, errors.GatedRepoError):
        return (
            f"{where} is gated on the Hugging Face Hub: accept its conditions on its page and "
            "set HF_TOKEN (or run `huggingface-cli login`)"
        )
    if isinstance(e, errors.RepositoryNotFoundError):
        return (
            f"no {where} on the Hugging Face Hub (or it is private: set HF_TOKEN); pass a Hub id "
            "such as Qwen/Qwen3-0.6B, a local model directory, or a .gguf file"
        )
    if isinstance(e, errors.RevisionNotFoundError):
        return f"{where} has no revision {revision!r} on the Hugging Face Hub"
    detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return (
        f"cannot download {where} from the Hugging Face Hub ({type(e).__name__}: {detail}); "
        "check the network, or set HF_HUB_OFFLINE=1 to use only the local cache"
    )
