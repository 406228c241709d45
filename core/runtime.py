"""Assembling an engine from its config: plugins -> platform -> model -> KV cache -> scheduler.

This is the one place that wires the pieces together, so each of them stays ignorant of the
others' construction.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from engine.attention_backends.interface import AttentionSpec
from engine.config import ConfigError, EngineConfig

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


def _model_dir(model: str | None) -> str | None:
    """The local directory of a Hugging Face model (None for a GGUF file)."""
    from engine.loader import resolve_model_path

    path = resolve_model_path(model) if model is not None else None
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
    """Turn ``dtype="auto"`` into the config's dtype, or float32 where the platform cannot
    compute in it (logged, since the user asked for "auto", not for a specific dtype)."""
    if config.model.dtype != "auto":
        return
    from engine.loader import resolve_dtype as checkpoint_dtype

    # The loader reads the top-level dtype, then the text_config's (multimodal configs).
    name = str(checkpoint_dtype(config.model, hf_config)).replace("torch.", "")
    if name not in platform.supported_dtypes:
        logger.warning(
            "the model's dtype %s is not supported on %s; dtype=auto uses float32",
            name,
            platform.name,
        )
        name = "float32"
    config.model.dtype = name


def attention_spec_for(hf_config: Any, config: EngineConfig, platform: Any) -> AttentionSpec:
    """What the model asks of an attention backend, read from its HF config."""
    text = getattr(hf_config, "text_config", None) or hf_config
    num_heads = text.num_attention_heads
    head_size = getattr(text, "head_dim", None) or text.hidden_size // num_heads
    return AttentionSpec(
        device_type=platform.device_type,
        dtype=config.model.dtype,
        head_size=head_size,
        num_heads=num_heads,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or num_heads,
        block_size=config.cache.block_size,
        sliding_window=bool(getattr(text, "sliding_window", None))
        and getattr(text, "use_sliding_window", True) is not False,
        logit_softcap=bool(getattr(text, "attn_logit_softcapping", None)),
    )


def _encoder_budget(config: EngineConfig, runner: Any) -> Any:
    """The scheduler's image-encoder budget (None for a model without image inputs)."""
    spec = runner.image_input_spec
    if spec is None:
        return None
    from engine.multimodal.encoder_cache import encoder_budget_for

    dtype_bytes = next(runner.model.parameters()).element_size()
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


def build_engine_parts(config: EngineConfig) -> tuple[Any, Any, Any, list[int], Any]:
    """Return ``(tokenizer, runner, scheduler, eos_token_ids, plugin_manager)``; the tokenizer
    is None with ``skip_tokenizer_init``."""
    from engine import generation_config
    from engine.kv_cache_manager import KVCacheGroupSpec
    from engine.loader import load_hf_config
    from engine.model_runner import ModelRunner
    from engine.models.registry import ModelRegistry
    from engine.plugins import PluginManager
    from engine.sampler import Sampler
    from engine.scheduler import Scheduler
    from engine.tokenizer import eos_token_ids, load_tokenizer

    start = time.perf_counter()
    if config.parallel.tensor_parallel_size != 1 or config.parallel.pipeline_parallel_size != 1:
        raise ConfigError(
            "tensor/pipeline parallelism is not implemented yet; use --tensor-parallel-size 1"
        )
    resolve_model_source(config)
    plugins = PluginManager.from_env()
    requested = None if config.platform == "auto" else config.platform
    platform = plugins.resolve_platform(requested)
    config.platform = platform.name
    from engine.cpu_threads import apply_cpu_threads

    apply_cpu_threads(config.cpu_threads)
    problems = platform.check_config(config)
    if problems:
        raise ConfigError(
            f"platform {platform.name} cannot run this configuration: " + "; ".join(problems)
        )

    models = ModelRegistry.with_plugins(plugins)
    max_model_len_given = config.model.max_model_len is not None
    hf_config = load_hf_config(config.model, models)
    config.model.max_model_len = resolve_max_model_len(config, hf_config)
    resolve_dtype(config, hf_config, platform)
    if config.model.served_model_name is None:
        config.model.served_model_name = config.model.model
    tokenizer = None if config.model.skip_tokenizer_init else load_tokenizer(config.model)
    generation_eos, config.model.default_sampling = generation_config.resolve(
        _model_dir(config.model.model), config.model.generation_config
    )

    kernels = plugins.kernel_registry().resolve(platform.name)
    spec = attention_spec_for(hf_config, config, platform)
    # Image tokens that attend to each other both ways (Gemma 3) need a backend that can.
    _, model_cls = models.resolve(getattr(hf_config, "architectures", None) or [])
    spec.bidirectional_spans = bool(
        getattr(model_cls, "bidirectional_image_attention", False)
        and config.multimodal.limit("image") > 0
    )
    backend_cls = plugins.select_attention_backend(config.attention_backend, spec, platform, config)
    logger.info("platform %s, attention backend %s", platform.name, backend_cls.name)

    if config.speculative is not None:
        from engine.spec_decode import ProposerRegistry

        ProposerRegistry().check(config, hf_config)  # ConfigError with every reason
    text_config = getattr(hf_config, "text_config", None) or hf_config
    sampler = Sampler(text_config.vocab_size, platform.torch_device(), argmax=kernels.argmax)
    runner = ModelRunner(config, platform, kernels, backend_cls, sampler, model_registry=models)
    runner.load_model()
    groups = runner.kv_cache_groups()
    # An unset max_model_len may be lowered to fit a CPU KV cache; a given one never is.
    num_blocks = runner.determine_num_blocks(max_model_len_fixed=max_model_len_given)
    runner.allocate_kv_cache(num_blocks)
    runner.capture_graphs()  # decode CUDA graphs where the platform and backend allow them
    if config.scheduler.async_scheduling is None:
        # Overlap pays where the device runs apart from the host and copies are asynchronous
        # (CUDA/HIP streams); CPU kernels run inline, and XLA builds one graph per step.
        config.scheduler.async_scheduling = runner.device.type == "cuda"
    scheduler = Scheduler(
        config.scheduler,
        config.cache,
        config.model.max_model_len,
        num_blocks,
        [KVCacheGroupSpec(sliding_window=w) for w in groups],
        speculative_config=config.speculative,
        encoder_budget=_encoder_budget(config, runner),
    )
    logger.info(
        "engine ready in %.1f s: %d KV blocks of %d tokens",
        time.perf_counter() - start,
        num_blocks,
        config.cache.block_size,
    )
    eos = eos_token_ids(tokenizer, hf_config, generation_eos)
    return tokenizer, runner, scheduler, eos, plugins
