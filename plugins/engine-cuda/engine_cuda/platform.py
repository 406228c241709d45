"""The CUDA platform: detection through NVML/the driver, memory through torch.cuda, NCCL."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from engine.platforms.detect import torch_build, visible_devices_hidden
from engine.platforms.torch_cuda import TorchCudaPlatform
from engine_cuda.detect import nvidia_gpu_count

if TYPE_CHECKING:
    from engine.config import EngineConfig


class CudaPlatform(TorchCudaPlatform):
    """NVIDIA GPUs through a CUDA build of torch. Priority 100 (a built-in accelerator).

    Detection never creates a CUDA context: it reads the torch build from ``torch/version.py``
    and counts GPUs through NVML, ``/proc/driver/nvidia`` or ``nvidia-smi -L``. Everything else
    (device facts, memory profiling) runs only once the platform is chosen and uses torch.cuda:
    ``mem_get_info`` for free/total memory, ``max_memory_allocated`` after
    ``reset_peak_memory_stats`` for the peak of a profiling pass.
    """

    name: ClassVar[str] = "cuda"
    device_type: ClassVar[str] = "cuda"
    dist_backend: ClassVar[str] = "nccl"
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16", "float16")
    priority: ClassVar[int] = 100
    supports_graph_capture: ClassVar[bool] = True
    device_control_env_var: ClassVar[str | None] = "CUDA_VISIBLE_DEVICES"

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        reasons = []
        build = torch_build()
        if not build.installed:
            reasons.append("torch is not installed")
        elif build.hip:
            reasons.append(f"{build.describe()} is a ROCm build (use the rocm platform)")
        elif not build.cuda:
            reasons.append(f"{build.describe()} has no CUDA support; install a CUDA build of torch")
        if visible_devices_hidden("CUDA_VISIBLE_DEVICES"):
            reasons.append("CUDA_VISIBLE_DEVICES hides every GPU")
        else:
            count, how = nvidia_gpu_count()
            if count == 0:
                reasons.append(f"no NVIDIA GPU found ({how})")
        return reasons

    # ---- device facts (memory profiling comes from TorchCudaPlatform) -------------------
    @classmethod
    def device_name(cls, index: int = 0) -> str:
        import torch

        return torch.cuda.get_device_name(index)

    # ---- engine integration -------------------------------------------------------------
    @classmethod
    def default_attention_backends(cls, config: Any = None) -> list[str]:
        # "triton" comes from engine-llm-triton; "flash-attn" (when flash_attn is installed) and
        # "sdpa" from this plugin; "torch" is the portable reference and always installed.
        return ["triton", "flash-attn", "sdpa", "torch"]

    @classmethod
    def check_config(cls, config: EngineConfig) -> list[str]:
        reasons = super().check_config(config)
        if config.model.dtype == "bfloat16":
            capability = cls.device_capability()
            if capability is not None and capability < (8, 0):
                reasons.append(
                    f"bfloat16 needs compute capability 8.0 or newer; this GPU has "
                    f"{capability[0]}.{capability[1]} (use --dtype float16)"
                )
        return reasons
