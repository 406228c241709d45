"""Collectives on XLA devices through ``torch_xla.core.xla_model`` (imported lazily).

XLA collectives are traced into the graph that every replica runs, so each call must be made by
every replica in the same order (as with any SPMD collective). ``group`` is an XLA replica-group
list such as ``[[0, 1], [2, 3]]`` (None: all replicas).
"""

from __future__ import annotations

from typing import Any

from engine.distributed import Communicator, check_reduce_op


def _xm() -> Any:
    import torch_xla.core.xla_model as xm

    return xm


class XlaCommunicator(Communicator):
    """``Communicator`` over torch_xla's ``xm`` collectives.

    Results are returned (XLA tensors are values in a lazy graph): always use the return value.
    ``send``/``recv`` use XLA Send/Recv with a channel id derived from the (source, destination)
    pair, so the matching ``recv`` on the destination computes the same channel.
    """

    _REDUCE = {"sum": "REDUCE_SUM", "max": "REDUCE_MAX", "min": "REDUCE_MIN"}

    @property
    def world_size(self) -> int:
        if self.group:
            return len(self.group[0])
        import torch_xla.runtime as xr

        return int(xr.world_size())

    @property
    def rank(self) -> int:
        import torch_xla.runtime as xr

        ordinal = int(xr.global_ordinal())
        if self.group:
            for replicas in self.group:
                if ordinal in replicas:
                    return list(replicas).index(ordinal)
        return ordinal

    def _groups(self) -> Any:
        return [list(g) for g in self.group] if self.group else None

    def _ordinal(self, group_rank: int) -> int:
        """The global replica ordinal of ``group_rank`` in this process's group."""
        if not self.group:
            return group_rank
        import torch_xla.runtime as xr

        ordinal = int(xr.global_ordinal())
        for replicas in self.group:
            if ordinal in replicas:
                return int(list(replicas)[group_rank])
        raise RuntimeError(f"replica {ordinal} is in none of the groups {self.group}")

    def all_reduce(self, tensor, op: str = "sum"):
        check_reduce_op(op)
        if self.world_size == 1:
            return tensor
        xm = _xm()
        return xm.all_reduce(getattr(xm, self._REDUCE[op]), tensor, groups=self._groups())

    def all_gather(self, tensor, dim: int = 0):
        if self.world_size == 1:
            return tensor
        return _xm().all_gather(tensor, dim=dim, groups=self._groups())

    def reduce_scatter(self, tensor, dim: int = 0):
        if self.world_size == 1:
            return tensor
        xm = _xm()
        return xm.reduce_scatter(
            xm.REDUCE_SUM,
            tensor,
            scale=1.0,
            scatter_dim=dim,
            shard_count=self.world_size,
            groups=self._groups(),
        )

    def broadcast(self, tensor, src: int = 0):
        if self.world_size == 1:
            return tensor
        # collective_broadcast updates the listed tensors in place (an in-graph all-reduce of
        # the source's value and zeros elsewhere), with the root given as a global ordinal.
        _xm().collective_broadcast([tensor], root_ordinal=self._ordinal(src), groups=self._groups())
        return tensor

    def all_to_all(self, tensor, dim: int = 0):
        n = self.world_size
        if n == 1:
            return tensor
        return _xm().all_to_all(
            tensor,
            split_dimension=dim,
            concat_dimension=dim,
            split_count=n,
            groups=self._groups(),
        )

    def _channel(self, src: int, dst: int) -> int:
        # One channel per ordered (src, dst) pair; XLA channel ids must be positive.
        return 1 + src * self.world_size + dst

    def send(self, tensor, dst: int) -> None:
        _xm().send(tensor, self._channel(self.rank, dst))

    def recv(self, tensor, src: int):
        return _xm().recv(tensor, self._channel(src, self.rank))

    def describe(self) -> str:
        return f"torch_xla xm collectives ({super().describe()})"
