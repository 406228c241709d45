"""``ParallelContext``: which shard of the model this process holds, and how to talk to the others.

Layers never call ``torch.distributed`` themselves: they read their rank and world size from the
``ParallelContext`` in the ``ModelContext`` and run collectives through its ``Communicator``
(supplied by the platform plugin). The default context is a single process (every collective an
identity), so single-device code paths pay nothing for parallelism.

Ranks are laid out as vLLM does: ``global_rank = pp_rank * tp_size + tp_rank``; the tensor-parallel
group of a pipeline stage is its ``tp_size`` consecutive global ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.distributed import Communicator


def _identity_communicator() -> Communicator:
    from engine.distributed import SingleProcessCommunicator

    return SingleProcessCommunicator()


@dataclass(frozen=True)
class ParallelContext:
    """This process's place in a tensor x pipeline parallel layout of one model replica.

    ``tp`` is the communicator of this rank's tensor-parallel group (``tp_size`` ranks) and
    ``pp`` that of the pipeline (one rank per stage, same ``tp_rank``); both are single-process
    identities when the size is 1.
    """

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp: Communicator = field(default_factory=_identity_communicator)
    pp: Communicator = field(default_factory=_identity_communicator)

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is outside [0, {self.tp_size})")
        if not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"pp_rank {self.pp_rank} is outside [0, {self.pp_size})")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def rank(self) -> int:
        """The global rank (``pp_rank * tp_size + tp_rank``)."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_driver(self) -> bool:
        """Rank 0 of the whole replica: the one that samples and reports."""
        return self.rank == 0


SINGLE_PROCESS = ParallelContext()


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator / denominator`` when it divides exactly, else a ``ValueError`` naming
    ``what`` (e.g. "attention heads") and the sizes that would work."""
    if numerator % denominator:
        fits = [d for d in range(1, numerator + 1) if numerator % d == 0]
        raise ValueError(
            f"{what} ({numerator}) cannot be split evenly over {denominator} ranks; "
            f"tensor_parallel_size must divide it (one of {fits[:12]})"
        )
    return numerator // denominator
