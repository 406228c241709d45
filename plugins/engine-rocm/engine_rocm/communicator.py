"""RCCL collectives for the rocm platform.

A ROCm build of torch ships RCCL under the ``nccl`` torch.distributed backend name (the same
``ProcessGroupNCCL`` code, compiled against RCCL through HIP), so the collectives are
``TorchDistributedCommunicator``'s; this class only names them truthfully and checks, on first
use, that the torch build really is a ROCm one (NCCL on a CUDA build would be another platform).
"""

from __future__ import annotations

from typing import Any

from engine.distributed import TorchDistributedCommunicator


class RcclCommunicator(TorchDistributedCommunicator):
    """torch.distributed over RCCL (backend name ``nccl``) on AMD GPUs."""

    def __init__(self, group: Any = None) -> None:
        super().__init__(group, backend="nccl")
        self._hip_checked = False

    def _ready(self) -> Any:
        if not self._hip_checked:
            import torch

            if not getattr(torch.version, "hip", None):
                raise RuntimeError(
                    f"the rocm platform's RCCL communicator needs a ROCm build of torch; "
                    f"torch {torch.__version__} has no HIP (torch.version.hip is None)"
                )
            self._hip_checked = True
        return super()._ready()

    def describe(self) -> str:
        return f"RCCL through torch.distributed 'nccl' ({type(self).__module__}:RcclCommunicator)"
