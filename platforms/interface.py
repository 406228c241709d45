"""The ``Platform`` interface: what a hardware plugin tells the engine about its device.

A platform class is returned by a plugin's ``engine_platform()`` hook. Its class-level
attributes and ``is_available()`` must be answerable without creating a device context or
importing anything heavy: detection runs on every start-up for every installed plugin.
Everything else is called only on the platform that was chosen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from engine.config import EngineConfig
    from engine.distributed import Communicator
    from engine.shape_buckets import ShapeBuckets


class Platform:
    """Base class for a hardware platform. Subclass it in a plugin.

    Class attributes:
        name: short unique name used by ``--platform`` (``cpu``, ``cuda``, ...).
        device_type: the torch device type (``"cpu"``, ``"cuda"``, ``"xla"``).
        dist_backend: the torch.distributed backend (``gloo``, ``nccl``, ...).
        supported_dtypes: dtype names the platform can compute in.
        priority: higher wins when several available platforms compete. Built-in
            accelerators use 100, the CPU 0; an out-of-tree vendor plugin should use 200+
            to win over a built-in plugin for the same device.
        supports_graph_capture: whether the model runner may capture/replay decode graphs.
        device_control_env_var: the environment variable that selects which devices a
            process sees (``CUDA_VISIBLE_DEVICES``); data parallelism gives each engine-core
            process one device through it. ``None``: the platform cannot be split that way
            (the CPU splits its threads instead).
    """

    name: ClassVar[str] = "unknown"
    device_type: ClassVar[str] = "cpu"
    dist_backend: ClassVar[str] = "gloo"
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")
    priority: ClassVar[int] = 0
    supports_graph_capture: ClassVar[bool] = False
    device_control_env_var: ClassVar[str | None] = None

    # ---- detection: cheap, no device context -------------------------------------------
    @classmethod
    def is_available(cls) -> bool:
        """True when the device is present and usable. Must be cheap; never raises."""
        return not cls.unavailable_reasons()

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        """Why this platform cannot run here (empty when it can). Cheap; never raises."""
        return []

    # ---- device facts -------------------------------------------------------------------
    @classmethod
    def device_count(cls) -> int:
        return 1

    @classmethod
    def device_name(cls, index: int = 0) -> str:
        return cls.name

    @classmethod
    def device_capability(cls, index: int = 0) -> tuple[int, int] | None:
        """Compute capability (major, minor) where the notion exists, else None."""
        return None

    @classmethod
    def torch_device(cls, index: int = 0) -> torch.device:
        import torch

        return (
            torch.device(cls.device_type, index)
            if cls.device_type != "cpu"
            else torch.device("cpu")
        )

    @classmethod
    def fp8_dtype(cls, index: int = 0) -> str | None:
        """The float8 flavour (a torch dtype name) fp8 quantization and fp8 KV caches use on
        this platform: the OCP ``float8_e4m3fn`` by default; AMD's MI300 (gfx942) uses
        ``float8_e4m3fnuz``. None: no fp8 here. Called on the chosen platform only (it may ask
        the device). Since plugin API 1.1."""
        return "float8_e4m3fn"

    # ---- memory profiling ---------------------------------------------------------------
    @classmethod
    def total_memory(cls, index: int = 0) -> int:
        """Total device memory in bytes."""
        raise NotImplementedError

    @classmethod
    def free_memory(cls, index: int = 0) -> int:
        """Free device memory in bytes right now."""
        raise NotImplementedError

    @classmethod
    def reset_peak_memory(cls, index: int = 0) -> None:
        """Start a new peak-memory measurement window."""

    @classmethod
    def peak_memory(cls, index: int = 0) -> int:
        """Peak bytes allocated by this process since ``reset_peak_memory``."""
        return 0

    @classmethod
    def synchronize(cls, index: int = 0) -> None:
        """Wait for all queued device work (no-op on CPU)."""

    # ---- engine integration -------------------------------------------------------------
    @classmethod
    def default_attention_backends(cls, config: EngineConfig | None = None) -> list[str]:
        """Attention backend names in the order ``--attention-backend auto`` tries them."""
        return ["torch"]

    @classmethod
    def default_dtype(cls) -> str:
        """The dtype ``dtype="auto"`` takes for a checkpoint that declares none (a GGUF file):
        float32, unless the platform computes faster in a 16-bit type it runs natively."""
        return "float32"

    @classmethod
    def emulated_dtypes(cls) -> tuple[str, ...]:
        """Supported dtypes this device computes without native arithmetic, so slower than
        float32 (bfloat16 on a CPU without AVX512-BF16 or AMX). The engine keeps such a dtype
        when it is asked for or declared by the checkpoint, and warns."""
        return ()

    @classmethod
    def decode_graphs_class(cls) -> type | None:
        """The class that captures and replays decode steps on this platform
        (``engine.cuda_graphs.DecodeGraphs`` or a subclass with its own ``_execute``), or None
        for eager steps only. By default CUDA graphs where ``supports_graph_capture`` and the
        device is a CUDA (or HIP) one. Only the engine calls it (no plugin API bump)."""
        if not cls.supports_graph_capture or cls.device_type != "cuda":
            return None
        from engine.cuda_graphs import DecodeGraphs

        return DecodeGraphs

    @classmethod
    def scheduler_defaults(cls, config: EngineConfig) -> tuple[int, int] | None:
        """``(max_num_seqs, max_num_batched_tokens)`` for the limits the user left unset,
        chosen for this device and ``config.scheduler.usage`` ("offline" for the ``LLM``
        class, "server" for ``engine serve``); None (the default) keeps the generic 256 and
        8192. The engine logs what it applied."""
        return None

    @classmethod
    def communicator(cls, group: Any = None) -> Communicator:
        """The default communicator, used when no plugin's ``engine_communicator`` hook answers
        for this platform: ``torch.distributed`` on ``dist_backend``. Prefer the hook (the
        engine asks ``PluginManager.communicator(platform, group)``, never this directly)."""
        from engine.distributed import TorchDistributedCommunicator

        return TorchDistributedCommunicator(group, backend=cls.dist_backend)

    @classmethod
    def shape_buckets(cls, config: EngineConfig) -> ShapeBuckets | None:
        """Padding buckets when this platform compiles a graph per input shape (XLA): the
        model runner then pads every step's token count, sequence count and block-table width
        to them (``engine.shape_buckets``). None (the default): shapes may vary freely."""
        return None

    @classmethod
    def check_config(cls, config: EngineConfig) -> list[str]:
        """Reasons this platform cannot run ``config`` (empty when it can)."""
        reasons = []
        dtype = config.model.dtype
        if dtype != "auto" and dtype not in cls.supported_dtypes:
            reasons.append(
                f"dtype {dtype} is not supported on {cls.name} "
                f"(supported: {', '.join(cls.supported_dtypes)})"
            )
        return reasons

    @classmethod
    def describe(cls) -> dict[str, Any]:
        """A JSON-friendly summary for ``engine plugins`` and ``engine env``."""
        reasons = cls.unavailable_reasons()
        return {
            "name": cls.name,
            "device_type": cls.device_type,
            "priority": cls.priority,
            "available": not reasons,
            "reasons": reasons,
        }
