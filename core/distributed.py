"""The ``Communicator`` contract for collectives, and its torch.distributed implementation.

A communicator runs collectives among the ranks of one process group. Platforms supply theirs
through the ``engine_communicator(platform, group)`` hook (``engine.hookspecs``); parallel
layers and executors only ever talk to this interface, never to ``torch.distributed`` directly,
so a platform whose collectives live elsewhere (XLA, a vendor library) plugs in unchanged.

The contract (plugin API 1.1), for every implementation:

* ``group`` is the platform's process-group handle, as created by whoever started the ranks:
  a ``torch.distributed`` ``ProcessGroup`` on torch.distributed platforms (``None``: the default
  group, every rank), an XLA replica-group list such as ``[[0, 1], [2, 3]]`` on XLA (``None``:
  every replica).
* ``rank`` and ``world_size`` are *within the group*; ``src``/``dst`` arguments are group ranks.
* Every rank of the group makes the same calls in the same order (SPMD); all tensors live on the
  platform's device.
* Results are *returned*. An implementation may work in place (torch.distributed does) or make
  a new tensor (XLA does): always use the return value, and treat the input as consumed.
* With ``world_size == 1`` (no process group at all) every collective is a cheap identity, so
  single-device runs need no group; ``send``/``recv`` need a peer and are errors there.
* Constructing a communicator is cheap and touches no device (``engine plugins`` builds one per
  platform to show it); the first collective may initialise what it needs.

Operations: ``all_reduce`` (sum, max or min), ``all_gather`` and ``reduce_scatter`` along a
dimension, ``broadcast``, point-to-point ``send``/``recv``, and ``all_to_all`` (equal splits,
for expert parallelism; the base class derives it from ``all_gather``, so implementing it is
optional).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

REDUCE_OPS = ("sum", "max", "min")


def check_reduce_op(op: str) -> str:
    """``op`` if it is one of ``REDUCE_OPS``, else a ``ValueError`` saying what is allowed."""
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r}; allowed: {', '.join(REDUCE_OPS)}")
    return op


class Communicator(ABC):
    """Collectives among the ranks of one process group (see the module docstring for the
    contract every implementation follows).

    Subclass it in a plugin and return an instance from ``engine_communicator``; implement
    ``world_size``, ``rank`` and the six collectives. ``all_to_all`` has a generic default.
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group

    @property
    @abstractmethod
    def world_size(self) -> int:
        """Number of ranks in the group (1 without a process group)."""

    @property
    @abstractmethod
    def rank(self) -> int:
        """This process's rank within the group, ``0 <= rank < world_size``."""

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Element-wise reduction (``"sum"``, ``"max"`` or ``"min"``) of ``tensor`` over all
        ranks; every rank gets the result."""

    @abstractmethod
    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Every rank's ``tensor`` (same shape everywhere) concatenated along ``dim`` in rank
        order."""

    @abstractmethod
    def reduce_scatter(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """The sum over ranks of ``tensor``, split into ``world_size`` equal chunks along
        ``dim``; rank ``r`` gets chunk ``r``. ``tensor.shape[dim]`` must divide evenly."""

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``tensor`` on every rank (each rank passes a tensor of the same shape
        and dtype)."""

    @abstractmethod
    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send ``tensor`` to rank ``dst``, which must call ``recv(..., src=this rank)``."""

    @abstractmethod
    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Receive from rank ``src`` a tensor of ``tensor``'s shape and dtype (``tensor`` is the
        buffer on in-place runtimes); returns what arrived."""

    def all_to_all(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Split ``tensor`` into ``world_size`` equal chunks along ``dim`` and send chunk ``i``
        to rank ``i``; returns the chunks received from ranks ``0..world_size-1`` concatenated
        along ``dim``. ``tensor.shape[dim]`` must divide evenly.

        This default gathers every rank's whole tensor and keeps what is addressed here
        (``world_size`` times the traffic of a real all-to-all); override it where the runtime
        has one.
        """
        n = self.world_size
        if n == 1:
            return tensor
        _check_divisible(tensor, dim, n, "all_to_all")
        import torch

        gathered = self.all_gather(tensor.unsqueeze(0), dim=0)  # [n, *tensor.shape]
        mine = [gathered[r].chunk(n, dim=dim)[self.rank] for r in range(n)]
        return torch.cat(mine, dim=dim)

    def describe(self) -> str:
        """A one-line description for ``engine plugins`` (class and, where known, backend)."""
        return f"{type(self).__module__}:{type(self).__qualname__}"


def _check_divisible(tensor: torch.Tensor, dim: int, n: int, op: str) -> None:
    if tensor.shape[dim] % n:
        raise ValueError(
            f"{op}: dimension {dim} of a tensor of shape {tuple(tensor.shape)} does not split "
            f"into {n} equal chunks (one per rank)"
        )


class SingleProcessCommunicator(Communicator):
    """The communicator of a group of one: every collective is the identity, whatever
    ``torch.distributed`` says (a tensor-parallel group of size 1 inside a larger world is one
    of these). ``send``/``recv`` have no peer and are errors."""

    @property
    def world_size(self) -> int:
        return 1

    @property
    def rank(self) -> int:
        return 0

    def all_reduce(self, tensor, op: str = "sum"):
        check_reduce_op(op)
        return tensor

    def all_gather(self, tensor, dim: int = 0):
        return tensor

    def reduce_scatter(self, tensor, dim: int = 0):
        return tensor

    def broadcast(self, tensor, src: int = 0):
        if src != 0:
            raise ValueError(f"broadcast from rank {src} in a group of one rank")
        return tensor

    def all_to_all(self, tensor, dim: int = 0):
        return tensor

    def send(self, tensor, dst: int) -> None:
        raise RuntimeError(f"send to rank {dst}: a single-process group has no other rank")

    def recv(self, tensor, src: int):
        raise RuntimeError(f"recv from rank {src}: a single-process group has no other rank")

    def describe(self) -> str:
        return "a single process: every collective is the identity"


class TorchDistributedCommunicator(Communicator):
    """Collectives through ``torch.distributed`` on whatever backend the group was created with
    (gloo on the CPU, NCCL on CUDA, RCCL — under torch's ``nccl`` name — on ROCm).

    Args:
        group: a ``ProcessGroup`` (None: the default group).
        backend: the backend the platform expects the group to use (``"gloo"``, ``"nccl"``);
            shown by ``engine plugins`` and checked against the group on first use, so a
            group created on the wrong backend is an error rather than a slow surprise.
    """

    _REDUCE = {"sum": "SUM", "max": "MAX", "min": "MIN"}

    def __init__(self, group: Any = None, backend: str | None = None) -> None:
        super().__init__(group)
        self.backend = backend
        self._checked = False

    @staticmethod
    def _dist() -> Any:
        import torch.distributed as dist

        return dist

    def _initialized(self) -> bool:
        dist = self._dist()
        return dist.is_available() and dist.is_initialized()

    @property
    def world_size(self) -> int:
        if not self._initialized():
            return 1
        return self._dist().get_world_size(self.group)

    @property
    def rank(self) -> int:
        if not self._initialized():
            return 0
        return self._dist().get_rank(self.group)

    def _ready(self) -> Any:
        """torch.distributed, after checking (once) that the group runs on ``backend``."""
        dist = self._dist()
        if not self._checked and self.backend is not None and self._initialized():
            actual = str(dist.get_backend(self.group)).lower()
            if self.backend.lower() not in re.split(r"[:,\s]+", actual):
                raise RuntimeError(
                    f"the process group uses backend {actual!r}, but this platform's "
                    f"communicator expects {self.backend!r}: create the group with "
                    f"torch.distributed.init_process_group({self.backend!r}, ...)"
                )
            self._checked = True
        return dist

    def _global(self, group_rank: int) -> int:
        """The global rank of ``group_rank`` (torch.distributed's point-to-point and broadcast
        calls take global ranks)."""
        if self.group is None:
            return group_rank
        return self._dist().get_global_rank(self.group, group_rank)

    def all_reduce(self, tensor, op: str = "sum"):
        check_reduce_op(op)
        if self.world_size == 1:
            return tensor
        dist = self._ready()
        dist.all_reduce(tensor, op=getattr(dist.ReduceOp, self._REDUCE[op]), group=self.group)
        return tensor

    def all_gather(self, tensor, dim: int = 0):
        if self.world_size == 1:
            return tensor
        import torch

        dist = self._ready()
        tensor = tensor.contiguous()
        out = torch.empty(
            (self.world_size * tensor.shape[0], *tensor.shape[1:]),
            dtype=tensor.dtype,
            device=tensor.device,
        )
        if hasattr(dist, "all_gather_into_tensor") and dist.get_backend(self.group) != "gloo":
            dist.all_gather_into_tensor(out, tensor, group=self.group)
        else:  # gloo has no all_gather_into_tensor
            dist.all_gather(list(out.chunk(self.world_size)), tensor, group=self.group)
        if dim in (0, -tensor.dim()):
            return out
        return torch.cat(out.chunk(self.world_size), dim=dim)

    def reduce_scatter(self, tensor, dim: int = 0):
        if self.world_size == 1:
            return tensor
        _check_divisible(tensor, dim, self.world_size, "reduce_scatter")
        import torch

        dist = self._ready()
        chunks = [c.contiguous() for c in tensor.chunk(self.world_size, dim=dim)]
        out = torch.empty_like(chunks[0])
        if dist.get_backend(self.group) == "gloo":
            # gloo has no reduce_scatter: reduce everything, keep this rank's chunk.
            full = torch.stack(chunks)
            dist.all_reduce(full, group=self.group)
            out.copy_(full[self.rank])
        else:
            dist.reduce_scatter(out, chunks, group=self.group)
        return out

    def broadcast(self, tensor, src: int = 0):
        if self.world_size == 1:
            return tensor
        self._ready().broadcast(tensor, src=self._global(src), group=self.group)
        return tensor

    def send(self, tensor, dst: int) -> None:
        self._ready().send(tensor.contiguous(), dst=self._global(dst), group=self.group)

    def recv(self, tensor, src: int):
        self._ready().recv(tensor, src=self._global(src), group=self.group)
        return tensor

    def all_to_all(self, tensor, dim: int = 0):
        n = self.world_size
        if n == 1:
            return tensor
        dist = self._ready()
        if dist.get_backend(self.group) == "gloo":
            return super().all_to_all(tensor, dim)  # gloo has no all_to_all
        _check_divisible(tensor, dim, n, "all_to_all")
        import torch

        inputs = [c.contiguous() for c in tensor.chunk(n, dim=dim)]
        outputs = [torch.empty_like(c) for c in inputs]
        dist.all_to_all(outputs, inputs, group=self.group)
        return torch.cat(outputs, dim=dim)

    def describe(self) -> str:
        backend = f" on {self.backend}" if self.backend else ""
        return f"torch.distributed{backend} ({super().describe()})"
