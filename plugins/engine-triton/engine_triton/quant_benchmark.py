"""Timings of the quantized matmuls on the Llama-3.1-8B projections (needs a CUDA GPU).

``python -m engine_triton.quant_benchmark [--json FILE] [--sweep]``

For each projection (qkv, o, gate_up, down) and batch rows M, microseconds per call inside a
CUDA graph of 100 back-to-back calls (weight copies rotated so HBM, not L2, is read), and the
weight bandwidth that implies, for: bf16 (cuBLAS), FP8 W8A8 (the per-token quantizer plus the
skinny GEMV or cuBLASLt), FP8 weight-only, and AWQ-style W4A16 with groups of 128. Then the
decode step's matmul time (x 32 layers) per method, which bounds batch-1 tokens/s.

``--sweep`` also tries skinny-kernel configurations at M = 1 (FMA and tensor-core variants)
and W4A16 GEMM tilings at 64, 256 and 1024 rows, and prints the fastest per shape (candidates
for the defaults in ``fp8_linear.py`` / ``wna16_linear.py``).
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
# Skinny-kernel configurations (block_n, block_k, num_warps, split_k, tensor cores) at M = 1.
FP8_CANDIDATES = [
    (4, 1024, 2, 1, False),
    (8, 1024, 4, 1, False),
    (8, 512, 4, 1, False),
    (16, 512, 4, 1, False),
    # e4m3 x e4m3 on the tensor cores (the row padded to 16): no per-weight conversion.
    (16, 256, 4, 2, True),
    (32, 256, 4, 1, True),
    (32, 256, 4, 2, True),
    (32, 512, 4, 1, True),
    (64, 128, 4, 2, True),
    (64, 256, 4, 1, True),
    (64, 256, 8, 2, True),
    (128, 128, 4, 2, True),
]
W4_CANDIDATES = [
    (32, 128, 4, 2, False),
    (64, 128, 4, 1, False),
    (64, 128, 4, 2, False),
    (64, 128, 4, 4, False),
    (128, 128, 4, 2, False),
    (128, 128, 8, 4, False),
    (32, 128, 2, 4, False),
    (32, 128, 4, 2, True),
    (64, 128, 4, 1, True),
    (64, 128, 4, 2, True),
    (64, 128, 4, 4, True),
    (128, 128, 4, 2, True),
    (128, 128, 8, 1, True),
]
# The W4A16 GEMM (block_m, block_n, block_k, num_warps, num_stages) at GEMM_ROWS.
W4_GEMM_CANDIDATES = [
    (64, 128, 64, 4, 3),
    (64, 128, 128, 4, 3),
    (128, 128, 64, 8, 3),
    (128, 128, 128, 8, 3),
    (128, 256, 64, 8, 3),
    (64, 256, 64, 8, 3),
    (128, 64, 128, 4, 4),
    (256, 128, 64, 8, 3),
    (128, 128, 64, 4, 4),
]
GEMM_ROWS = (64, 256, 1024)


def _copies(make, nbytes: int) -> list:
    return [make() for _ in range(max(2, ROTATE_BYTES // max(nbytes, 1)))]


def _calls(torch, fp8_mod, w4_mod, n: int, k: int):
    """(callables by method taking (x, i), weight bytes by method) for one projection shape,
    over rotated weight copies."""
    dev = torch.device("cuda")
    bf16 = _copies(lambda: torch.randn(n, k, device=dev, dtype=torch.bfloat16), 2 * n * k)
    fp8 = _copies(lambda: (torch.randn(n, k, device=dev) * 64).to(torch.float8_e4m3fn), n * k)
    ws = torch.rand(n, device=dev) * 1e-3
    q = torch.randint(0, 16, (n, k), device=dev, dtype=torch.uint8)
    s = (torch.rand(n, k // 128, device=dev) * 0.01).half()
    z = torch.full((n, k // 128), 8, device=dev, dtype=torch.uint8)
    w4 = _copies(lambda: w4_mod.wna16_linear.prepack(q, s, z, bits=4, group_size=128), n * k // 2)

    def f_bf16(x, i):
        return torch.nn.functional.linear(x, bf16[i % len(bf16)])

    def f_fp8(x, i):
        return fp8_mod.fp8_linear(x, fp8[i % len(fp8)], ws)

    def f_fp8_wo(x, i):
        return fp8_mod.fp8_linear(x, fp8[i % len(fp8)], ws, None, None, False)

    def f_w4(x, i):
        return w4_mod.wna16_linear(x, w4[i % len(w4)], bits=4, group_size=128)

    calls = {"bf16": f_bf16, "fp8_w8a8": f_fp8, "fp8_weight_only": f_fp8_wo, "w4a16_g128": f_w4}
    nbytes = {"bf16": 2 * n * k, "fp8_w8a8": n * k, "fp8_weight_only": n * k}
    nbytes["w4a16_g128"] = n * k // 2 + 4 * n * (k // 128)
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


def main(argv: list[str] | None = None) -> int:
    import torch

    from engine_triton.benchmark import _graph_us
    from engine_triton.kernels import fp8_linear as fp8_mod
    from engine_triton.kernels import wna16_linear as w4_mod

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--sweep", action="store_true", help="also sweep M=1 configurations")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    results: dict = {"gpu": torch.cuda.get_device_name(0), "shapes": {}, "sweep": {}}
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
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            best = {}
            for label, mod, cands in (
                ("fp8_w8a8", fp8_mod, FP8_CANDIDATES),
                ("w4a16_g128", w4_mod, W4_CANDIDATES),
            ):
                timings = _sweep(_graph_us, mod, "_skinny_config", cands, calls[label], x)
                best[label] = timings[:3]
                print(f"  sweep {name} {label} M=1: best {timings[:3]}", flush=True)
            for m in GEMM_ROWS:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                timings = _sweep(
                    _graph_us, w4_mod, "_gemm_config", W4_GEMM_CANDIDATES, calls["w4a16_g128"], x
                )
                best[f"w4a16_gemm_m{m}"] = timings[:3]
                base = [t for t in timings if t[1] == W4_GEMM_CANDIDATES[0]]
                print(
                    f"  sweep {name} w4a16 GEMM M={m}: best {timings[:3]}; "
                    f"current {base[0][0] if base else None}",
                    flush=True,
                )
            results["sweep"][name] = best
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
