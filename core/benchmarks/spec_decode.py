"""Speculative decoding on a real copy-heavy task: the same greedy request with and without it.

    python -m engine.benchmarks.spec_decode [--model PATH] [--speculative-config JSON]
        [--max-tokens 256] [--num-iters 3] [--dtype bfloat16] [--threads N] [--json FILE]

The task asks the model (default: the embedded Gemma 3 270M) to rewrite a paragraph with one
word changed, through its chat template: the answer is mostly a copy of the prompt, which a
prompt lookup drafts. Two engines, plain and with ``--speculative-config`` (default
``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
"prompt_lookup_min": 2}``), run the request ``--num-iters`` times each after one warm-up,
alternately (a busy host then slows both alike), with prefix caching off so every run
prefills; reported: the median output tokens/s, the speedup, the acceptance rate, the mean
acceptance length, per-position acceptance, and whether both produced the same tokens (greedy
speculation must not change them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

PARAGRAPH = (
    "The quick brown fox had lived at the edge of the forest for as long as anyone in the "
    "village could remember. Every morning it trotted along the stone wall behind the mill, "
    "stopped at the old well to drink, and then disappeared into the tall grass near the "
    "river. The children believed it guarded the bridge, the farmers believed it stole their "
    "chickens, and the miller, who watched it more closely than anyone, believed it was simply "
    "curious about the people who had built their houses so close to its home."
)
TASK = (
    'Rewrite the following paragraph exactly as it is, changing only the word "quick" to '
    '"clever". Reply with the rewritten paragraph and nothing else.\n\n' + PARAGRAPH
)
DEFAULT_SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}


def _prompt_ids(llm: Any) -> list[int]:
    tok = llm.get_tokenizer()
    if getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": TASK}], add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return list(tok(TASK).input_ids)


def _build(model: str, spec: dict | None, dtype: str, max_len: int) -> tuple[Any, float]:
    from engine import LLM

    start = time.perf_counter()
    llm = LLM(model, enable_prefix_caching=False, speculative_config=spec, max_model_len=max_len,
              cpu_kv_cache_gb=0.5, dtype=dtype)  # fmt: skip
    return llm, time.perf_counter() - start


def _once(llm: Any, prompt: list[int], max_tokens: int) -> tuple[Any, float]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return outs[0].outputs[0], time.perf_counter() - t0


def _record(out: Any, times: list[float], prompt: list[int], ready: float) -> dict[str, Any]:
    sec = statistics.median(times)
    return {
        "prompt_tokens": len(prompt),
        "output_tokens": len(out.token_ids),
        "seconds": round(sec, 4),
        "output_tokens_per_s": round(len(out.token_ids) / sec, 2),
        "runs_s": [round(t, 4) for t in times],
        "start_to_ready_s": round(ready, 2),
        "token_ids": list(out.token_ids),
        "text": out.text,
    }


def run(
    model: str, spec: dict, max_tokens: int, iters: int, dtype: str = "auto", max_len: int = 2048
) -> tuple[dict, dict]:
    """Both engines in this process, their runs alternated (a busy host slows both alike)."""
    from engine.spec_decode.stats import acceptance_summary

    plain, plain_ready = _build(model, None, dtype, max_len)
    fast, fast_ready = _build(model, spec, dtype, max_len)
    prompt = _prompt_ids(plain)
    _once(plain, prompt, max_tokens)  # warm-up
    _once(fast, prompt, max_tokens)
    before = fast.llm_engine.get_stats().spec_decoding
    plain_times, fast_times = [], []
    for _ in range(iters):
        plain_out, t = _once(plain, prompt, max_tokens)
        plain_times.append(t)
        fast_out, t = _once(fast, prompt, max_tokens)
        fast_times.append(t)
    a = _record(plain_out, plain_times, prompt, plain_ready)
    b = _record(fast_out, fast_times, prompt, fast_ready)
    b.update(acceptance_summary(fast.llm_engine.get_stats().spec_decoding, before))
    return a, b


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine.benchmarks.spec_decode", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", default=None, help="Default: the embedded Gemma 3 270M.")
    parser.add_argument("--speculative-config", default=json.dumps(DEFAULT_SPEC))
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", help="Default: %(default)s.")
    parser.add_argument("--max-model-len", type=int, default=2048, help="Default: %(default)s.")
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads.")
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model = args.model
    if model is None:
        from engine.default_model import resolve_model

        model = str(resolve_model(None)[0])
    spec = json.loads(args.speculative_config)
    plain, fast = run(model, spec, args.max_tokens, args.num_iters, args.dtype, args.max_model_len)
    speedup = fast["output_tokens_per_s"] / plain["output_tokens_per_s"]
    same = plain["token_ids"] == fast["token_ids"]
    print(f"prompt: {plain['prompt_tokens']} tokens; output: {plain['output_tokens']} tokens")
    print(f"plain:       {plain['output_tokens_per_s']:8.2f} tok/s  ({plain['seconds']:.3f} s)")
    print(
        f"speculative: {fast['output_tokens_per_s']:8.2f} tok/s  ({fast['seconds']:.3f} s)  "
        f"speedup {speedup:.2f}x"
    )
    print(
        f"acceptance rate {fast.get('acceptance_rate', 0):.3f}, mean acceptance length "
        f"{fast.get('mean_acceptance_length', 1):.2f}, per position "
        f"{fast.get('acceptance_per_position')}; same tokens: {same}"
    )
    if args.json:
        from engine.benchmarks.common import hardware, write_json

        write_json(
            args.json,
            {
                "benchmark": "spec_decode",
                "model": model,
                "dtype": args.dtype,
                "threads": args.threads,
                "speculative_config": spec,
                "plain": plain,
                "speculative": fast,
                "speedup": round(speedup, 3),
                "same_tokens": same,
                "hardware": hardware(),
            },
        )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
