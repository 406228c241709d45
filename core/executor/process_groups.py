"""A worker's torch.distributed process groups and the communicators over them.

Every rank of a replica joins one world group (the platform's ``dist_backend``: gloo on the
CPU, NCCL on CUDA, ...), then the tensor-parallel group of its pipeline stage and the pipeline
group of its tensor-parallel rank (vLLM's layout: ``rank = pp_rank * tp_size + tp_rank``). The
layers and the runner see only the resulting ``ParallelContext`` and its communicators.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any

from engine.parallel import ParallelContext

if TYPE_CHECKING:
    import torch

    from engine.distributed import Communicator
    from engine.platforms.interface import Platform
    from engine.plugins import PluginManager


def communicator_for(plugins: PluginManager, platform: type[Platform], group: Any) -> Communicator:
    """The communicator that runs ``platform``'s collectives over ``group``: what a plugin's
    ``engine_communicator`` hook answers, else the platform's own (``Platform.communicator``,
    torch.distributed on its ``dist_backend``). The one place a worker obtains them."""
    return plugins.communicator(platform, group)


def init_parallel_context(
    plugins: PluginManager,
    platform: type[Platform],
    rank: int,
    tp_size: int,
    pp_size: int,
    init_method: str,
    device: torch.device,
    timeout_s: float = 1800.0,
    enable_expert_parallel: bool = False,
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
        tp=communicator_for(plugins, platform, tp_group),
        pp=communicator_for(plugins, platform, pp_group),
        world=communicator_for(plugins, platform, None),
        enable_expert_parallel=enable_expert_parallel,
    )


def destroy_process_groups() -> None:
    """Leave torch.distributed (idempotent)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
