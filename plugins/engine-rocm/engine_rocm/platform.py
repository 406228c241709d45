"""The ROCm platform: HIP build of torch, amdsmi/KFD/rocm-smi detection, gfx architecture as the
capability, RCCL, torch.cuda memory APIs, Triton attention tuned per gfx family."""

from __future__ import annotations

from typing import Any, ClassVar

from engine.platforms.detect import torch_build, visible_devices_hidden
from engine.platforms.torch_cuda import TorchCudaPlatform
from engine_rocm import gfx
from engine_rocm.detect import amd_gpus

_VISIBILITY_VARIABLES = ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")


class RocmPlatform(TorchCudaPlatform):
    """AMD GPUs through a ROCm (HIP) build of torch. Priority 100 (a built-in accelerator).

    torch exposes HIP devices under the ``cuda`` device type and the ``torch.cuda`` API, and
    RCCL under the ``nccl`` distributed backend name; this platform uses them as such.
    Detection reads ``torch.version.hip`` from the build (without importing torch when it is
    not imported yet) and finds GPUs with amdsmi, the KFD topology or rocm-smi, without
    initialising HIP. The capability is the gfx architecture's ``(major, minor)`` (gfx942 ->
    (9, 4)); ``gfx_arch(i)`` gives the name, which also picks the fp8 flavour (fnuz on MI300)
    and the Triton tuning table.
    """

    name: ClassVar[str] = "rocm"
    device_type: ClassVar[str] = "cuda"
    dist_backend: ClassVar[str] = "nccl"  # RCCL, under torch's name for it
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16", "float16")
    priority: ClassVar[int] = 100
    supports_graph_capture: ClassVar[bool] = True
    # HIP honours CUDA_VISIBLE_DEVICES too, but ROCm's own variable is the documented one.
    device_control_env_var: ClassVar[str | None] = "HIP_VISIBLE_DEVICES"

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        reasons = []
        build = torch_build()
        if not build.installed:
            reasons.append("torch is not installed")
        elif not build.hip:
            reasons.append(f"{build.describe()} is not a ROCm build; install a ROCm build of torch")
        hidden = [v for v in _VISIBILITY_VARIABLES if visible_devices_hidden(v)]
        if hidden:
            reasons.append(f"{hidden[0]} hides every GPU")
        else:
            gpus = amd_gpus()
            if gpus.count == 0:
                reasons.append(f"no AMD GPU found ({gpus.how})")
        return reasons

    # ---- device facts ---------------------------------------------------------------------
    @classmethod
    def gfx_arch(cls, index: int = 0) -> str:
        """The device's gfx architecture (``"gfx942"``): from torch once it is imported (the
        platform is chosen), else from the management probes, without a HIP context."""
        import sys

        torch = sys.modules.get("torch")
        if torch is not None and getattr(torch.version, "hip", None):
            name = getattr(torch.cuda.get_device_properties(index), "gcnArchName", "") or ""
            if name:
                return name.split(":")[0]
        archs = amd_gpus().archs
        if index < len(archs):
            return archs[index]
        raise RuntimeError(f"cannot tell the gfx architecture of AMD GPU {index}")

    @classmethod
    def device_name(cls, index: int = 0) -> str:
        import torch

        props = torch.cuda.get_device_properties(index)
        arch = getattr(props, "gcnArchName", "")
        return f"{props.name} ({arch})" if arch else props.name

    @classmethod
    def device_capability(cls, index: int = 0) -> tuple[int, int] | None:
        return gfx.capability(cls.gfx_arch(index))

    @classmethod
    def fp8_dtype(cls, index: int = 0) -> str | None:
        """float8_e4m3fnuz on CDNA3 (MI300), the OCP float8_e4m3fn on CDNA4 and RDNA4, None on
        GPUs without fp8 units (``engine_rocm.gfx.FP8_BY_FAMILY``)."""
        return gfx.fp8_dtype(cls.gfx_arch(index))

    # ---- engine integration ---------------------------------------------------------------
    @classmethod
    def default_attention_backends(cls, config: Any = None) -> list[str]:
        # engine-triton's kernels with AMD launch configurations, then untuned, then the
        # portable reference.
        return ["triton-rocm", "triton", "torch"]
