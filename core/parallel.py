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
from typing import TYPE_CHECKING, Any

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
    #: every rank of the replica (None: this process alone); for start-up agreements such as
    #: the KV-cache size (an all-reduce MIN)
    world: Communicator | None = None
    #: MoE layers place whole experts across the tensor-parallel group instead of splitting
    #: each (``--enable-expert-parallel``; read by ``moe_parallel_from_context``)
    enable_expert_parallel: bool = False

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
        """Rank 0 of the whole replica."""
        return self.rank == 0

    @property
    def is_output_rank(self) -> bool:
        """The rank that reports a step's results: tensor-parallel rank 0 of the last stage
        (every rank of the last stage samples the same tokens; this one returns them)."""
        return self.is_last_stage and self.tp_rank == 0

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """The decoder layers ``[start, end)`` this pipeline stage builds."""
        return pp_layer_range(num_layers, self.pp_rank, self.pp_size)


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


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """Layers ``[start, end)`` of stage ``pp_rank`` when ``num_layers`` are split into
    ``pp_size`` consecutive stages: equal shares, the remainder one layer each to the first
    stages (the last stage also computes the logits, the first only looks up embeddings)."""
    if not 1 <= pp_size <= num_layers:
        raise ValueError(
            f"pipeline_parallel_size={pp_size} must be between 1 and the model's "
            f"{num_layers} layers (each stage needs at least one)"
        )
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


@dataclass
class IntermediateTensors:
    """What a pipeline stage hands the next one: the hidden states and the residual stream
    after its last layer, ``[num_tokens, hidden_size]`` each."""

    hidden: Any
    residual: Any
