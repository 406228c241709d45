"""Assembling an engine from its config: plugins -> platform -> model -> KV cache -> scheduler.

This is the one place that wires the pieces together, so each of them stays ignorant of the
others' construction.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from engine.attention_backends.interface import AttentionSpec
from engine.config import SCHEDULER_LIMITS, ConfigError, EngineConfig, ModelConfig

logger = logging.getLogger(__name__)


def resolve_model_source(config: EngineConfig) -> None:
    """Fill in the embedded default model when no model was given."""
    if config.model.model is not None:
        return
    from engine.default_model import resolve_model

    path, served_name = resolve_model(None)
    config.model.model = str(path)
    if config.model.served_model_name is None:
        config.model.served_model_name = served_name


def model_dir(model_config: ModelConfig) -> str | None:
    """The local directory of a Hugging Face model (a Hub id's cached snapshot; None for a
    GGUF file)."""
    from engine.loader import locate_model

    path = locate_model(model_config) if model_config.model is not None else None
    return str(path) if path is not None and path.is_dir() else None


def resolve_max_model_len(config: EngineConfig, hf_config: Any) -> int:
    """The context length: the user's ``max_model_len`` if it fits the model, else the model's
    (read from the ``text_config`` of a multimodal config)."""
    derived = None
    text = getattr(hf_config, "text_config", None) or hf_config
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(text, key, None)
        if isinstance(value, int) and value > 0:
            derived = value
            break
    requested = config.model.max_model_len
    if derived is None:
        if requested is None:
            raise ConfigError("the model config gives no maximum length; pass --max-model-len")
        return requested
    if requested is not None and requested > derived:
        raise ConfigError(
            f"max_model_len={requested} is larger than the model's maximum "
            f"context length ({derived}); use at most {derived}"
        )
    return requested or derived


def resolve_dtype(config: EngineConfig, hf_config: Any, platform: Any) -> None:
    """Turn ``dtype="auto"`` into the checkpoint's dtype; the platform's ``default_dtype``
    where the checkpoint declares none (a GGUF file); float32 where the platform cannot
    compute in the declared one (logged, since the user asked for "auto", not for a dtype).
    A dtype the platform only emulates is kept, with a warning."""
    if config.model.dtype == "auto":
        _resolve_auto_dtype(config, hf_config, platform)
    if config.model.dtype in platform.emulated_dtypes():
        logger.warning(
            "dtype %s has no native arithmetic on platform %s here: its matmuls are emulated "
            "and run slower than float32's (2-5x at 16 rows on an AVX2-only CPU, "
            "docs/benchmarks.md); --dtype float32 is faster here, at twice the weight memory",
            config.model.dtype,
            platform.name,
        )


def _resolve_auto_dtype(config: EngineConfig, hf_config: Any, platform: Any) -> None:
    from engine.loader.model_loader import declared_dtype

    # The loader reads the top-level dtype, then the text_config's (multimodal configs).
    declared = declared_dtype(hf_config)
    if declared is None:
        name = platform.default_dtype()
        logger.info(
            "the checkpoint declares no dtype: dtype=auto uses %s on %s (--dtype to choose)",
            name,
            platform.name,
        )
    else:
        name = str(declared).replace("torch.", "")
    if name not in platform.supported_dtypes:
        logger.warning(
            "the model's dtype %s is not supported on %s; dtype=auto uses float32",
            name,
            platform.name,
        )
        name = "float32"
    config.model.dtype = name


def attention_spec_for(hf_config: Any, config: EngineConfig, platform: Any) -> AttentionSpec:
    """What the model asks of an attention backend, read from its HF config: the head counts
    are one tensor-parallel rank's (KV heads replicated when there are fewer than ranks)."""
    text = getattr(hf_config, "text_config", None) or hf_config
    num_heads = text.num_attention_heads
    num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
    head_size = getattr(text, "head_dim", None) or text.hidden_size // num_heads
    tp = config.parallel.tensor_parallel_size
    return AttentionSpec(
        device_type=platform.device_type,
        dtype=config.model.dtype,
        head_size=head_size,
        num_heads=max(1, num_heads // tp),
        num_kv_heads=max(1, num_kv_heads // tp),
        block_size=config.cache.block_size,
        sliding_window=bool(getattr(text, "sliding_window", None))
        and getattr(text, "use_sliding_window", True) is not False,
        logit_softcap=bool(getattr(text, "attn_logit_softcapping", None)),
        kv_cache_dtype=config.cache.cache_dtype,
    )


def _encoder_budget(config: EngineConfig, runner: Any) -> Any:
    """The scheduler's image-encoder budget (None for a model without image inputs)."""
    spec = getattr(runner, "image_input_spec", None)
    if spec is None:
        return None
    from engine.multimodal.encoder_cache import encoder_budget_for

    # Remote executors report the workers' element size; in-process, read the model's.
    dtype_bytes = (
        getattr(runner, "dtype_bytes", None) or next(runner.model.parameters()).element_size()
    )
    budget = encoder_budget_for(
        config.multimodal, spec, dtype_bytes, config.scheduler.max_num_batched_tokens
    )
    if spec.bidirectional and not config.multimodal.disable_chunked_mm_input:
        logger.info(
            "image tokens attend to each other bidirectionally: one image's %d placeholder "
            "tokens always run in one step (disable_chunked_mm_input)",
            spec.tokens_per_image,
        )
    return budget


def resolve_quantization(
    config: EngineConfig, hf_config: Any, platform: Any, kernels: Any, plugins: Any
) -> Any:
    """``engine.quantization.resolve.resolve_quantization`` (the engine process's and every
    worker's quantization config)."""
    from engine.quantization.resolve import resolve_quantization as resolve

    return resolve(config, hf_config, platform, kernels, plugins)


def tensor_parallel_sizes(hf_config: Any, limit: int = 64) -> list[int]:
    """The tensor-parallel sizes (up to ``limit``) that split this model evenly: attention
    heads, key/value heads (or ranks a multiple of them: heads are then replicated) and the
    MLP's intermediate features."""
    text = getattr(hf_config, "text_config", None) or hf_config
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    inter = getattr(text, "intermediate_size", None)
    return [
        tp
        for tp in range(1, limit + 1)
        if heads % tp == 0 and (kv % tp == 0 or tp % kv == 0) and (inter is None or inter % tp == 0)
    ]


def check_parallel_config(config: EngineConfig, hf_config: Any, platform: Any) -> None:
    """Refuse, before any worker starts, a layout this model or host cannot run: a
    tensor-parallel size that does not split the heads (or the MLP), more pipeline stages than
    layers, more ranks than this host has devices (``mp``), a layout the transformers modeling
    backend cannot split. Each error lists what is allowed."""
    par = config.parallel
    tp, pp, world = par.tensor_parallel_size, par.pipeline_parallel_size, par.world_size
    text = getattr(hf_config, "text_config", None) or hf_config
    if tp > 1:
        allowed = tensor_parallel_sizes(hf_config)
        if tp not in allowed:
            heads = text.num_attention_heads
            kv = getattr(text, "num_key_value_heads", None) or heads
            raise ConfigError(
                f"tensor_parallel_size={tp} cannot split this model ({heads} attention heads, "
                f"{kv} key/value heads, intermediate_size "
                f"{getattr(text, 'intermediate_size', '?')}): it must divide the attention "
                f"heads, divide or be a multiple of the key/value heads, and divide the "
                f"intermediate size; sizes that work: {', '.join(map(str, allowed))}"
            )
    if tp > 1:
        _check_experts(text, tp, par.enable_expert_parallel)
    if pp > 1 and getattr(config, "lora", None) is not None:
        # A stage holds only its layers, and adapters name every layer's modules.
        raise ConfigError(
            f"--enable-lora with pipeline_parallel_size={pp} is not supported yet (a pipeline "
            "stage holds only its layers' LoRA targets); use tensor_parallel_size instead "
            "(LoRA runs under tensor parallelism), or pipeline_parallel_size=1"
        )
    if config.model.implementation == "transformers" and world > 1:
        from engine.models.transformers_backend import transformers_backend_parallel_problems

        problems = transformers_backend_parallel_problems(
            hf_config, tp, pp, config.model.model_impl
        )
        if problems:
            raise ConfigError("; ".join(problems))
    layers = getattr(text, "num_hidden_layers", None)
    if pp > 1 and layers is not None and pp > layers:
        raise ConfigError(
            f"pipeline_parallel_size={pp} is more stages than the model's {layers} layers; "
            f"use at most {layers}"
        )
    backend = par.executor_backend
    if world > 1 and backend == "mp" and platform.device_type == "cpu":
        import os

        cores = os.cpu_count() or 1
        if world > cores:
            logger.warning(
                "%d CPU ranks share this host's %d cores: each gets less than one", world, cores
            )
    if world > 1 and backend == "mp" and platform.device_type != "cpu":
        devices = platform.device_count()
        if world > devices:
            raise ConfigError(
                f"tensor_parallel_size x pipeline_parallel_size = {tp} x {pp} = {world} ranks "
                f"need {world} {platform.name} devices, but this host has {devices}; use at "
                f"most {devices} ranks here (e.g. tensor_parallel_size="
                f"{max(t for t in tensor_parallel_sizes(hf_config) if t <= devices)}), or "
                "--distributed-executor-backend ray to use the devices of several hosts"
            )
    if backend == "ray":
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise ConfigError(
                "--distributed-executor-backend ray needs Ray: pip install 'engine-llm[ray]'"
            )


def _check_experts(text: Any, tp: int, expert_parallel: bool) -> None:
    """A mixture-of-experts model under tensor parallelism: experts split over the ranks need
    an expert intermediate size that ``tp`` divides; experts placed across the ranks
    (``--enable-expert-parallel``) need at least one expert per rank; a shared expert (split
    either way, like a dense MLP) needs its intermediate size divisible."""
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    if not experts:
        return
    if expert_parallel and experts < tp:
        raise ConfigError(
            f"--enable-expert-parallel places {experts} experts over tensor_parallel_size={tp} "
            f"ranks: every rank needs at least one; use tensor_parallel_size <= {experts}, or "
            "split the experts instead (leave out --enable-expert-parallel)"
        )
    routed = getattr(text, "moe_intermediate_size", None) or getattr(
        text, "intermediate_size", None
    )
    if not expert_parallel and routed and routed % tp:
        raise ConfigError(
            f"tensor_parallel_size={tp} cannot split the experts' intermediate size ({routed}); "
            "use a size that divides it, or --enable-expert-parallel to place whole experts "
            "on the ranks"
        )
    shared = getattr(text, "shared_expert_intermediate_size", None)
    if shared and shared % tp:
        raise ConfigError(
            f"tensor_parallel_size={tp} cannot split the shared expert's intermediate size "
            f"({shared}); use a size that divides it"
        )


def _check_pooling(config: EngineConfig) -> None:
    """A pooling (embedding) model: one device, no speculative decoding or LoRA; the prefix
    cache is off (a pooling request never reads it, see ``engine.scheduler``) and decode
    graphs are not captured (there are no decodes)."""
    if getattr(config.model, "runner_type", "generate") != "pooling":
        return
    unsupported = []
    if config.parallel.world_size > 1:
        unsupported.append("tensor/pipeline parallelism")
    if config.speculative is not None:
        unsupported.append("speculative decoding")
    if config.lora is not None:
        unsupported.append("LoRA adapters")
    if unsupported:
        raise ConfigError(
            "the pooling runner (embeddings) does not support "
            + ", ".join(unsupported)
            + "; drop those options"
        )
    config.cache.enable_prefix_caching = False
    config.enforce_eager = True


def _check_image_parallel(config: EngineConfig, model_cls: type | None) -> None:
    """Refuse image inputs under pipeline parallelism: image embeddings replace token
    embeddings on the first stage only, which the stage hand-off does not do yet. Tensor
    parallelism is supported (every rank runs its shard of the vision tower; the step message
    carries the images). The model still runs text-only across stages
    (``limit_mm_per_prompt={"image": 0}``)."""
    par = config.parallel
    if par.pipeline_parallel_size == 1 or not hasattr(model_cls, "encode_images"):
        return
    if config.multimodal.limit("image") == 0:
        return
    raise ConfigError(
        f"image inputs are not supported with pipeline_parallel_size="
        f"{par.pipeline_parallel_size} ({model_cls.__name__}): serve images with "
        "pipeline_parallel_size=1 (tensor_parallel_size may be > 1), or serve the model "
        "text-only across stages with --limit-mm-per-prompt '{\"image\": 0}'"
    )


def build_executor(
    config: EngineConfig,
    platform: Any,
    kernels: Any,
    backend_cls: Any,
    models: Any,
    quant_config: Any = None,
) -> Any:
    """The executor of ``config.parallel``: the model loaded on its workers (in this process
    for ``uni``). ``quant_config`` is the resolved quantization (``resolve_quantization``);
    a worker process resolves its own from the same configuration."""
    from engine.executor.backends import executor_class

    backend = config.parallel.executor_backend
    if backend != "uni":
        return executor_class(backend)(config, platform, backend_cls)
    from engine.executor.uniproc import UniProcExecutor
    from engine.model_runner import ModelRunner
    from engine.sampler import Sampler

    text_config = getattr(config.model.hf_config, "text_config", None) or config.model.hf_config
    sampler = Sampler(text_config.vocab_size, platform.torch_device(), argmax=kernels.argmax)
    runner = ModelRunner(
        config,
        platform,
        kernels,
        backend_cls,
        sampler,
        model_registry=models,
        quant_config=quant_config,
    )
    runner.load_model()
    return UniProcExecutor(runner)


def apply_scheduler_defaults(config: EngineConfig, platform: Any) -> None:
    """Fill the step limits the user left unset with the platform's defaults, and log them."""
    sched = config.scheduler
    if not sched.defaulted:
        return
    chosen = platform.scheduler_defaults(config)
    if chosen is not None:  # else the generic values SchedulerConfig filled in stay
        for name, value in zip(SCHEDULER_LIMITS, chosen, strict=True):
            if name in sched.defaulted:
                setattr(sched, name, value)
    logger.info(
        "%s defaults (%s) for %s: max_num_seqs=%d, max_num_batched_tokens=%d",
        sched.usage,
        platform.name,
        "the unset " + " and ".join(sched.defaulted),
        sched.max_num_seqs,
        sched.max_num_batched_tokens,
    )
    sched.defaulted = ()


def build_engine_parts(config: EngineConfig) -> tuple[Any, Any, Any, list[int], Any]:
    """Return ``(tokenizer, executor, scheduler, eos_token_ids, plugin_manager)``; the
    tokenizer is None with ``skip_tokenizer_init``."""
    from engine import generation_config
    from engine.kv_cache_manager import KVCacheGroupSpec
    from engine.loader import load_hf_config
    from engine.models.registry import ModelRegistry
    from engine.plugins import PluginManager
    from engine.scheduler import Scheduler
    from engine.tokenizer import eos_token_ids, load_tokenizer

    start = time.perf_counter()
    resolve_model_source(config)
    plugins = PluginManager.from_env()
    requested = None if config.platform == "auto" else config.platform
    platform = plugins.resolve_platform(requested)
    config.platform = platform.name
    from engine.cpu_threads import apply_cpu_threads

    apply_cpu_threads(config.cpu_threads)
    apply_scheduler_defaults(config, platform)
    problems = platform.check_config(config)
    if problems:
        raise ConfigError(
            f"platform {platform.name} cannot run this configuration: " + "; ".join(problems)
        )

    models = ModelRegistry.with_plugins(plugins)
    max_model_len_given = config.model.max_model_len is not None
    hf_config = load_hf_config(config.model, models)
    config.model.max_model_len = resolve_max_model_len(config, hf_config)
    check_parallel_config(config, hf_config, platform)
    resolve_dtype(config, hf_config, platform)
    if config.model.served_model_name is None:
        config.model.served_model_name = config.model.model
    tokenizer = None if config.model.skip_tokenizer_init else load_tokenizer(config.model)
    generation_eos, config.model.default_sampling = generation_config.resolve(
        model_dir(config.model),
        config.model.generation_config,
        config.model.override_generation_config,
    )

    kernels = plugins.kernel_registry().resolve(platform.name)
    quant_config = resolve_quantization(config, hf_config, platform, kernels, plugins)
    spec = attention_spec_for(hf_config, config, platform)
    # Image tokens that attend to each other both ways (Gemma 3), and attention sinks
    # (GPT-OSS), need a backend that can. The native class, when one serves the model
    # (load_config chose the implementation): a model only the transformers backend runs has
    # no registered class to ask.
    model_cls: Any = None
    if getattr(config.model, "implementation", "native") != "transformers":
        _, model_cls = models.resolve(getattr(hf_config, "architectures", None) or [])
    spec.bidirectional_spans = bool(
        getattr(model_cls, "bidirectional_image_attention", False)
        and config.multimodal.limit("image") > 0
    ) or bool(getattr(model_cls, "bidirectional_attention", False))  # encoders (BERT)
    # Learned per-head softmax logits (GPT-OSS): a class that sets ``attention_sinks = True``
    # gets a backend that honours them, or the reasons why none does.
    spec.attention_sinks = bool(getattr(model_cls, "attention_sinks", False))
    _check_pooling(config)
    _check_image_parallel(config, model_cls)
    backend_cls = plugins.select_attention_backend(config.attention_backend, spec, platform, config)
    logger.info("platform %s, attention backend %s", platform.name, backend_cls.name)
    if quant_config is not None:
        from engine.loader.model_loader import check_quantized_layout

        # Before any worker starts or weight is read: the quantized layers can be built, and
        # sharded over the tensor-parallel ranks (QuantizationError saying why not).
        check_quantized_layout(
            config.model,
            kernels,
            backend_cls,
            models,
            quant_config,
            config.parallel.tensor_parallel_size,
            config.parallel.enable_expert_parallel,
        )

    if config.speculative is not None:
        from engine.spec_decode import ProposerRegistry

        ProposerRegistry().check(config, hf_config)  # ConfigError with every reason
    par = config.parallel
    if par.world_size > 1:
        logger.info(
            "%d ranks (tensor_parallel_size=%d x pipeline_parallel_size=%d) on the %s executor",
            par.world_size,
            par.tensor_parallel_size,
            par.pipeline_parallel_size,
            par.executor_backend,
        )
    executor = build_executor(config, platform, kernels, backend_cls, models, quant_config)
    try:
        groups = executor.kv_cache_groups()
        # The smallest over the ranks. An unset max_model_len may be lowered to fit a CPU KV
        # cache (the ranks agree on it); a given one never is.
        num_blocks = executor.determine_num_blocks(max_model_len_fixed=max_model_len_given)
        executor.allocate_kv_cache(num_blocks)
        executor.capture_graphs()  # decode CUDA graphs where the platform and backend allow
    except BaseException:
        executor.shutdown()
        raise
    if config.scheduler.async_scheduling is None:
        # Overlap pays where the device runs apart from the host and copies are asynchronous
        # (CUDA/HIP streams); CPU kernels run inline, and XLA builds one graph per step.
        # Pipeline stages overlap micro-batches only this way.
        config.scheduler.async_scheduling = (
            platform.device_type == "cuda" or par.pipeline_parallel_size > 1
        )
    scheduler = Scheduler(
        config.scheduler,
        config.cache,
        config.model.max_model_len,
        num_blocks,
        [KVCacheGroupSpec(sliding_window=w) for w in groups],
        speculative_config=config.speculative,
        pipeline_parallel_size=par.pipeline_parallel_size,
        encoder_budget=_encoder_budget(config, executor),
        lora_config=config.lora,
    )
    logger.info(
        "engine ready in %.1f s: %d KV blocks of %d tokens",
        time.perf_counter() - start,
        num_blocks,
        config.cache.block_size,
    )
    eos = eos_token_ids(tokenizer, hf_config, generation_eos)
    return tokenizer, executor, scheduler, eos, plugins
