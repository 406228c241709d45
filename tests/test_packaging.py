"""The wheel holds every sub-package.

pyproject.toml lists the packages explicitly (the fixed top level maps ``core/`` to ``engine``,
``platforms/`` to ``engine.platforms``...). An editable install finds a sub-package missing
from that list anyway, so only a non-editable install (CI, users) would notice: this test
notices first.
"""

from __future__ import annotations

import os

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setuptools_config() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def test_every_subpackage_is_listed_in_pyproject():
    config = _setuptools_config()
    listed = set(config["packages"])
    found = set()
    for package, directory in config["package-dir"].items():
        top = os.path.join(ROOT, directory)
        for here, dirs, files in os.walk(top):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            if "__init__.py" not in files:
                continue
            rel = os.path.relpath(here, top)
            name = package if rel == "." else package + "." + rel.replace(os.sep, ".")
            found.add(name)
    missing = sorted(found - listed)
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {missing}"
    assert not sorted(listed - found), "pyproject.toml lists packages that do not exist"
