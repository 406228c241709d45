"""Named kernels with torch reference implementations; plugins override them per platform."""

if __name__ == "kernels":
    # This folder is `engine.kernels`. It is imported as a top-level `kernels` only when a
    # checkout's root is on sys.path (`python -c` or `python -m` started there, or a Ray worker,
    # which puts its driver's working directory on sys.path), and there it would hide the
    # `kernels` distribution that transformers (5.2x) imports with its model configurations.
    # Hand the import over to that distribution where it is installed.
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _path = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _root]
    _spec = _machinery.PathFinder.find_spec("kernels", _path)
    if _spec is None or _spec.loader is None:
        # Not installed: stay an empty module with no __version__, which transformers' probe
        # (`_is_package_available`: it found this folder, has no metadata, so imports it)
        # reads as "kernels not usable". Raising here escapes that probe (transformers 5.17
        # does not catch it) and fails every model import.
        def __getattr__(name: str):
            raise AttributeError(
                f"module 'kernels' has no attribute {name!r}: the `kernels` distribution is "
                f"not installed, and {_os.path.dirname(__file__)} is engine.kernels"
            )
    else:
        _module = _util.module_from_spec(_spec)
        _sys.modules["kernels"] = _module  # the import statement returns what is here
        _spec.loader.exec_module(_module)
else:
    from engine.kernels.registry import (
        KERNEL_NAMES,
        KernelError,
        KernelImpl,
        KernelRegistry,
        Kernels,
    )

    __all__ = ["KERNEL_NAMES", "KernelError", "KernelImpl", "KernelRegistry", "Kernels"]
