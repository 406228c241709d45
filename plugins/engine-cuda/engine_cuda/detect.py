"""Counting NVIDIA GPUs without creating a CUDA context.

Tried in order, stopping at the first that answers: the driver's ``/proc/driver/nvidia/gpus``
directory, NVML through ``pynvml`` (from the ``nvidia-ml-py`` package, when installed), and
``nvidia-smi -L``. ``/proc`` comes first because reading it maps no library into the process:
on the H200 machine (driver 580), with NVML probed first, the conformance kit's
detection-is-cheap check found ``libcuda.so`` mapped after detection; with ``/proc`` first it
passes. Each failure is kept as a note for the "why not" message.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

PROC_GPUS = Path("/proc/driver/nvidia/gpus")


def _nvml_count() -> tuple[int | None, str]:
    try:
        import pynvml
    except ImportError:
        return None, "pynvml not installed"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return None, f"NVML unavailable ({exc})"
    try:
        return int(pynvml.nvmlDeviceGetCount()), "NVML"
    except Exception as exc:
        return None, f"NVML could not count devices ({exc})"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _proc_count() -> tuple[int | None, str]:
    if not PROC_GPUS.is_dir():
        return None, f"{PROC_GPUS.parent} absent (no NVIDIA driver loaded)"
    try:
        return len(list(PROC_GPUS.iterdir())), str(PROC_GPUS)
    except OSError as exc:
        return None, f"cannot read {PROC_GPUS} ({exc})"


def _smi_count() -> tuple[int | None, str]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None, "nvidia-smi not found"
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"nvidia-smi -L failed ({exc})"
    if out.returncode != 0:
        return None, f"nvidia-smi -L exited {out.returncode}: {out.stderr.strip()[:200]}"
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU ")), "nvidia-smi"


def nvidia_gpu_count() -> tuple[int, str]:
    """``(count, how)``: the number of NVIDIA GPUs the driver sees and which probe said so;
    ``(0, notes)`` with every probe's failure when none could tell."""
    notes = []
    for probe in (_proc_count, _nvml_count, _smi_count):
        count, how = probe()
        if count is not None:
            return count, how
        notes.append(how)
    return 0, "; ".join(notes)
