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
        _assert_empty_stand_in(r)


# The kernels distribution hidden from the guard's own lookup (an explicit path list) and from
# importlib.metadata, as on a machine that does not have it installed.
_WITHOUT_DISTRIBUTION = """
import importlib.machinery as m, importlib.metadata as md
find = m.PathFinder.find_spec.__func__
m.PathFinder.find_spec = classmethod(
    lambda cls, name, path=None, target=None: None
    if name == "kernels" and path is not None else find(cls, name, path, target)
)
version = md.version
def no_kernels(name):
    if name == "kernels":
        raise md.PackageNotFoundError(name)
    return version(name)
md.version = no_kernels
"""


def _assert_empty_stand_in(r: subprocess.CompletedProcess) -> None:
    assert r.returncode == 0, r.stderr
    folder, version, error = r.stdout.strip().splitlines()
    assert Path(folder).resolve() == REPO
    assert version == "N/A"
    assert "the `kernels` distribution is not installed" in error


def test_without_the_distribution_kernels_is_an_empty_stand_in():
    """transformers' probe imports a `kernels` it finds on sys.path and reads a module without
    ``__version__`` as "not usable"; an ImportError raised there escaped transformers 5.17's
    probe and failed every model import on the GPU machine (47 GPU tests)."""
    r = _run_in_root(
        _WITHOUT_DISTRIBUTION
        + "import kernels, os\n"
        + "print(os.path.dirname(os.path.dirname(kernels.__file__)))\n"
        + "print(getattr(kernels, '__version__', 'N/A'))\n"
        + "try:\n    kernels.get_kernel\nexcept AttributeError as e:\n    print(e)\n"
    )
    _assert_empty_stand_in(r)
    r = _run_in_root(
        _WITHOUT_DISTRIBUTION
        + "from transformers.utils.import_utils import is_kernels_available\n"
        + "from transformers.models.llama import configuration_llama\n"
        + "print(is_kernels_available())"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "False"


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
