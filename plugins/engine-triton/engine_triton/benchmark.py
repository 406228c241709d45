"""Microbenchmark of engine-llm-triton's paged attention on a GPU: launch-configuration sweeps.

``python -m engine_triton.benchmark [--json FILE]`` times the decode kernel (with the fused
cache append, as the backend runs it) over a grid of tile lengths, warps and pipeline depths on
three workloads of the Qwen3-0.6B attention shape (16 query / 8 KV heads, head size 128, bf16,
16-token blocks, shuffled block tables): a full batch of 256 at 600..1100 tokens (nano-vllm's
benchmark mid-run), 32 requests at 1500 and batch 1 at 640. The figure of merit is cache bytes
read per second. It then times a few prefill configurations on 8 fresh 1024-token prompts.

``python -m engine_triton.benchmark --linear-only [--json FILE]`` instead times the skinny GEMM
(``engine_triton.kernels.linear``) against ``F.linear`` on the decode matmuls of Qwen3-0.6B and
Llama-3.1-8B for M = 1, 2, 4, 8, 16: every candidate configuration and the heuristic's choice,
each as a plain ``do_bench`` (L2 flushed) and per call inside a CUDA graph of 100 back-to-back
calls over rotating weight copies (how the engine runs them). It prints achieved weight GB/s,
the max error against ``F.linear``, and ``TUNED`` lines ready to paste into the kernel module.

``python -m engine_triton.benchmark --moe-only [--moe-shapes S] [--moe-tokens 1,8,...]
[--moe-fp8 block|channel] [--moe-wna16 w4-g128|w4-g128-zp|w8-g128|gguf-q4k-q6k|gguf-q4k]``
(FP8 experts through ``fused_moe_fp8``, or 4/8-bit integer experts in groups through
``fused_moe_wna16``, GGUF stacks included; all weight-only) times the fused MoE kernel (``engine_triton.kernels.fused_moe``) per layer on the Qwen3-30B-A3B
(128 experts, top-8, hidden 2048, 768 wide) and Mixtral-8x7B (8 experts, top-2, 4096, 14336)
shapes, and gpt-oss-20b's (32 experts, top-4, 2880, 2880; biased, with the clamped SwiGLU:
``fused_moe_biased``, unquantized only), and GPT-OSS as released, gpt-oss-20b's and
gpt-oss-120b's (128 experts) MXFP4 experts through ``fused_moe_mxfp4`` (``--moe-shapes
gpt-oss`` takes all three), bf16, uniformly random routing, for each token count: both ways through the experts
(decode GEMVs, grouped GEMMs) and a few launch configurations, each per call inside a CUDA
graph over rotating weight copies and routings (HBM, not L2). It reports the bytes the call
must read (the distinct experts hit, plus activations), the achieved GB/s against this GPU's
measured copy bandwidth, the routing kernel's time, and the per-decode-step total over the
model's layers against the time to read the model's active parameters once.

``python -m engine_triton.benchmark --cascade-only [--cascade-batches 64,128,256]`` times
the decode kernel with cascade attention (``paged_decode`` with a shared prefix) for each launch
configuration of the shared pass, against the plain decode kernel over the same contexts, on
the Llama-3.1-8B attention shape: 64-256 requests behind one 2,000-token prefix in shared
blocks, each with 1-600 tokens of its own, per call inside a CUDA graph.

``python -m engine_triton.benchmark --lora-only [--lora-tokens 1,8,...] [--lora-rank 16]``
times the multi-LoRA op (``engine_triton.kernels.lora``: one shrink and one expand launch) on
the four Llama-3.1-8B projections (fused q/k/v, o, fused gate/up, down), bf16, 8 adapter slots
with the tokens spread evenly over them, per call inside a CUDA graph, next to the base
projection (``linear``) at the same token count; the shrink's split-K is swept around the
rule's choice. It prints the per-decode-step total over 32 layers and its ratio to the base
projections' (the decode-step overhead LoRA adds to the linear layers).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import random
import sys


def _paged(
    batch: int, ctx: list[int], hq: int, hkv: int, d: int, page: int, dtype, device: str = "cuda"
):
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
    cache = torch.randn(2, len(ids), page, hkv, d, dtype=dtype, device=device)
    q = torch.randn(batch, hq, d, dtype=dtype, device=device)
    k = torch.randn(batch, hkv, d, dtype=dtype, device=device)
    v = torch.randn(batch, hkv, d, dtype=dtype, device=device)
    return dict(
        query=q,
        key=k,
        value=v,
        kv_cache=cache,
        seq_lens=torch.tensor(ctx, dtype=torch.int32, device=device),
        block_table=table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
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


# Cascade attention's shared pass (``_shared_prefix_kernel``): the attention shape, the
# shared prefix and the batches of issue 20's shared-prefix workload (256 requests behind one
# 2,000-token prompt), and the launch configurations tried.
CASCADE_SHAPES = {"llama-3.1-8b": dict(hq=32, hkv=8, d=128, layers=32)}
CASCADE_PREFIX = 2000
CASCADE_SUFFIX = (1, 600)  # each request's own tokens after the prefix
CASCADE_CONFIGS = [
    {"block_m": bm, "block_n": bn, "num_warps": w, "num_stages": st}
    for bm, bn, w, st in itertools.product((32, 64, 128), (32, 64), (4, 8), (2, 3))
]


def _each_call(fn, **kwargs):
    """``call(i)`` for ``_graph_us``: ``fn(**kwargs)``, the same call every time."""
    return lambda i: fn(**kwargs)


def sweep_cascade(
    results: dict,
    batches: tuple[int, ...] = (64, 128, 256),
    configs: list[dict] | None = None,
    device: str = "cuda",
) -> None:
    """Time ``paged_decode`` with cascade attention (the shared pass's launch configurations
    of ``CASCADE_CONFIGS``, regime ``"shared_prefix"``) against the plain decode kernel over
    the same contexts, per call inside a CUDA graph, on ``CASCADE_SHAPES`` at each batch: every
    request holds the same ``CASCADE_PREFIX`` tokens in the same blocks, then its own
    ``CASCADE_SUFFIX`` tokens. Prints microseconds a call and a decode step's worth (times the
    layers), and each configuration's largest difference from the plain kernel's output."""
    import torch

    from engine.attention_backends.interface import CascadeInputs, SharedPrefix
    from engine_triton.kernels.attention import paged_decode

    page = 16
    configs = CASCADE_CONFIGS if configs is None else configs
    print(f"cascade: {torch.cuda.get_device_name(device)}, bf16, prefix {CASCADE_PREFIX} "
          f"tokens, own suffixes {CASCADE_SUFFIX}; us = per call in a graph", flush=True)  # fmt: skip
    for name, sh in CASCADE_SHAPES.items():
        hq, hkv, d = sh["hq"], sh["hkv"], sh["d"]
        for b in batches:
            rng = random.Random(b)
            ctx = [CASCADE_PREFIX + rng.randint(*CASCADE_SUFFIX) for _ in range(b)]
            torch.manual_seed(b)
            inputs = _paged(b, ctx, hq, hkv, d, page, torch.bfloat16, device)
            table = inputs["block_table"]
            shared_blocks = CASCADE_PREFIX // page
            table[1:, :shared_blocks] = table[0, :shared_blocks]  # as the prefix cache does
            cascade = CascadeInputs.from_prefix(
                SharedPrefix(shared_blocks * page, tuple(range(b))), b, device
            )
            counters = torch.zeros(b * hkv, dtype=torch.int32, device=device)
            reads = (shared_blocks * page + sum(ctx) - b * shared_blocks * page) * hkv * d * 4

            decode = functools.partial(
                paged_decode, query=inputs["query"], kv_cache=inputs["kv_cache"],
                seq_lens=inputs["seq_lens"], block_table=table, num_seqs=b, scale=d**-0.5,
                key=inputs["key"], value=inputs["value"], slot_mapping=inputs["slot_mapping"],
                split_counters=counters,
            )  # fmt: skip
            plain = torch.empty_like(inputs["query"])
            plain_us = _graph_us(_each_call(decode, out=plain))
            rows = [{"config": "plain decode", "us": round(plain_us, 1)}]
            for cfg in configs:
                out = torch.empty_like(inputs["query"])
                run = _each_call(decode, out=out, cascade_starts=cascade.starts,
                                 cascade_prefix=cascade.prefix, configs={"shared_prefix": cfg})  # fmt: skip
                try:
                    us = _graph_us(run)
                except Exception as e:  # a configuration the compiler refuses
                    rows.append({"config": cfg, "error": repr(e)[:120]})
                    continue
                err = (out.float() - plain.float()).abs().max().item()
                rows.append({"config": cfg, "us": round(us, 1), "max_err": round(err, 4)})
            rows.sort(key=lambda r: r.get("us", 1e12))
            key = f"cascade {name} B={b}"
            results[key] = {"reads_MB": round(reads / 1e6, 1), "rows": rows}
            print(f"{key}: {reads / 1e6:.1f} MB of distinct keys/values; plain decode "
                  f"{plain_us:.1f} us ({plain_us * sh['layers'] / 1e3:.2f} ms a step)", flush=True)  # fmt: skip
            for r in rows[:6]:
                step = f" ({r['us'] * sh['layers'] / 1e3:.2f} ms a step)" if "us" in r else ""
                print("  ", r, step, flush=True)
            errors = [r for r in rows if "error" in r or r.get("max_err", 0) > 0.05]
            if errors:
                print("   ERROR or max_err > 0.05:", errors[:3], flush=True)


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


# (model, layer) -> (N, K, layers per step) of the decode matmuls x[M, K] @ W[N, K]^T.
LINEAR_SHAPES = {
    "qwen3-0.6b qkv": (4096, 1024, 28),
    "qwen3-0.6b o": (1024, 2048, 28),
    "qwen3-0.6b gate_up": (6144, 1024, 28),
    "qwen3-0.6b down": (1024, 3072, 28),
    "qwen3-0.6b lm_head": (151936, 1024, 1),
    "llama-8b qkv": (6144, 4096, 32),
    "llama-8b o": (4096, 4096, 32),
    "llama-8b gate_up": (28672, 4096, 32),
    "llama-8b down": (4096, 14336, 32),
    "llama-8b lm_head": (128256, 4096, 1),
    "qwen3-30b-a3b qkv": (5120, 2048, 48),
    "qwen3-30b-a3b o": (2048, 4096, 48),
    "qwen3-30b-a3b router": (128, 2048, 48),
    "qwen3-30b-a3b lm_head": (151936, 2048, 1),
}
GRAPH_CALLS = 100
L2_ROTATE_BYTES = 256 << 20  # weight copies a graph cycles through, well past the 50 MB L2


def _rotating(op, x, weights, *extra):
    """``call(i)``: ``op(x, weights[i % len(weights)], *extra)`` (a fresh weight copy each call,
    so a graph of back-to-back calls reads HBM, not L2)."""
    return lambda i: op(x, weights[i % len(weights)], *extra)


def _graph_us(call, calls: int = GRAPH_CALLS, replays: int = 5) -> float:
    """Microseconds per call of ``call(i)`` for i in 0..calls-1 captured in one CUDA graph."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(end) * 1e3 / (replays * calls)


def sweep_linear(
    results: dict,
    shapes: list[str] | None = None,
    ms: tuple[int, ...] = (1, 2, 4, 8, 16),
    budget_s: float = 80.0,
    candidates: bool = True,
    device: str = "cuda",
) -> None:
    """F.linear vs the skinny kernel (heuristic and candidates) on ``LINEAR_SHAPES``. After
    ``budget_s`` seconds only F.linear and the heuristic are timed (the run stays short)."""
    import time

    import torch
    import torch.nn.functional as F
    import triton.testing

    from engine_triton.kernels import linear as lin

    t0 = time.perf_counter()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    names = [s for s in LINEAR_SHAPES if not shapes or any(f in s for f in shapes)]
    dtype = torch.bfloat16
    tuned_lines, per_step = [], {}
    print(f"linear: {torch.cuda.get_device_name(device)} ({sms} SMs), bf16; us = do_bench median "
          f"(L2 flushed) | graph = us/call in a graph of {GRAPH_CALLS}", flush=True)  # fmt: skip
    for name in names:
        n, k, per_model = LINEAR_SHAPES[name]
        wbytes = n * k * dtype.itemsize
        copies = max(1, min(GRAPH_CALLS, -(-L2_ROTATE_BYTES // wbytes)))
        weights = [torch.randn(n, k, dtype=dtype, device=device) * k**-0.5]
        weights += [torch.empty_like(weights[0]).copy_(weights[0]) for _ in range(copies - 1)]
        w = weights[0]
        for m in ms:
            x = torch.randn(m, k, dtype=dtype, device=device)
            ref = F.linear(x, w)
            heur = lin.config_for(m, n, k, sms)
            over = time.perf_counter() - t0 > budget_s
            cfgs = lin.candidate_configs(m, n, k) if candidates and not over else []
            if heur not in cfgs:
                cfgs.append(heur)
            entries = [("F.linear", None)] + [(c.short(), c) for c in cfgs]
            rows = []
            for label, cfg in entries:
                if cfg is None:
                    fn = functools.partial(F.linear, x, w)
                    call = _rotating(F.linear, x, weights)
                else:
                    fn = functools.partial(lin.skinny_linear, x, w, None, cfg)
                    call = _rotating(lin.skinny_linear, x, weights, None, cfg)

                try:
                    err = (fn().float() - ref.float()).abs().max().item()
                    us = triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median") * 1e3
                    g_us = _graph_us(call)
                except Exception as e:  # a config the compiler refuses
                    rows.append({"config": label, "error": repr(e)[:160]})
                    continue
                rows.append({
                    "config": label, "params": cfg.as_dict() if cfg else None,
                    "heuristic": cfg == heur, "us": round(us, 2), "GBps": round(wbytes / us / 1e3),
                    "graph_us": round(g_us, 2), "graph_GBps": round(wbytes / g_us / 1e3),
                    "max_err": round(err, 5),
                })  # fmt: skip
            ok = [r for r in rows if "graph_us" in r]
            base = next(r for r in ok if r["config"] == "F.linear")
            mine = [r for r in ok if r["config"] != "F.linear"]
            best = min(mine, key=lambda r: r["graph_us"]) if mine else None
            chosen = next((r for r in mine if r["heuristic"]), None)
            results[f"linear {name} M={m} N={n} K={k}"] = rows
            key = f"{name.split()[0]} M={m}"
            step = per_step.setdefault(key, {"F.linear": 0.0, "heuristic": 0.0, "best": 0.0})
            step["F.linear"] += per_model * base["graph_us"]
            step["heuristic"] += per_model * (chosen or base)["graph_us"]
            step["best"] += per_model * min(base["graph_us"], (best or base)["graph_us"])

            def fmt(r):
                if r is None:
                    return "-"
                return (f"{r['us']:7.2f}us {r['GBps']:5d}GB/s | graph {r['graph_us']:6.2f}us "
                        f"{r['graph_GBps']:5d}GB/s")  # fmt: skip

            print(f"{name:20s} M={m:<2d} F.linear  {fmt(base)}", flush=True)
            print(f"{'':25s} heuristic {fmt(chosen)}  [{heur.short()}]", flush=True)
            if best is not None and best is not chosen:
                print(f"{'':25s} best      {fmt(best)}  [{best['config']}]", flush=True)
            bad = [r for r in mine if r["max_err"] > 0.05]
            if bad:
                print(f"{'':25s} ERROR too large: {[(r['config'], r['max_err']) for r in bad]}")
            if best is not None and best["graph_us"] < 0.97 * (chosen or base)["graph_us"]:
                p = best["params"]
                tuned_lines.append(
                    f"    ({lin.m_bucket(m)}, {n}, {k}): C({p['block_n']}, {p['block_k']}, "
                    f"{p['num_warps']}, {p['num_stages']}, split_k={p['split_k']}, "
                    f"dot={p['dot']}),  # {name}: {best['graph_us']} us vs "
                    f"heuristic {(chosen or base)['graph_us']}, F.linear {base['graph_us']}"
                )
        del weights
        torch.cuda.empty_cache()
    print("\nper decode step, all matmuls of the model (graph us/call x layers):")
    for key, step in per_step.items():
        print(f"  {key:18s} " + "  ".join(f"{a} {v:8.1f}us" for a, v in step.items()))
    results["linear per step us"] = per_step
    results["linear TUNED suggestions"] = tuned_lines
    if tuned_lines:
        print("\nTUNED entries (best candidate beats the heuristic by > 3% in a graph):")
        print("\n".join(tuned_lines))
    print(f"\nlinear sweep took {time.perf_counter() - t0:.0f} s", flush=True)


# Expert shapes: experts, top-k, hidden, expert intermediate, MoE layers, active parameters
# outside the experts (attention, router, LM head) for the per-step floor.
MOE_SHAPES = {
    "qwen3-30b-a3b": dict(experts=128, top_k=8, hidden=2048, inter=768, layers=48,
                          other_params=48 * (2048 * 128 * 40 + 128 * 2048) + 151936 * 2048),
    "mixtral-8x7b": dict(experts=8, top_k=2, hidden=4096, inter=14336, layers=32,
                         other_params=32 * (4096 * 128 * 48 + 4096 * 128 * 32 + 8 * 4096)
                         + 32000 * 4096),
    # Biased experts with the clamped SwiGLU (``biased``): timed through fused_moe_biased,
    # unquantized only (--moe-fp8 / --moe-wna16 pass over it).
    "gpt-oss-20b": dict(experts=32, top_k=4, hidden=2880, inter=2880, layers=24, biased=True,
                        other_params=24 * (2880 * 64 * 64 * 2 + 2880 * 8 * 64 * 2 + 2880 * 32)
                        + 201088 * 2880),
    # GPT-OSS as released (``mxfp4``): MXFP4 experts with their biases, timed through
    # fused_moe_mxfp4 (--moe-fp8 / --moe-wna16 pass over them).
    "gpt-oss-20b-mxfp4": dict(experts=32, top_k=4, hidden=2880, inter=2880, layers=24,
                              biased=True, mxfp4=True,
                              other_params=24 * (2880 * 64 * 64 * 2 + 2880 * 8 * 64 * 2
                                                 + 2880 * 32) + 201088 * 2880),
    "gpt-oss-120b-mxfp4": dict(experts=128, top_k=4, hidden=2880, inter=2880, layers=36,
                               biased=True, mxfp4=True,
                               other_params=36 * (2880 * 64 * 64 * 2 + 2880 * 8 * 64 * 2
                                                  + 2880 * 128) + 201088 * 2880),
}  # fmt: skip
# Bytes an MXFP4 weight takes: its 4-bit code and its share of its block's exponent byte.
MOE_MXFP4_BYTES = 0.5 + 1 / 32
# GPT-OSS's clamped SwiGLU, for the biased shapes.
MOE_SWIGLU = ("swigluoai", 1.702, 7.0)
MOE_ROTATE_BYTES = 1 << 30  # weight copies a graph cycles through


def _copy_gbps(device: str, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), in GB/s."""
    import torch
    import triton.testing

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=5, rep=50, return_mode="median")
    return 2 * nbytes / ms / 1e6


def _moe_call(x, weights, routes, kw):
    """``call(j)``: the fused MoE on weight copy ``j`` and routing ``j`` (rotating). A copy
    is ``(w13, w2)``, ``(w13, w2, w13_bias, w2_bias)`` for biased experts, ``(w13, w2,
    w13_scale, w2_scale, block_size)`` for FP8 experts, ``(w13, w2, w13_scales, w2_scales,
    w13_bias, w2_bias)`` for MXFP4 ones, or longer for integer ones."""

    def call(j):
        ids, w = routes[j % len(routes)]
        return _moe_run(x, weights[j % len(weights)], w, ids, kw)

    return call


def _moe_run(x, copy, topk_weights, topk_ids, kw):
    from engine_triton.kernels import fused_moe as fm

    if len(copy) == 2:
        return fm.fused_moe(x, *copy, topk_weights, topk_ids, **kw)
    if len(copy) == 4:  # biased experts (GPT-OSS)
        w13, w2, b13, b2 = copy
        return fm.fused_moe_biased(x, w13, w2, topk_weights, topk_ids, b13, b2, *MOE_SWIGLU, **kw)
    if len(copy) == 6:  # MXFP4 experts (GPT-OSS as released)
        return fm.fused_moe_mxfp4(x, *copy[:2], topk_weights, topk_ids, *copy[2:], *MOE_SWIGLU,
                                  **kw)  # fmt: skip
    if len(copy) >= 7:  # integer experts (GGUF ones: with permutations, offsets, down width)
        w13, w2, s13, s2, *rest = copy
        return fm.fused_moe_wna16(x, w13, w2, topk_weights, topk_ids, s13, s2, *rest, **kw)
    w13, w2, s13, s2, block = copy
    return fm.fused_moe_fp8(x, w13, w2, topk_weights, topk_ids, s13, s2, block, **kw)


def _moe_reference(x, copy, topk_weights, topk_ids):
    from engine.kernels import reference as ref

    if len(copy) == 2:
        return ref.fused_moe(x, *copy, topk_weights, topk_ids)
    if len(copy) == 4:
        w13, w2, b13, b2 = copy
        return ref.fused_moe_biased(x, w13, w2, topk_weights, topk_ids, b13, b2, *MOE_SWIGLU)
    if len(copy) == 6:
        return ref.fused_moe_mxfp4(x, *copy[:2], topk_weights, topk_ids, *copy[2:], *MOE_SWIGLU)
    if len(copy) >= 7:
        w13, w2, s13, s2, *rest = copy
        return ref.fused_moe_wna16(x, w13, w2, topk_weights, topk_ids, s13, s2, *rest)
    w13, w2, s13, s2, block = copy
    return ref.fused_moe_fp8(x, w13, w2, topk_weights, topk_ids, s13, s2, block)


# ``--moe-fp8``: FP8 experts (weight-only) with per-channel or 128x128 block scales.
MOE_FP8_SCHEMES = {"channel": None, "block": (128, 128)}


# ``--moe-wna16``: integer experts (weight-only): bits, group size, symmetric (the engine's
# layout: float32 scales, uint8 zero points).
MOE_WNA16_SCHEMES = {"w4-g128": (4, 128, True), "w4-g128-zp": (4, 128, False),
                     "w8-g128": (8, 128, True)}  # fmt: skip
# GGUF experts as ``engine.quantization.gguf_moe`` runs them on a GPU (random blocks of the gate/up
# and the down stacks' types, ``engine.kernels.gguf.integer_planes``: float offsets).
MOE_GGUF_SCHEMES = {"gguf-q4k-q6k": ("Q4_K", "Q6_K"), "gguf-q4k": ("Q4_K", "Q4_K")}


def _gguf_bytes(name: str) -> float:
    """Bytes a call reads per weight of a GGUF type in ``integer_planes``' form: the value in
    4 or 8 bits plus its group's float32 scale and offset."""
    from engine.kernels import gguf

    t = gguf.gguf_type(name)
    return (4 if t.bits == 4 else 8) / 8 + 8 / t.group


def _wna16_bytes_per_weight(scheme: str) -> float:
    """Bytes a call reads per integer expert weight: the packed value, plus its share of the
    float32 scale and (asymmetric) uint8 zero point of its group (GGUF schemes: the float32
    offset; the gate/up stacks hold two thirds of the weights)."""
    if scheme in MOE_GGUF_SCHEMES:
        gate_up, down = MOE_GGUF_SCHEMES[scheme]
        return (2 * _gguf_bytes(gate_up) + _gguf_bytes(down)) / 3
    bits, group, sym = MOE_WNA16_SCHEMES[scheme]
    return bits / 8 + (4 + (0 if sym else 1)) / group


def _wna16_bits(scheme: str) -> int:
    """The gate/up width of an integer scheme (the dispatch rules read it)."""
    if scheme in MOE_GGUF_SCHEMES:
        from engine.kernels import gguf

        return 4 if gguf.gguf_type(MOE_GGUF_SCHEMES[scheme][0]).bits == 4 else 8
    return MOE_WNA16_SCHEMES[scheme][0]


def _wna16_rule_bits(scheme: str) -> int:
    """The width the grouped dispatch rule is given for ``scheme`` with 16-bit activations, as
    ``fused_moe._fused_moe`` decides it: experts whose down projection has another width than
    gate/up (GGUF Q4_K with Q6_K) take the general rule (0), the others their own width."""
    if scheme in MOE_GGUF_SCHEMES:
        from engine.kernels import gguf

        widths = {4 if gguf.gguf_type(name).bits == 4 else 8 for name in MOE_GGUF_SCHEMES[scheme]}
        return widths.pop() if len(widths) == 1 else 0
    return _wna16_bits(scheme)


def _gguf_experts(e: int, h: int, i: int, scheme: str, device: str) -> tuple:
    """Random GGUF stacks of ``scheme``'s types as ``fused_moe_wna16``'s operands."""
    import torch

    from engine.kernels import gguf
    from engine.testing.tiny_gguf import random_blocks

    planes = []
    for name, rows, cols in zip(MOE_GGUF_SCHEMES[scheme], (2 * i, h), (h, i), strict=True):
        t = gguf.gguf_type(name)
        seed = int(torch.randint(0, 2**31 - 1, ()))
        raw = torch.from_numpy(random_blocks(e * rows, cols, name, seed=seed))
        blocks = raw.view(e, rows, cols // t.block_size, t.type_size).to(device)
        planes.append((*gguf.integer_planes(blocks, name), 4 if t.bits == 4 else 8))
    (q13, s13, o13, bits), (q2, s2, o2, bits2) = planes
    return q13, q2, s13, s2, None, None, bits, None, None, o13, o2, bits2


def _moe_experts(
    e, h, i, dtype, device, fp8: str | None, wna16: str | None = None, biased: bool = False,
    mxfp4: bool = False,
) -> tuple:  # fmt: skip
    """One random copy of a layer's experts, quantized to FP8 when ``fp8``, to integers in
    groups when ``wna16`` (one bf16 copy alive at a time), with gate/up and down biases
    (std 0.5) when ``biased``; ``mxfp4``: random MXFP4 bytes (every code) with exponents
    2**-8 .. 2**-6 (weights of std about 0.02, as ``--load-format dummy`` fills them) and
    biases, never a bf16 copy (gpt-oss-120b's would take 8 GB a layer)."""
    import torch

    if mxfp4:

        def codes(n, k):
            return torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=device)

        def exponents(n, k):
            return torch.randint(119, 122, (e, n, k // 32), dtype=torch.uint8, device=device)

        b13 = torch.randn(e, 2 * i, device=device, dtype=dtype) * 0.5
        b2 = torch.randn(e, h, device=device, dtype=dtype) * 0.5
        return codes(2 * i, h), codes(h, i), exponents(2 * i, h), exponents(h, i), b13, b2

    w13 = torch.randn(e, 2 * i, h, device=device, dtype=dtype) * h**-0.5
    w2 = torch.randn(e, h, i, device=device, dtype=dtype) * i**-0.5
    if biased:
        b13 = torch.randn(e, 2 * i, device=device, dtype=dtype) * 0.5
        return w13, w2, b13, torch.randn(e, h, device=device, dtype=dtype) * 0.5
    if wna16 in MOE_GGUF_SCHEMES:
        return _gguf_experts(e, h, i, wna16, device)
    if wna16:
        from engine.quantization.wna16_moe import quantize_wna16_experts

        bits, group, sym = MOE_WNA16_SCHEMES[wna16]
        q13, s13, z13 = quantize_wna16_experts(w13, bits, group, sym)
        q2, s2, z2 = quantize_wna16_experts(w2, bits, group, sym)
        return q13, q2, s13, s2, z13, z2, bits
    return _fp8_copy(w13, w2, fp8) if fp8 else (w13, w2)


def _fp8_copy(w13, w2, scheme: str) -> tuple:
    from engine.quantization.fp8_moe import quantize_fp8_experts, quantize_fp8_experts_blocks

    block = MOE_FP8_SCHEMES[scheme]
    if block is None:
        q13, s13 = quantize_fp8_experts(w13)
        q2, s2 = quantize_fp8_experts(w2)
    else:
        q13, s13 = quantize_fp8_experts_blocks(w13, block, slices=2)
        q2, s2 = quantize_fp8_experts_blocks(w2, block)
    return q13, q2, s13, s2, block


def _topk_call(logits, top_k):
    from engine_triton.kernels import fused_moe as fm

    return lambda j: fm.moe_topk_softmax(logits, top_k, True)


def _moe_candidates(
    tokens: int,
    top_k: int,
    experts: int,
    bits: int = 0,
    rule_bits: int | None = None,
    mxfp4: bool = False,
) -> list[tuple[str, object]]:
    """(variant, config) pairs the sweep times for one batch, the rule's choice first: decode
    tilings while the decode kernels may serve it, grouped tilings sized to the pairs per
    expert. ``bits`` (integer experts): their decode default (``WNA16_DECODE[bits]``) and
    longer K steps (a step of packed words holds a quarter of FP8's bytes at 4 bits).
    ``rule_bits`` (default ``bits``): the width the grouped rule is given, 0 where the
    dispatch takes the general rule (``_wna16_rule_bits``). ``mxfp4`` (with ``bits`` 4 and
    ``rule_bits`` 0, as ``fused_moe_mxfp4`` dispatches): the decode default is
    ``MXFP4_DECODE``."""
    from engine_triton.kernels import fused_moe as fm

    D, G = fm.DecodeConfig, fm.GroupedConfig
    pairs = tokens * top_k
    rule = "decode" if fm.use_decode(tokens, top_k, experts, bits) else "grouped"
    decode_rule = fm.MXFP4_DECODE if mxfp4 else fm.WNA16_DECODE[bits] if bits else D()
    out: list[tuple[str, object]] = [
        (
            rule,
            decode_rule
            if rule == "decode"
            else fm.grouped_config(pairs, experts, bits if rule_bits is None else rule_bits),
        )
    ]
    if pairs <= fm.DECODE_MAX_PAIRS and bits:
        out += [("decode", c) for c in (D(16, 512, 8, 256), D(16, 1024, 8, 512),
                                        D(8, 1024, 8, 256, 8, 4), D(8, 2048, 8, 512, 4, 4),
                                        D(8, 1024, 4, 512, 4, 4))]  # fmt: skip
    elif pairs <= fm.DECODE_MAX_PAIRS:
        out += [("decode", c) for c in (D(8, 256, 8, 256), D(32, 128, 16, 128),
                                        D(16, 512, 8, 512, 8, 2), D(16, 256, 4, 256, 4, 4))]  # fmt: skip
    avg = pairs / experts
    if avg <= 16:
        grouped = (G(16, 64, 128, 1), G(16, 128, 128, 1, 4, 4), G(32, 64, 128, 4))
        grouped += (G(16, 128, 256, 1, 4, 4), G(16, 256, 128, 1, 8, 4)) if bits else ()
    elif avg <= 128:
        grouped = (G(32, 64, 128, 4), G(64, 64, 64, 8), G(64, 128, 64, 8, 4, 4))
        grouped += (G(64, 128, 128, 8, 4, 4), G(32, 128, 64, 8, 4, 4)) if bits else ()
    else:
        grouped = (G(64, 128, 64, 8, 4, 4, 64), G(128, 128, 64, 8, 8, 3), G(128, 64, 64, 8, 4, 4),
                   G(128, 256, 64, 8, 8, 3, 64))  # fmt: skip
    out += [("grouped", c) for c in grouped]
    return list(dict.fromkeys(out))


def sweep_moe(
    results: dict,
    shapes: list[str] | None = None,
    tokens: tuple[int, ...] = (1, 2, 4, 8, 32, 128, 512, 2048),
    candidates: bool = True,
    budget_s: float = 200.0,
    device: str = "cuda",
    fp8: str | None = None,
    wna16: str | None = None,
) -> None:
    """Time the fused MoE kernel per layer on ``MOE_SHAPES`` (see the module docstring).
    After ``budget_s`` seconds only the rule's choice is timed. ``fp8`` (a key of
    ``MOE_FP8_SCHEMES``) times ``fused_moe_fp8`` on the same experts quantized to e4m3
    (weight-only, bf16 activations): a byte per weight, so the copy-speed floor halves;
    ``wna16`` (a key of ``MOE_WNA16_SCHEMES``) ``fused_moe_wna16`` on them quantized to 4 or
    8 bits in groups, the bytes read counting the packed values with their group's scale and
    zero point (``_wna16_bytes_per_weight``). Shapes marked ``mxfp4`` (GPT-OSS as released)
    time ``fused_moe_mxfp4`` on random MXFP4 experts, the bytes read counting 4.25 bits a
    weight (``MOE_MXFP4_BYTES``: the codes and their blocks' exponents)."""
    import time

    import torch

    t0 = time.perf_counter()
    dtype = torch.bfloat16
    weight_bytes = 1 if fp8 else dtype.itemsize
    what = f"fp8 experts ({fp8} scales, weight-only), bf16 activations" if fp8 else "bf16"
    if wna16:
        weight_bytes = _wna16_bytes_per_weight(wna16)
        what = f"integer experts ({wna16}, weight-only), bf16 activations"
    copy = _copy_gbps(device)
    print(f"moe: {torch.cuda.get_device_name(device)}, {what}, copy bandwidth {copy:.0f} GB/s; "
          f"us = per call in a graph over rotating weights and routings", flush=True)  # fmt: skip
    results["moe copy GBps"] = round(copy)
    tuned = []
    names = [s for s in MOE_SHAPES if not shapes or any(f in s for f in shapes)]
    for name in names:
        sh = MOE_SHAPES[name]
        e, k, h, i = sh["experts"], sh["top_k"], sh["hidden"], sh["inter"]
        biased, mxfp4 = bool(sh.get("biased")), bool(sh.get("mxfp4"))
        if mxfp4 and (fp8 or wna16):
            print(f"\n{name}: passed over (its experts are MXFP4)", flush=True)
            continue
        if biased and (fp8 or wna16):
            print(f"\n{name}: passed over (its biased experts run unquantized only)", flush=True)
            continue
        shape_bytes = MOE_MXFP4_BYTES if mxfp4 else weight_bytes
        expert_bytes = 3 * h * i * shape_bytes
        copies = max(1, min(8, math.ceil(MOE_ROTATE_BYTES / (e * expert_bytes))))
        torch.manual_seed(0)
        weights = [_moe_experts(e, h, i, dtype, device, fp8, wna16, biased, mxfp4)
                   for _ in range(copies)]  # fmt: skip
        gen = torch.Generator(device="cpu").manual_seed(0)
        floor_bytes = (
            sh["other_params"] * dtype.itemsize + sh["layers"] * k * 3 * h * i * shape_bytes
        )
        floor_us = floor_bytes / copy * 1e-3  # read once at the copy rate
        op = "fused_moe_biased (swigluoai), " if biased else ""
        op = "fused_moe_mxfp4 (swigluoai), " if mxfp4 else op
        print(f"\n{name}: {op}{e} experts, top-{k}, hidden {h}, inter {i}, {sh['layers']} layers; "
              f"batch-1 step reads {floor_bytes / 1e9:.2f} GB of active weights = "
              f"{floor_us:.0f} us at copy speed (1.5x: {1.5 * floor_us:.0f} us)", flush=True)  # fmt: skip
        for t in tokens:
            rounds = max(4, 64 // max(1, t // 64))
            x = torch.randn(t, h, generator=gen).to(dtype).to(device)
            routes = []
            for _ in range(rounds):
                ids = torch.rand(t, e, generator=gen).topk(k, dim=-1).indices.to(torch.int32)
                w = torch.rand(t, k, generator=gen)
                routes.append((ids.to(device), (w / w.sum(-1, keepdim=True)).to(device)))
            distinct = sum(len(set(r[0].flatten().tolist())) for r in routes) / rounds
            nbytes = distinct * expert_bytes + 2 * t * h * dtype.itemsize
            expected = _moe_reference(x, weights[0], routes[0][1], routes[0][0]).float()
            over = time.perf_counter() - t0 > budget_s
            if mxfp4:  # fused_moe_mxfp4's dispatch: the 4-bit decode rule, the general tilings
                cands = _moe_candidates(t, k, e, 4, 0, mxfp4=True)
            else:
                cands = _moe_candidates(
                    t, k, e, *((_wna16_bits(wna16), _wna16_rule_bits(wna16)) if wna16 else (0, 0))
                )
            cands = cands if candidates and not over else cands[:1]
            rows = []
            for index, (variant, cfg) in enumerate(cands):
                kw = {"variant": variant}
                kw["decode_config" if variant == "decode" else "config"] = cfg

                call = _moe_call(x, weights, routes, kw)
                try:
                    err = (_moe_run(x, weights[0], routes[0][1], routes[0][0], kw).float()
                           - expected).abs().max().item()  # fmt: skip
                    us = _graph_us(call, calls=max(10, min(GRAPH_CALLS, 4 * rounds)))
                except Exception as exc:  # a configuration the compiler refuses
                    rows.append({"config": cfg.short(), "error": repr(exc)[:160]})
                    continue
                rows.append({"config": cfg.short(), "rule": index == 0, "us": round(us, 2),
                             "GBps": round(nbytes / us / 1e3), "of_copy": round(nbytes / us / 1e3 / copy, 3),
                             "max_err": round(err, 4)})  # fmt: skip
            ok = [r for r in rows if "us" in r]
            rule = next((r for r in ok if r["rule"]), None)
            best = min(ok, key=lambda r: r["us"]) if ok else None
            logits = torch.randn(t, e, device=device, dtype=dtype)
            topk_us = _graph_us(_topk_call(logits, k), calls=50)
            tag = f" fp8-{fp8}" if fp8 else f" {wna16}" if wna16 else ""
            results[f"moe{tag} {name} T={t}"] = {
                "bytes": round(nbytes), "distinct_experts": round(distinct, 1),
                "topk_softmax_us": round(topk_us, 2), "rows": rows,
            }  # fmt: skip
            if rule is None:
                print(f"  T={t:<5d} ERROR {rows[:1]}", flush=True)
                continue
            line = (f"  T={t:<5d} {rule['us']:8.1f} us/layer  {nbytes / 1e6:7.1f} MB "
                    f"({distinct:5.1f} experts) {rule['GBps']:5d} GB/s = {rule['of_copy']:.2f} of "
                    f"copy [{rule['config']}]  topk {topk_us:.1f} us; x{sh['layers']} layers "
                    f"{sh['layers'] * (rule['us'] + topk_us) / 1e3:.2f} ms")  # fmt: skip
            print(line, flush=True)
            if best is not rule and best["us"] < 0.97 * rule["us"]:
                print(f"  {'':7s} best {best['us']:8.1f} us [{best['config']}]", flush=True)
                tuned.append(f"{name} T={t}: {best['config']} {best['us']} us vs rule "
                             f"{rule['config']} {rule['us']} us")  # fmt: skip
            bad = [r for r in ok if r["max_err"] > 0.06]
            if bad:
                print(f"  {'':7s} ERROR too large: {[(r['config'], r['max_err']) for r in bad]}")
        del weights
        torch.cuda.empty_cache()
    results["moe better than the rule"] = tuned
    print(f"\nmoe sweep took {time.perf_counter() - t0:.0f} s", flush=True)


LORA_PROJECTIONS = {  # Llama-3.1-8B: (input features, fused output slices)
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}


def _lora_projection(t, k, sizes, rank, slots, st, ss, dtype) -> dict:
    """Times of one projection at ``t`` tokens: the base ``linear`` and the LoRA op for the
    rule's shrink configuration and split-K variants around it (rotating weight copies, so
    each call reads HBM as a real step does)."""
    import torch

    from engine_triton.kernels.linear import linear
    from engine_triton.kernels.lora import (
        _sm_count,
        lora_expand,
        lora_expand_augmented,
        lora_shrink,
        shrink_config,
    )

    n = sum(sizes)
    x = torch.randn(t, k, dtype=dtype, device="cuda")
    w_copies = max(1, L2_ROTATE_BYTES // (n * k * 2) + 1)
    ws = [torch.randn(n, k, dtype=dtype, device="cuda") * k**-0.5 for _ in range(w_copies)]
    ab_bytes = slots * rank * (len(sizes) * k + n) * 2
    ab = [
        (
            torch.randn(slots, len(sizes) * rank, k, dtype=dtype, device="cuda") * k**-0.5,
            torch.randn(slots, n, rank, dtype=dtype, device="cuda") * 0.01,
        )
        for _ in range(max(1, L2_ROTATE_BYTES // ab_bytes + 1))
    ]
    y = torch.zeros(t, n, dtype=dtype, device="cuda")
    base_us = _graph_us(_rotating(linear, x, ws))
    rule = shrink_config(t, len(sizes) * rank, k, slots, _sm_count(x.device))
    variants = {rule} | {
        (rule[0], rule[1], rule[2], split) for split in (1, 2, 4, 8, 16) if k >= 2 * rule[2] * split
    }
    timed = {}
    for cfg in sorted(variants, key=lambda c: c[3]):

        def call(i, cfg=cfg):
            a, b = ab[i % len(ab)]
            lora_expand(y, lora_shrink(x, a, st, ss, config=cfg), b, st, ss, sizes)

        timed[cfg] = _graph_us(call)
    best = min(timed, key=timed.get)
    # The shrink in the base GEMM: x @ [W; A_0..A_7]^T, then one expand launch.
    augs = [
        (torch.cat([w, ab[i % len(ab)][0].reshape(-1, k)]), ab[i % len(ab)][1])
        for i, w in enumerate(ws)
    ]
    ts = torch.zeros(t, dtype=torch.int32, device="cuda")  # read by the reference only

    def fused(i):
        w_aug, b = augs[i % len(augs)]
        lora_expand_augmented(linear(x, w_aug), n, b, ts, st, ss, sizes)

    fused_us = _graph_us(fused)
    return {
        "base_us": round(base_us, 2),
        "fused_us": round(fused_us, 2),
        "lora_us": round(timed[rule], 2),
        "rule": list(rule),
        "best": list(best),
        "best_us": round(timed[best], 2),
        "by_split": {c[3]: round(v, 2) for c, v in timed.items()},
    }


def sweep_lora(
    results: dict, tokens: tuple[int, ...] = (1, 8, 32, 64, 128, 256), rank: int = 16
) -> None:
    """The LoRA op per projection and per decode step (see the module docstring)."""
    import numpy as np
    import torch

    from engine.lora.mapping import group_by_slot

    slots, layers = 8, 32
    out: dict = {}
    for t in tokens:
        sorted_tokens, starts = group_by_slot(np.arange(t, dtype=np.int32) % slots, slots)
        st = torch.from_numpy(sorted_tokens).cuda()
        ss = torch.from_numpy(starts).cuda()
        row: dict = {}
        for name, (k, sizes) in LORA_PROJECTIONS.items():
            r = row[name] = _lora_projection(t, k, sizes, rank, slots, st, ss, torch.bfloat16)
            print(
                f"T={t:4d} {name:8s} base {r['base_us']:7.2f} us  separate shrink+expand "
                f"+{r['lora_us']:6.2f} us (split {r['rule'][3]}; best split {r['best'][3]}: "
                f"{r['best_us']:6.2f} us)  shrink in the GEMM: GEMM+expand {r['fused_us']:7.2f} us",
                flush=True,
            )
        step_lora = sum(row[n]["lora_us"] for n in LORA_PROJECTIONS) * layers / 1e3
        step_base = sum(row[n]["base_us"] for n in LORA_PROJECTIONS) * layers / 1e3
        step_fused = sum(row[n]["fused_us"] for n in LORA_PROJECTIONS) * layers / 1e3
        row["step_lora_ms"] = round(step_lora, 3)
        row["step_fused_ms"] = round(step_fused, 3)
        row["step_base_linear_ms"] = round(step_base, 3)
        print(
            f"T={t:4d} per decode step ({layers} layers): base projections {step_base:.3f} ms; "
            f"separate shrink+expand +{step_lora:.3f} ms (+{100 * step_lora / step_base:.1f}%); "
            f"shrink in the GEMM {step_fused:.3f} ms (+{100 * (step_fused / step_base - 1):.1f}%)",
            flush=True,
        )
        out[str(t)] = row
    results["lora"] = out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument(
        "--spread-only", action="store_true", help="Only the packed/spread block-layout check."
    )
    parser.add_argument(
        "--linear-only", action="store_true", help="Only the skinny-GEMM vs F.linear sweep."
    )
    parser.add_argument(
        "--linear-shapes",
        default=None,
        help="comma-separated substrings of the shapes to time (e.g. 'qwen,llama-8b o')",
    )
    parser.add_argument("--linear-m", default="1,2,4,8,16", help="batch rows to time")
    parser.add_argument(
        "--linear-budget-s",
        type=float,
        default=75.0,
        help="after this many seconds only F.linear and the heuristic are timed",
    )
    parser.add_argument(
        "--linear-no-candidates", action="store_true", help="time only the heuristic's choice"
    )
    parser.add_argument(
        "--moe-only", action="store_true", help="Only the fused-MoE kernel per-layer sweep."
    )
    parser.add_argument(
        "--moe-shapes", default=None, help="comma-separated substrings of MOE_SHAPES to time"
    )
    parser.add_argument("--moe-tokens", default="1,2,4,8,32,128,512,2048", help="tokens per call")
    parser.add_argument(
        "--moe-fp8",
        choices=sorted(MOE_FP8_SCHEMES),
        default=None,
        help="time fused_moe_fp8 (e4m3 experts, weight-only) with these scales",
    )
    parser.add_argument(
        "--moe-wna16",
        choices=sorted(MOE_WNA16_SCHEMES) + sorted(MOE_GGUF_SCHEMES),
        default=None,
        help="time fused_moe_wna16 (4/8-bit integer experts in groups, weight-only; gguf-*: "
        "random GGUF stacks of those types, as a GPU runs a GGUF MoE file)",
    )
    parser.add_argument(
        "--moe-no-candidates", action="store_true", help="time only the rule's configuration"
    )
    parser.add_argument(
        "--cascade-only",
        action="store_true",
        help="Only the cascade attention sweep (the shared pass's configurations).",
    )
    parser.add_argument("--cascade-batches", default="64,128,256", help="requests per call")
    parser.add_argument("--lora-only", action="store_true", help="Only the multi-LoRA op sweep.")
    parser.add_argument("--lora-tokens", default="1,8,32,64,128,256", help="tokens per call")
    parser.add_argument("--lora-rank", type=int, default=16, help="adapter rank")
    args = parser.parse_args(argv)
    results: dict = {}
    if args.cascade_only:
        sweep_cascade(results, tuple(int(v) for v in args.cascade_batches.split(",")))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        return 0
    if args.lora_only:
        sweep_lora(results, tuple(int(v) for v in args.lora_tokens.split(",")), args.lora_rank)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        return 0
    if args.moe_only:
        if args.moe_fp8 and args.moe_wna16:
            parser.error("--moe-fp8 and --moe-wna16 time different experts: pick one")
        sweep_moe(
            results,
            shapes=args.moe_shapes.split(",") if args.moe_shapes else None,
            tokens=tuple(int(v) for v in args.moe_tokens.split(",")),
            candidates=not args.moe_no_candidates,
            fp8=args.moe_fp8,
            wna16=args.moe_wna16,
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        return 0
    if args.linear_only:
        sweep_linear(
            results,
            shapes=args.linear_shapes.split(",") if args.linear_shapes else None,
            ms=tuple(int(v) for v in args.linear_m.split(",")),
            budget_s=args.linear_budget_s,
            candidates=not args.linear_no_candidates,
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        return 0
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
