"""Engine configuration: plain dataclasses, validated once, importable without torch.

``EngineConfig`` is built from the CLI flags or the ``LLM(...)`` keyword arguments (the names
match vLLM's so users switch by name) and handed to every component.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.lora.config import LoRAConfig

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {
    "float": "float32",
    "fp32": "float32",
    "half": "float16",
    "fp16": "float16",
    "bf16": "bfloat16",
}

KV_CACHE_DTYPES = ("auto", "fp8")
KV_CACHE_DTYPE_ALIASES = {"fp8_e4m3": "fp8"}


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and what is allowed."""


# What the model runs for (engine.pooling chooses the pooler): vLLM's --runner values, and
# its older --task values with the runner each means.
RUNNERS = ("auto", "generate", "pooling")
TASK_RUNNERS = {"auto": "auto", "generate": "generate", "embed": "pooling", "embedding": "pooling"}


# How load_format="dummy" draws each weight matrix (biases zero, norm scales one):
#   normal:  normal(0, 0.02), a model whose greedy output wanders like a trained one's does
#            (it rarely repeats), so a token-by-token comparison of layouts or kernels can
#            fail;
#   uniform: uniform(-1e-3, 1e-3), vLLM's dummy weights: the greedy output of such a model
#            soon repeats one token, which is what a speculative-decoding benchmark on random
#            weights needs (prompt lookup then drafts it) and what vLLM's own runs see.
DUMMY_INITS = ("normal", "uniform")
MODEL_LOADER_EXTRA_KEYS = ("dummy_init",)


@dataclass
class ModelConfig:
    """What to load and how.

    ``model`` is a local Hugging Face directory, a Hugging Face Hub id (found in the local cache
    or downloaded: ``engine.loader.hub``), or a ``.gguf`` file. ``hf_config`` (a ``transformers.PretrainedConfig``) is filled by the loader.
    ``served_model_name`` is the name the API answers to, or a list of names (the first is the
    one reported in metrics); ``served_model_names`` always gives the list.
    """

    model: str | None  # None: the embedded default model
    tokenizer: str | None = None
    # A Hub id's branch, tag or commit (vLLM's --revision / --tokenizer-revision; None: main)
    # and the cache directory downloads go to (--download-dir; None: the Hugging Face cache).
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    load_format: str = "auto"  # auto | safetensors | gguf | dummy
    # Loader options, vLLM's --model-loader-extra-config (a JSON object). The one key read
    # today: "dummy_init" (DUMMY_INITS), how load_format="dummy" draws its weights.
    model_loader_extra_config: dict[str, Any] | str = field(default_factory=dict)
    seed: int = 0
    served_model_name: str | list[str] | None = None
    trust_remote_code: bool = False
    # As vLLM's: load no tokenizer (a folder with only config.json, e.g. a --load-format dummy
    # benchmark). Prompts must then be token ids, outputs carry token ids and empty text.
    skip_tokenizer_init: bool = False
    # "auto": the model's generation_config.json gives EOS ids and sampling defaults; "vllm":
    # only its EOS ids; or a directory to read it from (see engine.generation_config).
    generation_config: str = "auto"
    # vLLM's --override-generation-config: sampling defaults in generation-config names
    # ({"temperature": 0.6}), over the file's (engine.generation_config).
    override_generation_config: dict[str, Any] = field(default_factory=dict)
    # vLLM's --hf-overrides: fields set on the model's transformers config after it is read
    # ({"max_position_embeddings": 4096}; a nested object updates a sub-config such as
    # text_config), in every process that reads it.
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    # A quantization method name (engine.quantization; vLLM's names: fp8, gptq, awq,
    # compressed-tensors); None: the checkpoint's quantization_config decides (unquantized
    # when it has none).
    quantization: str | None = None
    # auto | native | transformers (engine.models.selection): a native class when one is
    # registered, else the transformers modeling backend.
    model_impl: str = "auto"
    # auto | generate | pooling (--runner, vLLM's flag; engine.pooling): pooling runs prefill
    # only and returns one embedding per prompt; auto picks pooling for an architecture without
    # an LM head or a sentence-transformers checkpoint. ``task`` is vLLM's older spelling
    # ("embed" means pooling, "generate" generate).
    runner: str = "auto"
    task: str | None = None
    # As vLLM's --disable-cascade-attn: never attend a prefix many decodes share once for all
    # of them (engine.attention_backends.interface, supports_cascade_attention).
    disable_cascade_attn: bool = False
    # Filled in by the loader once the config is read:
    hf_config: Any = None
    runner_type: str = "generate"  # the runner chosen: generate | pooling
    pooler_config: Any = None  # engine.pooling.PoolerConfig of a pooling model
    architecture: str | None = None
    implementation: str | None = None  # the model_impl chosen: native | transformers
    # SamplingParams defaults from the generation config (engine.generation_config).
    default_sampling: dict[str, Any] = field(default_factory=dict)

    @property
    def dummy_init(self) -> str:
        """How ``load_format="dummy"`` draws its matrices (one of ``DUMMY_INITS``)."""
        return self.model_loader_extra_config.get("dummy_init", "normal")

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
        extra = self.model_loader_extra_config
        if isinstance(extra, str):  # the CLI's JSON text
            import json

            try:
                extra = self.model_loader_extra_config = json.loads(extra)
            except json.JSONDecodeError as e:
                raise ConfigError(f"model_loader_extra_config is not valid JSON: {e}") from None
        if not isinstance(extra, dict):
            raise ConfigError(
                f"model_loader_extra_config must be a JSON object, got {type(extra).__name__}"
            )
        unknown = sorted(set(extra) - set(MODEL_LOADER_EXTRA_KEYS))
        if unknown:
            raise ConfigError(
                f"model_loader_extra_config has unknown keys {unknown}; the keys read are "
                f"{', '.join(MODEL_LOADER_EXTRA_KEYS)}"
            )
        if extra.get("dummy_init", "normal") not in DUMMY_INITS:
            raise ConfigError(
                f"model_loader_extra_config dummy_init={extra['dummy_init']!r} is not "
                f"supported; choose one of {', '.join(DUMMY_INITS)}"
            )
        if self.model_impl not in ("auto", "native", "transformers"):
            raise ConfigError(
                f"model_impl={self.model_impl!r} is not supported; choose one of "
                "auto, native, transformers"
            )
        if self.task is not None:
            if self.task not in TASK_RUNNERS:
                raise ConfigError(
                    f"task={self.task!r} is not supported; choose one of "
                    f"{', '.join(TASK_RUNNERS)} (or use runner=generate|pooling)"
                )
            by_task = TASK_RUNNERS[self.task]
            if self.runner not in ("auto", by_task):
                raise ConfigError(f"task={self.task!r} contradicts runner={self.runner!r}")
            self.runner = by_task
        if self.runner not in RUNNERS:
            raise ConfigError(
                f"runner={self.runner!r} is not supported; choose one of {', '.join(RUNNERS)}"
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
    force preemption). On CPU ``cpu_kv_cache_gb`` is a budget in GiB (vLLM's
    ``VLLM_CPU_KVCACHE_SPACE``); None picks one from the memory available (see
    ``engine.cpu_kv_cache``), and the cache never exceeds what ``max_num_seqs`` requests of
    ``max_model_len`` tokens can use.
    """

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    num_gpu_blocks: int | None = None
    cpu_kv_cache_gb: float | None = None
    # KV-cache element type: "auto" (the model dtype) or "fp8" (e4m3 with a per-layer scale:
    # about twice the tokens in the same memory). vLLM's --kv-cache-dtype.
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ConfigError(f"num_gpu_blocks must be >= 1, got {self.num_gpu_blocks}")
        if self.cpu_kv_cache_gb is not None and not self.cpu_kv_cache_gb > 0:
            raise ConfigError(f"cpu_kv_cache_gb must be > 0 (GiB), got {self.cpu_kv_cache_gb}")
        self.cache_dtype = KV_CACHE_DTYPE_ALIASES.get(self.cache_dtype, self.cache_dtype)
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype={self.cache_dtype!r} is not supported; choose one of "
                f"{', '.join(KV_CACHE_DTYPES)} (fp8 = fp8_e4m3)"
            )


# The step limits where neither the user nor the platform chose (Platform.scheduler_defaults).
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
SCHEDULER_LIMITS = ("max_num_seqs", "max_num_batched_tokens")


@dataclass
class SchedulerConfig:
    """Per-step limits of the continuous-batching scheduler.

    ``max_num_seqs`` / ``max_num_batched_tokens`` left None take the platform's default for
    the device and the usage (``Platform.scheduler_defaults``: an offline ``LLM`` batches more
    than a server, which keeps its inter-token latency down), applied by the engine once the
    platform is known; until then, and for a scheduler built directly, 256 and 8192.
    ``defaulted`` names the limits that were left to the platform.
    """

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    policy: str = "fcfs"  # fcfs | priority
    enable_chunked_prefill: bool = True
    # Schedule step N+1 while the device runs step N (sampled tokens are fed back on the
    # device). None: on for devices that run asynchronously to the host (not the CPU).
    async_scheduling: bool | None = None

    # "offline" (the LLM class) or "server" (engine serve): which platform defaults apply.
    usage: str = "offline"
    defaulted: tuple[str, ...] = field(default=(), init=False)

    def __post_init__(self) -> None:
        self.defaulted = tuple(name for name in SCHEDULER_LIMITS if getattr(self, name) is None)
        if self.max_num_seqs is None:
            self.max_num_seqs = DEFAULT_MAX_NUM_SEQS
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS
        if self.usage not in ("offline", "server"):
            raise ConfigError(f"usage={self.usage!r} is not one of offline, server")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.policy not in ("fcfs", "priority"):
            raise ConfigError(f"policy={self.policy!r} is not supported; choose fcfs or priority")


DISTRIBUTED_EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass
class ParallelConfig:
    """How one model replica is spread over devices (vLLM's names).

    ``tensor_parallel_size`` ranks split every layer (heads, MLP columns, vocabulary rows);
    ``pipeline_parallel_size`` stages split the layers. Their product is the world size: one
    worker per device. ``distributed_executor_backend`` runs the workers: ``uni`` in this
    process (world size 1), ``mp`` one spawned process per rank on this host, ``ray`` Ray
    actors on one or several hosts; None picks ``uni`` for one rank and ``mp`` otherwise.
    ``enable_expert_parallel`` places a mixture-of-experts model's experts across the
    tensor-parallel ranks of a stage (``E / tp`` whole experts each) instead of splitting
    every expert over them (no effect on dense models or on one rank).
    ``data_parallel_size`` engine cores (processes) each hold a whole replica: one device each
    (times the world size) on a GPU host, a share of the CPU threads on the CPU.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ConfigError("tensor_parallel_size and pipeline_parallel_size must be >= 1")
        if not isinstance(self.data_parallel_size, int) or self.data_parallel_size < 1:
            raise ConfigError(f"data_parallel_size must be >= 1, got {self.data_parallel_size!r}")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ConfigError(
                f"distributed_executor_backend={backend!r} is not supported; choose one of "
                f"{', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}"
            )
        if backend == "uni" and self.world_size > 1:
            raise ConfigError(
                f"distributed_executor_backend='uni' runs one rank in this process, but "
                f"tensor_parallel_size x pipeline_parallel_size = {self.world_size}; use 'mp' "
                "(one process per rank on this host) or 'ray'"
            )

    @property
    def world_size(self) -> int:
        """Ranks of one model replica: ``tensor_parallel_size * pipeline_parallel_size``."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor_backend(self) -> str:
        """The backend that runs the workers (``distributed_executor_backend`` resolved)."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.world_size == 1 else "mp"


# The proposer methods of ``SpeculativeConfig`` (``engine.spec_decode`` registers one proposer
# class per name; this tuple keeps config validation free of imports).
SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3")
# Speculation runs in a step while its verify batch holds at most this many tokens
# (running requests x (num_speculative_tokens + 1)), unless ``disable_by_batch_size`` says
# otherwise: past it the verify step stops being bound by reading the weights and costs about
# (k + 1) decode steps, which only a near-perfect acceptance repays.
AUTO_SPECULATION_TOKEN_BUDGET = 256


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``--speculative-config`` keys).

    ``method``: ``ngram`` (prompt lookup: the longest suffix of ``prompt_lookup_min`` ..
    ``prompt_lookup_max`` tokens found earlier in the prompt + output proposes what followed
    it), ``draft_model`` (a smaller model sharing the tokenizer), ``eagle`` or ``eagle3`` (an
    EAGLE head fed with the target's hidden states). Left out, it follows vLLM: ``model`` of
    ``"ngram"`` means ngram, a model name containing "eagle3"/"eagle" means that head, any
    other model a draft model. ``num_speculative_tokens`` (k) drafts are verified per step.
    ``disable_by_batch_size``: no speculation in steps with more running requests than this
    (None: ``AUTO_SPECULATION_TOKEN_BUDGET // (k + 1)``).
    """

    method: str | None = None
    num_speculative_tokens: int | None = None
    model: str | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int | None = None
    draft_tensor_parallel_size: int | None = None

    def __post_init__(self) -> None:
        if self.method is None:
            if self.model is None:
                raise ConfigError(
                    "speculative_config needs a method (one of "
                    f"{', '.join(SPECULATIVE_METHODS)}) or a draft model"
                )
            name = self.model.lower()
            if name in ("ngram", "[ngram]"):
                self.method, self.model = "ngram", None
            elif "eagle3" in name:
                self.method = "eagle3"
            elif "eagle" in name:
                self.method = "eagle"
            else:
                self.method = "draft_model"
        if self.method == "[ngram]":
            self.method = "ngram"
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(
                f"speculative_config.method={self.method!r} is not supported; choose one of "
                f"{', '.join(SPECULATIVE_METHODS)}"
            )
        k = self.num_speculative_tokens
        if k is None:
            raise ConfigError(
                f"speculative_config.num_speculative_tokens is required for method "
                f"{self.method!r} (the number of draft tokens verified per step, e.g. 4)"
            )
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ConfigError(f"speculative_config.num_speculative_tokens must be >= 1, got {k!r}")
        if self.method == "ngram":
            if self.model is not None:
                raise ConfigError(
                    f"speculative_config: the ngram method uses no model; drop model={self.model!r}"
                )
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is None and hi is None:
                lo = hi = 5  # vLLM's defaults
            lo = hi if lo is None else lo
            hi = lo if hi is None else hi
            for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ConfigError(f"speculative_config.{name} must be >= 1, got {value!r}")
            if lo > hi:
                raise ConfigError(
                    f"speculative_config.prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}"
                )
            self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        else:
            if not self.model:
                raise ConfigError(
                    f"speculative_config.method={self.method!r} needs a model (the draft "
                    "model's or EAGLE head's directory)"
                )
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise ConfigError(
                        f"speculative_config.{name} applies to the ngram method only, not "
                        f"{self.method!r}"
                    )
        if self.draft_tensor_parallel_size not in (None, 1):
            raise ConfigError(
                "speculative_config.draft_tensor_parallel_size must be 1, got "
                f"{self.draft_tensor_parallel_size!r}"
            )
        if self.disable_by_batch_size is None:
            self.disable_by_batch_size = max(1, AUTO_SPECULATION_TOKEN_BUDGET // (k + 1))
        elif (
            not isinstance(self.disable_by_batch_size, int)
            or isinstance(self.disable_by_batch_size, bool)
            or self.disable_by_batch_size < 1
        ):
            raise ConfigError(
                "speculative_config.disable_by_batch_size must be >= 1, got "
                f"{self.disable_by_batch_size!r}"
            )

    @classmethod
    def from_dict(cls, value: Any) -> SpeculativeConfig:
        """Build from vLLM's JSON object (``--speculative-config``, ``LLM(speculative_config=)``);
        an unknown key is a ``ConfigError`` that lists the known ones."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ConfigError(
                f"speculative_config must be a JSON object, got {type(value).__name__}"
            )
        from dataclasses import fields

        known = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ConfigError(
                f"speculative_config has unknown key(s) {', '.join(unknown)}; known: "
                f"{', '.join(known)}"
            )
        return cls(**value)

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots a step reserves past the verified tokens: a draft model or EAGLE head
        writes its own KV for the tokens it drafts after the step; a prompt lookup writes
        none."""
        return 0 if self.method == "ngram" else int(self.num_speculative_tokens or 0)


# Items of one modality a prompt may carry when --limit-mm-per-prompt does not name it (vLLM's).
DEFAULT_MM_LIMIT = 999


@dataclass
class MultiModalConfig:
    """Image inputs of multimodal models (vLLM's names where vLLM has the setting).

    ``limit_mm_per_prompt``: the most items of each modality one prompt may carry
    (``{"image": 4}``; a modality not named gets ``DEFAULT_MM_LIMIT``); ``{"image": 0}`` serves
    the model as a text model and does not load its vision tower. ``mm_encoder_cache_gb``: the
    device memory (GiB) that caches image embeddings by content hash, so a repeated image is
    encoded once. ``max_num_encoder_input_tokens``: image tokens the encoder may produce in one
    step (None: ``max_num_batched_tokens``). ``disable_chunked_mm_input``: never split one
    image's placeholder tokens over two steps (forced on for models whose image tokens attend to
    each other bidirectionally, Gemma 3). Front end: ``allowed_local_media_path`` (a directory
    whose files ``file://`` URLs may name; None refuses them), ``allowed_media_domains`` (hosts
    that ``http(s)://`` image URLs may be fetched from; None refuses every fetch),
    ``max_image_bytes`` (encoded size) and ``max_image_pixels`` (width x height) per image,
    ``media_fetch_timeout`` (seconds per fetch).
    """

    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)
    mm_encoder_cache_gb: float = 0.25
    max_num_encoder_input_tokens: int | None = None
    disable_chunked_mm_input: bool = False
    allowed_local_media_path: str | None = None
    allowed_media_domains: list[str] | None = None
    max_image_bytes: int = 10 * 1024 * 1024
    max_image_pixels: int = 8192 * 8192
    media_fetch_timeout: float = 5.0

    def __post_init__(self) -> None:
        limits = self.limit_mm_per_prompt
        if isinstance(limits, str):
            import json

            try:
                limits = json.loads(limits)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--limit-mm-per-prompt is not valid JSON: {e}") from None
        if not isinstance(limits, dict):
            raise ConfigError(
                'limit_mm_per_prompt must be an object of modality -> count, e.g. {"image": 4}'
            )
        for modality, count in limits.items():
            if modality not in ("image",):
                raise ConfigError(
                    f"limit_mm_per_prompt: modality {modality!r} is not supported; supported: image"
                )
            if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                raise ConfigError(
                    f"limit_mm_per_prompt[{modality!r}] must be an integer >= 0, got {count!r}"
                )
        self.limit_mm_per_prompt = dict(limits)
        if not self.mm_encoder_cache_gb > 0:
            raise ConfigError(f"mm_encoder_cache_gb must be > 0, got {self.mm_encoder_cache_gb}")
        tokens = self.max_num_encoder_input_tokens
        if tokens is not None and tokens < 1:
            raise ConfigError(f"max_num_encoder_input_tokens must be >= 1, got {tokens}")
        for name in ("max_image_bytes", "max_image_pixels"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.media_fetch_timeout > 0:
            raise ConfigError(f"media_fetch_timeout must be > 0, got {self.media_fetch_timeout}")
        if isinstance(self.allowed_media_domains, str):
            self.allowed_media_domains = [self.allowed_media_domains]

    def limit(self, modality: str) -> int:
        """Items of ``modality`` one prompt may carry."""
        return self.limit_mm_per_prompt.get(modality, DEFAULT_MM_LIMIT)


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
    # Speculative decoding (None: off); see SpeculativeConfig.
    speculative: SpeculativeConfig | None = None
    # Threads of torch's CPU kernels; None: the physical cores available (engine.cpu_threads).
    cpu_threads: int | None = None
    # Image inputs (multimodal models); see MultiModalConfig.
    multimodal: MultiModalConfig = field(default_factory=MultiModalConfig)
    # Multi-LoRA serving (--enable-lora); None: off (engine.lora.config.LoRAConfig).
    lora: LoRAConfig | None = None

    def __post_init__(self) -> None:
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ConfigError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
