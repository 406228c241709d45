"""The CPU plugin's compiled kernels (``engine_cpu/csrc``), built on first use for this machine.

The sources are plain C with x86 intrinsics, compiled by the system's C compiler with
``-march=native`` into a shared library under ``~/.cache/engine/cpu-kernels`` (or
``$ENGINE_CPU_KERNEL_CACHE``), named by a hash of the sources, the flags, the compiler and the
CPU's feature flags, so a changed source or a different machine builds its own. A build takes
about a second; it is written to a temporary name and renamed, so concurrent processes (test
workers, ``--api-server-count``) never load a half-written file. The library is opened after
torch, so its OpenMP calls resolve to torch's already-loaded ``libgomp.so.1`` and share torch's
thread pool (``torch.set_num_threads`` applies to them).

``load()`` returns None, with the reason in ``unavailable_reason()`` (logged once by the
caller), where there is no compiler, the CPU lacks AMX (Intel Xeon since Sapphire Rapids),
Linux refuses the process AMX's tile state, or the platform is not x86-64 Linux; the kernels'
callers then keep their torch paths. ``ENGINE_CPU_NATIVE=0`` turns the
compiled kernels off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

_SOURCES = ("gguf_amx.c",)
_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
_LIBS = ("-lm",)
# /proc/cpuinfo names of what csrc/gguf_amx.c needs.
_NEEDS = ("avx512f", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")
_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_flags() -> str:
    from engine_cpu.platform import cpuinfo_field

    return cpuinfo_field("flags") or platform.processor()


def _cache_dir() -> Path:
    root = os.environ.get("ENGINE_CPU_KERNEL_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "engine" / "cpu-kernels"


class NotThisMachine(RuntimeError):
    """The kernels are not for this machine (no AMX, not x86-64 Linux): expected, not a fault."""


def _build() -> ctypes.CDLL:
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise NotThisMachine(
            f"built only for x86-64 Linux, this is {sys.platform} {platform.machine()}"
        )
    flags = _cpu_flags().split()
    missing = [f for f in _NEEDS if f not in flags]
    if missing:
        raise NotThisMachine(f"the CPU lacks {', '.join(missing)}")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc or gcc, or $CC) on PATH")
    src_dir = Path(__file__).parent / "csrc"
    sources = [src_dir / s for s in _SOURCES]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256()
    for part in [*(s.read_bytes() for s in sources), " ".join(_CFLAGS + _LIBS).encode()]:
        digest.update(part)
    digest.update(version.encode())
    digest.update(" ".join(sorted(flags)).encode())
    target = _cache_dir() / f"engine_cpu_kernels-{digest.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        cmd = [cc, *_CFLAGS, *map(str, sources), "-o", tmp, *_LIBS]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            os.unlink(tmp)
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
        os.replace(tmp, target)
        logger.info("engine-cpu: compiled kernels into %s", target)
    import torch  # noqa: F401  (torch's libgomp first, see the module docstring)

    lib = ctypes.CDLL(str(target))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    i32 = ctypes.c_int
    lib.gguf_amx_available.restype = i32
    lib.gguf_quantize_rows.argtypes = [ptr, i32, i64, i64, i32, ptr, ptr, ptr]
    lib.gguf_quantize_rows.restype = None
    lib.gguf_amx_gemm.argtypes = [ptr, ptr, ptr, i64, i64, i64, i32, ptr, ptr, ptr, i64, ptr, i64]
    lib.gguf_amx_gemm.restype = None
    lib.gguf_amx_gemm_bf16.argtypes = [ptr, ptr, ptr, i64, i64, i64, i32, ptr, i64, ptr, i64, ptr]
    lib.gguf_amx_gemm_bf16.restype = None
    if not lib.gguf_amx_available():
        raise RuntimeError("Linux refused this process the AMX tile state (arch_prctl)")
    return lib


def load() -> ctypes.CDLL | None:
    """The compiled library, built on the first call; None where it cannot be (see
    ``unavailable_reason``) or while ``ENGINE_CPU_NATIVE=0`` (read on every call)."""
    if os.environ.get("ENGINE_CPU_NATIVE", "1") == "0":
        return None
    with _lock:
        if "lib" not in _state and "error" not in _state:
            try:
                _state["lib"] = _build()
            except NotThisMachine as e:
                _state["error"] = str(e)
            except (OSError, RuntimeError) as e:  # this machine should have had them
                _state["error"] = str(e)
                logger.warning("engine-cpu: the compiled CPU kernels are unavailable: %s", e)
        return _state.get("lib")  # type: ignore[return-value]


def unavailable_reason() -> str | None:
    """Why ``load()`` returned None (None when it has not, or has not been called)."""
    if os.environ.get("ENGINE_CPU_NATIVE", "1") == "0":
        return "turned off by ENGINE_CPU_NATIVE=0"
    return _state.get("error")  # type: ignore[return-value]
