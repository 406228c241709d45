"""Quantization on the CPU: logit error per method on a tiny random model, and memory and
batch-1 decode speed per method on a mid-size dummy model.

``python -m engine.benchmarks.quant_cpu [--quality] [--kernels] [--memory] [--json FILE]``

* ``--quality``: a random Llama (hidden 256, 4 layers, float32) is quantized by every writer of
  ``engine.testing.quantized_models``; for each method the prefill logits of a 64-token prompt
  are compared with the method's *dequantized reference* (the same function computed with the
  dequantized weights: kernel and format correctness) and with the *original* float model (the
  quantization error itself), as max and mean absolute differences, plus the share of
  positions whose greedy token matches the original's.
* ``--kernels``: one projection (8192 x 2048 and 2048 x 8192) at M = 1 and 16, milliseconds per
  call for bf16 (plain and oneDNN-prepacked) and each quantized CPU path.
* ``--memory``: a Llama-shaped model of about 1.1B parameters (hidden 2048, 16 layers, MLP
  8192) with dummy weights, one fresh process per method: the weights as held, the process RSS
  once the engine is ready, and batch-1 decode tokens/s (``engine bench latency``'s
  measurement: 9 new tokens after a 64-token prompt, less the prefill).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

MID_SHAPE = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
FP8_BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
INT8 = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
            "input_activations": {
                "num_bits": 8,
                "type": "int",
                "strategy": "token",
                "dynamic": True,
                "symmetric": True,
            },
        }
    },
    "ignore": ["lm_head"],
}
# method label -> (quantization_config for config.json, --quantization). FP8 runs weight-only
# on the CPU, converting every weight per call: its decode speed is not measured (see
# ``--kernels`` for one layer).
MEMORY_METHODS: dict[str, tuple[dict | None, str | None]] = {
    "bf16": (None, None),
    "fp8 (online, weight-only on CPU)": (None, "fp8"),
    "fp8 block 128x128": (FP8_BLOCK, None),
    "int8 W8A8 (compressed-tensors)": (INT8, None),
    "gptq 4-bit g128": (GPTQ, None),
    "awq 4-bit g128": (AWQ, None),
}


# ---- quality --------------------------------------------------------------------------------
CALIBRATION = [10 + (i * 37) % 240 for i in range(64)]  # the prompt the errors are measured on


def _quality_variants() -> dict[str, Any]:
    from engine.testing import quantized_models as qm

    return {
        "gptq 4-bit g32 sym": lambda s, q, r: qm.write_gptq(s, q, r, bits=4, group_size=32),
        "gptq 4-bit g128 asym act-order": lambda s, q, r: qm.write_gptq(
            s, q, r, bits=4, group_size=128, sym=False, desc_act=True
        ),
        "gptq 8-bit g128": lambda s, q, r: qm.write_gptq(s, q, r, bits=8, group_size=128),
        "awq 4-bit g128": lambda s, q, r: qm.write_awq(s, q, r, group_size=128),
        "fp8 per-tensor (weight-only on CPU)": lambda s, q, r: qm.write_fp8(s, q, r),
        "fp8 per-tensor static W8A8 (forced)": lambda s, q, r: qm.write_fp8(
            s, q, r, activation_scheme="static", calibration=CALIBRATION
        ),
        "fp8 per-tensor W8A8 (forced)": lambda s, q, r: qm.write_fp8(s, q, r),
        "fp8 block 128x128 (weight-only on CPU)": lambda s, q, r: qm.write_fp8(
            s, q, r, block=(128, 128)
        ),
        "fp8 block 128x128 W8A8 (forced)": lambda s, q, r: qm.write_fp8(s, q, r, block=(128, 128)),
    }


def _ct_variants() -> dict[str, tuple[str, bool | None]]:
    """compressed-tensors kinds, and whether W8A8 is forced (None: the device's choice)."""
    return {
        "compressed-tensors fp8 dynamic (weight-only on CPU)": ("fp8_dynamic", None),
        "compressed-tensors fp8 dynamic W8A8 (forced)": ("fp8_dynamic", True),
        "compressed-tensors int8 W8A8 dynamic": ("int8_dynamic", None),
        "compressed-tensors int8 W8A8 static asym": ("int8_static", None),
        "compressed-tensors w4a16 g128": ("w4a16", None),
        "compressed-tensors w4a16 g128 asym": ("w4a16_asym", None),
        "compressed-tensors w8a16 g128": ("w8a16", None),
    }


def quality(root: Path) -> list[dict[str, Any]]:
    """The logit-error table (see the module docstring)."""
    import torch

    from engine.testing import quantized_models as qm
    from engine.testing.prefill import build_model as build
    from engine.testing.prefill import prefill_logits
    from engine.testing.tiny_models import build_tokenizer, save_tiny_model

    # Unit-gain random weights (std 1/sqrt(hidden)), so activations neither vanish nor blow
    # up through the layers; static activation scales calibrated on the prompt itself.
    src = save_tiny_model(
        "llama", root / "src", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=256**-0.5,
    )  # fmt: skip
    build_tokenizer(src)
    prompt = CALIBRATION
    original = prefill_logits(build(src)[0], prompt)
    rows = []

    def record(name, model_dir, reference_dir, activation_quant=None):
        model, quant = build(model_dir, activation_quant=activation_quant)
        got = prefill_logits(model, prompt)
        ref = prefill_logits(build(reference_dir)[0], prompt)
        vs_ref, vs_orig = (got - ref).abs(), (got - original).abs()
        rows.append(
            {
                "method": name,
                "config": quant.describe(),
                "vs_dequantized_max": float(vs_ref.max()),
                "vs_dequantized_mean": float(vs_ref.mean()),
                "vs_original_max": float(vs_orig.max()),
                "vs_original_mean": float(vs_orig.mean()),
                "greedy_agreement_with_original": float(
                    (got.argmax(-1) == original.argmax(-1)).float().mean()
                ),
                "logit_scale": float(original.abs().max()),
            }
        )

    for i, (name, write) in enumerate(_quality_variants().items()):
        q, r = write(src, root / f"q{i}", root / f"r{i}")
        record(name, q, r, True if "forced" in name else None)
    for i, (name, (kind, forced)) in enumerate(_ct_variants().items()):
        ckpt = qm.write_compressed_tensors(
            src, root / f"ct{i}", kind, group_size=128, dtype=torch.float32,
            calibration=CALIBRATION,
        )  # fmt: skip
        ref = qm.write_dequantized_compressed_tensors(ckpt, root / f"ctr{i}")
        record(name, ckpt, ref, forced)
    return rows


# ---- memory and speed --------------------------------------------------------------------------
_CHILD = r"""
import json, sys, time, psutil, torch
NEW = 9
from engine import LLM, SamplingParams
path, quantization, timed = sys.argv[1], (sys.argv[2] or None), sys.argv[3] == "1"
t0 = time.perf_counter()
llm = LLM(model=path, load_format="dummy", dtype="bfloat16", quantization=quantization,
          max_model_len=512, cpu_kv_cache_gb=0.05, max_num_seqs=4)
ready = time.perf_counter() - t0
runner = llm.llm_engine.runner
params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
          for n in (1, NEW)]
prompt = [{"prompt_token_ids": [10 + (i * 37) % 30000 for i in range(64)]}]
speed = None
if timed:
    llm.generate(prompt, params[1], use_tqdm=False)  # warm up
    t = time.perf_counter(); llm.generate(prompt, params[0], use_tqdm=False)
    pre = time.perf_counter() - t
    t = time.perf_counter(); llm.generate(prompt, params[1], use_tqdm=False)
    speed = round((NEW - 1) / (time.perf_counter() - t - pre), 2)
print(json.dumps({
    "weights_gib": round(runner.weights_bytes() / 2**30, 3),
    "rss_gib": round(psutil.Process().memory_info().rss / 2**30, 3),
    "ready_s": round(ready, 1),
    "decode_tok_s": speed,
    "quantization": None if runner.quant_config is None else runner.quant_config.describe(),
}))
"""


def memory(root: Path) -> list[dict[str, Any]]:
    """Weights, RSS and batch-1 decode speed per method, one fresh process each."""
    rows = []
    for label, (qconfig, flag) in MEMORY_METHODS.items():
        fp8 = label.startswith("fp8")
        model_dir = root / label.split()[0].replace("/", "-") / str(len(rows))
        model_dir.mkdir(parents=True, exist_ok=True)
        config = dict(MID_SHAPE)
        if qconfig is not None:
            config["quantization_config"] = qconfig
        (model_dir / "config.json").write_text(json.dumps(config))
        from engine.testing.tiny_models import build_tokenizer

        build_tokenizer(model_dir)
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, str(model_dir), flag or "", "0" if fp8 else "1"],
            capture_output=True,
            text=True,
            env=env,
            cwd=tempfile.gettempdir(),
        )
        if out.returncode:
            rows.append({"method": label, "error": out.stderr[-2000:]})
        else:
            rows.append({"method": label, **json.loads(out.stdout.strip().splitlines()[-1])})
        print(json.dumps(rows[-1]), flush=True)
    return rows


# ---- one layer, kernel by kernel -----------------------------------------------------------------
KERNEL_SHAPES = {"up (N 8192, K 2048)": (8192, 2048), "down (N 2048, K 8192)": (2048, 8192)}


def _layer_rows(label: str, n: int, k: int, best: Any) -> list[dict[str, Any]]:
    """The kernel timings of one projection shape (see ``kernels``)."""
    import torch

    from engine.layers.cpu_packed_linear import _pack, _packed_matmul, packing_supported
    from engine.plugins import PluginManager

    # The CPU platform's bound quantized matmuls (engine-llm-cpu's, through the registry: the
    # core never imports a plugin).
    cpu = PluginManager.from_env().kernel_registry().resolve("cpu")

    w = torch.randn(n, k) * 0.02
    wb = w.to(torch.bfloat16)
    packed_bf16 = _pack(wb) if packing_supported(torch.bfloat16, torch.device("cpu")) else None
    w8 = (w / (w.abs().amax(1, keepdim=True) / 448)).to(torch.float8_e4m3fn)
    s8 = torch.rand(n) * 1e-3
    wi8 = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    q4 = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    sc = (torch.rand(n, k // 128) * 0.01).half()
    zr = torch.full((n, k // 128), 8, dtype=torch.uint8)
    p4 = cpu.wna16_linear.prepack(q4, sc, zr, bits=4, group_size=128, dtype=torch.bfloat16)
    q8 = torch.randint(0, 256, (n, k), dtype=torch.uint8)
    z8 = torch.full((n, 1), 128, dtype=torch.uint8)
    p8 = cpu.wna16_linear.prepack(
        q8, torch.rand(n, 1).half(), z8, bits=8, group_size=k, dtype=torch.bfloat16
    )
    rows = []
    for m in (1, 16):
        x = torch.randn(m, k).to(torch.bfloat16)
        ops = {
            "bf16 F.linear": lambda x=x: torch.nn.functional.linear(x, wb),
            "int4 g128 (int4pack)": lambda x=x: cpu.wna16_linear(x, p4, bits=4, group_size=128),
            "int8 per-channel (int8pack)": lambda x=x: cpu.wna16_linear(
                x, p8, bits=8, group_size=k
            ),
            "int8 W8A8 (_int_mm)": lambda x=x: cpu.int8_linear(x, wi8, s8),
            "fp8 weight-only": lambda x=x: cpu.fp8_linear(x, w8, s8, None, None, False),
        }
        if packed_bf16 is not None:
            ops["bf16 oneDNN-packed"] = lambda x=x: _packed_matmul(packed_bf16, None, x, n)
        rows.append({"layer": label, "m": m, **{name: best(op) for name, op in ops.items()}})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def kernels(reps: int = 15) -> list[dict[str, Any]]:
    """Milliseconds per call (the minimum of ``reps``, which a shared machine disturbs least)
    of one projection at M = 1 and 16, bf16 activations, for each CPU weight format."""
    import time

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return round(min(times) * 1e3, 3)

    rows = []
    for label, (n, k) in KERNEL_SHAPES.items():
        rows += _layer_rows(label, n, k, best)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quality", action="store_true")
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--kernels", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not (args.quality or args.memory or args.kernels):
        args.quality = args.memory = args.kernels = True
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.quality:
            results["quality"] = quality(root / "quality")
            print(f"{'method':55s} {'vs dequantized max/mean':>26s} {'vs original max/mean':>24s}")
            for r in results["quality"]:
                print(
                    f"{r['method']:55s} {r['vs_dequantized_max']:12.2e} "
                    f"{r['vs_dequantized_mean']:12.2e} {r['vs_original_max']:11.3f} "
                    f"{r['vs_original_mean']:11.4f}  greedy {r['greedy_agreement_with_original']:.2f}"
                )
        if args.memory:
            results["memory"] = memory(root / "memory")
        if args.kernels:
            results["kernels"] = kernels()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
