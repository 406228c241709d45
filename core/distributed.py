"""The ``Communicator`` interface for collectives, with a torch.distributed implementation."""

from __future__ import annotations

from typing import Any


class Communicator:
    """Collectives among the ranks of one process group.

    Platforms return one from ``Platform.communicator(group)``. All tensor arguments live on the
    platform's device. ``world_size == 1`` makes every operation a cheap identity, so single-device
    runs need no process group.
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group

    @property
    def world_size(self) -> int:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return 1
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return 0
        return dist.get_rank(self.group)

    def all_reduce(self, tensor):
        raise NotImplementedError

    def all_gather(self, tensor, dim: int = 0):
        raise NotImplementedError

    def reduce_scatter(self, tensor, dim: int = 0):
        raise NotImplementedError

    def broadcast(self, tensor, src: int = 0):
        raise NotImplementedError

    def send(self, tensor, dst: int) -> None:
        raise NotImplementedError

    def recv(self, tensor, src: int):
        raise NotImplementedError


class TorchDistributedCommunicator(Communicator):
    """Collectives through ``torch.distributed`` on whatever backend the group was created with
    (gloo on CPU, nccl on CUDA, rccl on ROCm)."""

    def all_reduce(self, tensor):
        if self.world_size == 1:
            return tensor
        import torch.distributed as dist

        dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, tensor, dim: int = 0):
        if self.world_size == 1:
            return tensor
        import torch
        import torch.distributed as dist

        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, tensor, dim: int = 0):
        if self.world_size == 1:
            return tensor
        import torch
        import torch.distributed as dist

        chunks = [c.contiguous() for c in tensor.chunk(self.world_size, dim=dim)]
        out = torch.empty_like(chunks[0])
        dist.reduce_scatter(out, chunks, group=self.group)
        return out

    def broadcast(self, tensor, src: int = 0):
        if self.world_size == 1:
            return tensor
        import torch.distributed as dist

        dist.broadcast(tensor, src=src, group=self.group)
        return tensor

    def send(self, tensor, dst: int) -> None:
        import torch.distributed as dist

        dist.send(tensor, dst=dst, group=self.group)

    def recv(self, tensor, src: int):
        import torch.distributed as dist

        dist.recv(tensor, src=src, group=self.group)
        return tensor
