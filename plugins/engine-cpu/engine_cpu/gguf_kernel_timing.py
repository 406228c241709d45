"""Kernel timings of the CPU GGUF int8 products, AVX-512 VNNI against AVX2, layer by layer.

    python -m engine_cpu.gguf_kernel_timing [--rows 1,4] [--threads 1,2] [--rounds 20]

For each product of a decode step of the embedded Gemma 3 270M Q4_K_M (the runs its layers
hold: q and k fused, v alone where its type differs, o, gate and up fused, down, the
vocabulary), random valid GGUF blocks of that type and shape are packed as the engine packs
them (``engine_cpu.gguf``, in huge pages) and copied until the copies hold at least
``--min-mib`` (the last-level cache of a 2-core EPYC VM is 32 MiB), so that each call reads its
weight from memory as a decode step does. Then ``gguf_avx2_linear`` (activation quantization
included) runs on each copy in turn, timed call by call in C (``csrc/gguf_timing.c``, compiled
here with the kernels' own sources and flags), alternating the VNNI path and the AVX2 one
(layout bit 10, ``engine_cpu.gguf.AVX2_ONLY``) round by round so that other load hits both.
Prints one line per (product, rows, threads): the minimum and the median microseconds of
each path and the ratio of the medians, then each path's sum over one decode step (each
product times the number of layers that run it). Needs a CPU with AVX-512 VNNI. One row runs
the AVX2 products either way (``gguf_avx2_gemm``), so at ``--rows 1`` the two columns time the
same code (the harness's own spread); ``--csrc`` with the sources of ``c5dc689`` or earlier
times the VNNI tiles at one row.

The K-quants (Q4_K, Q5_K, Q6_K) are packed with their compact scales (float16 d and dmin and
integer sub-scales per 256 values, ``engine_cpu.gguf._avx2_kscales``). ``--float32-scales``
packs them in the earlier form, float32 scales (and offsets) per group, which the sources of
``--csrc`` before the compact scales need; ``--forms`` times the two forms against each other
instead of the two instruction sets (each with the instructions the engine picks: AVX2 at one
row, VNNI from two), alternating as above.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from engine.kernels import gguf as gk
from engine.testing.tiny_gguf import random_blocks
from engine_cpu import gguf as cpu_gguf
from engine_cpu import hugepages, native

# (name, GGUF type, output rows N, input columns K, how many a decode step runs) of the
# embedded Gemma 3 270M Q4_K_M: 18 layers; q + k are Q5_0 everywhere, v Q8_0 in 9 layers (its
# own run) and Q5_0 in the others (fused with q and k); down Q6_K in 9 layers, Q4_K in 9.
MODEL_PRODUCTS: tuple[tuple[str, str, int, int, int], ...] = (
    ("qk", "Q5_0", 1280, 640, 9),
    ("qkv", "Q5_0", 1536, 640, 9),
    ("v", "Q8_0", 256, 640, 9),
    ("o", "Q4_K", 640, 1024, 18),
    ("gate_up", "Q5_0", 4096, 640, 18),
    ("down", "Q6_K", 640, 2048, 9),
    ("down", "Q4_K", 640, 2048, 9),
    ("vocab", "Q8_0", 262144, 640, 1),
)


def _timing_library(workdir: Path, src: Path | None = None) -> ctypes.CDLL:
    """``csrc/gguf_timing.c`` with the AVX2 family's sources (from ``src``, default this
    package's ``csrc``: another version's, to compare two), built with the kernels' flags."""
    src = src or Path(native.__file__).parent / "csrc"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc or gcc, or $CC) on PATH")
    out = workdir / "gguf_timing.so"
    # The AVX2 family's sources as the engine builds them (gguf_avx2.c calls into cpu_ops.c
    # since the MoE call); an older version's csrc may lack some, and then does not need them.
    family = [src / name for name in native.FAMILIES["avx2"].sources]
    sources = [src / "gguf_timing.c", *(path for path in family if path.exists())]
    cmd = [cc, *native._CFLAGS, *map(str, sources), "-o", str(out), *native._LIBS]
    subprocess.run(cmd, check=True)
    lib = ctypes.CDLL(str(out))
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.gguf_time_linear.argtypes = [
        *(i64, ptr, ptr, ptr, i32, i64, i64, i32, ptr, i64, ptr, ptr, ptr),
    ]
    lib.gguf_time_linear.restype = None
    lib.gguf_avx2_vnni.restype = i32
    return lib


def _copies(packed: dict[str, torch.Tensor], min_bytes: int) -> list[dict[str, torch.Tensor]]:
    """``packed`` and copies of it in fresh huge-page memory, together at least ``min_bytes``
    (every tensor but the layout word: the compact scales are ``[N, K / 256, record]``)."""
    size = sum(t.numel() * t.element_size() for t in packed.values() if t.dim() >= 2)
    out = [packed]
    for _ in range(1, max(1, -(-min_bytes // size))):
        copy = {}
        for key, t in packed.items():
            copy[key] = t if t.dim() < 2 else hugepages.empty(t.shape, t.dtype).copy_(t)
        out.append(copy)
    return out


def float32_scales(blocks: torch.Tensor, name: str, packed: dict) -> dict[str, torch.Tensor]:
    """A K-quant weight packed with compact scales, in the earlier form: float32 scales (and
    offsets for Q4_K / Q5_K) per group, the layout word without the bit, Q5_K's and Q6_K's
    values a byte each (Q4_K's as they are). Other types are returned as they are."""
    if not int(packed["avx2_layout"][0]) & cpu_gguf._KSCALES:
        return packed
    u, scale, offset = gk.unpack(blocks, name)
    values, layout = packed["avx2_values"], packed["avx2_layout"].clone()
    layout[0] &= ~cpu_gguf._KSCALES
    if name in ("Q5_K", "Q6_K"):  # a byte a value, in the interleaved order
        u = u[:, cpu_gguf._avx2_order(u.shape[1])]
        values = hugepages.empty(u.shape, torch.uint8).copy_(u)
        layout[0] = layout[0] & ~0xFF | cpu_gguf._PACK_U8
    old = {
        "avx2_values": values,
        "avx2_scales": hugepages.empty(scale.shape, torch.float32).copy_(scale),
        "avx2_layout": layout,
    }
    if name != "Q6_K":
        old["avx2_offsets"] = hugepages.empty(offset.shape, torch.float32).copy_(offset)
    return old


def time_product(
    lib: ctypes.CDLL,
    name: str,
    n: int,
    k: int,
    rows: int,
    rounds: int,
    min_bytes: int,
    seed: int = 0,
    form: str = "compact",
) -> dict[str, list[float]]:
    """Microseconds of each call, ``{"vnni": [...], "avx2": [...]}``, of the product of ``rows``
    random activation rows with a random ``n x k`` weight of GGUF type ``name``, the two paths
    alternating round by round (which goes first alternates too). ``form``: the K-quants'
    scales, "compact", "float32", or "both" (then the paths are ``{"compact", "float32"}``)."""
    t = gk.gguf_type(name)
    raw = random_blocks(n, k, name, seed)
    blocks = torch.from_numpy(raw).view(n, k // t.block_size, t.type_size)
    packed = cpu_gguf.gguf_linear.prepack(blocks, qtype=t.ggml_type, dtype=torch.float32)
    if "avx2_values" not in packed:
        raise RuntimeError("the AVX2 kernels did not pack this weight")
    forms = {"compact": packed}
    if form != "compact":
        forms["float32"] = float32_scales(blocks, name, packed)
        if form == "float32":
            forms = {"float32": forms["float32"]}
    del raw, blocks
    args = {}
    for key, weight in forms.items():
        copies = _copies(weight, min_bytes)
        c = len(copies)
        values = (ctypes.c_void_p * c)(*(p["avx2_values"].data_ptr() for p in copies))
        scales = (ctypes.c_void_p * c)(*(p["avx2_scales"].data_ptr() for p in copies))
        offsets = (ctypes.c_void_p * c)(
            *((p["avx2_offsets"].data_ptr() if "avx2_offsets" in p else None) for p in copies)
        )
        args[key] = (copies, c, values, scales, offsets, int(weight["avx2_layout"][0]))
    group = int(packed["avx2_layout"][1])
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed + 1))
    y = torch.empty(rows, n)
    scratch = torch.empty(rows * k + 4 * rows * (k // 32 + k // 16) + 128, dtype=torch.uint8)
    base = scratch.data_ptr() + (-scratch.data_ptr() % 64)
    ns = (ctypes.c_double * max(a[1] for a in args.values()))()
    paths = ("compact", "float32") if form == "both" else ("vnni", "avx2")
    times: dict[str, list[float]] = {p: [] for p in paths}
    for r in range(rounds + 1):
        order = paths if r % 2 == 0 else paths[::-1]
        for path in order:
            _, c, values, scales, offsets, pack = args[path if form == "both" else form]
            layout = pack | (cpu_gguf._AVX2_ONLY_BIT if path == "avx2" else 0)
            lib.gguf_time_linear(
                c, values, scales, offsets, layout, n, k, group, x.data_ptr(), rows, base,
                y.data_ptr(), ns,
            )  # fmt: skip
            if r:  # round 0 warms up (page faults, the OpenMP pool)
                times[path] += [v / 1e3 for v in ns[:c]]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1", help="activation rows, comma-separated")
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--min-mib", type=int, default=96, help="bytes of copies of a weight")
    parser.add_argument("--only", default="", help="products by name, comma-separated")
    parser.add_argument(
        "--csrc", default=None, help="time the kernels of this csrc directory (another version)"
    )
    parser.add_argument(
        "--float32-scales",
        action="store_true",
        help="pack the K-quants with float32 scales per group (the form before the compact one)",
    )
    parser.add_argument(
        "--forms",
        action="store_true",
        help="time the K-quants' compact scales against float32 ones instead of VNNI against AVX2",
    )
    args = parser.parse_args()
    form = "both" if args.forms else "float32" if args.float32_scales else "compact"
    a_, b_ = ("compact", "float32") if args.forms else ("vnni", "avx2")
    only = {s for s in args.only.split(",") if s}
    with tempfile.TemporaryDirectory() as tmp:
        lib = _timing_library(Path(tmp), args.csrc and Path(args.csrc))
        if not lib.gguf_avx2_vnni():
            raise SystemExit("this CPU has no AVX-512 VNNI: nothing to compare")
        for threads in (int(s) for s in args.threads.split(",")):
            torch.set_num_threads(threads)
            for rows in (int(s) for s in args.rows.split(",")):
                step = {a_: 0.0, b_: 0.0}
                for label, name, n, k, per_step in MODEL_PRODUCTS:
                    if only and label not in only:
                        continue
                    times = time_product(
                        lib, name, n, k, rows, args.rounds, args.min_mib << 20, form=form
                    )
                    med = {p: statistics.median(v) for p, v in times.items()}
                    for p in step:
                        step[p] += per_step * med[p]
                    print(
                        f"threads={threads} rows={rows} {label:8s} {name:5s} {n:6d}x{k:<5d} "
                        f"{a_} min {min(times[a_]):8.1f} med {med[a_]:8.1f} us | "
                        f"{b_} min {min(times[b_]):8.1f} med {med[b_]:8.1f} us | "
                        f"{a_}/{b_} {med[a_] / med[b_]:.3f}",
                        flush=True,
                    )
                print(
                    f"threads={threads} rows={rows} one decode step's products (medians): "
                    f"{a_} {step[a_] / 1e3:.3f} ms, {b_} {step[b_] / 1e3:.3f} ms",
                    flush=True,
                )


if __name__ == "__main__":
    main()
