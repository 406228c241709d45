"""KV-cache waste measured through the real engine (model, runner, scheduler, sampler).

    python -m engine.benchmarks.kv_waste [--model DIR] [--num-prompts 64] [--block-size 16]

Runs a mixed workload (prompt and output lengths drawn uniformly from ranges) through
``LLMEngine`` and samples the scheduler's stats after every step. Waste is the fraction of
allocated KV slots that hold no computed or scheduled token; it is reported at the step of peak
KV usage and averaged over the run, weighted by usage. Without ``--model`` a tiny random Llama is
built in a temporary directory, since waste depends on lengths and block size, not weights.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile


def run(args: argparse.Namespace) -> dict:
    from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    model = args.model
    if model is None:
        from engine.testing.tiny_models import build_tiny_model

        model = str(
            build_tiny_model(
                tempfile.mkdtemp(prefix="kv_waste_"), "llama", max_position_embeddings=4096
            )
        )
    config = EngineConfig(
        model=ModelConfig(model=model, dtype="float32", load_format=args.load_format),
        cache=CacheConfig(
            block_size=args.block_size, num_gpu_blocks=args.num_blocks, enable_prefix_caching=False
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
        ),
    )
    engine = LLMEngine.from_config(config)
    rng = random.Random(args.seed)
    vocab = engine.runner.vocab_size
    for i in range(args.num_prompts):
        prompt = [rng.randrange(10, vocab) for _ in range(rng.randint(*args.input_len))]
        params = SamplingParams(
            temperature=0.0, ignore_eos=True, max_tokens=rng.randint(*args.output_len)
        )
        engine.add_request(str(i), None, params, prompt_token_ids=prompt, final_only=True)
    peak_usage = waste_at_peak = weighted = usage_sum = 0.0
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.scheduler.stats()
        steps += 1
        weighted += stats.kv_waste * stats.kv_usage
        usage_sum += stats.kv_usage
        if stats.kv_usage >= peak_usage:
            peak_usage, waste_at_peak = stats.kv_usage, stats.kv_waste
    result = {
        "num_prompts": args.num_prompts,
        "block_size": args.block_size,
        "steps": steps,
        "peak_kv_usage": round(peak_usage, 4),
        "kv_waste_at_peak": round(waste_at_peak, 4),
        "kv_waste_usage_weighted": round(weighted / usage_sum, 4) if usage_sum else 0.0,
        "preemptions": engine.scheduler.stats().num_preemptions,
        "blocks_in_use_after": engine.num_used_blocks,
    }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, nargs=2, default=(16, 512), metavar=("MIN", "MAX"))
    parser.add_argument(
        "--output-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX")
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:26s} {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
