"""What ``engine bench throughput`` and ``engine bench latency`` share: engine flags, model
resolution (a path or a built-in shape), building the ``LLM`` and timing its start."""

from __future__ import annotations

import argparse
import json
import os
import platform as host_platform
import tempfile
import time
from collections.abc import Callable
from typing import Any

from engine.benchmarks.lora import (
    add_lora_bench_args,
    bench_lora_requests,
    configure_engine_for_loras,
    lora_settings,
)
from engine.benchmarks.workload import BUILTIN_SHAPES, builtin_shape, write_builtin_model


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """The model (``MODEL`` or ``--model MODEL``) plus every engine flag (``engine serve``'s names), and ``--json``."""
    from engine.cli.args import add_engine_args, add_log_level_arg, add_model_arg

    add_model_arg(
        parser,
        positional=True,
        helptext="A model directory or .gguf file, or a built-in shape written as config.json "
        f"only ({', '.join(BUILTIN_SHAPES)}); pair a shape with --load-format dummy.",
    )
    add_engine_args(parser)
    add_log_level_arg(parser)
    add_lora_bench_args(parser)
    parser.add_argument("--json", default=None, metavar="FILE", help="Write the results here.")


def resolve_model(args: argparse.Namespace) -> str:
    """The model to benchmark: the embedded default model when none is given (as
    ``engine serve`` does); a built-in shape name becomes a temporary directory holding its
    config.json."""
    from engine.cli.args import merge_model_args

    merge_model_args(args)
    if args.model is None:
        from engine.default_model import default_model_path

        return str(default_model_path())  # a DefaultModelError says what to install
    if os.path.exists(args.model) or builtin_shape(args.model) is None:
        return args.model
    if args.load_format not in ("dummy",):
        raise SystemExit(
            f"--model {args.model} is a built-in shape without weights: add --load-format dummy"
        )
    root = tempfile.mkdtemp(prefix="engine-bench-")
    return write_builtin_model(args.model, root)


def build_llm(args: argparse.Namespace) -> tuple[Any, float]:
    """The ``LLM`` for these flags and its start-to-ready seconds (weights, KV sizing, graph
    capture, kernel compilation). ``--engine-core-process`` (where a benchmark has it) puts
    the engine core in a process of its own. With ``--num-loras`` the adapters are written and
    loaded afterwards (not counted) and kept as ``args.lora_requests``."""
    from engine.cli.args import configure_logging, engine_config_from_args
    from engine.llm import LLM

    configure_logging(getattr(args, "log_level", "info"))
    args.model = resolve_model(args)
    configure_engine_for_loras(args)
    config = engine_config_from_args(args)
    spec = config.speculative
    if spec is not None and spec.model and not os.path.exists(spec.model):
        if builtin_shape(spec.model) is not None:  # a draft shape, random like the target
            spec.model = write_builtin_model(spec.model, tempfile.mkdtemp(prefix="engine-bench-"))
    start = time.perf_counter()
    llm = LLM.from_engine_config(
        config, multiprocess=True if getattr(args, "engine_core_process", False) else None
    )
    ready = time.perf_counter() - start
    args.lora_requests = bench_lora_requests(llm, args)
    return llm, ready


def engine_settings(llm: Any) -> dict[str, Any]:
    """The settings that shape a benchmark's numbers, for the JSON record."""
    engine = llm.llm_engine
    cfg = engine.config
    core = getattr(engine.client, "core", None)
    if core is not None:
        runner = core.runner
        graphs = getattr(runner, "graphs", None)
        backend, num_blocks = runner.attn_backend_cls.name, runner.num_blocks
    else:  # engine-core processes: what the first one reported
        ready = engine.client.ready[0]
        graphs, backend, num_blocks = None, ready.attention_backend, ready.num_blocks
    return {
        "platform": cfg.platform,
        "model_impl": cfg.model.implementation,
        "attention_backend": backend,
        "dtype": cfg.model.dtype,
        "max_model_len": cfg.model.max_model_len,
        "block_size": cfg.cache.block_size,
        "num_kv_blocks": num_blocks,
        "data_parallel_size": cfg.parallel.data_parallel_size,
        "engine_core_in_process": core is not None,
        "max_num_seqs": cfg.scheduler.max_num_seqs,
        "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
        "enable_prefix_caching": cfg.cache.enable_prefix_caching,
        "gpu_memory_utilization": cfg.cache.gpu_memory_utilization,
        "cuda_graphs": None if graphs is None else graphs.sizes,
        "enforce_eager": cfg.enforce_eager,
        "tensor_parallel_size": cfg.parallel.tensor_parallel_size,
        "pipeline_parallel_size": cfg.parallel.pipeline_parallel_size,
        "executor": getattr(runner, "name", "uni"),
        "async_scheduling": cfg.scheduler.async_scheduling,
        "quantization": _quantization(runner),
        "kv_cache_dtype": cfg.cache.cache_dtype,
        "lora": lora_settings(llm),
    }


def _quantization(runner: Any) -> str | None:
    quant = getattr(runner, "quant_config", None)
    return None if quant is None else quant.describe()


def memory_report(llm: Any) -> dict[str, Any]:
    """Where the memory went: the weights as held (quantized weights stay packed), the KV
    cache, the device's peak and reserved memory (torch's allocator) and the process's RSS."""
    import psutil

    runner = llm.llm_engine.runner
    gib = 1 << 30
    kv = sum(t.numel() * t.element_size() for t in runner.kv_caches)
    report: dict[str, Any] = {
        "weights_gib": round(runner.weights_bytes() / gib, 3),
        "kv_cache_gib": round(kv / gib, 3),
        "num_kv_blocks": runner.num_blocks,
        "process_rss_gib": round(psutil.Process().memory_info().rss / gib, 3),
    }
    if runner.device.type == "cuda":
        import torch

        report["gpu_max_allocated_gib"] = round(torch.cuda.max_memory_allocated() / gib, 3)
        report["gpu_reserved_gib"] = round(torch.cuda.memory_reserved() / gib, 3)
        free, total = torch.cuda.mem_get_info()
        report["gpu_used_gib"] = round((total - free) / gib, 3)
    return report


def hardware() -> dict[str, Any]:
    """The device and host the numbers were measured on."""
    info: dict[str, Any] = {"host": host_platform.node(), "python": host_platform.python_version()}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def sampling_params(max_tokens: int) -> Any:
    """Greedy, ignore EOS, no detokenisation: the token count is exactly ``max_tokens``."""
    from engine.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)


def generate(
    llm: Any, prompts: list[list[int]], output_lens: list[int], loras: list[Any] | None = None
) -> tuple[list[Any], float]:
    """Run the prompts (token ids) to completion; returns the outputs and the seconds taken.
    With ``loras``, request ``i`` uses ``loras[i % len(loras)]``."""
    params = [sampling_params(n) for n in output_lens]
    lora_request = [loras[i % len(loras)] for i in range(len(prompts))] if loras else None
    start = time.perf_counter()
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        params,
        use_tqdm=False,
        lora_request=lora_request,
    )
    return outs, time.perf_counter() - start


def hf_greedy_generate(model: Any, ids: Any, new_tokens: int) -> Any:
    """transformers' ``generate`` producing exactly ``new_tokens`` greedy tokens per row (no EOS
    stop): the baseline the CPU benchmarks compare the engine against."""
    import torch

    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )


def write_json(path: str | None, record: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(record, f, indent=2)


def run_and_release(run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """``run(args)``, then the device memory its engine held given back: a second benchmark in
    the same process (a test, a notebook) sizes its KV cache from the device as the first
    found it, instead of counting the first engine's unreachable tensors as its activations."""
    try:
        return run(args)
    finally:
        import gc

        import torch

        gc.collect()  # the engine, runner and graphs hold one another: only a collection frees them
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
