"""The ROCm platform: HIP build of torch, amdsmi/KFD detection, RCCL, torch.cuda memory APIs."""

from __future__ import annotations

from typing import Any, ClassVar

from engine.platforms.detect import torch_build, visible_devices_hidden
from engine.platforms.torch_cuda import TorchCudaPlatform
from engine_rocm.detect import amd_gpu_count

_VISIBILITY_VARIABLES = ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")


class RocmPlatform(TorchCudaPlatform):
    """AMD GPUs through a ROCm (HIP) build of torch. Priority 100 (a built-in accelerator).

    torch exposes HIP devices under the ``cuda`` device type and the ``torch.cuda`` API, and
    RCCL under the ``nccl`` distributed backend name; this platform uses them as such.
    Detection reads ``torch.version.hip`` from the build (without importing torch when it is
    not imported yet) and counts GPUs with amdsmi or the KFD topology, without initialising HIP.
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
            count, how = amd_gpu_count()
            if count == 0:
                reasons.append(f"no AMD GPU found ({how})")
        return reasons

    @classmethod
    def device_name(cls, index: int = 0) -> str:
        import torch

        props = torch.cuda.get_device_properties(index)
        arch = getattr(props, "gcnArchName", "")
        return f"{props.name} ({arch})" if arch else props.name

    @classmethod
    def default_attention_backends(cls, config: Any = None) -> list[str]:
        return ["triton", "torch"]
