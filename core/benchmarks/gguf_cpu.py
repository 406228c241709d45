"""GGUF layers on the CPU, kernel by kernel: the CPU plugin's ``gguf_linear`` per packing.

``python -m engine.benchmarks.gguf_cpu [--threads 2] [--rows 1,4,16,64,256] [--json FILE]``
times one call of ``gguf_linear`` (activation quantization, product and conversions included)
on the shapes and types of the embedded Gemma 3 270M Q4_K_M (its Q8_0 vocabulary matrix, its
Q5_0 gate/up, Q4_K attention output and Q6_K down projections, as [out, in]) for each packing the CPU plugin has:
``amx`` (the compiled AMX kernels, where this CPU has them) and ``torch`` (the packings
without them: torch's int4 kernel for 4-bit types, dense oneDNN bf16 otherwise, as with
``ENGINE_CPU_NATIVE=0``), plus the bytes each packing holds. Random valid blocks; bf16
activations; best of ``--repeat`` calls.

``--quality FILE.gguf`` instead compares the prefill logits of a real file in bf16, with and
without the AMX kernels, against the same file dequantized at load in float32: max and mean
absolute logit difference and the share of positions whose argmax agrees.
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
    # The CPU platform's gguf_linear, through the registry (the core imports no plugin).
    gguf_linear = PluginManager.from_env().kernel_registry().resolve("cpu").gguf_linear
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    for what, name, n, k in SHAPES:
        t = ref.gguf_type(name)
        blocks = torch.from_numpy(random_blocks(n, k, name)).view(n, -1, t.type_size)
        for packing in ("amx", "torch"):
            os.environ["ENGINE_CPU_NATIVE"] = "1" if packing == "amx" else "0"
            packed = gguf_linear.prepack(blocks, qtype=t.ggml_type, dtype=torch.bfloat16)
            if packing == "amx" and "amx_values" not in packed:
                print(f"{what}: no AMX kernels on this machine (see the log)")
                continue
            for m in rows:
                x = torch.randn(m, k).bfloat16()
                gguf_linear(x, packed, qtype=t.ggml_type)  # warm-up
                best = float("inf")
                for _ in range(args.repeat):
                    start = time.perf_counter()
                    gguf_linear(x, packed, qtype=t.ggml_type)
                    best = min(best, time.perf_counter() - start)
                row = {
                    "layer": what,
                    "type": name,
                    "shape": [n, k],
                    "packing": packing,
                    "rows": m,
                    "ms": round(best * 1e3, 3),
                    "MB": round(_nbytes(packed) / 1e6, 1),
                }
                results.append(row)
                print(
                    f"{what:22s} {name} {n}x{k}  {packing:5s} M={m:<4d} {row['ms']:9.3f} ms"
                    f"  ({row['MB']} MB held)"
                )
    os.environ.pop("ENGINE_CPU_NATIVE", None)
    return results


def quality(path: str, threads: int) -> list[dict]:
    """Logit error of the bf16 packings against the float32 dequantized model (``--quality``)."""
    import torch

    from engine.testing.prefill import build_model, prefill_logits

    torch.set_num_threads(threads)
    ref, _ = build_model(path, quantization="none", dtype="float32")
    want = prefill_logits(ref).float()
    del ref
    results = []
    for packing in ("amx", "torch"):
        os.environ["ENGINE_CPU_NATIVE"] = "1" if packing == "amx" else "0"
        model, _ = build_model(path, dtype="bfloat16")
        got = prefill_logits(model).float()
        del model
        diff = (got - want).abs()
        row = {
            "packing": packing,
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
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--json", default=None)
    parser.add_argument("--quality", default=None, metavar="FILE", help="A .gguf file.")
    args = parser.parse_args()
    results = quality(args.quality, args.threads) if args.quality else run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
