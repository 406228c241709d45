"""TorchDistributedCommunicator over a real 2-process gloo group on the CPU."""

from __future__ import annotations

import pytest


@pytest.mark.timeout(120)
def test_cpu_communicator_with_two_gloo_ranks() -> None:
    from engine.distributed import TorchDistributedCommunicator
    from engine.testing.distributed import run_communicator_check
    from engine_cpu.platform import CpuPlatform

    assert isinstance(CpuPlatform.communicator(), TorchDistributedCommunicator)
    run_communicator_check(CpuPlatform, world_size=2)


def test_single_process_communicator_is_identity() -> None:
    import torch

    from engine.distributed import TorchDistributedCommunicator

    comm = TorchDistributedCommunicator()
    t = torch.arange(4.0)
    assert comm.world_size == 1 and comm.rank == 0
    for out in (comm.all_reduce(t), comm.all_gather(t), comm.reduce_scatter(t), comm.broadcast(t)):
        assert torch.equal(out, torch.arange(4.0))
