"""Tiny random GGUF files written with ``gguf.GGUFWriter``, for tests that must not need the
253 MB default model.

``write_tiny_gemma3_gguf(path)`` builds a random Gemma 3 text model with transformers, then
writes it the way llama.cpp's converter does (GGUF tensor names, RMSNorm weights stored as
``1 + w``, a sentencepiece-style vocabulary), quantizing the matrices to a mix of types
(Q8_0, Q5_0, Q4_0, F16, BF16, F32). Both transformers (``from_pretrained(dir, gguf_file=...)``)
and our loader can load the result, so it serves as a fast end-to-end reference.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

# HF parameter name fragments (after ``model.layers.N.``) -> GGUF names (after ``blk.N.``).
GEMMA3_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
LLAMA_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# Which GGML type each kind of matrix is written in (norms are always F32, as llama.cpp does).
DEFAULT_TYPES = {
    "token_embd": "Q8_0",
    "attn_q": "Q5_0",
    "attn_k": "Q8_0",
    "attn_v": "F16",
    "attn_output": "Q4_0",
    "ffn_gate": "Q5_0",
    "ffn_up": "BF16",
    "ffn_down": "Q8_0",
    "output": "Q8_0",
}
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
_WORDS = (
    "the quick brown fox jumps over lazy dog and a paged cache stores keys values in blocks "
    "hello world model engine token batch prefix sliding window attention of to is it"
).split()

TINY_GEMMA3 = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    # head_dim = query_pre_attn_scalar, as in every released size but 27B: a GGUF cannot
    # record the scalar, so readers derive it from head_dim.
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 8,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 0,
}


def tiny_vocab() -> tuple[list[str], list[float], list[int]]:
    """A sentencepiece-style vocabulary: specials, 256 byte tokens, then pieces (``▁word``,
    single letters) with decreasing scores. Returns (tokens, scores, token types)."""
    tokens = list(SPECIAL_TOKENS)
    types = [3] * len(SPECIAL_TOKENS)  # control
    types[3] = 2  # unknown
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256  # byte
    pieces = ["▁"] + [f"▁{w}" for w in dict.fromkeys(_WORDS)] + list("abcdefghijklmnopqrstuvwxyz.,")
    scores = [0.0] * len(tokens) + [-float(i) for i in range(len(pieces))]
    tokens += pieces
    types += [1] * len(pieces)  # normal
    return tokens, scores, types


# The block scale ``d`` of random blocks per type (and ``dmin`` / ``m`` as a multiple of it),
# chosen so the dequantized values have a standard deviation of about 0.05.
_RANDOM_BLOCK_SCALE = {
    "Q4_0": (0.011, None),
    "Q4_1": (0.011, -8.0),
    "Q5_0": (0.0054, None),
    "Q5_1": (0.0054, -16.0),
    "Q8_0": (0.00068, None),
    "Q4_K": (0.00033, 7.5),
    "Q5_K": (0.00014, 15.5),
    "Q6_K": (0.00004, None),
}
# Byte offset of the float16 ``d`` (and of ``dmin`` / ``m``) in each type's block.
_SCALE_OFFSETS = {
    "Q4_0": (0, None),
    "Q4_1": (0, 2),
    "Q5_0": (0, None),
    "Q5_1": (0, 2),
    "Q8_0": (0, None),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208, None),
}
RANDOM_BLOCK_TYPES = tuple(_RANDOM_BLOCK_SCALE)


# A tiny Gemma 3 whose tensors cover the K-quants and the legacy types at once (the tests'
# mixed-type file: write_tiny_gemma3_gguf(path, types=MIXED_TYPES, **MIXED_SHAPE)).
MIXED_TYPES = {
    "token_embd": "Q8_0",
    "attn_q": "Q4_K",
    "attn_k": "Q4_K",
    "attn_v": "Q6_K",
    "attn_output": "Q5_K",
    "ffn_gate": "Q4_0",
    "ffn_up": "Q5_0",
    "ffn_down": "Q8_0",
}
MIXED_SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2}


def random_blocks(rows: int, cols: int, qtype_name: str, seed: int = 0) -> np.ndarray:
    """Random valid GGUF blocks ``uint8 [rows, cols / block_size * type_size]`` of type
    ``qtype_name``: random quants and sub-block scales, finite float16 block scales of a size
    that keeps the values near N(0, 0.05). ``gguf.quants`` cannot quantize to the K-quants, so
    tests of those types use blocks like these (and the file's own dequantization as the
    reference)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype_name]]
    if cols % block:
        raise ValueError(f"{qtype_name} rows need a multiple of {block} values, not {cols}")
    rng = np.random.default_rng(seed)
    nb = rows * cols // block
    out = rng.integers(0, 256, size=(nb, type_size), dtype=np.uint8)
    d_scale, m_ratio = _RANDOM_BLOCK_SCALE[qtype_name]
    d_at, m_at = _SCALE_OFFSETS[qtype_name]
    d = (d_scale * rng.uniform(0.5, 1.5, nb)).astype(np.float16)
    out[:, d_at : d_at + 2] = d.view(np.uint8).reshape(nb, 2)
    if m_at is not None:
        m = (d.astype(np.float32) * m_ratio).astype(np.float16)
        out[:, m_at : m_at + 2] = m.view(np.uint8).reshape(nb, 2)
    return out.reshape(rows, -1)


def _write_tensor(writer: Any, name: str, value: np.ndarray, qtype_name: str) -> None:
    """Write ``value`` in ``qtype_name``; the K-quants (``gguf.quants`` has no quantizer for
    them) are written as ``random_blocks`` of the tensor's shape, not as ``value``."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    qtype = GGMLQuantizationType[qtype_name]
    value = np.ascontiguousarray(value, dtype=np.float32)
    if qtype_name.endswith("_K"):
        seed = sum(map(ord, name))
        rows = int(np.prod(value.shape[:-1]))  # a stack of experts [E, rows, cols] too
        blocks = random_blocks(rows, value.shape[-1], qtype_name, seed)
        writer.add_tensor(name, blocks.reshape(*value.shape[:-1], -1), raw_dtype=qtype)
    elif qtype == GGMLQuantizationType.F32:
        writer.add_tensor(name, value)
    elif qtype == GGMLQuantizationType.F16:
        writer.add_tensor(name, value.astype(np.float16))
    else:
        writer.add_tensor(name, quantize(value, qtype), raw_dtype=qtype)


def write_gguf(
    path: str | Path,
    arch: str,
    metadata: Callable[[Any], None],
    tensors: Mapping[str, np.ndarray],
    types: Mapping[str, str],
    vocab: tuple[list[str], list[float], list[int]],
) -> Path:
    """Write ``tensors`` (GGUF names -> float32 arrays in torch order) with ``types`` (GGUF
    tensor kind -> GGML type name; norms and 1-D tensors stay F32) and the metadata that the
    ``metadata(writer)`` callback adds."""
    from gguf import GGUFWriter

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(str(path), arch)
    metadata(writer)
    tokens, scores, token_types = vocab
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(token_types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    for name, value in tensors.items():
        kind = name.split(".")[-2]
        qtype = "F32" if value.ndim == 1 else types.get(kind, "F32")
        _write_tensor(writer, name, value, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_tensors(hf_model: Any, mapping: Mapping[str, str], norm_offset: float) -> dict:
    out: dict[str, np.ndarray] = {}
    for name, param in hf_model.state_dict().items():
        value = param.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            if getattr(hf_model.config, "tie_word_embeddings", False):
                continue
            gguf_name = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, _, suffix = rest.rpartition(".")
            gguf_name = f"blk.{layer}.{mapping[module]}.{suffix}"
        if norm_offset and name.endswith("norm.weight"):
            value = value + norm_offset
        out[gguf_name] = value
    return out


def tiny_gemma3_hf(seed: int = 0, **overrides: Any) -> Any:
    """A random ``Gemma3ForCausalLM`` of ``TINY_GEMMA3`` shape (with ``overrides``), whose
    vocabulary size matches ``tiny_vocab()``. Norm weights are randomised too (HF initialises
    them to zero, which would hide a missing ``+1``)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = dict(TINY_GEMMA3, vocab_size=len(tiny_vocab()[0]), **overrides)
    config = Gemma3TextConfig(**cfg)
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
            elif p.dim() == 2:
                p.normal_(0.0, 0.08)
    return model


def _decoder_metadata(w: Any, name: str, cfg: Any) -> None:
    """The GGUF keys every decoder writes from its HF config (sizes, heads, norm epsilon)."""
    w.add_name(name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)


def write_tiny_gemma3_gguf(
    path: str | Path,
    seed: int = 0,
    types: Mapping[str, str] | None = None,
    hf_model: Any = None,
    **overrides: Any,
) -> Path:
    """Write a tiny random Gemma 3 GGUF to ``path`` the way llama.cpp's converter would."""
    model = hf_model if hf_model is not None else tiny_gemma3_hf(seed, **overrides)
    cfg = model.config

    def metadata(w: Any) -> None:
        _decoder_metadata(w, "tiny gemma3", cfg)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_rope_freq_base(1_000_000.0)
        if cfg.sliding_window:
            w.add_sliding_window(cfg.sliding_window)

    tensors = _gguf_tensors(model, GEMMA3_TO_GGUF, 1.0)
    return write_gguf(
        path, "gemma3", metadata, tensors, DEFAULT_TYPES if types is None else types, tiny_vocab()
    )


def llama_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (HF half-split rotary -> interleaved pairs)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_llama_gguf(
    path: str | Path, hf_model: Any, types: Mapping[str, str] | None = None
) -> Path:
    """Write a (tiny) HF ``LlamaForCausalLM`` as a llama.cpp-style GGUF, q/k rows permuted."""
    cfg = hf_model.config

    def metadata(w: Any) -> None:
        _decoder_metadata(w, "tiny llama", cfg)
        w.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or 10_000.0))
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)

    tensors = _gguf_tensors(hf_model, LLAMA_TO_GGUF, 0.0)
    for name in list(tensors):
        if name.endswith("attn_q.weight"):
            tensors[name] = llama_permute(tensors[name], cfg.num_attention_heads)
        elif name.endswith("attn_k.weight"):
            tensors[name] = llama_permute(tensors[name], cfg.num_key_value_heads)
    return write_gguf(
        path, "llama", metadata, tensors, DEFAULT_TYPES if types is None else types, tiny_vocab()
    )


# --- Mixture of experts: Qwen3-MoE (qwen3moe), Qwen2-MoE (qwen2moe), Mixtral (llama + experts).

MOE_TO_GGUF = {
    **LLAMA_TO_GGUF,
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
# Stacked experts in transformers 5's in-memory layout -> GGUF (gate rows, up rows, down).
_STACKED_EXPERTS = {
    "mlp.experts.gate_up_proj": (("ffn_gate_exps", 0), ("ffn_up_exps", 1)),
    "mlp.experts.down_proj": (("ffn_down_exps", None),),
}
MOE_TYPES = {
    **DEFAULT_TYPES,
    "ffn_gate_exps": "Q8_0",
    "ffn_up_exps": "Q4_0",
    "ffn_down_exps": "Q5_0",
    "ffn_gate_inp": "F16",
    "ffn_gate_shexp": "Q8_0",
    "ffn_up_shexp": "BF16",
    "ffn_down_shexp": "Q4_0",
}
# Tiny MoE configurations for ``tiny_moe_hf``: many experts, top-2 to top-4, Qwen2-MoE's
# shared expert.
TINY_MOE = {
    "qwen3_moe": dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                      norm_topk_prob=True, head_dim=32),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, norm_topk_prob=False),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
}  # fmt: skip


def tiny_moe_hf(kind: str, seed: int = 0, router_scale: float = 1.0, **overrides: Any) -> Any:
    """A tiny random transformers Qwen3-MoE, Qwen2-MoE or Mixtral (``TINY_MOE[kind]``, hidden
    64 and two layers unless ``overrides`` say otherwise, untied, ``tiny_vocab``'s tokens),
    with weights of std ``1.5 / sqrt(fan_in)`` (the routers' ``router_scale`` times that) and
    norms near 1: decisive routing and greedy choices, where transformers' own initialisation
    gives nearly flat logits."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(
        vocab_size=len(tiny_vocab()[0]), hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=2, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    config = AutoConfig.for_model(kind, **{**settings, **TINY_MOE[kind], **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            elif p.dim() >= 2:
                router = name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight"))
                p.normal_(0.0, (router_scale if router else 1.0) * 1.5 / p.shape[-1] ** 0.5)
            else:
                p.normal_(0.0, 0.1)
    return model


MOE_GGUF_ARCHS = {"Qwen3MoeForCausalLM": "qwen3moe", "Qwen2MoeForCausalLM": "qwen2moe",
                  "MixtralForCausalLM": "llama"}  # fmt: skip


def _moe_entries(hf_model: Any) -> list[tuple[str, str, int | None]]:
    """(GGUF name, HF state-dict name, half) of every tensor llama.cpp's converter writes:
    ``half`` picks the gate (0) or up (1) rows of a fused ``gate_up_proj``."""
    out = []
    for name in hf_model.state_dict():
        if name == "model.embed_tokens.weight":
            out.append(("token_embd.weight", name, None))
        elif name == "model.norm.weight":
            out.append(("output_norm.weight", name, None))
        elif name == "lm_head.weight":
            if not getattr(hf_model.config, "tie_word_embeddings", False):
                out.append(("output.weight", name, None))
        else:
            _, _, layer, rest = name.split(".", 3)
            if rest in _STACKED_EXPERTS:
                for kind, half in _STACKED_EXPERTS[rest]:
                    out.append((f"blk.{layer}.{kind}.weight", name, half))
            else:
                module, _, suffix = rest.rpartition(".")
                out.append((f"blk.{layer}.{MOE_TO_GGUF[module]}.{suffix}", name, None))
    return out


def _moe_value(state: Mapping[str, Any], hf_name: str, half: int | None) -> np.ndarray:
    value = state[hf_name].detach().float()
    if half is not None:
        value = value.chunk(2, dim=1)[half]
    return value.numpy()


def write_tiny_moe_gguf(
    path: str | Path, hf_model: Any, types: Mapping[str, str] | None = None
) -> Path:
    """Write a (tiny) HF Qwen3-MoE, Qwen2-MoE or Mixtral model as llama.cpp's converter does:
    stacked, quantized experts (``ffn_*_exps``), the router (``ffn_gate_inp``), Qwen2-MoE's
    shared expert (``*_shexp``, its gate as a vector) and, for Mixtral (a ``llama`` file with
    ``expert_count``), q/k rows permuted."""
    cfg = hf_model.config
    arch = MOE_GGUF_ARCHS[type(hf_model).__name__]
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts

    def metadata(w: Any) -> None:
        _decoder_metadata(w, f"tiny {arch}", cfg)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if arch != "llama":
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)

    state = hf_model.state_dict()
    tensors = {}
    for gguf_name, hf_name, half in _moe_entries(hf_model):
        value = _moe_value(state, hf_name, half)
        if gguf_name.endswith("ffn_gate_inp_shexp.weight"):
            value = value.reshape(-1)
        if arch == "llama" and gguf_name.endswith("attn_q.weight"):
            value = llama_permute(value, cfg.num_attention_heads)
        elif arch == "llama" and gguf_name.endswith("attn_k.weight"):
            value = llama_permute(value, cfg.num_key_value_heads)
        tensors[gguf_name] = value
    return write_gguf(path, arch, metadata, tensors, MOE_TYPES if types is None else types,
                      tiny_vocab())  # fmt: skip


def gguf_round_trip_state_dict(hf_model: Any, types: Mapping[str, str] | None = None) -> dict:
    """``hf_model``'s state dict with every tensor quantized and dequantized by the ``gguf``
    library as ``write_tiny_moe_gguf`` stores it: the weights a correct GGUF loader must
    produce (load it into the same architecture for a reference model)."""
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    types = MOE_TYPES if types is None else types
    state = hf_model.state_dict()
    parts: dict[str, list[tuple[int | None, np.ndarray]]] = {}
    for gguf_name, hf_name, half in _moe_entries(hf_model):
        value = _moe_value(state, hf_name, half)
        kind = gguf_name.split(".")[-2]
        qname = "F32" if value.ndim == 1 or kind == "ffn_gate_inp_shexp" else types.get(kind, "F32")
        qtype = GGMLQuantizationType[qname]
        if qtype == GGMLQuantizationType.F16:
            value = value.astype(np.float16).astype(np.float32)
        elif qtype != GGMLQuantizationType.F32:
            value = dequantize(quantize(value, qtype), qtype).reshape(value.shape)
        parts.setdefault(hf_name, []).append((half, value))
    out = {}
    for hf_name, pieces in parts.items():
        arrays = [v for _, v in sorted(pieces, key=lambda p: -1 if p[0] is None else p[0])]
        merged = arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=1)
        out[hf_name] = torch.from_numpy(np.ascontiguousarray(merged)).to(state[hf_name].dtype)
    return out
