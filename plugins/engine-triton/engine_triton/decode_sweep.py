"""Decode attention at batch 1 and 4 inside CUDA graphs, over split counts and tile shapes.

``python -m engine_triton.decode_sweep`` times ``paged_decode`` (with the fused cache append)
for Qwen3-0.6B heads (16 query / 8 KV) and Llama-3.1-8B heads (32 / 8), head size 128, bf16,
16-token blocks in shuffled order, at 160, 400 and 640 tokens of context: each configuration as
the mean of 250 launches replayed from a CUDA graph of 50, so launch overhead is what the engine's
decode graphs see. Prints the fastest configurations per case and the 32-split, 32-token-tile
one. This sweep chose ``decode_splits`` and ``DECODE_MANY_SPLITS_CONFIG`` for small batches
(figures in docs/benchmarks.md). Needs a CUDA GPU.
"""

from __future__ import annotations

import torch

from engine_triton.kernels.attention import paged_decode

CONFIGS = ((16, 4, 2), (32, 4, 2), (64, 4, 2), (32, 2, 2))  # (tile, warps, stages)
SPLITS = (1, 2, 4, 8, 16, 32)


def time_decode(heads, kv_heads, head, batch, ctx, splits, cfg, device) -> float:
    """Microseconds per ``paged_decode`` launch, replayed from a CUDA graph."""
    bs = 16
    per = ctx // bs + 2
    num_blocks = batch * per + 1
    cache = torch.randn(2, num_blocks, bs, kv_heads, head, device=device, dtype=torch.bfloat16)
    q = torch.randn(batch, heads, head, device=device, dtype=torch.bfloat16)
    k = torch.randn(batch, kv_heads, head, device=device, dtype=torch.bfloat16)
    v = torch.randn(batch, kv_heads, head, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    perm = torch.randperm(num_blocks - 1, device=device)[: batch * per] + 1
    table = perm.view(batch, per).to(torch.int32)
    seq = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    slot = table[:, (ctx - 1) // bs].long() * bs + (ctx - 1) % bs
    counters = torch.zeros(4096, dtype=torch.int32, device=device)

    def call() -> None:
        paged_decode(q, cache, out, seq, table, batch, head**-0.5, num_splits=splits, key=k,
                     value=v, slot_mapping=slot, split_counters=counters, config=cfg)  # fmt: skip

    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(50):
                call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 250 * 1e3


def main() -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    for heads, kv_heads, head, name in ((16, 8, 128, "qwen"), (32, 8, 128, "llama")):
        for batch in (1, 4):
            for ctx in (160, 400, 640):
                res = []
                for splits in SPLITS:
                    for tile, warps, stages in CONFIGS:
                        cfg = {"block_n": tile, "num_warps": warps, "num_stages": stages}
                        try:
                            us = time_decode(heads, kv_heads, head, batch, ctx, splits, cfg, device)
                        except Exception:  # a configuration Triton cannot build here
                            us = float("nan")
                        res.append((us, splits, tile, warps))
                res.sort()
                ref = [r for r in res if r[1:] == (32, 32, 4)]
                top = [(round(r[0], 2), r[1], r[2], r[3]) for r in res[1:5]]
                print(
                    f"{name} B={batch} ctx={ctx}: best {res[0][0]:.2f}us splits={res[0][1]} "
                    f"tile={res[0][2]} warps={res[0][3]}; 32 splits x 32 tiles "
                    f"{ref[0][0] if ref else float('nan'):.2f}us; next {top}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
