"""Device facts and memory profiling through ``torch.cuda``, shared by every platform whose
torch build exposes that API (CUDA, and ROCm through HIP's torch.cuda)."""

from __future__ import annotations

from engine.platforms.interface import Platform


class TorchCudaPlatform(Platform):
    """A ``Platform`` whose device queries and memory profiling go through ``torch.cuda``.

    Subclasses add detection (``unavailable_reasons``) and their device names; torch is imported
    only inside the methods, which run on the chosen platform alone.
    """

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
