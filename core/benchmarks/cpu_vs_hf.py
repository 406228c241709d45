"""Generation throughput on this CPU: the engine against transformers' ``generate``.

    python -m engine.benchmarks.cpu_vs_hf [--arch llama|qwen3] [--batch-sizes 1,8,32]
        [--prompt-len 64] [--gen-len 64] [--hidden-size 512] [--layers 8] [--vocab 32000]

Builds one random model (default: a ~58M-parameter Llama) in a temporary directory, then for
each batch size runs the same greedy workload (``batch`` prompts of ``prompt_len`` random tokens,
exactly ``gen_len`` new tokens each, EOS ignored) through transformers and through the engine's
offline ``LLM`` API. Each side runs in its own fresh process so its peak RSS is its own. Prints
output tokens/s per side, the ratio, whether the greedy tokens agree, and peak RSS against the
weights' size.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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


def run_hf(path: str, batches: list[int], prompt_len: int, gen_len: int, vocab: int) -> dict:
    """transformers side: ``generate`` with a static-shape batch (no padding needed)."""
    import torch
    import transformers  # noqa: F401  (both sides measure RSS after torch + transformers)
    from transformers import AutoModelForCausalLM

    base = _rss_bytes()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    results: dict[str, Any] = {"tokens": {}, "seconds": {}}
    with torch.inference_mode():
        warm = torch.tensor(make_prompts(1, 8, vocab, seed=999))
        model.generate(warm, max_new_tokens=4, do_sample=False)
        for b in batches:
            ids = torch.tensor(make_prompts(b, prompt_len, vocab, seed=b))
            start = time.perf_counter()
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=gen_len,
                min_new_tokens=gen_len,
                do_sample=False,
                pad_token_id=0,
            )
            results["seconds"][b] = time.perf_counter() - start
            results["tokens"][b] = out[:, prompt_len:].tolist()
    results["peak_rss"] = _peak_rss_bytes()
    results["base_rss"] = base
    return results


def run_engine(path: str, batches: list[int], prompt_len: int, gen_len: int, vocab: int) -> dict:
    """engine side: the offline ``LLM`` API with greedy sampling and EOS ignored."""
    import torch  # noqa: F401  (both sides measure RSS after torch + transformers)
    import transformers  # noqa: F401

    from engine import LLM, SamplingParams

    base = _rss_bytes()
    llm = LLM(
        path,
        dtype="float32",
        max_model_len=prompt_len + gen_len + 8,
        max_num_seqs=max(batches),
        enable_prefix_caching=False,
        cpu_kv_cache_gb=1.0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True, detokenize=False)
    results: dict[str, Any] = {"tokens": {}, "seconds": {}}
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)
    llm.generate(make_prompts(1, 8, vocab, seed=999), warm, use_tqdm=False)
    for b in batches:
        prompts = make_prompts(b, prompt_len, vocab, seed=b)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        results["seconds"][b] = time.perf_counter() - start
        results["tokens"][b] = [o.outputs[0].token_ids for o in outs]
    results["peak_rss"] = _peak_rss_bytes()
    results["base_rss"] = base
    return results


def _in_fresh_process(fn: Any, *args: Any) -> dict:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(fn, args)


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
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batch_sizes.split(",")]

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
        common = (str(path), batches, args.prompt_len, args.gen_len, args.vocab)
        hf = _in_fresh_process(run_hf, *common)
        eng = _in_fresh_process(run_engine, *common)

    print()
    print(f"{'batch':>5} | {'HF tok/s':>9} | {'engine tok/s':>12} | {'ratio':>6} | tokens equal")
    print("-" * 58)
    for b in batches:
        hf_tps = b * args.gen_len / hf["seconds"][b]
        en_tps = b * args.gen_len / eng["seconds"][b]
        same = sum(x == y for x, y in zip(hf["tokens"][b], eng["tokens"][b], strict=True))
        print(f"{b:>5} | {hf_tps:>9.1f} | {en_tps:>12.1f} | {en_tps / hf_tps:>5.2f}x | {same}/{b}")
    print()
    for name, r in (("transformers", hf), ("engine", eng)):
        print(
            f"peak RSS {name:>12}: {r['peak_rss'] / _MiB:7.0f} MiB "
            f"({(r['peak_rss'] - r['base_rss']) / _MiB:6.0f} MiB above the process after imports; "
            f"weights {weights / _MiB:.0f} MiB)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
