"""A worker's torch.distributed process groups and the communicators over them.

Every rank of a replica joins one world group (the platform's ``dist_backend``: gloo on the
CPU, NCCL on CUDA, ...), then the tensor-parallel group of its pipeline stage and the pipeline
group of its tensor-parallel rank (vLLM's layout: ``rank = pp_rank * tp_size + tp_rank``). The
layers and the runner see only the resulting ``ParallelContext`` and its communicators.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any

from engine.distributed import TorchDistributedCommunicator
from engine.parallel import ParallelContext

if TYPE_CHECKING:
    import torch

    from engine.distributed import Communicator
    from engine.platforms.interface import Platform


def communicator_for(platform: type[Platform], group: Any) -> Communicator:
    """The communicator that runs ``platform``'s collectives over ``group``.

    The one place a worker obtains its communicators: once the ``engine_communicator`` plugin
    hook is in (``PluginManager.communicator(platform, group)``), this returns what it answers
    and ``_GroupRankCommunicator`` goes away."""
    communicator = platform.communicator(group)
    if type(communicator) is TorchDistributedCommunicator:
        return _GroupRankCommunicator(group)
    return communicator


class _GroupRankCommunicator(TorchDistributedCommunicator):
    """``TorchDistributedCommunicator`` with the two parts of the communicator contract that
    tensor and pipeline parallelism need and the current class lacks: ``all_reduce(op=...)``
    (``"sum"``, ``"max"``, ``"min"``) and ``src``/``dst`` as ranks *within the group*
    (torch.distributed's point-to-point calls take global ranks, which differ on a pipeline
    group of a tensor-parallel rank other than 0)."""

    _OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}

    def _global(self, group_rank: int) -> int:
        import torch.distributed as dist

        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if op not in self._OPS:
            raise ValueError(f"unknown reduce op {op!r}; allowed: {', '.join(self._OPS)}")
        if self.world_size == 1:
            return tensor
        import torch.distributed as dist

        dist.all_reduce(tensor, op=getattr(dist.ReduceOp, self._OPS[op]), group=self.group)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        import torch.distributed as dist

        dist.broadcast(tensor, src=self._global(src), group=self.group)
        return tensor

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        import torch.distributed as dist

        dist.send(tensor.contiguous(), dst=self._global(dst), group=self.group)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        import torch.distributed as dist

        dist.recv(tensor, src=self._global(src), group=self.group)
        return tensor


def init_parallel_context(
    platform: type[Platform],
    rank: int,
    tp_size: int,
    pp_size: int,
    init_method: str,
    device: torch.device,
    timeout_s: float = 1800.0,
) -> ParallelContext:
    """Join the replica's process groups and return this rank's ``ParallelContext``.

    Every rank calls this with the same sizes and ``init_method`` (a ``tcp://host:port``
    rendezvous hosted by rank 0). Groups are created in the same order on every rank, as
    torch.distributed requires."""
    import torch.distributed as dist

    world_size = tp_size * pp_size
    kwargs: dict[str, Any] = {}
    if device.type != "cpu":
        kwargs["device_id"] = device  # binds NCCL to this rank's device up front
    dist.init_process_group(
        platform.dist_backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **kwargs,
    )
    tp_rank, pp_rank = rank % tp_size, rank // tp_size
    tp_group = pp_group = None
    for stage in range(pp_size):
        ranks = [stage * tp_size + t for t in range(tp_size)]
        group = dist.new_group(ranks) if tp_size < world_size else None
        if stage == pp_rank:
            tp_group = group
    for t in range(tp_size):
        ranks = [stage * tp_size + t for stage in range(pp_size)]
        group = dist.new_group(ranks) if pp_size < world_size else None
        if t == tp_rank:
            pp_group = group
    return ParallelContext(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=pp_rank,
        pp_size=pp_size,
        tp=communicator_for(platform, tp_group),
        pp=communicator_for(platform, pp_group),
        world=communicator_for(platform, None),
    )


def destroy_process_groups() -> None:
    """Leave torch.distributed (idempotent)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
