"""Engine configuration: plain dataclasses, validated once, importable without torch.

``EngineConfig`` is built from the CLI flags or the ``LLM(...)`` keyword arguments (the names
match vLLM's so users switch by name) and handed to every component.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {
    "float": "float32",
    "fp32": "float32",
    "half": "float16",
    "fp16": "float16",
    "bf16": "bfloat16",
}


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and what is allowed."""


@dataclass
class ModelConfig:
    """What to load and how.

    ``model`` is a local Hugging Face directory, a model id found in the local HF cache, or a
    ``.gguf`` file. ``hf_config`` (a ``transformers.PretrainedConfig``) is filled by the loader.
    ``served_model_name`` is the name the API answers to, or a list of names (the first is the
    one reported in metrics); ``served_model_names`` always gives the list.
    """

    model: str | None  # None: the embedded default model
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    load_format: str = "auto"  # auto | safetensors | gguf | dummy
    seed: int = 0
    served_model_name: str | list[str] | None = None
    trust_remote_code: bool = False
    # "auto": the model's generation_config.json gives EOS ids and sampling defaults; "vllm":
    # only its EOS ids; or a directory to read it from (see engine.generation_config).
    generation_config: str = "auto"
    # Filled in by the loader once the config is read:
    hf_config: Any = None
    architecture: str | None = None
    # SamplingParams defaults from the generation config (engine.generation_config).
    default_sampling: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.dtype not in SUPPORTED_DTYPES:
            raise ConfigError(
                f"dtype={self.dtype!r} is not supported; choose one of "
                f"{', '.join(SUPPORTED_DTYPES)}"
            )
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ConfigError(
                f"load_format={self.load_format!r} is not supported; choose one of "
                "auto, safetensors, gguf, dummy"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
        names = self.served_model_name
        if isinstance(names, (list, tuple)):
            if not names or not all(isinstance(n, str) and n for n in names):
                raise ConfigError(
                    f"served_model_name must be a non-empty name or list of names, got {names!r}"
                )
            if len(set(names)) != len(names):
                raise ConfigError(f"served_model_name lists a name twice: {list(names)!r}")
            self.served_model_name = names[0] if len(names) == 1 else list(names)
        elif names is not None and (not isinstance(names, str) or not names):
            raise ConfigError(f"served_model_name must be a non-empty string, got {names!r}")

    @property
    def served_model_names(self) -> list[str]:
        """Every name the API answers to (the model path when none was given)."""
        names = self.served_model_name
        if isinstance(names, list):
            return list(names)
        if names:
            return [names]
        return [str(self.model)] if self.model is not None else []


@dataclass
class CacheConfig:
    """The paged KV cache.

    ``num_gpu_blocks`` overrides the size that memory profiling would choose (tests use it to
    force preemption). On CPU ``cpu_kv_cache_gb`` is a budget (vLLM's
    ``VLLM_CPU_KVCACHE_SPACE``): the cache takes the smaller of it and what ``max_num_seqs``
    requests of ``max_model_len`` tokens can use.
    """

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    num_gpu_blocks: int | None = None
    cpu_kv_cache_gb: float = 4.0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ConfigError(f"num_gpu_blocks must be >= 1, got {self.num_gpu_blocks}")
        if not self.cpu_kv_cache_gb > 0:
            raise ConfigError(f"cpu_kv_cache_gb must be > 0 (GiB), got {self.cpu_kv_cache_gb}")


@dataclass
class SchedulerConfig:
    """Per-step limits of the continuous-batching scheduler."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    policy: str = "fcfs"  # fcfs | priority
    enable_chunked_prefill: bool = True
    # Schedule step N+1 while the device runs step N (sampled tokens are fed back on the
    # device). None: on for devices that run asynchronously to the host (not the CPU).
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.policy not in ("fcfs", "priority"):
            raise ConfigError(f"policy={self.policy!r} is not supported; choose fcfs or priority")


@dataclass
class ParallelConfig:
    """Parallelism. Only tensor_parallel_size=1 runs today; larger values are refused loudly.

    ``data_parallel_size`` engine cores (processes) each hold a whole copy of the model: one
    device each on a GPU host, a share of the CPU threads on the CPU.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ConfigError("tensor_parallel_size and pipeline_parallel_size must be >= 1")
        if not isinstance(self.data_parallel_size, int) or self.data_parallel_size < 1:
            raise ConfigError(f"data_parallel_size must be >= 1, got {self.data_parallel_size!r}")


@dataclass
class EngineConfig:
    """Everything the engine needs, in one object passed to every component."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    platform: str = "auto"
    attention_backend: str = "auto"
    enforce_eager: bool = False
    max_logprobs: int = 20
