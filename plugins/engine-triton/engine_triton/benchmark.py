"""Microbenchmark of engine-triton's paged attention on a GPU: launch-configuration sweeps.

``python -m engine_triton.benchmark [--json FILE]`` times the decode kernel (with the fused
cache append, as the backend runs it) over a grid of tile lengths, warps and pipeline depths on
three workloads of the Qwen3-0.6B attention shape (16 query / 8 KV heads, head size 128, bf16,
16-token blocks, shuffled block tables): a full batch of 256 at 600..1100 tokens (nano-vllm's
benchmark mid-run), 32 requests at 1500 and batch 1 at 640. The figure of merit is cache bytes
read per second. It then times a few prefill configurations on 8 fresh 1024-token prompts.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import random
import sys


def _paged(batch: int, ctx: list[int], hq: int, hkv: int, d: int, page: int, dtype):
    import torch

    need = [(c + page - 1) // page for c in ctx]
    ids = list(range(sum(need) + 8))
    random.Random(0).shuffle(ids)
    width = max(need)
    table = torch.zeros(batch, width, dtype=torch.int32)
    at = 0
    slots = []
    for i, n in enumerate(need):
        table[i, :n] = torch.tensor(ids[at : at + n])
        at += n
        pos = ctx[i] - 1
        slots.append(ids[at - n + pos // page] * page + pos % page)
    cache = torch.randn(2, len(ids), page, hkv, d, dtype=dtype, device="cuda")
    q = torch.randn(batch, hq, d, dtype=dtype, device="cuda")
    k = torch.randn(batch, hkv, d, dtype=dtype, device="cuda")
    v = torch.randn(batch, hkv, d, dtype=dtype, device="cuda")
    return dict(
        query=q,
        key=k,
        value=v,
        kv_cache=cache,
        seq_lens=torch.tensor(ctx, dtype=torch.int32, device="cuda"),
        block_table=table.cuda(),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device="cuda"),
    )


def sweep_decode(results: dict) -> None:
    import torch
    import triton.testing

    from engine_triton.kernels.attention import decode_splits, paged_decode

    hq, hkv, d, page = 16, 8, 128, 16
    rng = random.Random(1)
    workloads = {
        "B256_ctx600-1100": [rng.randint(600, 1100) for _ in range(256)],
        "B32_ctx1500": [1500] * 32,
        "B1_ctx640": [640],
    }
    configs = [
        {"block_n": bn, "num_warps": w, "num_stages": st}
        for bn, w, st in itertools.product((32, 64, 128), (4, 8), (2, 3))
    ] + [{"block_n": 16, "num_warps": 4, "num_stages": 3}, {"block_n": 64, "num_warps": 4,
                                                              "num_stages": 1}]  # fmt: skip
    for name, ctx in workloads.items():
        b = len(ctx)
        inputs = _paged(b, ctx, hq, hkv, d, page, torch.bfloat16)
        nbytes = sum(ctx) * hkv * d * 2 * 2
        out = torch.empty_like(inputs["query"])
        counters = torch.zeros(b * hkv, dtype=torch.int32, device="cuda")
        splits = decode_splits(b, hkv, torch.device("cuda"))
        rows = []
        for cfg in configs:
            run = functools.partial(
                paged_decode, inputs["query"], inputs["kv_cache"], out, inputs["seq_lens"],
                inputs["block_table"], b, d**-0.5, num_splits=splits, key=inputs["key"],
                value=inputs["value"], slot_mapping=inputs["slot_mapping"],
                split_counters=counters, config=cfg,
            )  # fmt: skip
            try:
                ms = triton.testing.do_bench(run, warmup=5, rep=25, return_mode="median")
            except Exception as e:  # a config the compiler refuses (e.g. shared memory)
                rows.append({**cfg, "error": repr(e)[:120]})
                continue
            rows.append({**cfg, "us": round(ms * 1e3, 1), "GBps": round(nbytes / ms / 1e6, 0)})
        rows.sort(key=lambda r: r.get("us", 1e12))
        results[f"decode {name} splits={splits} MB={nbytes / 1e6:.0f}"] = rows
        print(f"decode {name} (splits {splits}, {nbytes / 1e6:.0f} MB):", flush=True)
        for r in rows[:6]:
            print("  ", r, flush=True)
        print("   worst:", rows[-1], flush=True)


def spread_check(results: dict, num_blocks: int = 72764) -> None:
    """The default decode configuration at 256 x 600..1100 tokens in a cache the size the
    engine allocates for Qwen3-0.6B on an H200 (72764 blocks, 4.8 GB a layer), with the used
    blocks packed at the start of the cache or spread over all of it."""
    import torch
    import triton.testing

    from engine_triton.kernels.attention import paged_decode

    hq, hkv, d, page = 16, 8, 128, 16
    rng = random.Random(1)
    ctx = [rng.randint(600, 1100) for _ in range(256)]
    need = [(c + page - 1) // page for c in ctx]
    cache = torch.randn(2, num_blocks, page, hkv, d, dtype=torch.bfloat16, device="cuda")
    nbytes = sum(ctx) * hkv * d * 2 * 2
    for layout in ("packed", "spread"):
        pool = list(range(sum(need))) if layout == "packed" else list(range(num_blocks))
        rng.shuffle(pool)
        table = torch.zeros(256, max(need), dtype=torch.int32)
        at = 0
        for i, n in enumerate(need):
            table[i, :n] = torch.tensor(pool[at : at + n])
            at += n
        inputs = dict(
            query=torch.randn(256, hq, d, dtype=torch.bfloat16, device="cuda"),
            seq_lens=torch.tensor(ctx, dtype=torch.int32, device="cuda"),
            block_table=table.cuda(),
        )
        out = torch.empty_like(inputs["query"])
        run = functools.partial(
            paged_decode, inputs["query"], cache, out, inputs["seq_lens"],
            inputs["block_table"], 256, d**-0.5,
        )  # fmt: skip
        ms = triton.testing.do_bench(run, warmup=5, rep=25, return_mode="median")
        row = {"us": round(ms * 1e3, 1), "GBps": round(nbytes / ms / 1e6, 0)}
        results[f"decode 256x600-1100 in {num_blocks} blocks, {layout}"] = row
        print(f"decode 256 x 600..1100, {num_blocks}-block cache, {layout}: {row}", flush=True)


def sweep_prefill(results: dict) -> None:
    import torch
    import triton.testing

    from engine_triton.kernels.attention import paged_prefill

    hq, hkv, d, page, n, length = 16, 8, 128, 16, 8, 1024
    inputs = _paged(n, [length] * n, hq, hkv, d, page, torch.bfloat16)
    t = n * length
    q = torch.randn(t, hq, d, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    qsl = torch.arange(0, t + 1, length, dtype=torch.int32, device="cuda")
    flops = 4 * n * (length * (length + 1) / 2) * hq * d  # causal: QK^T and PV
    rows = []
    for bm, bn, w, st in [(128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2), (128, 32, 8, 3)]:
        cfg = {"block_m": bm, "block_n": bn, "num_warps": w, "num_stages": st}

        def run(cfg=cfg):
            paged_prefill(q, inputs["kv_cache"], out, qsl, inputs["seq_lens"],
                          inputs["block_table"], n, t, d**-0.5, config=cfg)  # fmt: skip

        try:
            ms = triton.testing.do_bench(run, warmup=5, rep=25, return_mode="median")
        except Exception as e:
            rows.append({**cfg, "error": repr(e)[:120]})
            continue
        rows.append({**cfg, "us": round(ms * 1e3, 1), "TFLOPs": round(flops / ms / 1e9, 1)})
    rows.sort(key=lambda r: r.get("us", 1e12))
    results["prefill 8x1024"] = rows
    print("prefill 8 x 1024:", flush=True)
    for r in rows:
        print("  ", r, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument(
        "--spread-only", action="store_true", help="Only the packed/spread block-layout check."
    )
    args = parser.parse_args(argv)
    results: dict = {}
    spread_check(results)
    if args.spread_only:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        return 0
    sweep_decode(results)
    if not args.skip_prefill:
        sweep_prefill(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
