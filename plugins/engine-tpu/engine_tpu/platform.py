"""The TPU platform: torch_xla with a PJRT device; xm collectives and memory info."""

from __future__ import annotations

import glob
import os
from typing import Any, ClassVar

from engine.platforms.detect import module_available
from engine.platforms.interface import Platform

# PJRT devices this platform drives: real TPUs, and torch_xla's CPU device (used to test the
# XLA path without a TPU). GPUs through PJRT are left to the cuda platform.
_PJRT_DEVICES = ("TPU", "CPU")


def _tpu_present() -> bool:
    """A TPU VM: libtpu is installed or TPU device nodes exist (what torch_xla itself checks
    before defaulting PJRT_DEVICE to TPU)."""
    return module_available("libtpu") or bool(
        glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")
    )


def _memory_info(index: int) -> dict[str, Any]:
    import torch_xla.core.xla_model as xm

    return dict(xm.get_memory_info(TpuPlatform.torch_device(index)))


class TpuPlatform(Platform):
    """TPUs through torch_xla's PJRT runtime. Priority 100 (a built-in accelerator).

    Available when torch_xla is importable and a PJRT device is selected: ``PJRT_DEVICE=TPU``
    (or unset on a TPU VM, where torch_xla picks the TPU) or ``PJRT_DEVICE=CPU`` (torch_xla's
    CPU device, for testing the XLA path). Memory comes from ``xm.get_memory_info``;
    collectives from ``engine_tpu.communicator.XlaCommunicator``.
    """

    name: ClassVar[str] = "tpu"
    device_type: ClassVar[str] = "xla"
    dist_backend: ClassVar[str] = "xla"
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")
    priority: ClassVar[int] = 100
    supports_graph_capture: ClassVar[bool] = False

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        reasons = []
        if not module_available("torch_xla"):
            reasons.append("torch_xla is not installed (pip install engine-llm-tpu[tpu])")
        pjrt = os.environ.get("PJRT_DEVICE", "").strip()
        if pjrt:
            if pjrt.upper() not in _PJRT_DEVICES:
                reasons.append(
                    f"PJRT_DEVICE={pjrt} is not a TPU or CPU PJRT device (for GPUs use the cuda "
                    "platform)"
                )
        elif not _tpu_present():
            reasons.append(
                "no PJRT device: PJRT_DEVICE is unset and no TPU was found (no libtpu, no "
                "/dev/accel*); set PJRT_DEVICE=TPU on a TPU VM or PJRT_DEVICE=CPU for "
                "torch_xla's CPU device"
            )
        return reasons

    @classmethod
    def device_count(cls) -> int:
        import torch_xla.runtime as xr

        return int(xr.addressable_runtime_device_count())

    @classmethod
    def device_name(cls, index: int = 0) -> str:
        import torch_xla.core.xla_model as xm

        return str(xm.xla_device_hw(cls.torch_device(index)))

    @classmethod
    def torch_device(cls, index: int = 0):
        import torch_xla.core.xla_model as xm

        return xm.xla_device(index)

    @classmethod
    def total_memory(cls, index: int = 0) -> int:
        info = _memory_info(index)
        if "bytes_limit" in info:
            return int(info["bytes_limit"])
        return int(info["kb_total"]) * 1024  # torch_xla < 2.3

    @classmethod
    def free_memory(cls, index: int = 0) -> int:
        info = _memory_info(index)
        if "bytes_limit" in info:
            return int(info["bytes_limit"]) - int(info["bytes_used"])
        return int(info["kb_free"]) * 1024  # torch_xla < 2.3

    @classmethod
    def reset_peak_memory(cls, index: int = 0) -> None:
        # XLA keeps a process-lifetime peak only; nothing to reset.
        pass

    @classmethod
    def peak_memory(cls, index: int = 0) -> int:
        info = _memory_info(index)
        if "peak_bytes_used" in info:
            return int(info["peak_bytes_used"])
        if "bytes_used" in info:
            return int(info["bytes_used"])
        return (int(info["kb_total"]) - int(info["kb_free"])) * 1024

    @classmethod
    def synchronize(cls, index: int = 0) -> None:
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()

    @classmethod
    def default_attention_backends(cls, config: Any = None) -> list[str]:
        return ["torch"]

    @classmethod
    def communicator(cls, group: Any = None):
        from engine_tpu.communicator import XlaCommunicator

        return XlaCommunicator(group)
