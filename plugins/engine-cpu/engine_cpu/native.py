"""The CPU plugin's compiled kernels (``engine_cpu/csrc``), built on first use for this machine.

Two families, each its own shared library:

* ``amx`` (``csrc/gguf_amx.c``): GGUF matmuls in AMX int8 / bf16 tiles, for Intel Xeons since
  Sapphire Rapids (AVX-512 BF16, AMX-INT8/BF16, and Linux granting the process the tile state);
* ``avx2`` (``csrc/gguf_avx2.c``): GGUF matmuls as AVX2 int8 dot products, for any x86-64 CPU
  with AVX2, FMA and F16C (Intel since Haswell, AMD since Zen); where the CPU also has AVX-512
  F, BW, VL and VNNI (Intel since Ice Lake, AMD since Zen 4), the same products in AVX-512
  VNNI (``csrc/gguf_vnni.c``), compiled in by ``-march=native`` and taken at run time
  (``gguf_avx2_vnni()`` says whether).

The sources are plain C with x86 intrinsics, compiled by the system's C compiler with
``-march=native`` into a shared library under ``~/.cache/engine/cpu-kernels`` (or
``$ENGINE_CPU_KERNEL_CACHE``), named by a hash of the sources, the flags, the compiler and the
CPU's feature flags, so a changed source or a different machine builds its own. A build takes
about a second; it is written to a temporary name and renamed, so concurrent processes (test
workers, ``--api-server-count``) never load a half-written file. The library is opened after
torch, so its OpenMP calls resolve to torch's already-loaded ``libgomp.so.1`` and share torch's
thread pool (``torch.set_num_threads`` applies to them).

``load(family)`` returns None, with the reason in ``unavailable_reason(family)`` (logged once by
the caller), where there is no compiler, the CPU lacks the family's instructions, Linux refuses
the process AMX's tile state, or the platform is not x86-64 Linux; the kernels' callers then
keep their torch paths. ``ENGINE_CPU_NATIVE=0`` turns every compiled kernel off;
``ENGINE_CPU_NATIVE=avx2`` (a comma-separated list of families) allows only those, e.g. to run
the AVX2 kernels on a CPU that also has AMX; unset or ``1``: every family this CPU can run.
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

logger = logging.getLogger(__name__)

_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
_LIBS = ("-lm",)


@dataclass(frozen=True)
class _Family:
    """One library of kernels: its sources (with the headers they include, which name the
    build too), the /proc/cpuinfo flags they need, and the function that declares its
    entry points' C types."""

    sources: tuple[str, ...]
    needs: tuple[str, ...]
    declare: Callable[[ctypes.CDLL], None]
    headers: tuple[str, ...] = ()


def _declare_amx(lib: ctypes.CDLL) -> None:
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.gguf_amx_available.restype = i32
    lib.gguf_quantize_rows.argtypes = [ptr, i32, i64, i64, i32, ptr, ptr, ptr]
    lib.gguf_quantize_rows.restype = None
    lib.gguf_amx_gemm.argtypes = [ptr, ptr, ptr, i64, i64, i64, i32, ptr, ptr, ptr, i64, ptr, i64]
    lib.gguf_amx_gemm.restype = None
    lib.gguf_amx_gemm_bf16.argtypes = [ptr, ptr, ptr, i64, i64, i64, i32, ptr, i64, ptr, i64, ptr]
    lib.gguf_amx_gemm_bf16.restype = None
    if not lib.gguf_amx_available():
        raise RuntimeError("Linux refused this process the AMX tile state (arch_prctl)")
    # No twins: a recording that meets one of these refuses itself (see Kernel).
    for name in ("gguf_quantize_rows", "gguf_amx_gemm", "gguf_amx_gemm_bf16"):
        setattr(lib, name, Kernel(name, getattr(lib, name), None))


def _declare_avx2(lib: ctypes.CDLL) -> None:
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.gguf_avx2_available.restype = i32
    lib.gguf_avx2_vnni.restype = i32
    lib.gguf_avx2_quantize_rows.argtypes = [ptr, i32, i64, i64, i32, ptr, ptr, ptr]
    lib.gguf_avx2_quantize_rows.restype = None
    lib.gguf_avx2_gemm.argtypes = [ptr, i32, ptr, ptr, i64, i64, i32, ptr, ptr, ptr, i64, ptr, i64]
    lib.gguf_avx2_gemm.restype = None
    lib.gguf_avx2_dequantize.argtypes = [ptr, i32, ptr, ptr, i64, i64, i64, i32, ptr]
    lib.gguf_avx2_dequantize.restype = None
    f32 = ctypes.c_float
    lib.gguf_avx2_linear.argtypes = [
        ptr,
        i32,
        ptr,
        i32,
        ptr,
        ptr,
        i64,
        i64,
        i32,
        i64,
        ptr,
        ptr,
        i64,
    ]
    lib.gguf_avx2_linear.restype = None
    lib.gguf_avx2_rows.argtypes = [ptr, i32, ptr, ptr, ptr, i64, i64, i32, ptr, i32, i32, f32]
    lib.gguf_avx2_rows.restype = None
    lib.gguf_avx2_moe.argtypes = [ptr, i32, i64, i64, ptr, ptr, i64, i64, ptr, i32, i64, ptr, ptr,
                                  ptr, ptr]  # fmt: skip
    lib.gguf_avx2_moe.restype = None
    lib.cpu_rms_norm.argtypes = [ptr, i64, i64, ptr, i64, i64, i32, i64, i64, i64, ptr, f32]
    lib.cpu_fused_add_rms_norm.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i32, i64, i64, ptr, f32]
    lib.cpu_qk_norm_rotary.argtypes = [
        *(ptr, i64, i64, ptr, i64, i64, i32, i64, i64),
        *(ptr, ptr, ptr, ptr, f32),
    ]
    lib.cpu_write_kv.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64, ptr, i32, i64, i64, i64]
    lib.cpu_paged_decode.argtypes = [
        *(ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, i64),
        *(i32, i64, i64, i64, i64, i64, f32, f32, i64, ptr),  # ..., window, sinks (or NULL)
    ]
    lib.cpu_gated_act.argtypes = [ptr, i64, ptr, i64, i32, i64, i64, i32]
    lib.cpu_argmax_f32.argtypes = [ptr, i64, i64, i64, ptr]
    lib.cpu_topk_softmax.argtypes = [ptr, i64, i32, i64, i64, i64, i32, ptr, ptr]
    lib.cpu_dense_linear.argtypes = [ptr, i64, i32, i64, i64, ptr, i32, i64, ptr, i64, i32]
    for fn in (
        lib.cpu_rms_norm,
        lib.cpu_fused_add_rms_norm,
        lib.cpu_qk_norm_rotary,
        lib.cpu_write_kv,
        lib.cpu_paged_decode,
        lib.cpu_gated_act,
        lib.cpu_argmax_f32,
        lib.cpu_topk_softmax,
        lib.cpu_dense_linear,
    ):
        fn.restype = None
    lib.cpu_plan_run.argtypes = [ptr, i64]
    lib.cpu_plan_run.restype = None
    # The kernels a decode step calls, recordable into a native plan (engine_cpu.plan): each
    # has a twin ``<name>_p`` in csrc/cpu_plan.c taking its arguments from an int64 array.
    for name in _PLANNED_AVX2:
        setattr(lib, name, Kernel(name, getattr(lib, name), getattr(lib, name + "_p")))
    for name in (
        "gguf_avx2_quantize_rows",
        "gguf_avx2_gemm",
        "gguf_avx2_dequantize",
        "cpu_argmax_f32",  # sampling's, outside the recorded forward
    ):
        setattr(lib, name, Kernel(name, getattr(lib, name), None))


_PLANNED_AVX2 = (
    "gguf_avx2_linear",
    "gguf_avx2_rows",
    "cpu_rms_norm",
    "cpu_fused_add_rms_norm",
    "cpu_qk_norm_rotary",
    "cpu_write_kv",
    "cpu_paged_decode",
    "cpu_gated_act",
    "gguf_avx2_moe",
    "cpu_topk_softmax",
    "cpu_dense_linear",
)


class Kernel:
    """A compiled kernel as the CPU ops call it (``lib.<name>(...)``), which a native plan can
    record: while ``engine_cpu.plan`` records a decode step (``recorder`` set), each call is
    appended to the plan and then run as usual. The plan runs the kernel's twin, which reads the
    same arguments from an int64 array: ``kinds`` says how each converts (``p`` pointer, ``i``
    integer, ``f`` float). Every kernel a step can call is one of these, so none can run
    unseen by a recording: one without a twin (``twin`` None) makes the recording refuse."""

    __slots__ = ("name", "fn", "twin", "kinds")
    recorder: ClassVar[Any] = None  # the engine_cpu.plan recorder while one is active

    def __init__(self, name: str, fn: Any, twin: Any) -> None:
        self.name, self.fn = name, fn
        self.twin = None if twin is None else ctypes.cast(twin, ctypes.c_void_p).value
        self.kinds = "".join(
            "p" if t is ctypes.c_void_p else "f" if t is ctypes.c_float else "i"
            for t in fn.argtypes
        )

    def __call__(self, *args: Any) -> Any:
        if Kernel.recorder is not None:
            Kernel.recorder.record(self, args)
        return self.fn(*args)


FAMILIES: dict[str, _Family] = {
    "amx": _Family(
        ("gguf_amx.c",),
        ("avx512f", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"),
        _declare_amx,
    ),
    "avx2": _Family(
        ("gguf_avx2.c", "gguf_vnni.c", "cpu_ops.c", "cpu_plan.c"),
        ("avx2", "fma", "f16c"),
        _declare_avx2,
        ("avx2_common.h", "gguf_layout.h"),
    ),
}
_lock = threading.Lock()
_state: dict[str, dict[str, object]] = {}


def _cpu_flags() -> str:
    from engine_cpu.cpuinfo import cpuinfo_field

    return cpuinfo_field("flags") or platform.processor()


def _cache_dir() -> Path:
    root = os.environ.get("ENGINE_CPU_KERNEL_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "engine" / "cpu-kernels"


class NotThisMachine(RuntimeError):
    """The kernels are not for this machine (no AMX, not x86-64 Linux): expected, not a fault."""


def _build(name: str) -> ctypes.CDLL:
    family = FAMILIES[name]
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise NotThisMachine(
            f"built only for x86-64 Linux, this is {sys.platform} {platform.machine()}"
        )
    flags = _cpu_flags().split()
    missing = [f for f in family.needs if f not in flags]
    if missing:
        raise NotThisMachine(f"the CPU lacks {', '.join(missing)}")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc or gcc, or $CC) on PATH")
    src_dir = Path(__file__).parent / "csrc"
    sources = [src_dir / s for s in family.sources]
    headers = [src_dir / h for h in family.headers]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256()
    for part in [
        *(s.read_bytes() for s in sources + headers),
        " ".join(_CFLAGS + _LIBS).encode(),
    ]:
        digest.update(part)
    digest.update(version.encode())
    digest.update(" ".join(sorted(flags)).encode())
    target = _cache_dir() / f"engine_cpu_{name}-{digest.hexdigest()[:16]}.so"
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
        logger.info("engine-cpu: compiled the %s kernels into %s", name, target)
    import torch  # noqa: F401  (torch's libgomp first, see the module docstring)

    lib = ctypes.CDLL(str(target))
    family.declare(lib)
    return lib


def _turned_off(name: str) -> str | None:
    """Why ``ENGINE_CPU_NATIVE`` (read on every call) excludes family ``name``, or None."""
    setting = os.environ.get("ENGINE_CPU_NATIVE")
    if setting is None or setting == "1":
        return None
    setting = setting.strip()
    if setting == "0":
        return "turned off by ENGINE_CPU_NATIVE=0"
    if setting in ("", "1"):
        return None
    allowed = {part.strip() for part in setting.split(",")}
    if name not in allowed:
        return f"not in ENGINE_CPU_NATIVE={setting}"
    return None


def load(family: str = "amx") -> ctypes.CDLL | None:
    """The compiled library of ``family`` (a key of ``FAMILIES``), built on the first call; None
    where it cannot be (see ``unavailable_reason``) or while ``ENGINE_CPU_NATIVE`` excludes
    it."""
    if family not in FAMILIES:
        raise ValueError(f"unknown CPU kernel family {family!r}; known: {', '.join(FAMILIES)}")
    if _turned_off(family):
        return None
    built = _state.get(family)
    if built is not None and "lib" in built:  # the per-op fast path: no lock once built
        return built["lib"]  # type: ignore[return-value]
    with _lock:
        state = _state.setdefault(family, {})
        if "lib" not in state and "error" not in state:
            try:
                state["lib"] = _build(family)
            except NotThisMachine as e:
                state["error"] = str(e)
            except (OSError, RuntimeError) as e:  # this machine should have had them
                state["error"] = str(e)
                logger.warning("engine-cpu: the compiled %s kernels are unavailable: %s", family, e)
        return state.get("lib")  # type: ignore[return-value]


def unavailable_reason(family: str = "amx") -> str | None:
    """Why ``load(family)`` returned None (None when it has not, or has not been called)."""
    off = _turned_off(family)
    if off:
        return off
    return _state.get(family, {}).get("error")  # type: ignore[return-value]
