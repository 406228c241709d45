"""Engine flags shared by ``engine serve``, ``generate``, ``chat`` and ``bench``.

Flag names follow ``vllm serve`` so that users can switch by name. ``engine_config_from_args``
turns the parsed namespace into an ``EngineConfig``; nothing here imports torch.
"""

from __future__ import annotations

import argparse

from engine.config import (
    SUPPORTED_DTYPES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)


def add_model_arg(parser: argparse.ArgumentParser, positional: bool = True) -> None:
    """The model to load: positional (optional) for serve/generate/chat, like ``vllm serve``."""
    helptext = (
        "Hugging Face model directory, a model id in the local Hugging Face cache, or a "
        ".gguf file. Default: the embedded Gemma 3 270M (engine[default-model])."
    )
    if positional:
        parser.add_argument("model", nargs="?", default=None, help=helptext)
    else:
        parser.add_argument("--model", default=None, help=helptext)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add the engine's model, cache, scheduler and device flags as argument groups."""
    model = parser.add_argument_group("model")
    model.add_argument(
        "--tokenizer", default=None, help="Tokenizer directory or id (default: the model's)."
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
    model.add_argument("--seed", type=int, default=0, help="Random seed (default: %(default)s).")

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
        "--num-gpu-blocks-override",
        type=int,
        default=None,
        help="Use this many KV blocks instead of the profiled number.",
    )
    cache.add_argument(
        "--cpu-kv-cache-gb",
        type=float,
        default=4.0,
        help=(
            "KV-cache budget on the CPU platform, in GiB (vLLM: VLLM_CPU_KVCACHE_SPACE); the "
            "cache takes the smaller of this and what --max-num-seqs requests of "
            "--max-model-len tokens can use (default: %(default)s)."
        ),
    )

    sched = parser.add_argument_group("scheduler")
    sched.add_argument(
        "--max-num-seqs",
        type=int,
        default=256,
        help="Maximum requests in one step (default: %(default)s).",
    )
    sched.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=8192,
        help="Token budget of one step; long prompts are split into chunks (default: %(default)s).",
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
    device.add_argument("--enforce-eager", action="store_true", help="Never capture device graphs.")
    device.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="Tensor-parallel ranks (only 1 is supported today).",
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


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the ``EngineConfig`` from flags added by ``add_engine_args`` (+ a ``model`` attr)."""
    import os

    platform = args.platform
    if platform == "auto" and os.environ.get("ENGINE_PLATFORM"):
        platform = os.environ["ENGINE_PLATFORM"]
    return EngineConfig(
        model=ModelConfig(
            model=args.model,
            tokenizer=args.tokenizer,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            load_format=args.load_format,
            seed=args.seed,
            served_model_name=args.served_model_name,
            generation_config=args.generation_config,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enable_prefix_caching=args.enable_prefix_caching,
            num_gpu_blocks=args.num_gpu_blocks_override,
            cpu_kv_cache_gb=args.cpu_kv_cache_gb,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            policy=args.scheduling_policy,
            async_scheduling=getattr(args, "async_scheduling", None),
        ),
        parallel=ParallelConfig(
            tensor_parallel_size=args.tensor_parallel_size,
            data_parallel_size=getattr(args, "data_parallel_size", 1),
        ),
        platform=platform,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
    )
