"""Cheap detection helpers shared by platform plugins.

Everything here answers without importing torch (when it is not imported yet) and without
touching a device: ``engine plugins`` and every start-up run detection for every installed
platform, so it must cost milliseconds.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

_ASSIGNMENT = re.compile(r"^(\w+)\s*(?::[^=]+)?=\s*(.+?)\s*$")


@dataclass(frozen=True)
class TorchBuild:
    """What the installed torch was built for, read without importing it."""

    installed: bool
    version: str | None = None
    cuda: str | None = None  # torch.version.cuda
    hip: str | None = None  # torch.version.hip

    def describe(self) -> str:
        if not self.installed:
            return "torch not installed"
        if self.cuda:
            return f"torch {self.version} (CUDA {self.cuda})"
        if self.hip:
            return f"torch {self.version} (ROCm/HIP {self.hip})"
        return f"torch {self.version} (CPU-only build)"


def module_available(name: str) -> bool:
    """True when ``name`` could be imported, without importing it (parents may be imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def torch_build() -> TorchBuild:
    """Version, CUDA and HIP of the installed torch.

    When torch is already imported it is asked directly; otherwise ``torch/version.py`` (a file
    of plain assignments written at build time) is parsed, which takes well under a millisecond
    where ``import torch`` takes a second or more.
    """
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "version"):
        return TorchBuild(True, torch.__version__, torch.version.cuda, torch.version.hip)
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return TorchBuild(False)
    values: dict[str, object] = {}
    for location in spec.submodule_search_locations:
        path = Path(location) / "version.py"
        if path.is_file():
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
                match = _ASSIGNMENT.match(line)
                if match:
                    try:
                        values[match.group(1)] = ast.literal_eval(match.group(2))
                    except (ValueError, SyntaxError):
                        pass
            break
    if "__version__" not in values:  # an unusual build: fall back to asking torch itself
        import torch

        return TorchBuild(True, torch.__version__, torch.version.cuda, torch.version.hip)
    return TorchBuild(
        True,
        str(values["__version__"]),
        values.get("cuda") or None,  # type: ignore[arg-type]
        values.get("hip") or None,  # type: ignore[arg-type]
    )


def visible_devices_hidden(variable: str, environ: Mapping[str, str] | None = None) -> bool:
    """True when a ``*_VISIBLE_DEVICES`` variable is set but selects no device."""
    env = os.environ if environ is None else environ
    value = env.get(variable)
    if value is None:
        return False
    value = value.strip()
    return value == "" or value.startswith("-1")
