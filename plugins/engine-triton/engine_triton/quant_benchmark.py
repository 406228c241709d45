"""Timings of the quantized matmuls on the Llama-3.1-8B projections (needs a CUDA GPU).

``python -m engine_triton.quant_benchmark [--json FILE] [--sweep]``

For each projection (qkv, o, gate_up, down) and batch rows M, microseconds per call inside a
CUDA graph of 100 back-to-back calls (weight copies rotated so HBM, not L2, is read), and the
weight bandwidth that implies, for: bf16 (cuBLAS), FP8 W8A8 as the model runs it (weight-only
arithmetic up to 16 rows, then the per-token quantizer plus cuBLASLt), FP8 W8A8 quantizing
the activations at every size, FP8 weight-only, and AWQ-style W4A16 with groups of 128 as a bf16
model runs it (torch's int4 tiles on NVIDIA sm_80+, ``int4pack.py``) and in the Triton kernels'
layout (``w4a16_g128_triton``). Then the decode step's matmul time (x 32 layers) per method,
which bounds batch-1 tokens/s.

``--producers`` times, instead, the kernels that write an FP8 linear's input (hidden 4096,
intermediate 14336): ``fused_add_rms_norm`` + ``quantize_fp8`` against
``fused_add_rms_norm_quant_fp8``, ``silu_and_mul`` + ``quantize_fp8`` against
``silu_and_mul_quant_fp8`` and its (chunk, warps) candidates (``SILU_QUANT_CANDIDATES``;
the default is ``_QUANT_BLOCK`` / ``_QUANT_WARPS`` in ``activation.py``), per batch rows.

``--int4-gemm-sweep [--rows 32,64,128,256,512] [--budget-s 100]`` times, instead, the GEMM over
torch's int4 tiles (``int4gemm.py``, groups of 128) against the path it would replace (the
weight dequantized to bf16 + cuBLAS, ``dense``) and bf16 cuBLAS alone, per projection and rows:
first ``int4gemm``'s default configuration everywhere, then the ``INT4_GEMM_CANDIDATES`` in
order until the budget is spent; every output is checked against the dense path (largest
absolute difference); the default also with ``int4gemm.UNPACK_ASM`` off (its unpacking in
plain Triton, ``no-asm``). One table at the end, the JSON with every timing. Its roughly 70
kernels are first compiled by ``--compile-workers`` spawned processes (12 on a GPU) into
Triton's on-disk cache, so the budget goes to timing rather than to one compilation at a time. ``--device cpu``
(under ``TRITON_INTERPRET=1``) runs the same code on two tiny shapes with wall-clock timing, a
dry run of the code path, not a measurement.

``--sweep`` also tries kernel configurations per shape and prints the fastest (candidates for
the defaults in ``fp8_linear.py`` / ``wna16_linear.py``): the FP8 skinny kernel and the W4A16
one-row kernel at M = 1, the W4A16 tensor-core decode kernel at 16 rows, and the W4A16 GEMM
tilings at 64, 256 and 1024 rows against the dequantized weight through cuBLAS.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}
ROWS = (1, 4, 16, 64, 256, 1024)
ROTATE_BYTES = 256 << 20
# FP8 skinny-kernel configurations (block_n, block_k, num_warps, split_k, tensor cores) at
# M = 1 (weight-only arithmetic: the decode default).
FP8_CANDIDATES = [
    (4, 1024, 2, 1, False),
    (8, 1024, 4, 1, False),
    (4, 2048, 4, 1, False),
    (8, 512, 4, 1, False),
    (16, 512, 4, 1, False),
    (32, 256, 4, 1, True),
    (64, 256, 4, 1, True),
    (32, 512, 4, 1, True),
]
# The W4A16 one-row kernel (block_n, block_k, tiles per iteration, num_warps, split_k).
W4_GEMV_CANDIDATES = [
    (64, 128, 1, 4, 4),
    (64, 128, 2, 4, 4),
    (64, 128, 4, 4, 1),
    (64, 128, 4, 4, 2),
    (64, 128, 4, 4, 4),
    (64, 128, 4, 4, 8),
    (64, 128, 8, 8, 2),
    (64, 128, 8, 8, 4),
    (128, 128, 4, 8, 2),
    (128, 128, 4, 8, 4),
    (32, 128, 4, 2, 4),
    (32, 128, 8, 4, 4),
    (64, 128, 2, 4, 8),
    (64, 128, 2, 2, 8),
]
# The W4A16 tensor-core decode kernel (block_n, block_k, num_warps, split_k) at 16 rows.
W4_SKINNY_CANDIDATES = [
    (32, 128, 4, 2),
    (32, 128, 4, 4),
    (64, 128, 4, 1),
    (64, 128, 4, 2),
    (64, 128, 4, 4),
    (64, 128, 8, 2),
    (128, 128, 4, 2),
    (128, 128, 8, 1),
]
# The W4A16 GEMM (block_m, block_n, block_k, num_warps, num_stages) at GEMM_ROWS, against the
# dequantized weight through cuBLAS ("dense").
W4_GEMM_CANDIDATES = [
    (64, 128, 128, 4, 3),
    (128, 128, 128, 8, 3),
    (128, 64, 128, 4, 4),
    (128, 256, 64, 8, 3),
    (256, 128, 64, 8, 3),
    (128, 128, 64, 4, 4),
]
GEMM_ROWS = (64, 256, 1024)
# The int4-tile GEMM (``int4gemm.py``) for --int4-gemm-sweep: (block_n, cap on block_m (the
# power of two covering M, ``int4gemm.block_rows``), block_kw (words of a row per K block: 8
# inputs each), split_k (0: ``int4gemm.split_k``'s rule for one wave of programs, -2: for two
# waves, n > 0: n), num_warps, num_stages), timed in this order after the default
# configuration until the budget runs out. Shared memory: about 3 * (8 * block_kw * block_m +
# 4 * block_kw * block_n) bytes per stage set, so block_m 256 or block_kw 32 need 3 stages.
INT4_GEMM_CANDIDATES = [
    (128, 128, 16, 1, 8, 3),  # the default without split-K
    (128, 128, 16, -2, 8, 4),  # split for two programs per SM
    (128, 128, 32, 0, 8, 3),  # K blocks of 256: half the waits and loop overhead per weight
    (128, 64, 64, 0, 8, 2),  # K blocks of 512 (dots 128 deep): a quarter of the waits
    (64, 128, 16, 0, 4, 4),  # one warpgroup, 64 outputs
    (128, 256, 16, 0, 8, 3),  # up to 256 rows a block: each weight unpacked once to M = 256
    (64, 128, 16, -2, 4, 4),
    (256, 64, 16, 0, 8, 3),  # 256 outputs: x read half as often from L2
    (128, 64, 16, 0, 8, 4),
    (128, 128, 16, 0, 8, 5),
    (64, 64, 16, -2, 4, 4),
    (128, 128, 16, 4, 8, 4),
]
INT4_GEMM_ROWS = (32, 64, 128, 256, 512)
# --device cpu: a dry run of the sweep's code path in the interpreter on tiny shapes.
INT4_GEMM_CPU_SHAPES = {"tiny_qkv": (96, 256), "tiny_down": (64, 512)}
# The FP8 SiLU-and-mul kernel's (columns per chunk, num_warps), for --producers.
SILU_QUANT_CANDIDATES = [(1024, 4), (2048, 8), (2048, 16), (4096, 8), (4096, 16), (8192, 16)]
PRODUCER_ROWS = (17, 64, 256, 512, 1024)


def _producer_row(torch, graph_us, m: int, device: str = "cuda") -> dict:
    """One batch size of ``_producers``."""
    from engine_triton.kernels import activation, norm
    from engine_triton.kernels.fp8_linear import quantize_fp8

    bf16 = torch.bfloat16
    w = torch.ones(4096, device=device, dtype=bf16)
    x = torch.randn(m, 4096, device=device, dtype=bf16)
    res = torch.randn(m, 4096, device=device, dtype=bf16)
    gate_up = torch.randn(m, 2 * 14336, device=device, dtype=bf16)
    row = {
        "norm+quant": graph_us(lambda i: quantize_fp8(norm.fused_add_rms_norm(x, res, w, 1e-5)[0])),
        "norm_fp8": graph_us(lambda i: norm.fused_add_rms_norm_quant_fp8(x, res, w, 1e-5)),
        "silu+quant": graph_us(lambda i: quantize_fp8(activation.silu_and_mul(gate_up))),
    }
    default = (activation._QUANT_BLOCK, activation._QUANT_WARPS)
    for block, warps in SILU_QUANT_CANDIDATES:
        activation._QUANT_BLOCK, activation._QUANT_WARPS = block, warps
        try:
            row[f"silu_fp8 {block}x{warps}w"] = graph_us(
                lambda i: activation.silu_and_mul_quant_fp8(gate_up)
            )
        finally:
            activation._QUANT_BLOCK, activation._QUANT_WARPS = default
    return {k: round(v, 2) for k, v in row.items()}


def _producers(torch, graph_us, rows: list[int]) -> dict:
    """Microseconds per call of the plain producer + quantizer and of the fused producer
    (see the module docstring), at Llama-3.1-8B widths, by batch rows."""
    from engine_triton.kernels import activation

    results: dict = {}
    for m in rows:
        results[m] = _producer_row(torch, graph_us, m)
        cells = " | ".join(f"{k}: {v:7.2f}us" for k, v in results[m].items())
        print(
            f"M={m:5d} {cells} (default silu_fp8 "
            f"{activation._QUANT_BLOCK}x{activation._QUANT_WARPS}w)",
            flush=True,
        )
    return results


def _copies(make, nbytes: int) -> list:
    return [make() for _ in range(max(2, ROTATE_BYTES // max(nbytes, 1)))]


def _calls(torch, fp8_mod, w4_mod, n: int, k: int, device: str = "cuda"):
    """(callables by method taking (x, i), weight bytes by method) for one projection shape,
    over rotated weight copies."""
    dev = torch.device(device)
    bf16 = _copies(lambda: torch.randn(n, k, device=dev, dtype=torch.bfloat16), 2 * n * k)
    fp8 = _copies(lambda: (torch.randn(n, k, device=dev) * 64).to(torch.float8_e4m3fn), n * k)
    ws = torch.rand(n, device=dev) * 1e-3
    q = torch.randint(0, 16, (n, k), device=dev, dtype=torch.uint8)
    s = (torch.rand(n, k // 128, device=dev) * 0.01).half()
    z = torch.full((n, k // 128), 8, device=dev, dtype=torch.uint8)
    # As a bf16 model's layers get them (torch's int4 tiles where available), and in the Triton
    # kernels' layout (what the configuration sweeps time).
    w4 = _copies(
        lambda: w4_mod.wna16_linear.prepack(q, s, z, bits=4, group_size=128, dtype=torch.bfloat16),
        n * k // 2,
    )
    w4t = _copies(lambda: w4_mod.wna16_linear.prepack(q, s, z, bits=4, group_size=128), n * k // 2)

    def f_bf16(x, i):
        return torch.nn.functional.linear(x, bf16[i % len(bf16)])

    def f_fp8(x, i):
        return fp8_mod.fp8_linear(x, fp8[i % len(fp8)], ws)

    def f_fp8_wo(x, i):
        return fp8_mod.fp8_linear(x, fp8[i % len(fp8)], ws, None, None, False)

    def f_fp8_q(x, i):  # W8A8 with the activations quantized at every M (no decode shortcut)
        default = fp8_mod.DECODE_WEIGHT_ONLY
        fp8_mod.DECODE_WEIGHT_ONLY = False
        try:
            return fp8_mod.fp8_linear(x, fp8[i % len(fp8)], ws)
        finally:
            fp8_mod.DECODE_WEIGHT_ONLY = default

    def f_w4(x, i):
        return w4_mod.wna16_linear(x, w4[i % len(w4)], bits=4, group_size=128)

    def f_w4_triton(x, i):
        return w4_mod.wna16_linear(x, w4t[i % len(w4t)], bits=4, group_size=128)

    calls = {
        "bf16": f_bf16,
        "fp8_w8a8": f_fp8,
        "fp8_w8a8_quantized": f_fp8_q,
        "fp8_weight_only": f_fp8_wo,
        "w4a16_g128": f_w4,
        "w4a16_g128_triton": f_w4_triton,
    }
    nbytes = {"bf16": 2 * n * k, "fp8_w8a8": n * k, "fp8_w8a8_quantized": n * k}
    nbytes["fp8_weight_only"] = n * k
    nbytes["w4a16_g128"] = n * k // 2 + 4 * n * (k // 128)
    nbytes["w4a16_g128_triton"] = nbytes["w4a16_g128"]
    return calls, nbytes


def _sweep(graph_us, mod, attr, candidates, call, x) -> list:
    """Time ``call`` on ``x`` for each configuration (the module's ``attr`` function replaced
    by one returning the candidate), fastest first."""
    original = getattr(mod, attr)
    timings = []
    try:
        for cand in candidates:
            setattr(mod, attr, lambda *a, c=cand: c)
            try:
                timings.append((round(graph_us(lambda i: call(x, i)), 2), cand))
            except Exception as exc:  # a configuration the compiler or the K size refuses
                timings.append((float("inf"), f"{cand}: {type(exc).__name__}"))
    finally:
        setattr(mod, attr, original)
    return sorted(timings, key=lambda t: t[0])


def _sweep_shape(name, k, calls, fp8_mod, w4_mod, graph_us, torch, device="cuda") -> dict:
    """The configuration sweeps of one projection shape, printed; the three fastest of each."""
    best = {}

    def report(label, timings, current=None):
        best[label] = timings[:3]
        tail = f"; current {current}" if current is not None else ""
        print(f"  sweep {name} {label}: best {timings[:3]}{tail}", flush=True)

    x1 = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    x16 = torch.randn(16, k, device=device, dtype=torch.bfloat16)
    report(
        "fp8 M=1",
        _sweep(graph_us, fp8_mod, "_skinny_config", FP8_CANDIDATES, calls["fp8_w8a8"], x1),
    )
    gemv = [c for c in W4_GEMV_CANDIDATES if k % (c[1] * c[4]) == 0]
    report(
        "w4a16 M=1", _sweep(graph_us, w4_mod, "_gemv_config", gemv, calls["w4a16_g128_triton"], x1)
    )
    skinny = [c for c in W4_SKINNY_CANDIDATES if k % (c[1] * c[3]) == 0]
    report(
        "w4a16 M=16",
        _sweep(graph_us, w4_mod, "_skinny_config", skinny, calls["w4a16_g128_triton"], x16),
    )
    dense_rows = w4_mod.DENSE_MIN_ROWS
    try:
        for m in GEMM_ROWS:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            w4_mod.DENSE_MIN_ROWS = 1 << 30
            timings = _sweep(
                graph_us, w4_mod, "_gemm_config", W4_GEMM_CANDIDATES, calls["w4a16_g128_triton"], x
            )
            current = round(graph_us(lambda i, x=x: calls["w4a16_g128_triton"](x, i)), 2)
            w4_mod.DENSE_MIN_ROWS = 1
            dense = round(graph_us(lambda i, x=x: calls["w4a16_g128_triton"](x, i)), 2)
            timings = sorted(timings + [(dense, "dense")], key=lambda t: t[0])
            report(f"w4a16 GEMM M={m}", timings, current)
    finally:
        w4_mod.DENSE_MIN_ROWS = dense_rows
    return best


def _int4_gemm_resolve(cand, m: int, n: int, k: int, sms: int) -> tuple:
    """A candidate of ``INT4_GEMM_CANDIDATES`` as ``int4gemm._gemm_config`` returns one."""
    from engine_triton.kernels import int4gemm

    block_n, cap, block_kw, split, warps, stages = cand
    block_m = int4gemm.block_rows(m, cap)
    if split <= 0:
        waves = max(1, -split)
        split = int4gemm.split_k(m, n, k, block_n, block_m, block_kw, sms, waves)
    return block_n, block_m, block_kw, min(split, max(1, k // (8 * block_kw))), warps, stages


def _wall_us(call) -> float:
    """Microseconds of one ``call(i)`` by the wall clock (the CPU dry run: no graphs)."""
    call(0)
    t0 = time.perf_counter()
    call(1)
    return (time.perf_counter() - t0) * 1e6


def _int4_gemm_layer(torch, n: int, k: int, group: int, copies, device: str) -> tuple:
    """(K, rotated int4-tile copies of one random 4-bit layer, rotated bf16 weights)."""
    from engine_triton.kernels import int4pack

    q = torch.randint(0, 16, (n, k), device=device, dtype=torch.uint8)
    s = torch.rand(n, k // group, device=device) * 0.01 + 0.001
    z = torch.randint(0, 16, (n, k // group), device=device, dtype=torch.uint8)
    packs = copies(lambda: int4pack.pack(q, s, z, group), n * k // 2)
    dense_w = copies(lambda: torch.randn(n, k, device=device, dtype=torch.bfloat16), 2 * n * k)
    return k, packs, dense_w


def _int4_gemm_kernels(rows, shapes: dict, sms: int) -> list[tuple]:
    """Every distinct compilation the sweep will ask for: (block_n, block_m, block_kw, K split
    or not, num_warps, num_stages, PTX unpacking), defaults first, then the candidates."""
    from engine_triton.kernels import int4gemm

    seen: dict[tuple, None] = {}
    for asm in (True, False):
        for n, k in shapes.values():
            for m in rows:
                c = int4gemm._gemm_config(m, n, k, sms)
                seen[(c[0], c[1], c[2], c[3] > 1, c[4], c[5], asm)] = None
    for cand in INT4_GEMM_CANDIDATES:
        for n, k in shapes.values():
            for m in rows:
                c = _int4_gemm_resolve(cand, m, n, k, sms)
                seen[(c[0], c[1], c[2], c[3] > 1, c[4], c[5], True)] = None
    return list(seen)


def _int4_gemm_compile(kernels: list[tuple], device: str) -> list[str]:
    """Compile ``kernels`` (as ``_int4_gemm_kernels`` lists them) by one small call each, so
    that Triton's on-disk cache holds them: a tiny layer with the 8B shapes' specialization
    (every size and stride a multiple of 16, M unspecialized, K split in two or not at all).
    Runs in the worker processes of ``_int4_gemm_precompile``; returns the failures."""
    import torch

    from engine_triton.kernels import int4gemm, int4pack

    n, k, group = 256, 512, 128
    q = torch.randint(0, 16, (n, k), device=device, dtype=torch.uint8)
    s = torch.rand(n, k // group, device=device) * 0.01 + 0.001
    z = torch.full((n, k // group), 8, device=device, dtype=torch.uint8)
    packed = int4pack.pack(q, s, z, group)
    x = torch.randn(17, k, device=device, dtype=torch.bfloat16)
    failed = []
    config, asm = int4gemm._gemm_config, int4gemm.UNPACK_ASM
    try:
        for bn, bm, bkw, is_split, warps, stages, unpack_asm in kernels:
            int4gemm._gemm_config = (
                lambda *a, c=(bn, bm, bkw, 2 if is_split else 1, warps, stages): c
            )
            int4gemm.UNPACK_ASM = unpack_asm
            try:
                int4gemm.gemm(x, packed["int4pack"], packed["scale_zero"], group)
            except Exception as exc:  # the sweep meets it again and records it
                failed.append(f"{(bn, bm, bkw, is_split, warps, stages, unpack_asm)}: {exc}"[:200])
        if device != "cpu":
            torch.cuda.synchronize()
    finally:
        int4gemm._gemm_config, int4gemm.UNPACK_ASM = config, asm
    return failed


def _int4_gemm_precompile(kernels: list[tuple], device: str, workers: int) -> None:
    """Compile ``kernels`` in ``workers`` spawned processes (Triton compiles one kernel at a
    time per process; the sweep asks for about 70), filling the on-disk cache the sweep then
    loads from. Best effort: on any failure the sweep compiles what is missing itself."""
    import concurrent.futures
    import multiprocessing

    t0 = time.perf_counter()
    chunks = [kernels[i::workers] for i in range(workers) if kernels[i::workers]]
    try:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(len(chunks), mp_context=ctx) as pool:
            failed = [f for r in pool.map(_int4_gemm_compile, chunks, [device] * len(chunks))
                      for f in r]  # fmt: skip
    except Exception as exc:
        print(f"int4gemm: precompilation failed ({type(exc).__name__}: {exc})", flush=True)
        return
    print(
        f"int4gemm: {len(kernels)} kernels compiled in {len(chunks)} processes in "
        f"{time.perf_counter() - t0:.0f}s; {len(failed)} refused {failed[:3]}",
        flush=True,
    )


def _int4_gemm_sweep(
    torch, rows, budget_s: float, device: str = "cuda", save=None, workers: int = 0
) -> dict:
    """``--int4-gemm-sweep`` (see the module docstring): per projection and rows, the dense
    path, bf16 cuBLAS, the GEMM's default and its candidates; returns everything measured and
    hands it to ``save`` after every pass (a run cut short keeps what it measured). A
    candidate starts only if the previous pass's duration still fits in ``budget_s``. With
    ``workers``, every kernel is first compiled in that many processes."""
    from engine_triton.kernels import int4pack

    gemm_rows = int4pack.GEMM_MAX_ROWS
    int4pack.GEMM_MAX_ROWS = 0  # int4pack.linear is the dense path whatever it is set to
    try:
        return _int4_gemm_passes(torch, rows, budget_s, device, save, workers)
    finally:
        int4pack.GEMM_MAX_ROWS = gemm_rows


def _int4_gemm_passes(torch, rows, budget_s: float, device: str, save, workers: int) -> dict:
    """The body of ``_int4_gemm_sweep``, with ``int4pack.linear`` held to the dense path."""
    from engine_triton.benchmark import _graph_us
    from engine_triton.kernels import int4gemm, int4pack

    t0 = time.perf_counter()
    on_gpu = device != "cpu"
    shapes = SHAPES if on_gpu else INT4_GEMM_CPU_SHAPES
    timer = _graph_us if on_gpu else _wall_us
    copies = _copies if on_gpu else (lambda make, nbytes: [make(), make()])
    sms = int4gemm._sm_count(torch.device(device))
    group = 128
    if workers:
        _int4_gemm_precompile(_int4_gemm_kernels(rows, shapes, sms), device, workers)
    layers, results = {}, {}
    for name, (n, k) in shapes.items():
        layers[name] = _int4_gemm_layer(torch, n, k, group, copies, device)
        results[name] = {}

    def gemm_call(x, packs):
        return lambda i: int4gemm.gemm(
            x, packs[i % len(packs)]["int4pack"], packs[i % len(packs)]["scale_zero"], group
        )

    def run(x, packs, want, config=None) -> dict:
        """The GEMM at ``config`` (None: the default): us per call, largest difference from
        the dense path, the configuration it ran."""
        original = int4gemm._gemm_config
        if config is not None:
            int4gemm._gemm_config = lambda m_, n_, k_, sms_: _int4_gemm_resolve(
                config, m_, n_, k_, sms_
            )
        try:
            m, k = x.shape
            used = int4gemm._gemm_config(m, want.shape[1], k, sms)
            got = gemm_call(x, packs)(0)
            err = float((got.float() - want.float()).abs().max())
            us = timer(gemm_call(x, packs))
            return {"us": round(us, 2), "max_abs_err": round(err, 4), "config": list(used)}
        except Exception as exc:  # a configuration the compiler or the GPU refuses
            return {"us": float("inf"), "error": f"{type(exc).__name__}: {exc}"[:200]}
        finally:
            int4gemm._gemm_config = original

    xs = {}
    for name, (k, packs, dense_w) in layers.items():  # pass 1: the comparison that matters
        for m in rows:
            x = xs[name, m] = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            want = int4pack.linear(x, packs[0], group, None, None)  # dequantize + cuBLAS
            dense = timer(
                lambda i, x=x, p=packs: int4pack.linear(x, p[i % len(p)], group, None, None)
            )
            bf16 = timer(lambda i, x=x, w=dense_w: torch.nn.functional.linear(x, w[i % len(w)]))
            entry = {"dense": round(dense, 2), "bf16": round(bf16, 2)}
            entry["default"] = run(x, packs, want)
            int4gemm.UNPACK_ASM = False  # the same without the PTX unpacking: its A/B
            try:
                entry["default_no_asm"] = run(x, packs, want)
            finally:
                int4gemm.UNPACK_ASM = True
            entry["candidates"] = []
            results[name][m] = entry
            d = entry["default"]
            print(
                f"int4gemm {name:8s} M={m:4d} dense {dense:8.2f} bf16 {bf16:8.2f} "
                f"default {d['us']:8.2f} {d.get('config', d.get('error'))} "
                f"err {d.get('max_abs_err')} no-asm {entry['default_no_asm']['us']:8.2f} "
                f"err {entry['default_no_asm'].get('max_abs_err')} "
                f"({time.perf_counter() - t0:.0f}s)",
                flush=True,
            )
    if save is not None:
        save(results)
    last = 0.0
    for cand in INT4_GEMM_CANDIDATES:  # pass 2: the candidates, while the budget lasts
        started = time.perf_counter()
        if started - t0 + last > budget_s:
            print(f"int4gemm: budget of {budget_s:.0f}s spent before {cand}", flush=True)
            break
        for name, (_k, packs, _dense_w) in layers.items():
            for m in rows:
                x = xs[name, m]
                want = int4pack.linear(x, packs[0], group, None, None)
                r = run(x, packs, want, cand)
                r["candidate"] = list(cand)
                results[name][m]["candidates"].append(r)
        done = [results[name][m]["candidates"][-1] for name in layers for m in rows]
        line = " ".join(
            f"{name}/{m}:{results[name][m]['candidates'][-1]['us']}"
            for name in layers
            for m in rows
        )
        errs = [r["max_abs_err"] for r in done if "max_abs_err" in r]
        line += f" max_abs_err {max(errs) if errs else 'n/a'}"
        print(f"int4gemm candidate {cand}: {line} ({time.perf_counter() - t0:.0f}s)", flush=True)
        last = time.perf_counter() - started
        if save is not None:
            save(results)
    _int4_gemm_table(results)
    return results


def _int4_gemm_table(results: dict) -> None:
    """One table: per projection and rows, dense / bf16 / default / best of all, the best's
    configuration and the largest difference from the dense path over every configuration."""
    head = (
        f"{'shape':8s} {'M':>4s} {'dense':>8s} {'bf16':>8s} {'default':>8s} {'no-asm':>8s} "
        f"{'best':>8s} {'best/dense':>10s} {'max_abs_err':>11s}  best config"
    )
    print("\n" + head + "\n" + "-" * len(head))
    for name, by_m in results.items():
        for m, e in by_m.items():
            runs = [e["default"], e["default_no_asm"], *e["candidates"]]
            best = min(runs, key=lambda r: r["us"])
            errs = [r["max_abs_err"] for r in runs if "max_abs_err" in r]
            err = max(errs) if errs else float("nan")
            print(
                f"{name:8s} {m:4d} {e['dense']:8.2f} {e['bf16']:8.2f} {e['default']['us']:8.2f} "
                f"{e['default_no_asm']['us']:8.2f} {best['us']:8.2f} "
                f"{best['us'] / e['dense']:10.2f} {err:11.4f}  "
                f"{best.get('config')}",
                flush=True,
            )


def main(argv: list[str] | None = None) -> int:
    import torch

    from engine_triton.benchmark import _graph_us
    from engine_triton.kernels import fp8_linear as fp8_mod
    from engine_triton.kernels import wna16_linear as w4_mod

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--sweep", action="store_true", help="also sweep M=1 configurations")
    parser.add_argument("--rows", default=None, help="batch rows, comma-separated")
    parser.add_argument(
        "--producers", action="store_true", help="time the FP8 norm / SiLU kernels instead"
    )
    parser.add_argument(
        "--int4-gemm-sweep",
        action="store_true",
        help="time the int4-tile GEMM's configurations against dequantize + cuBLAS instead",
    )
    parser.add_argument("--budget-s", type=float, default=100.0, help="--int4-gemm-sweep's")
    parser.add_argument(
        "--compile-workers",
        type=int,
        default=None,
        help="--int4-gemm-sweep: processes compiling its kernels first (default: 12 on a GPU, "
        "0 on the CPU)",
    )
    parser.add_argument(
        "--device", default="cuda", help="--int4-gemm-sweep on cpu: an interpreter dry run"
    )
    args = parser.parse_args(argv)
    if args.int4_gemm_sweep:
        on_gpu = args.device != "cpu"
        default_rows = INT4_GEMM_ROWS if on_gpu else (17, 33)
        rows = [int(r) for r in (args.rows or ",".join(map(str, default_rows))).split(",")]
        gpu = torch.cuda.get_device_name(0) if on_gpu else "cpu (interpreter)"

        def save(sweep: dict) -> None:
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"gpu": gpu, "rows": rows, "int4_gemm": sweep}, f, indent=2)

        workers = args.compile_workers
        if workers is None:
            workers = 12 if on_gpu else 0
        _int4_gemm_sweep(torch, rows, args.budget_s, args.device, save, workers)
        return 0
    default_rows = PRODUCER_ROWS if args.producers else ROWS
    rows = [int(r) for r in (args.rows or ",".join(map(str, default_rows))).split(",")]
    results: dict = {"gpu": torch.cuda.get_device_name(0), "shapes": {}, "sweep": {}}
    if args.producers:
        results["producers"] = _producers(torch, _graph_us, rows)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
        return 0
    step_us: dict[str, float] = {}
    for name, (n, k) in SHAPES.items():
        calls, nbytes = _calls(torch, fp8_mod, w4_mod, n, k)
        results["shapes"][name] = {}
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {}
            for method, call in calls.items():
                us = _graph_us(lambda i, call=call, x=x: call(x, i))
                row[method] = {"us": round(us, 2), "GBps": round(nbytes[method] / us / 1e3)}
                if m == 1:
                    step_us[method] = step_us.get(method, 0.0) + 32 * us
            results["shapes"][name][m] = row
            cells = " | ".join(
                f"{k_}: {v['us']:8.2f}us {v['GBps']:5d}GB/s" for k_, v in row.items()
            )
            print(f"{name:8s} M={m:5d} {cells}", flush=True)
        if args.sweep:
            results["sweep"][name] = _sweep_shape(name, k, calls, fp8_mod, w4_mod, _graph_us, torch)
    results["decode_step_matmul_us_m1"] = {k: round(v, 1) for k, v in step_us.items()}
    print("\nper decode step at M=1, the 32 layers' projections (lm_head not included):")
    for method, us in step_us.items():
        print(f"  {method:16s} {us / 1e3:7.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    t0 = time.time()
    code = main()
    print(f"done in {time.time() - t0:.0f}s")
    sys.exit(code)
