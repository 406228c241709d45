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


def _pyprojects() -> list[str]:
    """Every pyproject.toml of the repository (not of virtual environments or build trees)."""
    skip = {".git", ".tox", ".venv", ".venv-engine", "build", "dist", "__pycache__", ".peers"}
    found = []
    for here, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in skip and not d.endswith(".egg-info")]
        if "pyproject.toml" in files:
            found.append(os.path.join(here, "pyproject.toml"))
    return sorted(found)


def test_license_is_an_spdx_expression_everywhere():
    """PEP 639: `license = "Apache-2.0"`. The TOML-table form makes setuptools warn
    "project.license as a TOML table is deprecated" on every build of every distribution; the
    string form needs setuptools >= 77 at build time."""
    checked = 0
    for path in _pyprojects():
        with open(path, "rb") as f:
            data = tomllib.load(f)
        license_ = data.get("project", {}).get("license")
        if license_ is None:
            continue
        rel = os.path.relpath(path, ROOT)
        assert license_ == "Apache-2.0", f"{rel}: license = {license_!r}"
        requires = data["build-system"]["requires"]
        assert "setuptools>=77" in requires, f"{rel}: build-system requires {requires}"
        assert not any(
            c.startswith("License ::") for c in data["project"].get("classifiers", [])
        ), f"{rel}: a License classifier next to an SPDX license is an error in setuptools"
        checked += 1
    assert checked >= 7  # the engine, its five plugins and the example vendor plugin


def test_cpu_install_pins_agree():
    """tox, the quick-start script and the docs install the same CPU torch from the same index
    and the same triton (the one the GPU machine runs): a user's quick start is what CI tests."""
    import re

    def read(rel: str) -> str:
        with open(os.path.join(ROOT, rel)) as f:
            return f.read()

    tox = read("tox.ini")
    torch_pin = re.search(r"^\s*torch==([\d.]+)\+cpu; sys_platform == \"linux\"$", tox, re.M)
    triton_pin = re.search(r"^\s*triton==([\d.]+);", tox, re.M)
    links = re.search(r"^\s*--find-links (\S+)/torch/$", tox, re.M)
    assert torch_pin and triton_pin and links, "tox.ini lost its torch/triton pins or CPU index"
    torch_version, triton_version, cpu_index = torch_pin[1], triton_pin[1], links[1]
    assert f'torch=={torch_version}; sys_platform != "linux"' in tox

    script = read("examples/quickstart.sh")
    assert f"TORCH_VERSION={torch_version}\n" in script
    assert f"TRITON_VERSION={triton_version}\n" in script
    assert f"TORCH_INDEX_URL=${{TORCH_INDEX_URL:-{cpu_index}}}" in script
    assert "torch==$TORCH_VERSION" in script and "triton==%s" in script

    quickstart = " ".join(read("docs/quickstart.md").split())
    assert f"torch=={torch_version} --index-url {cpu_index}" in quickstart
    testing = " ".join(read("docs/testing.md").split())
    assert f"torch=={torch_version}+cpu" in testing and f"triton=={triton_version}" in testing


def test_distribution_names_are_the_published_ones():
    """`engine` on the package index is an unrelated project, so the six distributions are
    engine-llm and engine-llm-<platform>; the import names (engine, engine_cpu, ...) and the
    `engine` command stay. Every reference to a distribution must use the published name."""
    from importlib import metadata

    from engine.version import DISTRIBUTION_NAME, __version__

    def project(rel: str) -> dict:
        with open(os.path.join(ROOT, rel, "pyproject.toml"), "rb") as f:
            return tomllib.load(f)["project"]

    core = project(".")
    assert core["name"] == DISTRIBUTION_NAME == "engine-llm"
    assert core["optional-dependencies"]["cpu"] == ["engine-llm-cpu"]
    assert core["scripts"] == {"engine": "engine.cli.main:main"}
    for plugin in ("cpu", "cuda", "rocm", "tpu", "triton"):
        meta = project(f"plugins/engine-{plugin}")
        assert meta["name"] == f"engine-llm-{plugin}"
        assert "engine-llm>=0.1,<0.2" in meta["dependencies"]
        assert not any(d.split(">")[0].split("=")[0] == "engine" for d in meta["dependencies"])
    assert "engine-llm>=0.1,<0.2" in project("examples/engine-example-vendor")["dependencies"]
    assert metadata.version("engine-llm") == __version__  # what this environment installed
