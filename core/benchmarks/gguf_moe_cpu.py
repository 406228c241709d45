"""A GGUF mixture-of-experts file of a real model's layer shape, for CPU benchmarks.

``python -m engine.benchmarks.gguf_moe_cpu OUT.gguf [--layers 4]`` writes a ``qwen3moe`` file
with Qwen3-30B-A3B's layer (hidden 2048, 128 experts, top-8, expert intermediate 768, 32 query
and 4 key/value heads of 128) and the types of its Q4_K_M release (attention and expert gate/up
Q4_K, value and expert down Q6_K, router and norms F32), in fewer layers and with the tiny test
vocabulary, so that it fits a small machine: random valid blocks (the K-quants have no
quantizer in the ``gguf`` library), enough for speed and memory, not for text. Both this engine
(``engine bench latency --model OUT.gguf``) and llama.cpp (``llama-bench -m OUT.gguf``) load it;
docs/benchmarks.md has the commands and the figures. ``--time-layer TOKENS`` times one such
layer's experts alone instead: the CPU plugin's one compiled call against the torch loop over
experts.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from engine.testing.tiny_gguf import random_blocks, tiny_vocab

QWEN3_30B_A3B = dict(hidden=2048, experts=128, top_k=8, moe_inter=768, heads=32, kv_heads=4,
                     head_dim=128)  # fmt: skip
# Q4_K_M as llama.cpp's quantizer assigns it to Qwen3-30B-A3B (attn_v and ffn_down Q6_K).
Q4_K_M = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K",
          "ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_K", "ffn_down_exps": "Q6_K",
          "token_embd": "Q4_K", "output": "Q6_K"}  # fmt: skip


def write_moe_gguf(path: str | Path, layers: int = 4, seed: int = 0, **shape: int) -> Path:
    """Write the file (see the module docstring); ``shape`` overrides ``QWEN3_30B_A3B``."""
    from gguf import GGMLQuantizationType, GGUFWriter

    s = {**QWEN3_30B_A3B, **shape}
    h, e, inter, hd = s["hidden"], s["experts"], s["moe_inter"], s["head_dim"]
    tokens, scores, token_types = tiny_vocab()
    vocab = len(tokens)
    rng = np.random.default_rng(seed)
    path = Path(path)
    w = GGUFWriter(str(path), "qwen3moe")
    w.add_name(f"qwen3-30b-a3b shape, {layers} layers, random Q4_K_M blocks")
    w.add_context_length(4096)
    w.add_embedding_length(h)
    w.add_block_count(layers)
    w.add_feed_forward_length(6144)
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(1e6)
    w.add_expert_count(e)
    w.add_expert_used_count(s["top_k"])
    w.add_expert_feed_forward_length(inter)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(token_types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)

    def quantized(name: str, kind: str, *dims: int) -> None:
        qtype = Q4_K_M[kind]
        rows = int(np.prod(dims[:-1]))
        blocks = random_blocks(rows, dims[-1], qtype, seed + len(name) + sum(map(ord, name)))
        w.add_tensor(name, blocks.reshape(*dims[:-1], -1), raw_dtype=GGMLQuantizationType[qtype])

    def f32(name: str, *dims: int, std: float = 1.0, mean: float = 0.0) -> None:
        w.add_tensor(name, (mean + std * rng.standard_normal(dims)).astype(np.float32))

    quantized("token_embd.weight", "token_embd", vocab, h)
    for i in range(layers):
        b = f"blk.{i}"
        f32(f"{b}.attn_norm.weight", h, std=0.05, mean=1.0)
        quantized(f"{b}.attn_q.weight", "attn_q", s["heads"] * hd, h)
        quantized(f"{b}.attn_k.weight", "attn_k", s["kv_heads"] * hd, h)
        quantized(f"{b}.attn_v.weight", "attn_v", s["kv_heads"] * hd, h)
        quantized(f"{b}.attn_output.weight", "attn_output", h, s["heads"] * hd)
        f32(f"{b}.attn_q_norm.weight", hd, std=0.05, mean=1.0)
        f32(f"{b}.attn_k_norm.weight", hd, std=0.05, mean=1.0)
        f32(f"{b}.ffn_norm.weight", h, std=0.05, mean=1.0)
        f32(f"{b}.ffn_gate_inp.weight", e, h, std=h**-0.5)
        quantized(f"{b}.ffn_gate_exps.weight", "ffn_gate_exps", e, inter, h)
        quantized(f"{b}.ffn_up_exps.weight", "ffn_up_exps", e, inter, h)
        quantized(f"{b}.ffn_down_exps.weight", "ffn_down_exps", e, h, inter)
    f32("output_norm.weight", h, std=0.05, mean=1.0)
    quantized("output.weight", "output", vocab, h)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def build_gguf_moe_layer(
    types: tuple[str, str, str],
    experts: int = 128,
    hidden: int = 2048,
    inter: int = 768,
    top_k: int = 8,
    seed: int = 0,
    kernels: Any = None,
    integer: bool = False,
    dtype: Any = None,
) -> tuple[Any, dict[str, Any]]:
    """A ``FusedMoE`` with ``GGUFMoEMethod`` (the CPU platform's kernels unless ``kernels``;
    ``integer``: converted for ``fused_moe_wna16``, as on a GPU), loaded from random GGUF
    stacks of ``types`` (gate, up, down) through the loader's stacked names; returns it and
    the raw stacks (``uint8 [E, rows, K / block, type_size]``, on the CPU)."""
    import torch

    from engine.kernels import gguf as gk
    from engine.layers.fused_moe import ExpertCheckpointMapping, FusedMoE
    from engine.plugins import PluginManager
    from engine.quantization.gguf_moe import GGUFMoEMethod

    projections = ("gate", "up", "down")
    kept = {p: gk.gguf_type(t) for p, t in zip(projections, types, strict=True)}
    method = GGUFMoEMethod(kept, integer=integer)
    kernels = kernels or PluginManager.from_env().kernel_registry().resolve("cpu")
    layer = FusedMoE(experts, top_k, hidden, inter, renormalize=True, kernels=kernels,
                     dtype=dtype or torch.float32, quant_method=method, prefix="experts")  # fmt: skip
    stacks = {}
    for i, (proj, (rows, cols)) in enumerate(
        {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}.items()
    ):
        t = gk.gguf_type(types[i])
        raw = torch.from_numpy(random_blocks(experts * rows, cols, t.name, seed + i))
        stacks[proj] = raw.view(experts, rows, cols // t.block_size, t.type_size)
    container = torch.nn.Module()
    container.experts = layer
    mapping = ExpertCheckpointMapping(container)
    left = list(mapping.filter((f"experts.{p}_proj.qweight", stacks[p]) for p in projections))
    if left or mapping.loaded() != {"experts.w13_qweight", "experts.w2_qweight"}:
        raise RuntimeError(f"the stacks did not load: {left}")
    layer.process_weights_after_loading()
    return layer, stacks


def time_layer(tokens: int = 1, rounds: int = 200, seed: int = 0) -> dict[str, float]:
    """ms per call of one Qwen3-30B-A3B-shaped layer of Q4_K/Q4_K/Q6_K experts at ``tokens``,
    over ``rounds`` random routings: the one compiled call (``routed_experts``) and the torch
    loop over experts, with the bytes of the experts a call reads."""
    import time

    import torch

    layer, _ = build_gguf_moe_layer(("Q4_K", "Q4_K", "Q6_K"), seed=seed)
    op, method = layer.kernels.gguf_linear, layer.quant_method
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, layer.hidden_size, generator=gen)

    def choices() -> torch.Tensor:  # top_k distinct experts for each token
        rows = [torch.randperm(layer.num_experts, generator=gen)[: layer.top_k] for _ in x]
        return torch.stack(rows).to(torch.int32)

    routes = [(torch.rand(tokens, layer.top_k, generator=gen), choices()) for _ in range(rounds)]
    distinct = sum(len(set(ids.flatten().tolist())) for _, ids in routes) / rounds
    bytes_per_expert = layer.intermediate_size * layer.hidden_size * (2 * 144 + 210) / 256
    result = {"experts_read": distinct, "mb_read": distinct * bytes_per_expert / 1e6}
    fused = getattr(op, "routed_experts", None)
    for name in ("compiled", "loop"):
        if name == "loop":
            op.routed_experts = lambda *a: None
        with torch.inference_mode():
            for w, ids in routes[:10]:
                method.apply(layer, x, w, ids)
            t0 = time.perf_counter()
            for w, ids in routes:
                method.apply(layer, x, w, ids)
            result[f"{name}_ms"] = (time.perf_counter() - t0) / rounds * 1e3
    if fused is not None:
        del op.routed_experts
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", help="the .gguf file to write")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (the model: 48)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--time-layer", type=int, metavar="TOKENS", default=None,
        help="instead: time one layer's experts at TOKENS tokens, compiled call and torch loop",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.time_layer is not None:
        r = time_layer(args.time_layer, seed=args.seed)
        gbps = r["mb_read"] / r["compiled_ms"]
        print(f"{args.time_layer} tokens: {r['experts_read']:.1f} experts, {r['mb_read']:.1f} MB; "
              f"compiled call {r['compiled_ms']:.3f} ms ({gbps:.1f} GB/s), torch loop "
              f"{r['loop_ms']:.3f} ms")  # fmt: skip
        return
    if args.out is None:
        parser.error("give the .gguf file to write, or --time-layer")
    path = write_moe_gguf(args.out, args.layers, args.seed)
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB, {args.layers} layers)")


if __name__ == "__main__":
    main()
