"""LoRA adapters for benchmarks: ``--num-loras N --lora-rank R``.

``engine bench throughput|latency`` and ``kernel_profile`` with ``--num-loras N`` write ``N``
random adapters of rank ``R`` in the PEFT format for the loaded model (every linear layer of
its decoder, shapes read from the model itself, so any shape works, dummy weights included),
load them, and spread the requests over them round-robin (request ``i`` uses adapter
``i % N``). Without ``--enable-lora`` the engine gets ``--max-loras N`` and
``--max-lora-rank R``. The adapters are written before timing starts and loaded through the
same path as users' (``LLM.add_lora``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any


def add_lora_bench_args(parser: argparse.ArgumentParser) -> None:
    """``--num-loras`` and ``--lora-rank``."""
    group = parser.add_argument_group("LoRA benchmark adapters")
    group.add_argument(
        "--num-loras",
        type=int,
        default=0,
        help="Write this many random LoRA adapters for the model and spread the requests over "
        "them (default: %(default)s: no LoRA).",
    )
    group.add_argument(
        "--lora-rank", type=int, default=16, help="Rank of those adapters (default: %(default)s)."
    )


def configure_engine_for_loras(args: argparse.Namespace) -> None:
    """Turn LoRA on for ``--num-loras`` (unless ``--enable-lora`` chose the limits)."""
    num = getattr(args, "num_loras", 0)
    if num < 0 or getattr(args, "lora_rank", 16) < 1:
        raise SystemExit("--num-loras must be >= 0 and --lora-rank >= 1")
    if num and not args.enable_lora:
        args.enable_lora = True
        args.max_loras = num
        args.max_lora_rank = args.lora_rank
        args.max_cpu_loras = None


def write_dummy_adapters(
    llm: Any, num: int, rank: int, root: str | Path | None = None, seed: int = 0
) -> list[Path]:
    """``num`` random rank-``rank`` adapters (PEFT format) for every LoRA layer of the loaded
    model, in the model dtype; returns their directories."""
    import torch
    from safetensors.torch import save_file

    manager = llm.llm_engine.runner.lora
    if manager is None:
        raise SystemExit("--num-loras needs LoRA enabled (--enable-lora)")
    root = Path(root or tempfile.mkdtemp(prefix="engine-bench-loras-"))
    dtype = manager.dtype
    gen = torch.Generator().manual_seed(seed)
    leaves = sorted({m.split(".")[-1] for m in manager.module_names})
    paths = []
    for i in range(num):
        tensors = {}
        for target in manager.targets.values():
            layer = target.layer
            for s, module in enumerate(target.slice_modules):
                a = torch.randn(rank, layer.input_size, generator=gen) / layer.input_size**0.5
                b = torch.randn(layer.output_full_sizes[s], rank, generator=gen) * 0.01
                tensors[f"base_model.model.{module}.lora_A.weight"] = a.to(dtype)
                tensors[f"base_model.model.{module}.lora_B.weight"] = b.to(dtype)
        path = root / f"lora-{i}"
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": leaves}
        (path / "adapter_config.json").write_text(json.dumps(config))
        paths.append(path)
    return paths


def bench_lora_requests(llm: Any, args: argparse.Namespace) -> list[Any] | None:
    """Write and load ``--num-loras`` adapters; their ``LoRARequest``s (None without)."""
    num = getattr(args, "num_loras", 0)
    if not num:
        return None
    from engine.lora.request import LoRARequest

    paths = write_dummy_adapters(llm, num, args.lora_rank, seed=args.seed)
    requests = [LoRARequest(f"bench-lora-{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    for request in requests:
        llm.add_lora(request)
    print(f"{num} LoRA adapters of rank {args.lora_rank} loaded", flush=True)
    return requests


def lora_settings(llm: Any) -> dict[str, Any] | None:
    """The engine's LoRA settings for a benchmark's JSON record (None: LoRA off)."""
    lora = llm.llm_engine.config.lora
    if lora is None:
        return None
    manager = llm.llm_engine.runner.lora
    return {
        "adapters_loaded": len(manager.registered()) if manager is not None else 0,
        "max_loras": lora.max_loras,
        "max_lora_rank": lora.max_lora_rank,
        "max_cpu_loras": lora.max_cpu_loras,
    }
