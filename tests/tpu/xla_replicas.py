"""Two replicas of XLA's CPU device all_reduce through ``XlaCommunicator`` (run by
test_xla_engine.py in a fresh interpreter with ``CPU_NUM_DEVICES=2``, ``PJRT_DEVICE=CPU``).

PJRT's CPU client runs the replicas as threads of one process. Concurrent compilations of the
same collective there get different rendezvous ids and never meet, so each collective's graph
is launched in rank order: the later replicas reuse the first one's compiled graph. Only
all_reduce is checked this way: all_gather, reduce_scatter, broadcast, all_to_all and send/recv
trace per-replica ids that do not match even then, so on this device they are checked against a
stand-in ``xm`` only (tests/test_platform_plugins.py); on a TPU the runtime launches them.
"""

from __future__ import annotations

import sys
import threading

_TURN = threading.Condition()
_STATE = {"turn": 0}


def replica(index: int) -> None:
    import torch
    import torch_xla

    from engine_tpu.communicator import XlaCommunicator

    comm = XlaCommunicator()
    n, rank = comm.world_size, comm.rank
    assert n == 2, f"world_size {n}"
    device = torch_xla.device()
    values = [torch.arange(6, dtype=torch.float32).mul(r + 1).sub(3 * r) for r in range(n)]
    for op, reduce in (("sum", torch.sum), ("max", torch.amax), ("min", torch.amin)):
        out = comm.all_reduce(values[rank].to(device), op=op)
        with _TURN:
            _TURN.wait_for(lambda: _STATE["turn"] % n == rank)
            torch_xla.sync(wait=False)
            _STATE["turn"] += 1
            _TURN.notify_all()
        expected = reduce(torch.stack(values), dim=0)
        torch.testing.assert_close(out.cpu(), expected, msg=f"all_reduce({op}) rank {rank}")
    # One write per line: the replicas are threads, and print() writes the newline separately.
    sys.stdout.write(f"replica {rank} of {n}: all_reduce sum, max, min ok\n")
    sys.stdout.flush()


if __name__ == "__main__":
    import torch_xla.distributed.xla_multiprocessing as xmp

    xmp.spawn(replica, args=())
