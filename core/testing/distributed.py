"""A real multi-process check of a platform's communicator.

``run_communicator_check(platform_cls, world_size)`` spawns ``world_size`` processes (torch
multiprocessing), joins them in a ``torch.distributed`` group with the platform's
``dist_backend`` over a loopback TCP rendezvous, and has each rank check all_reduce,
all_gather, reduce_scatter, broadcast and send/recv on tiny tensors with known answers.
Used by our tests (CPU/gloo) and by the conformance kit's ``--engine-conformance-distributed``.
"""

from __future__ import annotations

import socket
from typing import Any


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world_size: int, port: int, platform_qualname: str) -> None:
    import importlib

    import torch
    import torch.distributed as dist

    module_name, _, cls_name = platform_qualname.partition(":")
    platform = getattr(importlib.import_module(module_name), cls_name)
    dist.init_process_group(
        platform.dist_backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
    )
    try:
        device = platform.torch_device(rank if platform.device_type != "cpu" else 0)
        comm = platform.communicator(None)
        assert (comm.rank, comm.world_size) == (rank, world_size), (comm.rank, comm.world_size)
        n = world_size

        # all_reduce: sum of (rank + 1) over ranks.
        out = comm.all_reduce(torch.full((3,), float(rank + 1), device=device))
        expected = torch.full((3,), float(n * (n + 1) // 2))
        torch.testing.assert_close(out.cpu(), expected)

        # all_gather along dim 0 and along dim 1.
        piece = torch.tensor([[rank, 10 * rank]], dtype=torch.float32, device=device)
        gathered = comm.all_gather(piece, dim=0).cpu()
        torch.testing.assert_close(
            gathered, torch.tensor([[r, 10 * r] for r in range(n)], dtype=torch.float32)
        )
        gathered1 = comm.all_gather(piece, dim=1).cpu()
        torch.testing.assert_close(
            gathered1, torch.tensor([[v for r in range(n) for v in (r, 10 * r)]]).float()
        )

        # reduce_scatter: every rank contributes arange * (rank + 1); rank r keeps chunk r.
        full = torch.arange(2 * n, dtype=torch.float32, device=device) * (rank + 1)
        mine = comm.reduce_scatter(full, dim=0).cpu()
        total = torch.arange(2 * n, dtype=torch.float32) * (n * (n + 1) // 2)
        torch.testing.assert_close(mine, total[2 * rank : 2 * rank + 2])

        # broadcast from the last rank.
        src = n - 1
        value = torch.full((2,), 7.0 if rank == src else -1.0, device=device)
        torch.testing.assert_close(comm.broadcast(value, src=src).cpu(), torch.full((2,), 7.0))

        # send/recv around a ring: rank r sends r*100 to r+1.
        right, left = (rank + 1) % n, (rank - 1) % n
        outgoing = torch.full((4,), float(rank * 100), device=device)
        incoming = torch.empty(4, device=device)
        if rank % 2 == 0:
            comm.send(outgoing, dst=right)
            got = comm.recv(incoming, src=left)
        else:
            got = comm.recv(incoming, src=left)
            comm.send(outgoing, dst=right)
        torch.testing.assert_close(got.cpu(), torch.full((4,), float(left * 100)))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_communicator_check(platform_cls: type[Any], world_size: int = 2) -> None:
    """Spawn ``world_size`` ranks and check the platform's communicator; raises on failure
    (the failing rank's assertion is re-raised by torch.multiprocessing)."""
    import torch.multiprocessing as mp

    qualname = f"{platform_cls.__module__}:{platform_cls.__qualname__}"
    mp.spawn(_worker, args=(world_size, _free_port(), qualname), nprocs=world_size, join=True)
