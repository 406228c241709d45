"""The embedded default model on this CPU: the engine against transformers, side by side.

    python -m engine.benchmarks.gemma_cpu [--model PATH.gguf] [--dtypes float32,bfloat16]
        [--batch-sizes 1,8,32] [--prompt-len 64] [--gen-len 64] [--threads N] [--no-hf]

Both sides load the same GGUF (default: the assembled Gemma 3 270M Q4_K_M from
``engine-llm[default-model]``): transformers through ``from_pretrained(dir, gguf_file=...)``, the
engine through its GGUF loader. For each dtype and batch size the same greedy workload (``batch``
prompts of ``prompt_len`` random tokens, exactly ``gen_len`` new tokens each, EOS ignored) runs
through transformers' ``generate`` and through the engine's offline ``LLM`` API, each dtype and
side in its own fresh process (so peak RSS is its own). Prints generated tokens/s (aggregate over
the batch, prefill included), the ratio, token agreement, start-up time and peak RSS.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import resource
import sys
import time
from typing import Any

from engine.benchmarks.common import hf_greedy_generate

_MiB = 1 << 20


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def make_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``batch`` prompts of ``length`` random ids (BOS first), away from the special tokens."""
    rng = random.Random(seed)
    return [[2] + [rng.randrange(1000, vocab) for _ in range(length - 1)] for _ in range(batch)]


def _setup(threads: int | None) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)


def run_hf(
    path: str, dtype: str, batches: list[int], prompt_len: int, gen_len: int, threads: int | None
) -> dict:
    """transformers: ``generate`` on equal-length prompts (no padding), greedy."""
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    _setup(threads)
    p = Path(path)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        p.parent, gguf_file=p.name, dtype=getattr(torch, dtype)
    ).eval()
    load_s = time.perf_counter() - start
    vocab = model.config.vocab_size
    out: dict[str, Any] = {"load_s": load_s, "seconds": {}, "tokens": {}}
    with torch.inference_mode():
        model.generate(
            torch.tensor(make_prompts(1, 8, vocab, 999)), max_new_tokens=4, do_sample=False
        )
        for b in batches:
            ids = torch.tensor(make_prompts(b, prompt_len, vocab, seed=b))
            t0 = time.perf_counter()
            gen = hf_greedy_generate(model, ids, gen_len)
            out["seconds"][b] = time.perf_counter() - t0
            out["tokens"][b] = gen[:, prompt_len:].tolist()
    out["peak_rss"] = _peak_rss()
    return out


def run_engine(
    path: str, dtype: str, batches: list[int], prompt_len: int, gen_len: int, threads: int | None
) -> dict:
    """The engine: the offline ``LLM`` API, greedy, EOS ignored."""
    _setup(threads)
    from engine import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        path,
        dtype=dtype,
        max_model_len=prompt_len + gen_len + 16,
        max_num_seqs=max(batches),
        max_num_batched_tokens=max(2048, prompt_len),
        enable_prefix_caching=False,
        cpu_kv_cache_gb=0.25,
    )
    load_s = time.perf_counter() - start
    vocab = llm.llm_engine.runner.model.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True, detokenize=False)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)
    llm.generate(make_prompts(1, 8, vocab, 999), warm, use_tqdm=False)
    out: dict[str, Any] = {"load_s": load_s, "seconds": {}, "tokens": {}}
    for b in batches:
        prompts = make_prompts(b, prompt_len, vocab, seed=b)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        out["seconds"][b] = time.perf_counter() - t0
        out["tokens"][b] = [o.outputs[0].token_ids for o in outs]
    out["peak_rss"] = _peak_rss()
    return out


def _fresh(fn: Any, *args: Any) -> dict:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="A .gguf file (default: the embedded model).")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--gen-len", type=int, default=64)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)."
    )
    parser.add_argument("--no-hf", action="store_true", help="Measure the engine only.")
    parser.add_argument("--json", default=None, metavar="FILE", help="Write the results here.")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    if args.model is None:
        from engine.default_model import default_model_path

        args.model = str(default_model_path())
    print(
        f"model {args.model}; {args.prompt_len} prompt + {args.gen_len} new tokens per sequence, greedy",
        flush=True,
    )

    results: dict[str, Any] = {}
    for dtype in args.dtypes.split(","):
        common = (args.model, dtype, batches, args.prompt_len, args.gen_len, args.threads)
        eng = _fresh(run_engine, *common)
        hf = None if args.no_hf else _fresh(run_hf, *common)
        results[dtype] = {"engine": eng, "transformers": hf}
        print(
            f"\n{dtype}: engine ready in {eng['load_s']:.1f} s, peak RSS {eng['peak_rss'] / _MiB:.0f} MiB",
            end="",
        )
        if hf:
            print(
                f"; transformers ready in {hf['load_s']:.1f} s, peak RSS {hf['peak_rss'] / _MiB:.0f} MiB",
                end="",
            )
        print()
        print(
            f"{'batch':>5} | {'engine tok/s':>12} | {'HF tok/s':>9} | {'ratio':>6} | tokens equal"
        )
        for b in batches:
            en = b * args.gen_len / eng["seconds"][b]
            if hf is None:
                print(f"{b:>5} | {en:>12.1f} |")
                continue
            ht = b * args.gen_len / hf["seconds"][b]
            same = sum(x == y for x, y in zip(eng["tokens"][b], hf["tokens"][b], strict=True))
            print(f"{b:>5} | {en:>12.1f} | {ht:>9.1f} | {en / ht:>5.2f}x | {same}/{b}", flush=True)
    if args.json:
        for per in results.values():
            for side in per.values():
                if side:
                    side.pop("tokens", None)
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
