"""A real multi-process check of a platform's communicator.

``run_communicator_check(platform_name, world_size, seed)`` spawns ``world_size`` processes
(torch multiprocessing). Each loads the plugins (as the engine does, honouring
``ENGINE_PLUGINS``), resolves the platform, joins a ``torch.distributed`` group on the
platform's ``dist_backend`` over a loopback TCP rendezvous, takes its communicator from
``PluginManager.communicator(platform, group)`` — the ``engine_communicator`` hook — and checks
every operation of the contract in ``engine.distributed`` on seeded random tensors against
answers computed locally: all_reduce (sum, max, min), all_gather and reduce_scatter along two
dimensions, broadcast from every rank, send/recv around a ring and all_to_all. With three or
more ranks it repeats the checks on a subgroup that leaves rank 0 out, so group ranks (not
global ranks) are what ``src``/``dst`` mean.

A failure names the operation, the rank and the seed. Used by our tests (CPU/gloo) and by the
conformance kit (``platform::communicator-2-ranks``).
"""

from __future__ import annotations

import socket
from typing import Any


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _inputs(seed: int, rank: int, shape: tuple[int, ...]) -> Any:
    """Rank ``rank``'s input: every rank can recompute every other rank's."""
    import torch

    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(*shape, generator=gen)


def _check_group(
    comm: Any, device: Any, ranks: list[int], global_rank: int, seed: int, label: str
) -> None:
    """Every operation on ``comm``, whose group holds the global ``ranks`` (in group order)."""
    import torch

    n = len(ranks)
    me = ranks.index(global_rank)
    assert (comm.rank, comm.world_size) == (me, n), (
        f"communicator rank/world_size [{label}] are ({comm.rank}, {comm.world_size}), "
        f"expected group rank {me} of {n} (global rank {global_rank})"
    )

    def inputs(r: int, shape: tuple[int, ...]) -> torch.Tensor:
        return _inputs(seed, ranks[r], shape)

    def same(prop: str, got: torch.Tensor, expected: torch.Tensor) -> None:
        try:
            torch.testing.assert_close(got.detach().cpu(), expected, rtol=1e-5, atol=1e-5)
        except AssertionError as exc:
            raise AssertionError(
                f"communicator {prop} [{label}, group rank {me} of {n}, seed {seed}] is wrong: "
                f"{exc}"
            ) from None

    shape = (2 * n, 3)
    everyone = [inputs(r, shape) for r in range(n)]
    for op, reduce in (("sum", torch.sum), ("max", torch.amax), ("min", torch.amin)):
        out = comm.all_reduce(everyone[me].clone().to(device), op=op)
        same(f"all_reduce(op={op!r})", out, reduce(torch.stack(everyone), dim=0))
    for dim in (0, 1):
        out = comm.all_gather(everyone[me].clone().to(device), dim=dim)
        same(f"all_gather(dim={dim})", out, torch.cat(everyone, dim=dim))
    total = torch.stack(everyone).sum(0)
    out = comm.reduce_scatter(everyone[me].clone().to(device), dim=0)
    same("reduce_scatter(dim=0)", out, total.chunk(n, dim=0)[me])
    wide = [inputs(r, (3, 2 * n)) for r in range(n)]
    out = comm.reduce_scatter(wide[me].clone().to(device), dim=1)
    same("reduce_scatter(dim=1)", out, torch.stack(wide).sum(0).chunk(n, dim=1)[me])
    for src in range(n):
        value = everyone[me].clone().to(device)
        same(f"broadcast(src={src})", comm.broadcast(value, src=src), everyone[src])
    right, left = (me + 1) % n, (me - 1) % n
    outgoing = everyone[me].clone().to(device)
    incoming = torch.empty_like(outgoing)
    if me % 2 == 0:
        comm.send(outgoing, dst=right)
        got = comm.recv(incoming, src=left)
    else:
        got = comm.recv(incoming, src=left)
        comm.send(outgoing, dst=right)
    same(f"send/recv (from group rank {left})", got, everyone[left])
    out = comm.all_to_all(everyone[me].clone().to(device), dim=0)
    same("all_to_all(dim=0)", out, torch.cat([everyone[r].chunk(n)[me] for r in range(n)]))


def _worker(rank: int, world_size: int, port: int, platform_name: str, seed: int) -> None:
    import torch.distributed as dist

    from engine.plugins import PluginManager

    pm = PluginManager.from_env()
    platform = pm.resolve_platform(platform_name)
    dist.init_process_group(
        platform.dist_backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
    )
    try:
        device = platform.torch_device(rank if platform.device_type != "cpu" else 0)
        everyone = list(range(world_size))
        _check_group(pm.communicator(platform, None), device, everyone, rank, seed, "all ranks")
        if world_size >= 3:
            ranks = list(range(1, world_size))
            sub = dist.new_group(ranks)  # every rank takes part in creating it
            if rank in ranks:
                comm = pm.communicator(platform, sub)
                _check_group(comm, device, ranks, rank, seed, f"subgroup {ranks}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_communicator_check(platform: str | type[Any], world_size: int = 2, seed: int = 0) -> None:
    """Spawn ``world_size`` ranks and check the communicator of the platform named
    ``platform`` (or of that Platform class's name); raises on failure (torch.multiprocessing
    re-raises the failing rank's assertion, which names the operation and the seed)."""
    import torch.multiprocessing as mp

    name = platform if isinstance(platform, str) else platform.name
    mp.spawn(_worker, args=(world_size, _free_port(), name, seed), nprocs=world_size, join=True)
