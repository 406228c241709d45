"""The GPU and Triton test modules can at least start: checked on the CPU, where they skip.

A GPU test runs only on a GPU machine, so a typo in it is found there or never: 15 tests of
tests/gpu/test_triton_gpu.py called ``torch.testing.assertclose`` (there is no such function)
and failed on the H200 on every run without anyone seeing why. Here every module under
tests/gpu and tests/triton_kernels is read with ``ast`` and, without running a test:

* every import, at module level or inside a test function (the GPU tests import their kernels
  lazily), names a module that imports and names that module defines;
* every attribute chain rooted in an imported module or name (``torch.testing.assert_close``,
  ``ref.rms_norm``, ``triton.cdiv``) resolves, attribute by attribute.

A third-party package that is not installed here (e.g. ``torch_xla``) skips the modules that
need it; anything else that does not resolve fails, naming the file and line.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
MODULES = sorted([*(TESTS / "gpu").glob("*.py"), *(TESTS / "triton_kernels").glob("*.py")])


class Unresolved(Exception):
    pass


class NotInstalled(Exception):
    pass


def _import(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        top = (e.name or name).split(".")[0]
        if importlib.util.find_spec(top) is None and not name.startswith(("engine", top + "_")):
            raise NotInstalled(top) from None
        raise Unresolved(f"cannot import {name}: {e}") from None


def _attr(obj, name: str, where: str):
    """``getattr``, or the submodule ``obj.name`` when ``obj`` is a package."""
    if hasattr(obj, name):
        return getattr(obj, name)
    module_name = getattr(obj, "__name__", None)
    if isinstance(module_name, str) and hasattr(obj, "__path__"):
        try:
            return _import(f"{module_name}.{name}")
        except Unresolved:
            pass
    raise Unresolved(f"{where}: {getattr(obj, '__name__', type(obj).__name__)} has no {name!r}")


def _bindings(tree: ast.AST, path: Path) -> dict[str, object]:
    """Names bound by every import in the file (any scope), resolved to their objects."""
    bound: dict[str, object] = {}
    for node in ast.walk(tree):
        where = f"{path.name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                module = _import(alias.name)
                if alias.asname:
                    bound[alias.asname] = module
                else:
                    top = alias.name.split(".")[0]
                    bound[top] = _import(top)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise Unresolved(f"{where}: relative import in a test module")
            module = _import(node.module)
            for alias in node.names:
                if alias.name == "*":
                    continue
                bound[alias.asname or alias.name] = _attr(module, alias.name, where)
    return bound


def _chain(node: ast.Attribute) -> tuple[str, list[str]] | None:
    """``a.b.c`` as ("a", ["b", "c"]); None unless the chain ends in a plain name."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return node.id, attrs[::-1]


def _label(path: Path) -> str:
    return str(path.relative_to(TESTS.parent)) if TESTS.parent in path.parents else path.name


def unresolved_uses(path: Path) -> list[str]:
    """Every import or attribute use in ``path`` that does not resolve."""
    tree = ast.parse(path.read_text(), str(path))
    problems: list[str] = []
    try:
        bound = _bindings(tree, path)
    except Unresolved as e:
        return [str(e)]
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue  # only whole chains, from their outermost attribute
        chain = _chain(node)
        if chain is None or chain[0] not in bound:
            continue
        root, attrs = chain
        obj = bound[root]
        where = f"{_label(path)}:{node.lineno}"
        try:
            for name in attrs:
                obj = _attr(obj, name, f"{where}: {root}.{'.'.join(attrs)}")
        except Unresolved as e:
            problems.append(str(e))
    return problems


@pytest.fixture(autouse=True)
def helper_modules(monkeypatch):
    """The shared helpers (kernel_tolerance, paged_reference) are imported by bare name, as
    tests/gpu/conftest.py arranges."""
    monkeypatch.syspath_prepend(str(TESTS / "triton_kernels"))
    monkeypatch.syspath_prepend(str(TESTS / "gpu"))


@pytest.mark.parametrize("path", MODULES, ids=[f"{p.parent.name}/{p.name}" for p in MODULES])
def test_every_import_and_attribute_resolves(path):
    try:
        problems = unresolved_uses(path)
    except NotInstalled as e:
        pytest.skip(f"{e} is not installed here")
    assert not problems, "\n".join(problems)


def test_the_check_catches_a_misspelled_function(tmp_path):
    """What it was written for: the old ``torch.testing.assertclose`` line fails here, and so
    does a lazy import of a kernel that does not exist."""
    bad = tmp_path / "test_bad.py"
    bad.write_text(
        "import torch\n\n\ndef test_x():\n"
        "    from engine.kernels import reference as ref\n"
        "    torch.testing.assertclose(ref.rms_norm, 1)\n"
        "    torch.testing.assert_close(1, 1)\n"
    )
    problems = unresolved_uses(bad)
    assert len(problems) == 1 and "has no 'assertclose'" in problems[0], problems
    assert problems[0].startswith("test_bad.py:6")
    bad.write_text("def test_y():\n    from engine.kernels.reference import no_such_kernel\n")
    (problem,) = unresolved_uses(bad)
    assert "no 'no_such_kernel'" in problem
