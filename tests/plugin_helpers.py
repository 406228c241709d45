"""Installing tiny plugin distributions for tests without pip.

``install_fake_dist`` writes what an installer leaves behind — ``<name>-<version>.dist-info``
with ``METADATA`` and ``entry_points.txt`` — next to a copy of the distribution's modules in a
target directory. With that directory on ``sys.path`` (or ``PYTHONPATH``), ``importlib.metadata``
discovers the entry points exactly as it does for a pip-installed distribution.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "plugins_fixtures"
EXAMPLE_VENDOR = REPO / "examples" / "engine-example-vendor"


def install_fake_dist(source: Path, target: Path) -> str:
    """Lay out the distribution in ``source`` (a pyproject.toml project) under ``target``.

    Returns the distribution name.
    """
    project = tomllib.loads((source / "pyproject.toml").read_text())
    meta = project["project"]
    name, version = meta["name"], meta["version"]
    target.mkdir(parents=True, exist_ok=True)
    setuptools_cfg = project.get("tool", {}).get("setuptools", {})
    for module in setuptools_cfg.get("py-modules", []):
        shutil.copy(source / f"{module}.py", target / f"{module}.py")
    for package in setuptools_cfg.get("packages", []):
        if "." not in package:
            shutil.copytree(source / package, target / package, dirs_exist_ok=True)
    dist_info = target / f"{re.sub(r'[-_.]+', '_', name)}-{version}.dist-info"
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    )
    lines = []
    for group, entries in meta.get("entry-points", {}).items():
        lines.append(f"[{group}]")
        lines += [f"{key} = {value}" for key, value in entries.items()]
    (dist_info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return name


def install_fixtures(target: Path, *names: str) -> list[str]:
    """Install the named fixture distributions from ``tests/plugins_fixtures`` into ``target``."""
    return [install_fake_dist(FIXTURES / name, target) for name in names]
