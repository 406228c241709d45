"""GGUF kept quantized against dequantized at load: batch-1 decode speed and the model's
weight bytes, on the platform the engine picks (the CPU here; a GPU where one is).

    python -m engine.benchmarks.gguf_decode [--model PATH.gguf] [--dtype bfloat16]
        [--threads 1] [--prompt-len 32] [--gen-len 64] [--modes gguf,none]

For each mode (``gguf``: the default, linear weights kept quantized; ``none``:
``--quantization none``, every tensor dequantized at load) a fresh process loads the model
(default: the embedded Gemma 3 270M Q4_K_M) through the offline ``LLM`` API and runs one greedy
request twice: ``max_tokens=1`` (prefill) and ``max_tokens=gen_len`` (EOS ignored). Decode
tok/s is ``(gen_len - 1) / (t_gen - t_prefill)``, the best of three runs. Weight bytes are the
model's parameters, buffers and oneDNN-prepacked copies (linear layers, embedding, LM head,
norms; storage shared by a tied head counted once). Prints one JSON line per mode
and whether the generated tokens agree.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import time


def _run(
    model: str,
    mode: str,
    dtype: str,
    threads: int,
    prompt_len: int,
    gen_len: int,
    enforce_eager: bool = False,
) -> dict:
    import torch

    torch.set_num_threads(threads)
    from engine import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        model=model,
        dtype=dtype,
        quantization=mode,
        max_model_len=1024,
        max_num_seqs=1,
        enforce_eager=enforce_eager,
    )
    load_s = time.perf_counter() - start
    net = llm.llm_engine.runner.model
    tensors = list(net.parameters()) + list(net.buffers())
    # oneDNN-prepacked copies (engine.layers.cpu_packed_linear) live outside the parameters.
    tensors += [
        m.packed_weight for m in net.modules() if getattr(m, "packed_weight", None) is not None
    ]
    seen, weight_bytes = set(), 0
    for t in tensors:
        # A tied head shares the embedding's storage; an opaque oneDNN tensor has none.
        key = t.data_ptr() if t.layout == torch.strided else id(t)
        if key not in seen:
            seen.add(key)
            weight_bytes += t.numel() * t.element_size()
    rng = random.Random(0)
    prompt = [2] + [rng.randrange(1000, 200_000) for _ in range(prompt_len - 1)]

    def timed(n: int) -> tuple[float, list[int]]:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return time.perf_counter() - t0, list(out[0].outputs[0].token_ids)

    timed(4)  # warm-up
    best = float("inf")
    tokens: list[int] = []
    for _ in range(3):
        t1, _ = timed(1)
        tn, tokens = timed(gen_len)
        best = min(best, (tn - t1) / (gen_len - 1))
    return {
        "mode": mode,
        "dtype": dtype,
        "enforce_eager": enforce_eager,
        "threads": threads,
        "decode_tok_s": round(1.0 / best, 2),
        "weight_bytes": weight_bytes,
        "weight_MiB": round(weight_bytes / 2**20, 1),
        "load_s": round(load_s, 1),
        "tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="A .gguf file (default: the embedded model).")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--gen-len", type=int, default=64)
    parser.add_argument("--modes", default="gguf,none")
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="Decode steps as Python calls, without the CPU's native plans (or CUDA graphs).",
    )
    args = parser.parse_args()
    model = args.model
    if model is None:
        from engine.default_model import default_model_path

        model = str(default_model_path())
    ctx = multiprocessing.get_context("spawn")
    results = []
    for mode in args.modes.split(","):
        with ctx.Pool(1) as pool:
            r = pool.apply(
                _run,
                (
                    model,
                    mode,
                    args.dtype,
                    args.threads,
                    args.prompt_len,
                    args.gen_len,
                    args.enforce_eager,
                ),
            )
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "tokens"}), flush=True)
    if len(results) > 1:
        same = all(r["tokens"] == results[0]["tokens"] for r in results)
        print(json.dumps({"tokens_agree": same}))


if __name__ == "__main__":
    main()
