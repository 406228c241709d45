"""Generation throughput on this CPU: the engine against transformers' ``generate``.

    python -m engine.benchmarks.cpu_vs_hf [--arch llama|qwen3] [--batch-sizes 1,8,32]
        [--prompt-len 64] [--gen-len 64] [--hidden-size 512] [--layers 8] [--vocab 32000]
        [--model-impls native,transformers]

Builds one random model (default: a ~58M-parameter Llama) in a temporary directory, then for
each batch size runs the same greedy workload (``batch`` prompts of ``prompt_len`` random tokens,
exactly ``gen_len`` new tokens each, EOS ignored) through transformers and through the engine's
offline ``LLM`` API, alternating the two. Each side runs in its own worker process so its peak
RSS is its own. Prints output tokens/s per side, the ratio, whether the greedy tokens agree, and
peak RSS against the weights' size. ``--model-impls native,transformers`` runs one engine side
per implementation (the transformers modeling backend next to the native path), all
alternating.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.benchmarks.common import hf_greedy_generate

_MiB = 1 << 20


def _rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _peak_rss_bytes() -> int:
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def build_model(path: Path, arch: str, hidden: int, layers: int, vocab: int, seed: int) -> int:
    """Write a random ``arch`` model (plus a small tokenizer, which the engine loads) to
    ``path``; returns its parameter count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.testing.tiny_models import build_tokenizer

    heads = max(1, hidden // 64)
    config = AutoConfig.for_model(
        arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=hidden // heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    # Wider than the default init so greedy choices are decisive (token agreement is then a
    # meaningful check rather than a coin flip between near-equal logits).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.5 / p.shape[-1] ** 0.5)
            elif "norm" in name:
                p.fill_(1.0)
    model.save_pretrained(path)
    build_tokenizer(path)
    return sum(p.numel() for p in model.parameters())


def make_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(batch)]


# Each side lives in its own worker process (so its peak RSS is its own); the worker keeps its
# loaded model here between calls.
_WORKER: dict[str, Any] = {}


def _init_hf(path: str, vocab: int, threads: int) -> None:
    """transformers worker: load the model and warm it up."""
    import torch
    import transformers  # noqa: F401  (both sides measure RSS after torch + transformers)
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)

    _WORKER["base_rss"] = _rss_bytes()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        model.generate(torch.tensor(make_prompts(1, 8, vocab, seed=999)), max_new_tokens=4)
    _WORKER["model"] = model


def _gen_hf(batch: int, prompt_len: int, gen_len: int, vocab: int) -> tuple:
    """One timed ``generate`` of a static-shape batch (equal lengths: no padding)."""
    import torch

    ids = torch.tensor(make_prompts(batch, prompt_len, vocab, seed=batch))
    with torch.inference_mode():
        start = time.perf_counter()
        out = hf_greedy_generate(_WORKER["model"], ids, gen_len)
        seconds = time.perf_counter() - start
    return seconds, out[:, prompt_len:].tolist(), _peak_rss_bytes(), _WORKER["base_rss"]


def _init_engine(
    path: str,
    vocab: int,
    threads: int,
    max_model_len: int,
    max_num_seqs: int,
    model_impl: str = "native",
) -> None:
    """engine worker: build an ``LLM`` and warm it up."""
    import torch
    import transformers  # noqa: F401  (both sides measure RSS after torch + transformers)

    from engine import LLM, SamplingParams

    if threads:
        torch.set_num_threads(threads)

    _WORKER["base_rss"] = _rss_bytes()
    llm = LLM(
        path,
        dtype="float32",
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=False,
        cpu_kv_cache_gb=1.0,
        model_impl=model_impl,
    )
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)
    llm.generate(make_prompts(1, 8, vocab, seed=999), warm, use_tqdm=False)
    _WORKER["llm"] = llm


def _gen_engine(batch: int, prompt_len: int, gen_len: int, vocab: int) -> tuple:
    """One timed greedy ``LLM.generate`` (EOS ignored, no detokenization)."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True, detokenize=False)
    prompts = make_prompts(batch, prompt_len, vocab, seed=batch)
    start = time.perf_counter()
    outs = _WORKER["llm"].generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    return seconds, tokens, _peak_rss_bytes(), _WORKER["base_rss"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="llama", choices=["llama", "qwen3", "qwen2", "mistral"])
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--gen-len", type=int, default=64)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per side and batch")
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads per side (0: torch's default)"
    )
    parser.add_argument(
        "--model-impls",
        default="native",
        help="engine sides, comma-separated: native and/or transformers (default: native)",
    )
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    impls = [i.strip() for i in args.model_impls.split(",") if i.strip()]
    if not impls or any(i not in ("native", "transformers") for i in impls):
        parser.error(f"--model-impls takes native and/or transformers, got {args.model_impls!r}")

    with tempfile.TemporaryDirectory(prefix="engine-bench-") as tmp:
        path = Path(tmp) / args.arch
        num_params = build_model(
            path, args.arch, args.hidden_size, args.layers, args.vocab, args.seed
        )
        weights = num_params * 4
        print(
            f"model: random {args.arch}, {num_params / 1e6:.1f}M params "
            f"({weights / _MiB:.0f} MiB fp32), prompt {args.prompt_len} + {args.gen_len} new "
            "tokens per sequence, greedy",
            flush=True,
        )
        ctx = multiprocessing.get_context("spawn")
        max_len = args.prompt_len + args.gen_len + 8
        sides = {
            "transformers.generate": (_init_hf, (str(path), args.vocab, args.threads), _gen_hf)
        }
        for impl in impls:
            init_args = (str(path), args.vocab, args.threads, max_len, max(batches), impl)
            sides[f"engine {impl}"] = (_init_engine, init_args, _gen_engine)
        pools = {name: ctx.Pool(1, init, init_args) for name, (init, init_args, _) in sides.items()}
        try:
            # Alternate the sides and keep each one's fastest run: the machine may be shared,
            # and alternating spreads any interference over all of them.
            best: dict[str, dict[int, tuple]] = {name: {} for name in sides}
            for b in batches:
                for _ in range(args.repeat):
                    for name, pool in pools.items():
                        fn = sides[name][2]
                        r = pool.apply(fn, (b, args.prompt_len, args.gen_len, args.vocab))
                        if b not in best[name] or r[0] < best[name][b][0]:
                            best[name][b] = r
            rss = {
                name: (pool.apply(_peak_rss_bytes), best[name][batches[0]][3])
                for name, pool in pools.items()
            }
        finally:
            for pool in pools.values():  # a clean exit (terminate() leaks a semaphore)
                pool.close()
                pool.join()

    hf = best.pop("transformers.generate")
    print()
    header = f"{'batch':>5} | {'HF tok/s':>9}"
    for name in best:
        header += f" | {name + ' tok/s':>22} | {'ratio':>6} | tokens equal"
    print(header)
    print("-" * len(header))
    for b in batches:
        hf_tps = b * args.gen_len / hf[b][0]
        row = f"{b:>5} | {hf_tps:>9.1f}"
        for runs in best.values():
            tps = b * args.gen_len / runs[b][0]
            same = sum(x == y for x, y in zip(hf[b][1], runs[b][1], strict=True))
            row += f" | {tps:>22.1f} | {tps / hf_tps:>5.2f}x | {f'{same}/{b}':>12}"
        print(row)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"(output tokens/s, best of {args.repeat} alternating runs per side; "
        f"{os.cpu_count()} CPUs, load average {load})"
    )
    print()
    for name, (peak, base) in rss.items():
        print(
            f"peak RSS {name:>22}: {peak / _MiB:7.0f} MiB ({(peak - base) / _MiB:6.0f} MiB above "
            f"the process after imports; weights {weights / _MiB:.0f} MiB)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
