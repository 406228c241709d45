"""The int4-tile GEMM's configuration sweep (``kernels/int4gemm.py``), on a CUDA GPU.

``python -m engine_triton.quant_benchmark --int4-gemm-sweep [--rows 32,64,128,256,512]
[--budget-s 150] [--json FILE]`` (``quant_benchmark`` hands this module its shapes and its
weight-copy helper, so the dependency points one way).

For each Llama-3.1-8B projection (``quant_benchmark.SHAPES``; AWQ-style 4-bit weights in
groups of 128 with zero points, in torch's int4 tiles as a bf16 model's layers hold them) and
each row count, microseconds per call inside a CUDA graph of 100 back-to-back calls over
weight copies rotated so HBM, not L2, is read (``benchmark._graph_us``), of:

* ``dense``: what ``int4pack.linear`` does above 16 rows today, the weight dequantized to bf16
  and multiplied by cuBLAS (the path the GEMM would replace);
* ``bf16``: cuBLAS on a bf16 weight of the same shape (the floor of the dense path);
* ``tinygemm``: torch's ``_weight_int4pack_mm`` at this row count (what serves up to 16 rows);
* ``default``: the GEMM's own choice (``int4gemm._gemm_config``), and ``no-asm``: the same
  with the unpacking in plain Triton instead of inline PTX;
* then each of ``CANDIDATES`` in order, across every shape and row count, while ``budget_s``
  lasts. Every GEMM output is checked against the dense path's (largest difference relative
  to the largest output); a configuration further off than ``MAX_REL_ERR`` is reported and
  never chosen.

At the end: one table (best GEMM configuration per shape and rows against dense and
tinygemm), the rows where the GEMM wins summed over the four projections (a decode step runs
all four), the suggested ``int4pack.GEMM_MAX_ROWS``, and the ``int4gemm.TUNED`` lines to paste.
The kernels are first compiled by ``--compile-workers`` spawned processes (12 on a GPU) into
Triton's on-disk cache, so the budget goes to timing. ``--device cpu`` (under
``TRITON_INTERPRET=1``) runs the same code on two tiny shapes with wall-clock timings: a dry
run of the code path for the tests, not a measurement. ``--sm90-report`` instead compiles
every configuration the sweep would run for sm_90 on any machine (no GPU: Triton ships
``ptxas``) and prints registers, shared memory, spills and the instructions that say whether
the loads are pipelined and which MMA runs; it exits 1 if one does not fit.
"""

from __future__ import annotations

import argparse
import json
import time

# (block_n, cap on block_m (the power of two covering M, ``int4gemm.block_rows``), block_kw
# (words of a row per K block: 8 inputs each), split_k (0: ``int4gemm.split_k``'s rule for one
# wave of programs, -2: for two waves, n > 0: n), num_warps, num_stages), timed in this order
# after the default configuration until the budget runs out. Each compiles for sm_90 without
# spills within shared memory (``--sm90-report``, no GPU needed; registers and shared bytes at
# the largest row block the cap allows in the comments). K blocks stay at 128 inputs: with
# groups of 128 a longer block takes the per-word-column scale path (2-D scale tiles). Not
# here: 32 outputs a program (Triton then uses mma.sync, whose operand layout costs about 7.6
# unpacking instructions per weight against 1.9).
CANDIDATES = [
    (128, 128, 16, 1, 8, 3),  # the rule of thumb without split-K (166 regs, 113 KiB)
    (128, 64, 16, 0, 8, 4),  # row blocks of 64 (90 regs, 90 KiB: two programs per SM)
    (128, 256, 16, 0, 8, 2),  # one block up to 256 rows: each weight unpacked once (254 regs)
    (256, 64, 16, 0, 8, 3),  # 256 outputs: x read from L2 half as often (167 regs, 82 KiB)
    (256, 128, 16, 0, 8, 2),  # (254 regs, 81 KiB)
    (128, 64, 16, 0, 4, 4),  # one warpgroup for 128 outputs: loop overhead over more weights
    (128, 128, 16, -2, 8, 3),  # split for two waves
    (64, 64, 16, -2, 4, 4),  # small tiles, many programs (80 regs, 77 KiB)
    (128, 32, 16, 0, 8, 4),  # row blocks of 32 (56 regs, 58 KiB: three programs per SM)
    (64, 128, 16, 0, 4, 4),  # (166 regs, 141 KiB)
    (128, 128, 16, 0, 8, 4),  # (166 regs, 154 KiB)
]
ROWS = (32, 64, 128, 256, 512)
GROUP = 128
# A GEMM output further than this from the dense path's, relative to the largest output, marks
# the configuration as wrong (two bf16 roundings are about 0.8%).
MAX_REL_ERR = 0.02
# --device cpu: a dry run of the code path in the interpreter on tiny shapes.
CPU_SHAPES = {"tiny_qkv": (96, 256), "tiny_down": (64, 512)}


def resolve(cand, m: int, n: int, k: int, sms: int):
    """A candidate of ``CANDIDATES`` as the ``int4gemm.GemmConfig`` it runs at this shape."""
    from engine_triton.kernels import int4gemm

    block_n, cap, block_kw, split, warps, stages = cand
    block_m = int4gemm.block_rows(m, cap)
    if split <= 0:
        waves = max(1, -split)
        split = int4gemm.split_k(m, n, k, block_n, block_m, block_kw, sms, waves)
    split = min(split, max(1, k // (8 * block_kw)))
    return int4gemm.GemmConfig(block_n, block_m, block_kw, split, warps, stages)


def _wall_us(call) -> float:
    """Microseconds of one ``call(i)`` by the wall clock (the CPU dry run: no graphs)."""
    call(0)
    t0 = time.perf_counter()
    call(1)
    return (time.perf_counter() - t0) * 1e6


def _layer(torch, n: int, k: int, copies, device: str) -> tuple:
    """(K, rotated int4-tile copies of one random 4-bit layer, rotated bf16 weights)."""
    from engine_triton.kernels import int4pack

    q = torch.randint(0, 16, (n, k), device=device, dtype=torch.uint8)
    s = torch.rand(n, k // GROUP, device=device) * 0.01 + 0.001
    z = torch.randint(0, 16, (n, k // GROUP), device=device, dtype=torch.uint8)
    packs = copies(lambda: int4pack.pack(q, s, z, GROUP), n * k // 2)
    dense_w = copies(lambda: torch.randn(n, k, device=device, dtype=torch.bfloat16), 2 * n * k)
    return k, packs, dense_w


def _kernels(rows, shapes: dict, sms: int) -> list[tuple]:
    """Every distinct compilation the sweep will ask for: (block_n, block_m, block_kw, K split
    or not, num_warps, num_stages, PTX unpacking), defaults first, then the candidates."""
    from engine_triton.kernels import int4gemm

    seen: dict[tuple, None] = {}
    for asm in (True, False):
        for n, k in shapes.values():
            for m in rows:
                c = int4gemm._gemm_config(m, n, k, sms)
                seen[(c[0], c[1], c[2], c[3] > 1, c[4], c[5], asm)] = None
    for cand in CANDIDATES:
        for n, k in shapes.values():
            for m in rows:
                c = resolve(cand, m, n, k, sms)
                seen[(c[0], c[1], c[2], c[3] > 1, c[4], c[5], True)] = None
    return list(seen)


def _compile(kernels: list[tuple], device: str) -> list[str]:
    """Compile ``kernels`` (as ``_kernels`` lists them) by one small call each, so that
    Triton's on-disk cache holds them: a tiny layer with the 8B shapes' specialization (every
    size and stride a multiple of 16, M unspecialized, K split in two or not at all). Runs in
    the worker processes of ``_precompile``; returns the failures."""
    import torch

    from engine_triton.kernels import int4gemm, int4pack

    n, k = 256, 512
    q = torch.randint(0, 16, (n, k), device=device, dtype=torch.uint8)
    s = torch.rand(n, k // GROUP, device=device) * 0.01 + 0.001
    z = torch.full((n, k // GROUP), 8, device=device, dtype=torch.uint8)
    packed = int4pack.pack(q, s, z, GROUP)
    x = torch.randn(17, k, device=device, dtype=torch.bfloat16)
    failed = []
    config, asm = int4gemm._gemm_config, int4gemm.UNPACK_ASM
    try:
        for bn, bm, bkw, is_split, warps, stages, unpack_asm in kernels:
            cfg = int4gemm.GemmConfig(bn, bm, bkw, 2 if is_split else 1, warps, stages)
            int4gemm._gemm_config = lambda *a, c=cfg: c
            int4gemm.UNPACK_ASM = unpack_asm
            try:
                int4gemm.gemm(x, packed["int4pack"], packed["scale_zero"], GROUP)
            except Exception as exc:  # the sweep meets it again and records it
                failed.append(f"{(bn, bm, bkw, is_split, warps, stages, unpack_asm)}: {exc}"[:200])
        if device != "cpu":
            torch.cuda.synchronize()
    finally:
        int4gemm._gemm_config, int4gemm.UNPACK_ASM = config, asm
    return failed


def _precompile(kernels: list[tuple], device: str, workers: int) -> None:
    """Compile ``kernels`` in ``workers`` spawned processes (Triton compiles one kernel at a
    time per process), filling the on-disk cache the sweep then loads from. Best effort: on
    any failure the sweep compiles what is missing itself."""
    import concurrent.futures
    import multiprocessing

    t0 = time.perf_counter()
    chunks = [kernels[i::workers] for i in range(workers) if kernels[i::workers]]
    try:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(len(chunks), mp_context=ctx) as pool:
            failed = [f for r in pool.map(_compile, chunks, [device] * len(chunks))
                      for f in r]  # fmt: skip
    except Exception as exc:
        print(f"int4gemm: precompilation failed ({type(exc).__name__}: {exc})", flush=True)
        return
    print(
        f"int4gemm: {len(kernels)} kernels compiled in {len(chunks)} processes in "
        f"{time.perf_counter() - t0:.0f}s; {len(failed)} refused {failed[:3]}",
        flush=True,
    )


def sweep(torch, rows, budget_s: float, device: str, save, workers: int, shapes, copies) -> dict:
    """The sweep (see the module docstring) over ``shapes`` (name -> (N, K)) with weight
    copies made by ``copies(make, nbytes)``: per projection and rows, the dense path, bf16
    cuBLAS, tinygemm, the GEMM's default and its candidates; returns everything measured and
    hands it to ``save`` after every pass (a run cut short keeps what it measured). A
    candidate starts only if the previous one's duration still fits in ``budget_s``."""
    from engine_triton.kernels import int4pack

    gemm_rows = int4pack.GEMM_MAX_ROWS
    int4pack.GEMM_MAX_ROWS = 0  # int4pack.linear is the dense path whatever it is set to
    try:
        return _passes(torch, rows, budget_s, device, save, workers, shapes, copies)
    finally:
        int4pack.GEMM_MAX_ROWS = gemm_rows


def _passes(torch, rows, budget_s, device, save, workers, shapes, copies) -> dict:
    """The body of ``sweep``, with ``int4pack.linear`` held to the dense path."""
    from engine_triton.benchmark import _graph_us
    from engine_triton.kernels import int4gemm, int4pack

    t0 = time.perf_counter()
    on_gpu = device != "cpu"
    timer = _graph_us if on_gpu else _wall_us
    sms = int4gemm._sm_count(torch.device(device))
    if workers:
        _precompile(_kernels(rows, shapes, sms), device, workers)
    layers = {name: _layer(torch, n, k, copies, device) for name, (n, k) in shapes.items()}
    results: dict = {name: {} for name in shapes}

    def gemm_call(x, packs):
        return lambda i: int4gemm.gemm(
            x, packs[i % len(packs)]["int4pack"], packs[i % len(packs)]["scale_zero"], GROUP
        )

    def run(x, packs, want, config=None) -> dict:
        """The GEMM at ``config`` (None: the default): us per call, largest difference from
        the dense path (absolute, and relative to its largest output), the configuration."""
        original = int4gemm._gemm_config
        if config is not None:
            int4gemm._gemm_config = lambda m_, n_, k_, sms_: resolve(config, m_, n_, k_, sms_)
        try:
            m, k = x.shape
            used = int4gemm._gemm_config(m, want.shape[1], k, sms)
            got = gemm_call(x, packs)(0)
            err = float((got.float() - want.float()).abs().max())
            rel = err / max(float(want.float().abs().max()), 1e-30)
            us = timer(gemm_call(x, packs))
            return {"us": round(us, 2), "max_abs_err": round(err, 4), "rel_err": round(rel, 5),
                    "config": list(used)}  # fmt: skip
        except Exception as exc:  # a configuration the compiler or the GPU refuses
            return {"us": float("inf"), "error": f"{type(exc).__name__}: {exc}"[:200]}
        finally:
            int4gemm._gemm_config = original

    xs, wants = {}, {}
    for name, (k, packs, dense_w) in layers.items():  # pass 1: the comparison that matters
        for m in rows:
            x = xs[name, m] = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            want = wants[name, m] = int4pack.linear(x, packs[0], GROUP, None, None)
            dense = timer(
                lambda i, x=x, p=packs: int4pack.linear(x, p[i % len(p)], GROUP, None, None)
            )
            bf16 = timer(lambda i, x=x, w=dense_w: torch.nn.functional.linear(x, w[i % len(w)]))
            tiny = None
            if on_gpu:  # torch's kernel exists for these tiles on CUDA only
                tiny = round(timer(lambda i, x=x, p=packs: torch._weight_int4pack_mm(
                    x, p[i % len(p)]["int4pack"], GROUP, p[i % len(p)]["scale_zero"])), 2)  # fmt: skip
            entry = {"dense": round(dense, 2), "bf16": round(bf16, 2), "tinygemm": tiny}
            entry["default"] = run(x, packs, want)
            int4gemm.UNPACK_ASM = False  # the same without the PTX unpacking: its A/B
            try:
                entry["default_no_asm"] = run(x, packs, want)
            finally:
                int4gemm.UNPACK_ASM = True
            entry["candidates"] = []
            results[name][m] = entry
            d, na = entry["default"], entry["default_no_asm"]
            print(
                f"int4gemm {name:8s} M={m:4d} dense {dense:8.2f} bf16 {bf16:8.2f} "
                f"tinygemm {tiny} default {d['us']:8.2f} {d.get('config', d.get('error'))} "
                f"rel_err {d.get('rel_err')} no-asm {na['us']:8.2f} rel_err {na.get('rel_err')} "
                f"({time.perf_counter() - t0:.0f}s)",
                flush=True,
            )
    if save is not None:
        save(results)
    last = 0.0
    for cand in CANDIDATES:  # pass 2: the candidates, while the budget lasts
        started = time.perf_counter()
        if started - t0 + last > budget_s:
            print(f"int4gemm: budget of {budget_s:.0f}s spent before {cand}", flush=True)
            break
        for name, (_k, packs, _dense_w) in layers.items():
            for m in rows:
                r = run(xs[name, m], packs, wants[name, m], cand)
                r["candidate"] = list(cand)
                results[name][m]["candidates"].append(r)
        done = [results[name][m]["candidates"][-1] for name in layers for m in rows]
        line = " ".join(
            f"{name}/{m}:{results[name][m]['candidates'][-1]['us']}"
            for name in layers
            for m in rows
        )
        errs = [r["rel_err"] for r in done if "rel_err" in r]
        line += f" rel_err {max(errs) if errs else 'n/a'}"
        print(f"int4gemm candidate {cand}: {line} ({time.perf_counter() - t0:.0f}s)", flush=True)
        last = time.perf_counter() - started
        if save is not None:
            save(results)
    report(results, shapes)
    return results


def _best(entry: dict) -> dict:
    """The fastest GEMM run of one (shape, rows) entry among those close to the dense path."""
    runs = [entry["default"], entry["default_no_asm"], *entry["candidates"]]
    ok = [r for r in runs if "error" not in r and r.get("rel_err", 1.0) <= MAX_REL_ERR]
    return min(ok, key=lambda r: r["us"]) if ok else {"us": float("inf")}


def report(results: dict, shapes: dict) -> dict:
    """Print the table, the per-rows totals over the projections, the suggested
    ``GEMM_MAX_ROWS`` and the ``TUNED`` lines; returns ``{"gemm_max_rows": ..., "tuned": ...}``."""
    from engine_triton.kernels import int4gemm

    head = (
        f"{'shape':8s} {'M':>4s} {'dense':>8s} {'bf16':>8s} {'tinygemm':>8s} {'default':>8s} "
        f"{'no-asm':>8s} {'best':>8s} {'best/dense':>10s} {'rel_err':>8s}  best config"
    )
    print("\n" + head + "\n" + "-" * len(head))
    totals: dict[int, list[float]] = {}
    tuned = []
    for name, by_m in results.items():
        n, k = shapes[name]
        for m, e in by_m.items():
            best = _best(e)
            runs = [e["default"], e["default_no_asm"], *e["candidates"]]
            errs = [r["rel_err"] for r in runs if "rel_err" in r]
            tiny = e.get("tinygemm")
            print(
                f"{name:8s} {m:4d} {e['dense']:8.2f} {e['bf16']:8.2f} "
                f"{tiny if tiny is not None else float('nan'):8.2f} {e['default']['us']:8.2f} "
                f"{e['default_no_asm']['us']:8.2f} {best['us']:8.2f} "
                f"{best['us'] / e['dense']:10.2f} {max(errs) if errs else float('nan'):8.4f}  "
                f"{best.get('config')}",
                flush=True,
            )
            t = totals.setdefault(int(m), [0.0, 0.0])
            t[0] += e["dense"]
            t[1] += best["us"]
            if best["us"] < e["dense"] and "config" in best:
                cfg = int4gemm.GemmConfig(*best["config"])
                tuned.append(f"TUNED[({int(m)}, {n}, {k})] = {cfg!r}")
    print("\nrows: the projections' summed us, dense -> best GEMM")
    gemm_max_rows, losing = 0, False
    for m in sorted(totals):
        dense, best = totals[m]
        print(f"  M={m:4d}: {dense:9.2f} -> {best:9.2f} ({best / dense:.2f}x)", flush=True)
        losing = losing or best >= dense
        if not losing:  # the GEMM's rows run from 17 up: every smaller count swept won too
            gemm_max_rows = m
    print(f"\nsuggested: int4pack.GEMM_MAX_ROWS = {gemm_max_rows}")
    print("int4gemm.TUNED entries where the GEMM won (paste into kernels/int4gemm.py):")
    for line in tuned:
        print(f"  {line}")
    return {"gemm_max_rows": gemm_max_rows, "tuned": tuned}


def sm90_report(config, unpack_asm: bool = True, split: bool = True) -> dict:
    """Compile the kernel at ``config`` (an ``int4gemm.GemmConfig``) for sm_90 without a GPU
    (Triton's own ``ptxas``), with the divisibility the 8B shapes give every size and stride,
    and read the result: registers and shared bytes per program, spills, how many wgmma
    (``HGMMA``) or mma.sync (``HMMA``) instructions, how many ``cp.async`` copies (the
    pipelined loads) and plain global loads. Needs no ``TRITON_INTERPRET``."""
    import glob
    import os
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine_triton.kernels import int4gemm

    fn = int4gemm._int4_gemm_kernel
    types = {"x_ptr": "*bf16", "w16_ptr": "*i16", "sz32_ptr": "*i32", "bias_ptr": "*bf16",
             "y_ptr": "*bf16", "part_ptr": "*fp32", "counter_ptr": "*i32"}  # fmt: skip
    constexprs = {"INNER": 8, "BLOCK_N": config.block_n, "BLOCK_M": config.block_m,
                  "BLOCK_KW": config.block_kw, "IS_SPLIT": split, "GROUP_PER_BLOCK": True,
                  "HAS_BIAS": False, "UNPACK_ASM": unpack_asm, "USE_PDL": False}  # fmt: skip
    signature = {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in fn.arg_names}
    runtime = ("M", "SPLIT_K", "LOG2_GROUP")  # not multiples of 16 (M is not specialized)
    divisible = [a for a in fn.arg_names if a not in constexprs and a not in runtime]
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in divisible}
    kernel = triton.compile(
        ASTSource(fn, signature, constexprs, attrs),
        target=GPUTarget("cuda", 90, 128),
        options={"num_warps": config.num_warps, "num_stages": config.num_stages},
    )
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    cuobjdump = (glob.glob(os.path.join(tools, "cuobjdump")) or ["cuobjdump"])[0]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True).stdout
        usage = subprocess.run(
            [cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
    ptx = kernel.asm["ptx"]
    regs = re.search(r"REG:(\d+)", usage)
    return {
        "regs": int(regs.group(1)) if regs else None,
        "shared": kernel.metadata.shared,
        "spills": len(re.findall(r"\b(STL|LDL)\b", sass)),
        "hgmma": sass.count("HGMMA"),
        "hmma": len(re.findall(r"\bHMMA\b", sass)),
        "cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
        "ld_global": ptx.count("ld.global"),
    }


def _sm90_table(rows, shapes: dict) -> int:
    """``--sm90-report``: ``sm90_report`` for the default configuration and every candidate
    at ``shapes`` and ``rows``, each distinct compilation once (132 SMs assumed)."""
    from engine_triton.kernels import int4gemm

    seen = {}
    for n, k in shapes.values():
        for m in rows:
            for c in [int4gemm._gemm_config(m, n, k, 132)] + [
                resolve(cand, m, n, k, 132) for cand in CANDIDATES
            ]:
                key = (c.block_n, c.block_m, c.block_kw, c.num_warps, c.num_stages, c.split_k > 1)
                seen.setdefault(key, c)
    bad = 0
    for key, c in seen.items():
        r = sm90_report(c, split=c.split_k > 1)
        fits = r["spills"] == 0 and r["shared"] <= 227 * 1024
        bad += not fits
        print(f"{key} {r} {'ok' if fits else 'DOES NOT FIT'}", flush=True)
    return int(bad > 0)


def main(argv: list[str], shapes: dict, copies) -> int:
    """Parse the flags (see the module docstring) and run the sweep on ``shapes`` (the CPU
    dry run: on ``CPU_SHAPES``, two copies of each weight)."""
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=None, help="rows, comma-separated")
    parser.add_argument("--json", default=None)
    parser.add_argument("--budget-s", type=float, default=150.0, help="seconds for the sweep")
    parser.add_argument(
        "--compile-workers",
        type=int,
        default=None,
        help="processes compiling the kernels first (default: 12 on a GPU, 0 on the CPU)",
    )
    parser.add_argument("--device", default="cuda", help="cpu: an interpreter dry run")
    parser.add_argument(
        "--sm90-report",
        action="store_true",
        help="compile every configuration for sm_90 without a GPU and print its resources",
    )
    args = parser.parse_args(argv)
    on_gpu = args.device != "cpu"
    default_rows = ROWS if on_gpu else (17, 33)
    rows = [int(r) for r in (args.rows or ",".join(map(str, default_rows))).split(",")]
    if args.sm90_report:
        return _sm90_table(
            [int(r) for r in (args.rows or ",".join(map(str, ROWS))).split(",")], shapes
        )
    gpu = torch.cuda.get_device_name(0) if on_gpu else "cpu (interpreter)"

    def save(results: dict) -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"gpu": gpu, "rows": rows, "int4_gemm": results}, f, indent=2)

    workers = args.compile_workers
    if workers is None:
        workers = 12 if on_gpu else 0
    if not on_gpu:
        shapes, copies = CPU_SHAPES, lambda make, nbytes: [make(), make()]
    sweep(torch, rows, args.budget_s, args.device, save, workers, shapes, copies)
    return 0
