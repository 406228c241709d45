"""The CPU platform: host RAM as device memory, gloo for collectives."""

from __future__ import annotations

import platform as _platform
import sys
from pathlib import Path
from typing import Any, ClassVar

from engine.platforms.interface import Platform
from engine_cpu.cpuinfo import cpuinfo_field

_PROC_STATUS = Path("/proc/self/status")
_PROC_CLEAR_REFS = Path("/proc/self/clear_refs")


def _cpu_model_name() -> str:
    return cpuinfo_field("model name") or _platform.processor() or _platform.machine() or "cpu"


def _vm_hwm_bytes() -> int | None:
    """Peak resident set size (VmHWM) from /proc on Linux, else None."""
    try:
        for line in _PROC_STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _native_bf16() -> bool:
    """Whether this CPU has native bf16 arithmetic (AVX512-BF16 or AMX), by torch's own
    feature probes (private: absent ones count as no)."""
    import torch

    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


class CpuPlatform(Platform):
    """Runs on the host CPU. Always available, lowest priority (0).

    Memory profiling reports host RAM (psutil): ``total_memory`` is the machine's RAM,
    ``free_memory`` what the OS reports as available, and ``peak_memory`` the process's peak
    resident set size since ``reset_peak_memory`` (Linux resets it through
    ``/proc/self/clear_refs``; elsewhere the peak is since process start).
    """

    name: ClassVar[str] = "cpu"
    device_type: ClassVar[str] = "cpu"
    dist_backend: ClassVar[str] = "gloo"
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")
    priority: ClassVar[int] = 0
    supports_graph_capture: ClassVar[bool] = False

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        return []

    @classmethod
    def default_dtype(cls) -> str:
        """bfloat16 on CPUs with native bf16 arithmetic (AVX512-BF16 or AMX), where oneDNN's
        bf16 matmuls run about twice as fast as float32 on half the bytes (docs/benchmarks.md);
        float32 elsewhere, where bf16 is emulated and slower."""
        return "bfloat16" if _native_bf16() else "float32"

    @classmethod
    def emulated_dtypes(cls) -> tuple[str, ...]:
        """bfloat16 on a CPU without AVX512-BF16 or AMX: there its matmuls ran 2-5x slower
        than float32's at 16 rows (an AVX2-only AMD EPYC, docs/benchmarks.md)."""
        return () if _native_bf16() else ("bfloat16",)

    @classmethod
    def device_count(cls) -> int:
        return 1

    @classmethod
    def device_name(cls, index: int = 0) -> str:
        return _cpu_model_name()

    @classmethod
    def total_memory(cls, index: int = 0) -> int:
        import psutil

        return int(psutil.virtual_memory().total)

    @classmethod
    def free_memory(cls, index: int = 0) -> int:
        import psutil

        return int(psutil.virtual_memory().available)

    @classmethod
    def reset_peak_memory(cls, index: int = 0) -> None:
        # Writing "5" to clear_refs resets the kernel's peak RSS (VmHWM) to the current RSS.
        try:
            _PROC_CLEAR_REFS.write_text("5")
        except OSError:
            pass

    @classmethod
    def peak_memory(cls, index: int = 0) -> int:
        peak = _vm_hwm_bytes()
        if peak is not None:
            return peak
        import psutil

        rss = int(psutil.Process().memory_info().rss)
        try:
            import resource

            maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            # ru_maxrss is in KiB on Linux and in bytes on macOS.
            return max(rss, maxrss if sys.platform == "darwin" else maxrss * 1024)
        except (ImportError, OSError):
            return rss

    @classmethod
    def decode_graphs_class(cls) -> type | None:
        """Native plans (``engine_cpu.plan``): each decode batch size recorded on first use and
        then run by one call into the compiled kernels, where they build (x86-64 with AVX2)."""
        from engine_cpu import native

        if native.load("avx2") is None:
            return None
        from engine_cpu.plan import CpuDecodePlans

        return CpuDecodePlans

    @classmethod
    def default_attention_backends(cls, config: Any = None) -> list[str]:
        # The compiled decode path where it builds (x86-64 with AVX2), else the reference.
        return ["cpu", "torch"]
