"""The checkout's ``kernels/`` folder (``engine.kernels``) must not hide the ``kernels``
distribution when the repository root is on ``sys.path`` (``python -c`` started there, a Ray
worker): transformers 5.2x imports that distribution with its model configurations."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _run_in_root(code: str) -> subprocess.CompletedProcess:
    # `python -c` puts the working directory first on sys.path, as a Ray worker does its
    # driver's.
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def _kernels_distribution_installed() -> bool:
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_top_level_kernels_from_the_root_is_the_distribution_or_absent():
    r = _run_in_root(
        "import kernels, os; print(os.path.dirname(os.path.dirname(kernels.__file__)))"
    )
    if _kernels_distribution_installed():
        assert r.returncode == 0, r.stderr
        assert Path(r.stdout.strip()).resolve() != REPO
    else:
        assert r.returncode != 0
        assert "ModuleNotFoundError: No module named 'kernels'" in r.stderr


def test_engine_kernels_still_imports_from_the_root():
    r = _run_in_root(
        "import engine.kernels as k, kernels as maybe_other\nprint(k.KernelRegistry.__module__)"
        if _kernels_distribution_installed()
        else "import engine.kernels as k; print(k.KernelRegistry.__module__)"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "engine.kernels.registry"


def test_a_model_configuration_imports_from_the_root():
    r = _run_in_root("from transformers.models.llama import configuration_llama; print('ok')")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"
