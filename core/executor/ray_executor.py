"""``RayExecutor`` (``--distributed-executor-backend ray``): one Ray actor per rank, any hosts.

The engine joins the Ray cluster (``ray.init()``: the cluster named by ``RAY_ADDRESS`` or one
started with ``ray start`` on this host, else a new local one), reserves one bundle per rank in
a placement group (``PACK``: as few hosts as fit; one device per bundle, or one CPU on the CPU
platform), and starts a ``RayWorker`` actor in each bundle. The workers find the engine through
Ray: the actors are created with the engine's ZMQ addresses (tcp:// on the engine host's Ray
node address) and rank 0's host and a free port there for torch.distributed's rendezvous. From
then on everything runs as with ``mp`` (``engine.executor.remote``): the same broadcast, the same
worker loop, inside the actor's ``run`` call.

Failure: a monitor thread waits on every actor's ``run`` call; an actor that dies (its process
killed, its node lost) fails that call, and the executor fails as ``mp``'s does. No actor
outlives the engine: they are owned by the engine's Ray driver, which Ray kills them with;
shutdown kills them and removes the placement group.

Ray sets each actor's visible devices (``CUDA_VISIBLE_DEVICES``) to the one it was given, so a
worker always uses device 0 of what it sees.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from engine.config import ConfigError
from engine.executor.remote import RemoteExecutor

if TYPE_CHECKING:
    from engine.executor.worker import WorkerSpec

logger = logging.getLogger(__name__)

# Seconds to wait for the cluster to grant the placement group.
PLACEMENT_TIMEOUT_S = 120.0
# Ray resource names of platform device types (a platform may set ``ray_resource``).
_RAY_RESOURCES = {"cuda": "GPU", "xla": "TPU", "cpu": "CPU"}


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "--distributed-executor-backend ray needs Ray: pip install 'engine-llm[ray]'"
        ) from None
    return ray


class _RayWorker:
    """The actor class (decorated with ``ray.remote`` when the executor starts)."""

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def free_port(self) -> int:
        import socket

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    def pid(self) -> int:
        import os

        return os.getpid()

    def run(self, spec: WorkerSpec) -> None:
        """Serve the engine until it shuts down (blocks for the worker's life)."""
        from engine.executor.worker import WorkerLoop

        WorkerLoop(spec).run()


def node_address(ray: Any, node_id: str) -> str:
    """The address the Ray cluster knows node ``node_id`` by."""
    for node in ray.nodes():
        if node.get("NodeID") == node_id and node.get("Alive", True):
            return str(node["NodeManagerAddress"])
    raise RuntimeError(f"Ray node {node_id} is not in the cluster")


class RayExecutor(RemoteExecutor):
    """One Ray actor per rank in a placement group (see the module docstring)."""

    name = "ray"

    def _channel_host(self) -> str:
        ray = _ray()
        if not ray.is_initialized():
            ray.init()
        self._ray = ray
        self._pg = None
        self._actors: list[Any] = []
        self._runs: list[Any] = []
        return node_address(ray, ray.get_runtime_context().get_node_id())

    def _bundle(self) -> dict[str, float]:
        key = getattr(self.platform, "ray_resource", None) or _RAY_RESOURCES.get(
            self.platform.device_type, self.platform.device_type.upper()
        )
        return {key: 1.0}

    def _prepare_workers(self) -> tuple[str, list[tuple[int, int]]]:
        ray = self._ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self._bundle()
        key = next(iter(bundle))
        have = ray.cluster_resources().get(key, 0)
        if have < self.world_size:
            raise ConfigError(
                f"tensor_parallel_size x pipeline_parallel_size = {self.world_size} Ray workers "
                f"need {self.world_size} {key}, but the Ray cluster has {have:g}; add hosts "
                "(ray start --address HEAD:6379) or use fewer ranks"
            )
        self._pg = placement_group([dict(bundle) for _ in range(self.world_size)], strategy="PACK")
        try:
            ray.get(self._pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except Exception as e:  # GetTimeoutError (name varies across Ray versions)
            raise ConfigError(
                f"the Ray cluster cannot place {self.world_size} workers of {bundle} each "
                f"(tensor_parallel_size x pipeline_parallel_size) within "
                f"{PLACEMENT_TIMEOUT_S:.0f} s: it has {ray.cluster_resources()} in all, "
                f"{ray.available_resources()} free ({type(e).__name__})"
            ) from None
        actor_cls = ray.remote(_RayWorker)
        device = next(iter(bundle))
        options: dict[str, Any] = {"num_cpus": 1 if device == "CPU" else 0}
        if device == "GPU":
            options["num_gpus"] = 1
        elif device != "CPU":
            options["resources"] = dict(bundle)
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=rank
            )
            self._actors.append(actor_cls.options(scheduling_strategy=strategy, **options).remote())
        nodes = ray.get([a.node_id.remote() for a in self._actors])
        self._nodes = [node_address(ray, n) for n in nodes]
        per_node = {n: nodes.count(n) for n in set(nodes)}
        logger.info(
            "Ray placement group of %d x %s on %d node(s): %s",
            self.world_size,
            bundle,
            len(per_node),
            ", ".join(sorted(set(self._nodes))),
        )
        port = ray.get(self._actors[0].free_port.remote())
        # Ray makes each actor see only its own device: device index 0 everywhere.
        return f"tcp://{self._nodes[0]}:{port}", [(0, per_node[n]) for n in nodes]

    def _start_workers(self, specs: list[WorkerSpec]) -> None:
        self._runs = [
            actor.run.remote(spec) for actor, spec in zip(self._actors, specs, strict=True)
        ]
        self._monitor = threading.Thread(target=self._watch, name="engine-ray-workers", daemon=True)
        self._monitor.start()

    def _watch(self) -> None:
        """Wait on every actor's ``run``: one that ends while the engine runs is a failure."""
        ray = self._ray
        pending = {ref: rank for rank, ref in enumerate(self._runs)}
        while pending and not self._closed:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
            for ref in done:
                rank = pending.pop(ref)
                try:
                    ray.get(ref)
                    what = "returned"
                except Exception as e:  # RayActorError, a worker exception
                    what = f"failed: {type(e).__name__}: {str(e).strip().splitlines()[0]}"
                self._worker_died(f"worker rank {rank} (Ray actor on {self._nodes[rank]}) {what}")
            if self._failure is not None:
                break

    def _stop_workers(self, timeout_s: float) -> None:
        ray = getattr(self, "_ray", None)
        if ray is None:
            return
        if self._runs:
            ray.wait(self._runs, num_returns=len(self._runs), timeout=timeout_s)
        for actor in self._actors:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._pg)
            except Exception:  # noqa: BLE001 - the cluster may be gone already
                pass
        monitor = getattr(self, "_monitor", None)
        if monitor is not None:
            monitor.join(timeout=2)
