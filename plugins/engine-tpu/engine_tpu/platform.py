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


def _pjrt_cpu() -> bool:
    """torch_xla's CPU device (PJRT_DEVICE=CPU): memory is the host's."""
    return os.environ.get("PJRT_DEVICE", "").strip().upper() == "CPU"


def _memory_info(index: int) -> dict[str, Any]:
    import torch_xla.core.xla_model as xm

    return dict(xm.get_memory_info(TpuPlatform.torch_device(index)))


def _vm_hwm_bytes() -> int:
    """Peak resident set size of this process (VmHWM), for XLA's CPU device."""
    try:
        for line in open("/proc/self/status").read().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import psutil

    return int(psutil.Process().memory_info().rss)


class TpuPlatform(Platform):
    """TPUs through torch_xla's PJRT runtime. Priority 100 (a built-in accelerator).

    Available when torch_xla is importable and a PJRT device is selected: ``PJRT_DEVICE=TPU``
    (or unset on a TPU VM, where torch_xla picks the TPU) or ``PJRT_DEVICE=CPU`` (torch_xla's
    CPU device, for testing the XLA path). XLA compiles one graph per input shape, so the
    platform asks the model runner for static shapes (``shape_buckets``: token counts, sequence
    counts and block-table widths padded to powers of two). Memory comes from
    ``xm.get_memory_info`` (on the CPU device, which has no allocator statistics, from the
    host: RAM and the process's peak resident set);
    collectives from ``engine_tpu.communicator.XlaCommunicator`` (through the plugin's
    ``engine_communicator`` hook).
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
        import torch_xla

        if hasattr(torch_xla, "device"):  # torch_xla >= 2.5 (xm.xla_device is deprecated)
            return torch_xla.device(index)
        import torch_xla.core.xla_model as xm

        return xm.xla_device(index)

    @classmethod
    def total_memory(cls, index: int = 0) -> int:
        if _pjrt_cpu():
            import psutil

            return int(psutil.virtual_memory().total)
        info = _memory_info(index)
        if "bytes_limit" in info:
            return int(info["bytes_limit"])
        return int(info["kb_total"]) * 1024  # torch_xla < 2.3

    @classmethod
    def free_memory(cls, index: int = 0) -> int:
        if _pjrt_cpu():
            import psutil

            return int(psutil.virtual_memory().available)
        info = _memory_info(index)
        if "bytes_limit" in info:
            return int(info["bytes_limit"]) - int(info["bytes_used"])
        return int(info["kb_free"]) * 1024  # torch_xla < 2.3

    @classmethod
    def reset_peak_memory(cls, index: int = 0) -> None:
        # A TPU's runtime keeps a process-lifetime peak only; on the CPU device the kernel's
        # peak RSS can be reset (Linux: "5" to /proc/self/clear_refs).
        if _pjrt_cpu():
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                pass

    @classmethod
    def peak_memory(cls, index: int = 0) -> int:
        if _pjrt_cpu():
            return _vm_hwm_bytes()
        info = _memory_info(index)
        if "peak_bytes_used" in info:
            return int(info["peak_bytes_used"])
        if "bytes_used" in info:
            return int(info["bytes_used"])
        return (int(info["kb_total"]) - int(info["kb_free"])) * 1024

    @classmethod
    def synchronize(cls, index: int = 0) -> None:
        """Run the pending lazy graph, then wait for the device (waiting alone would not run
        what is still only traced)."""
        import torch_xla
        import torch_xla.core.xla_model as xm

        if hasattr(torch_xla, "sync"):
            torch_xla.sync()
        else:  # torch_xla < 2.5
            xm.mark_step()
        xm.wait_device_ops()

    @classmethod
    def default_attention_backends(cls, config: Any = None) -> list[str]:
        # The Pallas kernel on TPUs; the static-shape XLA backend elsewhere (XLA's CPU device).
        return ["pallas", "xla"]

    @classmethod
    def shape_buckets(cls, config: Any):
        """Powers of two up to the scheduler's limits: one graph per bucket combination."""
        from engine.shape_buckets import ShapeBuckets

        sched = config.scheduler
        max_len = config.model.max_model_len or sched.max_num_batched_tokens
        max_blocks = -(-max_len // config.cache.block_size)
        return ShapeBuckets.for_limits(
            sched.max_num_batched_tokens, sched.max_num_seqs, max(1, max_blocks)
        )
