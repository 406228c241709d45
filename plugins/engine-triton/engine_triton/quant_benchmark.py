"""Timings of the quantized matmuls on the Llama-3.1-8B projections (needs a CUDA GPU).

``python -m engine_triton.quant_benchmark [--json FILE] [--sweep | --int4-gemm-sweep]``

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

``--int4-gemm-sweep`` runs, instead, the int4-tile GEMM's configuration sweep
(``int4gemm_sweep.py``, which documents it and its other flags).

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


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else list(argv)
    if "--int4-gemm-sweep" in args_in:
        from engine_triton import int4gemm_sweep

        rest = [a for a in args_in if a != "--int4-gemm-sweep"]
        return int4gemm_sweep.main(rest, SHAPES, _copies)
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
    args = parser.parse_args(argv)
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
