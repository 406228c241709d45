"""Every repository path that README.md and docs/*.md name exists, and the docs cite no file
outside the repository: they must stand alone, and renames must not leave them pointing at
nothing (they once named `engine/server/async_engine.py`, the import path, for
`core/server/async_engine.py`, and a design document that is not in the checkout).

A path is a code span or a link target that contains a `/` and either starts with a top-level
entry of the repository or ends with a file extension, or a bare `*.md` name. URLs, absolute
and home paths, placeholders (`<file>`, `$VAR`), HTTP routes and flags are not paths.
"""

from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXTENSIONS = (".py", ".md", ".sh", ".toml", ".ini", ".txt", ".json", ".yaml", ".yml", ".cfg")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def top_level() -> set[str]:
    return {p.name for p in ROOT.iterdir()} - {".git", ".venv", ".tox"}


def candidate(token: str) -> str | None:
    """The repository path ``token`` names, or None when it names none."""
    token = token.strip().split("::", 1)[0].split("#", 1)[0].rstrip(".,;:")
    if not token or " " in token or any(c in token for c in "<>$~{}=\"'") or "://" in token:
        return None
    if token.startswith(("/", "-", "http")) or token.endswith("..."):
        return None
    if "/" not in token:
        return token if token.endswith(".md") else None
    first = token.split("/", 1)[0]
    if first in top_level() or first in ("engine", "shared", "..") or token.endswith(EXTENSIONS):
        return token
    return None


def named_paths(doc: Path) -> list[tuple[int, str, Path]]:
    """(line, token, resolved path) for every path the document names: in code spans and link
    targets, and in fenced code blocks (diagrams, commands) every word that is a path."""
    found = []
    fenced = False
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            for word in re.split(r"[\s,()]+", line):
                path = candidate(word)
                if path is not None and "/" in path:
                    found.append((number, word, ROOT / path))
            continue
        for token in CODE_SPAN.findall(line):
            path = candidate(token)
            if path is not None:
                found.append((number, token, ROOT / path))
        for target in LINK.findall(line):
            path = candidate(target)
            if path is not None:
                found.append((number, target, (doc.parent / path).resolve()))
    return found


def exists(path: Path) -> bool:
    if any(c in str(path) for c in "*?["):
        return bool(glob.glob(str(path)))
    return path.exists()


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_named_path_exists(doc):
    missing = [
        f"{doc.relative_to(ROOT)}:{line}: `{token}`"
        for line, token, path in named_paths(doc)
        if not exists(path) or ROOT not in path.parents and path != ROOT
    ]
    assert not missing, "paths that are not in the repository:\n" + "\n".join(missing)


def test_the_rule_catches_what_it_must():
    """The check itself: an import path, a file outside the checkout, a bare design doc."""
    assert candidate("engine/server/async_engine.py") == "engine/server/async_engine.py"
    assert candidate("core/server/async_engine.py") == "core/server/async_engine.py"
    assert candidate("DESIGN.md") == "DESIGN.md"
    assert candidate("shared/peers/vllm") == "shared/peers/vllm"
    assert candidate("tests/test_llm_vs_hf.py::test_n4") == "tests/test_llm_vs_hf.py"
    for not_a_path in ("/v1/completions", "Qwen/Qwen2.5-7B", "--min-/--max-input-len", "a/b"):
        assert candidate(not_a_path) is None, not_a_path
    assert not exists(ROOT / "engine/server/async_engine.py")
