"""GGUF layers on the CPU, kernel by kernel: the CPU plugin's ``gguf_linear`` per packing.

``python -m engine.benchmarks.gguf_cpu [--threads 2] [--rows 1,4,16,64,256] [--dtype bfloat16]
[--stream-mb 256] [--json FILE]`` times one call of ``gguf_linear`` (activation quantization,
product and conversions included) on the shapes and types of the embedded Gemma 3 270M Q4_K_M
(its Q8_0 vocabulary matrix, its Q5_0 gate/up, Q4_K attention output and Q6_K down
projections, as [out, in]) for each packing the CPU plugin has: ``amx`` and ``avx2`` (the
compiled kernels, where this CPU has them; ``amx`` serves 16-bit activations only) and
``torch`` (the packings without them: torch's int4 kernel for 4-bit types in 16-bit dtypes,
dense oneDNN otherwise, as with ``ENGINE_CPU_NATIVE=0``), plus the bytes each packing holds.
Random valid blocks; the median of ``--repeat`` calls that cycle through enough copies of the
layer to read ``--stream-mb`` megabytes (default 256, beyond this machine's caches, as a
model's step reads its layers; 0 times one copy, cache-resident for the small layers).

``--quality FILE.gguf`` instead compares the prefill logits of a real file, in bf16 with and
without the AMX kernels and in float32 with and without the AVX2 ones, against the same file
dequantized at load in float32: max and mean absolute logit difference and the share of
positions whose argmax agrees.
"""

from __future__ import annotations

import argparse
import json
import os
import time

SHAPES = [  # (what, type, rows N, columns K)
    ("vocabulary (LM head)", "Q8_0", 262144, 640),
    ("gate / up projection", "Q5_0", 2048, 640),
    ("attention output", "Q4_K", 640, 1024),
    ("down projection", "Q6_K", 640, 2048),
]


def _nbytes(packed: dict) -> int:
    """Bytes of a packing's tensors (an opaque oneDNN tensor counted at its logical size)."""
    return sum(t.numel() * t.element_size() for t in packed.values())


def run(args: argparse.Namespace) -> list[dict]:
    import torch

    from engine.kernels import gguf as ref
    from engine.plugins import PluginManager
    from engine.testing.tiny_gguf import random_blocks

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    # The CPU platform's gguf_linear, through the registry (the core imports no plugin).
    gguf_linear = PluginManager.from_env().kernel_registry().resolve("cpu").gguf_linear
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    for what, name, n, k in SHAPES:
        t = ref.gguf_type(name)
        blocks = torch.from_numpy(random_blocks(n, k, name)).view(n, -1, t.type_size)
        for packing, setting, key in (
            ("amx", "amx", "amx_values"),
            ("avx2", "avx2", "avx2_values"),
            ("torch", "0", None),
        ):
            os.environ["ENGINE_CPU_NATIVE"] = setting
            packed = gguf_linear.prepack(blocks, qtype=t.ggml_type, dtype=dtype)
            if key is not None and key not in packed:
                print(f"{what}: no {packing} kernels for {args.dtype} here (see the log)")
                continue
            copies = max(1, int(args.stream_mb * 1e6 // max(_nbytes(packed), 1)))
            layers = [packed] + [
                gguf_linear.prepack(blocks, qtype=t.ggml_type, dtype=dtype)
                for _ in range(copies - 1)
            ]
            for m in rows:
                x = torch.randn(m, k).to(dtype)
                gguf_linear(x, packed, qtype=t.ggml_type)  # warm-up
                times = []
                for i in range(max(args.repeat, 1)):
                    layer = layers[i % len(layers)]
                    start = time.perf_counter()
                    gguf_linear(x, layer, qtype=t.ggml_type)
                    times.append(time.perf_counter() - start)
                times.sort()
                row = {
                    "layer": what,
                    "type": name,
                    "shape": [n, k],
                    "packing": packing,
                    "dtype": args.dtype,
                    "rows": m,
                    "ms": round(times[len(times) // 2] * 1e3, 3),
                    "MB": round(_nbytes(packed) / 1e6, 1),
                    "copies": copies,
                }
                results.append(row)
                print(
                    f"{what:22s} {name} {n}x{k}  {packing:5s} M={m:<4d} {row['ms']:9.3f} ms"
                    f"  ({row['MB']} MB held, {copies} copies)"
                )
            del layers
    os.environ.pop("ENGINE_CPU_NATIVE", None)
    return results


def quality(path: str, threads: int) -> list[dict]:
    """Logit error of the packings against the float32 dequantized model (``--quality``)."""
    import torch

    from engine.testing.prefill import build_model, prefill_logits

    torch.set_num_threads(threads)
    ref, _ = build_model(path, quantization="none", dtype="float32")
    want = prefill_logits(ref).float()
    del ref
    results = []
    for packing, setting, dtype in (
        ("amx", "amx", "bfloat16"),
        ("torch", "0", "bfloat16"),
        ("avx2", "avx2", "float32"),
        ("torch", "0", "float32"),
    ):
        os.environ["ENGINE_CPU_NATIVE"] = setting
        model, _ = build_model(path, dtype=dtype)
        served = any(n.endswith(f"_{packing}_values") for n, _ in model.named_parameters())
        if setting != "0" and not served:
            print(f"no {packing} kernels for {dtype} here (see the log)")
            continue
        got = prefill_logits(model).float()
        del model
        diff = (got - want).abs()
        row = {
            "packing": packing,
            "dtype": dtype,
            "max_abs": round(float(diff.max()), 4),
            "mean_abs": round(float(diff.mean()), 4),
            "max_abs_logit": round(float(want.abs().max()), 2),
            "argmax_agree": round(float((got.argmax(-1) == want.argmax(-1)).float().mean()), 4),
            "positions": int(want.shape[0]),
        }
        results.append(row)
        print(json.dumps(row))
    os.environ.pop("ENGINE_CPU_NATIVE", None)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,4,16,64,256")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--dtype", default="bfloat16", help="activation dtype")
    parser.add_argument("--stream-mb", type=float, default=256.0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--quality", default=None, metavar="FILE", help="A .gguf file.")
    args = parser.parse_args()
    results = quality(args.quality, args.threads) if args.quality else run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
