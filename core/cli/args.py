"""Engine flags shared by ``engine serve``, ``generate``, ``chat`` and ``bench``.

Flag names follow ``vllm serve`` so that users can switch by name. ``engine_config_from_args``
turns the parsed namespace into an ``EngineConfig``; nothing here imports torch.
"""

from __future__ import annotations

import argparse

from engine.config import (
    DISTRIBUTED_EXECUTOR_BACKENDS,
    SUPPORTED_DTYPES,
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    MultiModalConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)


def add_model_arg(
    parser: argparse.ArgumentParser, positional: bool = True, helptext: str | None = None
) -> None:
    """The model to load, as ``vllm serve`` takes it: ``engine serve MODEL`` or
    ``engine serve --model MODEL`` (both forms; giving both with different values is an error,
    see ``merge_model_args``). ``positional=False`` adds only ``--model``, for commands whose
    positional arguments are something else (``engine generate PROMPT...``)."""
    helptext = helptext or (
        "Hugging Face model directory, a Hugging Face Hub id (downloaded unless cached; "
        "--revision, --download-dir), or a .gguf file. Default: the embedded Gemma 3 270M "
        "(engine-llm[default-model])."
    )
    if positional:
        parser.add_argument("model", nargs="?", default=None, help=helptext)
        parser.add_argument(
            "--model", dest="model_option", default=None, metavar="MODEL", help="Same as MODEL."
        )
    else:
        parser.add_argument("--model", default=None, help=helptext)


def merge_model_args(args: argparse.Namespace) -> None:
    """Fold ``--model`` into ``args.model`` (the positional); idempotent.

    Raises ``ConfigError`` when both forms are given with different values: which one the user
    meant cannot be guessed."""
    option = getattr(args, "model_option", None)
    if option is None:
        return
    positional = getattr(args, "model", None)
    if positional is not None and positional != option:
        raise ConfigError(
            f"the model is given twice, as {positional!r} and as --model {option!r}; "
            "give it once (either form)"
        )
    args.model = option
    args.model_option = None


LOG_LEVELS = ("debug", "info", "warning", "error")


def add_log_level_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--log-level``: the engine's log lines, and whether an error shows its traceback."""
    parser.add_argument(
        "--log-level",
        default="info",
        choices=LOG_LEVELS,
        help="Level of the engine's log lines on stderr; debug also prints the traceback of an "
        "error, which is otherwise one line (default: %(default)s).",
    )


def configure_logging(level: str = "info", tag: str = "") -> None:
    """One format for every log line on stderr (engine, and uvicorn's, which propagate);
    ``tag`` names the process among several (``[api 1]``, ``[core 0]``)."""
    import logging

    logging.basicConfig(
        level=logging.INFO if level == "trace" else getattr(logging, level.upper()),
        format=f"%(asctime)s %(levelname)s %(name)s{' ' + tag if tag else ''}: %(message)s",
        datefmt="%H:%M:%S",
    )


def _json_object(text: str) -> dict:
    """A JSON object flag value (vLLM's --hf-overrides / --override-generation-config)."""
    import json

    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"invalid JSON {text!r}: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def _checked_overrides(value: dict | None) -> dict:
    """``--override-generation-config``, checked now (before a server takes its port)."""
    from engine.generation_config import check_overrides

    return dict(check_overrides(value)) if value else {}


def int_at_least(minimum: int):
    """An argparse ``type``: an integer >= ``minimum``, or a message saying what is allowed."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be an integer >= {minimum}, got {text!r}"
            ) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add the engine's model, cache, scheduler and device flags as argument groups."""
    model = parser.add_argument_group("model")
    model.add_argument(
        "--tokenizer",
        default=None,
        help="Tokenizer directory or Hugging Face Hub id (default: the model's).",
    )
    model.add_argument(
        "--revision",
        default=None,
        help="Branch, tag or commit of a Hugging Face Hub model id (default: main).",
    )
    model.add_argument(
        "--tokenizer-revision",
        default=None,
        help="Branch, tag or commit of the tokenizer's Hub repository (default: the model's "
        "revision).",
    )
    model.add_argument(
        "--download-dir",
        default=None,
        help="Cache directory for models downloaded from the Hugging Face Hub (default: the "
        "Hugging Face cache, HF_HUB_CACHE). HF_HUB_OFFLINE=1 downloads nothing.",
    )
    model.add_argument(
        "--dtype",
        default="auto",
        choices=SUPPORTED_DTYPES,
        help="Weights and activations dtype; auto takes the config's (default: %(default)s).",
    )
    model.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="Maximum context length, prompt plus output (default: the model's).",
    )
    model.add_argument(
        "--load-format",
        default="auto",
        choices=("auto", "safetensors", "gguf", "dummy"),
        help="dummy builds random weights from the config alone, for benchmarks "
        "(default: %(default)s).",
    )
    model.add_argument(
        "--model-loader-extra-config",
        default=None,
        metavar="JSON",
        help='Loader options as a JSON object. \'{"dummy_init": "uniform"}\' gives '
        "--load-format dummy vLLM's random weights, uniform(-1e-3, 1e-3), whose greedy output "
        'soon repeats one token (speculative-decoding benchmarks); the default "normal" '
        "draws normal(0, 0.02).",
    )
    model.add_argument(
        "--model-impl",
        default="auto",
        choices=("auto", "native", "transformers"),
        help="auto: the engine's own implementation of the architecture when it has one, else "
        "the transformers modeling backend (any AutoModelForCausalLM with replaceable "
        "attention); native / transformers force one (default: %(default)s).",
    )
    model.add_argument(
        "--runner",
        default="auto",
        choices=("auto", "generate", "pooling"),
        help="pooling: an embedding model (prefill only, /v1/embeddings, LLM.embed); auto "
        "picks pooling for architectures without an LM head (BertModel, XLMRobertaModel, "
        "Qwen3Model) and sentence-transformers checkpoints (default: %(default)s).",
    )
    model.add_argument(
        "--task",
        default=None,
        choices=("auto", "generate", "embed", "embedding"),
        help="vLLM's older spelling of --runner: embed means --runner pooling.",
    )
    model.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="Allow custom model and tokenizer code from the model directory (auto_map).",
    )
    model.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="Name(s) the API serves the model under: requests may use any of them and get it "
        "back as `model`; /v1/models lists them all; the first labels the metrics (default: "
        "the model argument).",
    )
    model.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|DIR",
        help="auto: the model's generation_config.json gives end-of-sequence ids and default "
        "sampling parameters (temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_new_tokens) for requests that leave them unset; vllm: its end-of-sequence ids "
        "only; DIR: read generation_config.json from there (default: %(default)s).",
    )
    model.add_argument(
        "--override-generation-config",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="Default sampling parameters over the generation config's, in its names, e.g. "
        '\'{"temperature": 0.6, "top_p": 0.95, "max_new_tokens": 2048}\'.',
    )
    model.add_argument(
        "--hf-overrides",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="Fields to set on the model's transformers config after it is read, e.g. "
        "'{\"max_position_embeddings\": 65536}' (a nested object updates a sub-config such as "
        "text_config).",
    )
    model.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="Load no tokenizer (e.g. a config.json-only folder with --load-format dummy): "
        "prompts must be token ids, outputs carry token ids only, stop strings and chat are "
        "refused.",
    )
    model.add_argument(
        "--quantization",
        "-q",
        default=None,
        metavar="NAME",
        help="Quantization method (fp8, gptq, awq, compressed-tensors, gguf, or a plugin's; `engine "
        "plugins` lists them). Default: the checkpoint's quantization_config decides; fp8 on "
        "an unquantized checkpoint quantizes its weights to FP8 at load; a .gguf file runs "
        "kept quantized (gguf), and 'none' dequantizes it at load.",
    )
    model.add_argument("--seed", type=int, default=0, help="Random seed (default: %(default)s).")
    model.add_argument(
        "--max-logprobs",
        type=int_at_least(0),
        default=20,
        help="Most log-probabilities a request may ask for per token (logprobs, top_logprobs, "
        "prompt_logprobs; default: %(default)s).",
    )

    cache = parser.add_argument_group("KV cache")
    cache.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="Tokens per KV-cache block (default: %(default)s).",
    )
    cache.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="Fraction of device memory for weights, activations and the KV cache "
        "(default: %(default)s).",
    )
    cache.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Reuse the KV cache of shared prompt prefixes (default: on).",
    )
    cache.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "fp8", "fp8_e4m3"),
        help="KV-cache element type: auto (the model dtype) or fp8 (e4m3 with a per-layer "
        "scale, about twice the tokens in the same memory) (default: %(default)s).",
    )
    cache.add_argument(
        "--num-gpu-blocks-override",
        type=int,
        default=None,
        help="Use this many KV blocks instead of the profiled number.",
    )
    cache.add_argument(
        "--cpu-kv-cache-gb",
        type=float,
        default=None,
        metavar="GIB",
        help=(
            "KV-cache budget on the CPU platform, in GiB (vLLM: VLLM_CPU_KVCACHE_SPACE); the "
            "cache takes the smaller of this and what --max-num-seqs requests of "
            "--max-model-len tokens can use. Default: 4, or half the memory available if "
            "less; 0.5 for engine generate and engine chat. An unset --max-model-len is "
            "lowered to fit the budget (logged)."
        ),
    )

    sched = parser.add_argument_group("scheduler")
    sched.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="Maximum requests in one step (default: the platform's, logged at start: 1024 on "
        "a GPU of 70 GiB or more, else 256).",
    )
    sched.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="Token budget of one step; long prompts are split into chunks (default: the "
        "platform's, logged at start: on a GPU of 70 GiB or more 8192 for engine serve and "
        "16384 for offline runs, else 8192).",
    )
    sched.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=("fcfs", "priority"),
        help="Order of admission (default: %(default)s).",
    )
    sched.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Schedule the next step while the device runs the current one, feeding sampled "
        "tokens back on the device (default: on for GPUs and other asynchronous devices, off "
        "on the CPU).",
    )

    spec = parser.add_argument_group("speculative decoding")
    spec.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='Speculative decoding as a JSON object, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\', '
        '\'{"method": "draft_model", "model": DIR, "num_speculative_tokens": 4}\' or '
        '\'{"method": "eagle3", "model": DIR, "num_speculative_tokens": 3}\'; '
        '"disable_by_batch_size" turns it off in larger batches (default: off).',
    )

    add_multimodal_args(parser)

    device = parser.add_argument_group("device and parallelism")
    device.add_argument(
        "--platform",
        default="auto",
        help="Platform to run on (auto, cpu, cuda, rocm, tpu, or a vendor "
        "plugin's); also ENGINE_PLATFORM. `engine plugins` lists them.",
    )
    device.add_argument(
        "--attention-backend",
        default="auto",
        help="Attention backend (auto or a name from `engine plugins`).",
    )
    device.add_argument(
        "--enforce-eager",
        action="store_true",
        help="Never capture decode steps (CUDA graphs on GPUs, native plans on the CPU).",
    )
    device.add_argument(
        "--disable-cascade-attn",
        action="store_true",
        help="Never attend a cached prefix that many decodes of a step share once for all of "
        "them (cascade attention, where the attention backend offers it).",
    )
    device.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        metavar="N",
        help="Threads for the engine's CPU kernels (torch's intra-op threads; per worker "
        "process with several ranks). Default: OMP_NUM_THREADS if set, else the physical "
        "cores this process may use (affinity and cgroup quota), split over the ranks of this "
        "host; fewer helps when other work shares the cores.",
    )
    device.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="Tensor-parallel ranks: every layer split over this many devices (heads, MLP "
        "columns, vocabulary rows).",
    )
    device.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=1,
        help="Pipeline stages: the layers split into this many consecutive groups, one per "
        "device group, with several batches in flight.",
    )
    device.add_argument(
        "--distributed-executor-backend",
        choices=DISTRIBUTED_EXECUTOR_BACKENDS,
        default=None,
        help="How the tensor x pipeline ranks run: uni (this process, one rank), mp (one "
        "process per rank on this host; the default for several ranks) or ray (Ray actors on "
        "one or several hosts; pip install 'engine-llm[ray]').",
    )
    device.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="Mixture-of-experts models: place whole experts across the tensor-parallel ranks "
        "(E / tp each) instead of splitting every expert over them.",
    )
    device.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="Engine cores, each with a whole copy of the model: one device each on a GPU "
        "host, the CPU threads split among them on the CPU; requests go to the least loaded "
        "core, or to the one that holds their prompt prefix (default: %(default)s).",
    )

    lora = parser.add_argument_group("LoRA adapters")
    lora.add_argument(
        "--enable-lora",
        action="store_true",
        help="Serve LoRA adapters (PEFT format) on top of the model, several per batch.",
    )
    lora.add_argument(
        "--max-loras",
        type=int,
        default=1,
        help="Adapters one batch may use (device slots) (default: %(default)s).",
    )
    lora.add_argument(
        "--max-lora-rank",
        type=int,
        default=16,
        help="Largest adapter rank accepted; sizes the device slots (default: %(default)s).",
    )
    lora.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="Adapters kept loaded in host memory (an LRU cache; at least --max-loras, "
        "default: --max-loras).",
    )
    lora.add_argument(
        "--lora-fused-shrink",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Compute the adapters' shrink inside the base GEMM of unquantized layers (their "
        "A matrices appended to the weight) instead of a separate kernel (default: on for "
        "GPUs, off on the CPU).",
    )


def add_multimodal_args(parser: argparse.ArgumentParser) -> None:
    """Image inputs of multimodal models (vLLM's flag names where vLLM has the setting)."""
    mm = parser.add_argument_group("image inputs (multimodal models)")
    mm.add_argument(
        "--limit-mm-per-prompt",
        default=None,
        metavar="JSON",
        help="Most images one prompt may carry, e.g. '{\"image\": 4}' (default: 999); "
        "'{\"image\": 0}' serves the model as a text model without loading its vision tower.",
    )
    mm.add_argument(
        "--allowed-local-media-path",
        default=None,
        metavar="DIR",
        help="Let requests read images from file:// URLs under this directory (a security "
        "risk: only in trusted environments). Default: file:// URLs are refused.",
    )
    mm.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        metavar="HOST",
        help="Hosts that http(s):// image URLs may be fetched from. Default: none - the server "
        "never fetches from the network (vLLM fetches any host unless this is set); clients "
        "send images as data: URLs.",
    )
    mm.add_argument(
        "--max-image-bytes",
        type=int,
        default=MultiModalConfig.max_image_bytes,
        metavar="N",
        help="Largest encoded image accepted, in bytes (default: %(default)s = 10 MiB; a "
        "data: URL also counts against --max-request-body-bytes).",
    )
    mm.add_argument(
        "--max-image-pixels",
        type=int,
        default=MultiModalConfig.max_image_pixels,
        metavar="N",
        help="Largest image accepted, width x height, checked before decoding "
        "(default: %(default)s = 8192 x 8192).",
    )
    mm.add_argument(
        "--mm-encoder-cache-gb",
        type=float,
        default=MultiModalConfig.mm_encoder_cache_gb,
        metavar="GIB",
        help="Device memory for image embeddings cached by content hash, so a repeated image "
        "is encoded once (default: %(default)s).",
    )
    mm.add_argument(
        "--max-num-encoder-input-tokens",
        type=int,
        default=None,
        metavar="N",
        help="Image embeddings the vision encoder may produce in one step (default: "
        "--max-num-batched-tokens).",
    )
    mm.add_argument(
        "--disable-chunked-mm-input",
        action="store_true",
        help="Never split one image's placeholder tokens over two prefill chunks (always on "
        "for Gemma 3, whose image tokens attend to each other bidirectionally).",
    )


def multimodal_config_from_args(args: argparse.Namespace) -> MultiModalConfig:
    """The ``MultiModalConfig`` of flags added by ``add_multimodal_args`` (defaults for
    namespaces without them)."""
    defaults = MultiModalConfig()
    return MultiModalConfig(
        limit_mm_per_prompt=getattr(args, "limit_mm_per_prompt", None) or {},
        allowed_local_media_path=getattr(args, "allowed_local_media_path", None),
        allowed_media_domains=getattr(args, "allowed_media_domains", None),
        max_image_bytes=getattr(args, "max_image_bytes", defaults.max_image_bytes),
        max_image_pixels=getattr(args, "max_image_pixels", defaults.max_image_pixels),
        mm_encoder_cache_gb=getattr(args, "mm_encoder_cache_gb", defaults.mm_encoder_cache_gb),
        max_num_encoder_input_tokens=getattr(args, "max_num_encoder_input_tokens", None),
        disable_chunked_mm_input=getattr(args, "disable_chunked_mm_input", False),
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the ``EngineConfig`` from flags added by ``add_engine_args`` (+ a ``model`` attr)."""
    import os

    merge_model_args(args)
    platform = args.platform
    if platform == "auto" and os.environ.get("ENGINE_PLATFORM"):
        platform = os.environ["ENGINE_PLATFORM"]
    return EngineConfig(
        model=ModelConfig(
            model=args.model,
            tokenizer=args.tokenizer,
            revision=args.revision,
            tokenizer_revision=args.tokenizer_revision,
            download_dir=args.download_dir,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            load_format=args.load_format,
            model_loader_extra_config=getattr(args, "model_loader_extra_config", None) or {},
            disable_cascade_attn=getattr(args, "disable_cascade_attn", False),
            seed=args.seed,
            served_model_name=args.served_model_name,
            generation_config=args.generation_config,
            override_generation_config=_checked_overrides(
                getattr(args, "override_generation_config", None)
            ),
            hf_overrides=dict(getattr(args, "hf_overrides", None) or {}),
            skip_tokenizer_init=getattr(args, "skip_tokenizer_init", False),
            quantization=getattr(args, "quantization", None),
            model_impl=getattr(args, "model_impl", "auto"),
            runner=getattr(args, "runner", "auto"),
            task=getattr(args, "task", None),
            trust_remote_code=getattr(args, "trust_remote_code", False),
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enable_prefix_caching=args.enable_prefix_caching,
            num_gpu_blocks=args.num_gpu_blocks_override,
            cpu_kv_cache_gb=args.cpu_kv_cache_gb,
            cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            policy=args.scheduling_policy,
            async_scheduling=getattr(args, "async_scheduling", None),
            usage=getattr(args, "scheduler_usage", "offline"),
        ),
        parallel=ParallelConfig(
            tensor_parallel_size=args.tensor_parallel_size,
            data_parallel_size=getattr(args, "data_parallel_size", 1),
            pipeline_parallel_size=args.pipeline_parallel_size,
            distributed_executor_backend=args.distributed_executor_backend,
            enable_expert_parallel=getattr(args, "enable_expert_parallel", False),
        ),
        platform=platform,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        max_logprobs=getattr(args, "max_logprobs", 20),
        speculative=(
            SpeculativeConfig.from_dict(args.speculative_config)
            if getattr(args, "speculative_config", None)
            else None
        ),
        cpu_threads=getattr(args, "cpu_threads", None),
        multimodal=multimodal_config_from_args(args),
        lora=lora_config_from_args(args),
    )


def lora_config_from_args(args: argparse.Namespace):
    """The ``LoRAConfig`` of ``--enable-lora`` and its limits (None without the flag; the
    limits given without it are an error, as they would silently do nothing)."""
    from engine.config import ConfigError
    from engine.lora.config import LoRAConfig

    if not getattr(args, "enable_lora", False):
        changed = [
            flag
            for flag, value, default in (
                ("--max-loras", getattr(args, "max_loras", 1), 1),
                ("--max-lora-rank", getattr(args, "max_lora_rank", 16), 16),
                ("--max-cpu-loras", getattr(args, "max_cpu_loras", None), None),
                ("--lora-fused-shrink", getattr(args, "lora_fused_shrink", None), None),
            )
            if value != default
        ]
        if changed:
            raise ConfigError(f"{', '.join(changed)} need --enable-lora")
        return None
    return LoRAConfig(
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        fused_shrink=getattr(args, "lora_fused_shrink", None),
    )
