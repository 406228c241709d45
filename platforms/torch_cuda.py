"""Device facts and memory profiling through ``torch.cuda``, shared by every platform whose
torch build exposes that API (CUDA, and ROCm through HIP's torch.cuda)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.platforms.interface import Platform

if TYPE_CHECKING:
    from engine.config import EngineConfig

# A device with at least this much memory (H100, H200, MI300...) gets the large step limits:
# its KV cache holds enough tokens for 1024 running requests, and its compute keeps a 16k-token
# prefill step short. Below it (24-48 GB cards) the generic 256 / 8192 stay.
LARGE_DEVICE_BYTES = 70 * 2**30


class TorchCudaPlatform(Platform):
    """A ``Platform`` whose device queries and memory profiling go through ``torch.cuda``.

    Subclasses add detection (``unavailable_reasons``) and their device names; torch is imported
    only inside the methods, which run on the chosen platform alone.
    """

    @classmethod
    def scheduler_defaults(cls, config: EngineConfig) -> tuple[int, int] | None:
        """1024 requests on a large device; 16384 batched tokens offline, where only the
        throughput counts, and 8192 for a server, where a step's prefill tokens lengthen every
        running stream's inter-token gap (docs/kv-cache-and-scheduler.md, "Scheduling")."""
        if cls.total_memory(0) < LARGE_DEVICE_BYTES:
            return super().scheduler_defaults(config)
        return 1024, (16384 if config.scheduler.usage == "offline" else 8192)

    @classmethod
    def device_count(cls) -> int:
        import torch

        return torch.cuda.device_count()

    @classmethod
    def device_capability(cls, index: int = 0) -> tuple[int, int] | None:
        import torch

        return tuple(torch.cuda.get_device_capability(index))  # type: ignore[return-value]

    @classmethod
    def total_memory(cls, index: int = 0) -> int:
        import torch

        return int(torch.cuda.mem_get_info(index)[1])

    @classmethod
    def free_memory(cls, index: int = 0) -> int:
        import torch

        return int(torch.cuda.mem_get_info(index)[0])

    @classmethod
    def reset_peak_memory(cls, index: int = 0) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats(index)

    @classmethod
    def peak_memory(cls, index: int = 0) -> int:
        import torch

        return int(torch.cuda.max_memory_allocated(index))

    @classmethod
    def synchronize(cls, index: int = 0) -> None:
        import torch

        torch.cuda.synchronize(index)
