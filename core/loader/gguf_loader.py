"""Loading a model from a single ``.gguf`` file: its config, weights and tokenizer.

The contract the model loader calls:

* ``load_config(path) -> transformers.PretrainedConfig`` maps GGUF metadata to the Hugging Face
  config of the same model (for ``gemma3`` a ``Gemma3TextConfig``).
* ``iter_weights(path, hf_config, dtype, stats=None, keep_quantized=None)`` yields ``(hf_name, lazy tensor)`` pairs
  under Hugging Face parameter names, dequantized to ``dtype`` one tensor at a time when
  materialised (only in the window a tensor-parallel shard narrows it to), with the same values
  ``transformers`` loads from the file (its GGUF conversion is the reference the tests check).
* ``load_tokenizer(path, cache_dir)`` builds a fast tokenizer from the metadata once and caches
  it (converting a 262k vocabulary takes ~15 s; reloading the cached copy well under 1 s).

Conventions that differ between llama.cpp and Hugging Face, handled here:

* llama.cpp's converter stores Gemma RMSNorm weights with the ``+1`` of ``x * (1 + w)`` folded
  in; Hugging Face keeps ``w``. We yield ``w`` (the stored value minus one, computed in float32
  before the cast, exactly as ``transformers`` does), so HF-convention models load unchanged.
* llama.cpp permutes the rows of Llama's q/k projections for its interleaved rotary embedding;
  we undo it so the rows are in the Hugging Face (half-split, "neox") order. Gemma and the Qwen
  MoE models are stored unpermuted.
* Mixture of experts (``qwen3moe``, ``qwen2moe``, and ``llama`` files with ``expert_count``,
  i.e. Mixtral): llama.cpp stores each layer's experts stacked (``ffn_gate_exps`` /
  ``ffn_up_exps`` ``[E, I, H]``, ``ffn_down_exps`` ``[E, H, I]``, router ``ffn_gate_inp``); we
  yield them stacked, as ``<block>.experts.gate_proj`` etc., which the MoE models load whole.
  llama.cpp renormalises the top-k weights of Qwen3-MoE and not those of Qwen2-MoE unless the
  file says otherwise (``expert_weights_norm``); the configs say the same.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import GGML_QUANT_SIZES

from engine.loader.gguf_file import GGUFFile, GGUFLoadError
from engine.loader.lazy_tensor import LazyTensor, ReadStats
from engine.progress import activity

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

__all__ = [
    "GGUFLoadError",
    "SUPPORTED_ARCHITECTURES",
    "load_config",
    "iter_weights",
    "load_tokenizer",
    "gguf_architecture",
]

# Per-layer GGUF tensor names (after ``blk.N.``) -> Hugging Face names (after
# ``model.layers.N.``), shared by the Llama family and Gemma 3.
_ATTN = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LLAMA_LAYER = {
    **_ATTN,
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GEMMA3_LAYER = {
    **_ATTN,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    # Gemma's "ffn_norm" is the norm *before* the MLP (Llama's post_attention_layernorm).
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


# Mixture of experts: router and stacked experts under the model's MoE block, the shared
# expert of Qwen2-MoE (its gate is stored as a vector, HF keeps [1, H]).
def _moe_layer(block: str) -> dict[str, str]:
    return {
        "ffn_gate_inp": f"{block}.gate",
        "ffn_gate_exps": f"{block}.experts.gate_proj",
        "ffn_up_exps": f"{block}.experts.up_proj",
        "ffn_down_exps": f"{block}.experts.down_proj",
    }


_SHARED_EXPERT = {
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")


@dataclass(frozen=True)
class _ArchSpec:
    """How one GGUF architecture maps onto its Hugging Face model."""

    hf_architecture: str
    build_config: Callable[[GGUFFile], PretrainedConfig]
    layer_names: dict[str, str]
    norm_offset: float  # subtract this from every *norm weight (1.0 for Gemma)
    unpermute_qk: bool  # rows of q/k were permuted by llama.cpp's converter


# -- config ---------------------------------------------------------------------------------


def _clean_float(value: float) -> float:
    """GGUF stores float32; print-round it so 1e-6 reads back as 1e-06, not 9.99999997e-07.
    Both become the same float32 inside the kernels."""
    return float(str(np.float32(value)))


def _scalar(f: GGUFFile, key: str, default: Any = None) -> Any:
    """An architecture-scoped value that must be one number (some files store per-layer
    arrays, e.g. head_count_kv; those must be uniform for the models we support)."""
    value = f.arch_get(key, default)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise GGUFLoadError(
                f"{f.path}: per-layer values for {f.architecture}.{key} ({value}) are not supported"
            )
        value = value[0]
    return value


def _common_config(f: GGUFFile) -> dict[str, Any]:
    """Config fields every supported decoder shares."""
    hidden = f.require("embedding_length")
    heads = _scalar(f, "attention.head_count")
    if heads is None:
        raise GGUFLoadError(f"{f.path}: missing {f.architecture}.attention.head_count")
    if "token_embd.weight" not in f.tensors:
        raise GGUFLoadError(f"{f.path}: no token_embd.weight tensor")
    eps = f.arch_get("attention.layer_norm_rms_epsilon", 1e-6)
    kwargs: dict[str, Any] = {
        "vocab_size": f.tensors["token_embd.weight"].shape[0],
        "hidden_size": hidden,
        "intermediate_size": _scalar(f, "feed_forward_length"),
        "num_hidden_layers": f.require("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _scalar(f, "attention.head_count_kv", heads),
        "head_dim": f.arch_get("attention.key_length", hidden // heads),
        "rms_norm_eps": _clean_float(eps),
        "max_position_embeddings": f.arch_get("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in f.tensors,
    }
    for hf_key, gguf_key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
        ("unk_token_id", "tokenizer.ggml.unknown_token_id"),
    ):
        if gguf_key in f.metadata:
            kwargs[hf_key] = f.metadata[gguf_key]
    return kwargs


def _end_of_turn_ids(f: GGUFFile, names: tuple[str, ...]) -> list[int]:
    """Ids of the chat turn terminators among the first tokens of the vocabulary (special
    tokens come first in every sentencepiece vocabulary we support)."""
    if "tokenizer.ggml.tokens" not in f.metadata:
        return []
    head = f.strings("tokenizer.ggml.tokens", stop=1024)
    return [i for i, tok in enumerate(head) if tok in names]


def _rope_scaling(f: GGUFFile) -> dict[str, Any] | None:
    kind = f.arch_get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = f.arch_get("rope.scaling.factor")
    if kind != "linear" or factor is None:
        raise GGUFLoadError(
            f"{f.path}: rope scaling {kind!r} is not supported for GGUF files (supported: linear)"
        )
    return {"rope_type": "linear", "factor": _clean_float(factor)}


def _gemma3_layer_types(f: GGUFFile, n_layers: int, window: int | None) -> list[str]:
    """Which layers attend through the sliding window. llama.cpp hard-codes Gemma 3's pattern
    (every 6th layer global) unless the file carries ``attention.sliding_window_pattern``."""
    if not window:
        return ["full_attention"] * n_layers
    pattern = f.arch_get("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # one flag per layer, true = sliding
        if len(pattern) != n_layers:
            raise GGUFLoadError(f"{f.path}: sliding_window_pattern has {len(pattern)} entries")
        return ["sliding_attention" if p else "full_attention" for p in pattern]
    return [
        "sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(n_layers)
    ]


def _gemma3_config(f: GGUFFile) -> PretrainedConfig:
    from transformers import Gemma3TextConfig

    kw = _common_config(f)
    window = f.arch_get("attention.sliding_window")
    scale = f.arch_get("attention.scale")
    if scale:
        query_pre_attn_scalar = 1.0 / float(scale) ** 2
    elif kw["num_hidden_layers"] == 62:
        # Gemma 3 27B scales by hidden/heads (168), every other size by head_dim; llama.cpp
        # keys this off the layer count, and so must we (the file does not store it).
        query_pre_attn_scalar = kw["hidden_size"] // kw["num_attention_heads"]
    else:
        query_pre_attn_scalar = kw["head_dim"]
    kw.update(
        architectures=["Gemma3ForCausalLM"],
        sliding_window=window or None,
        layer_types=_gemma3_layer_types(f, kw["num_hidden_layers"], window),
        query_pre_attn_scalar=query_pre_attn_scalar,
        hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=f.arch_get("final_logit_softcapping"),
        attn_logit_softcapping=f.arch_get("attn_logit_softcapping"),
        # Legacy keyword names: accepted by transformers 4.5x and converted into
        # ``rope_parameters`` by 5.x (global theta, local theta, global scaling).
        rope_theta=_clean_float(f.arch_get("rope.freq_base", 1_000_000.0)),
        rope_local_base_freq=_clean_float(f.arch_get("rope.freq_base_swa", 10_000.0)),
        rope_scaling=_rope_scaling(f),
    )
    # Chat turns end with <end_of_turn>: stop there too, as Gemma's generation_config does.
    extra = [i for i in _end_of_turn_ids(f, ("<end_of_turn>",)) if i != kw.get("eos_token_id")]
    if extra and "eos_token_id" in kw:
        kw["eos_token_id"] = [kw["eos_token_id"], *extra]
    return Gemma3TextConfig(**kw)


def _llama_config(f: GGUFFile) -> PretrainedConfig:
    from transformers import LlamaConfig, MixtralConfig

    if "rope_freqs.weight" in f.tensors:
        raise GGUFLoadError(
            f"{f.path}: Llama 3 rope frequency scaling (tensor rope_freqs.weight) is not "
            "supported for GGUF files"
        )
    kw = _common_config(f)
    kw.update(
        rope_theta=_clean_float(f.arch_get("rope.freq_base", 10_000.0)),
        rope_scaling=_rope_scaling(f),
    )
    experts = f.arch_get("expert_count", 0)
    if experts:  # Mixtral: llama.cpp writes it as a llama with experts
        kw.update(
            architectures=["MixtralForCausalLM"],
            num_local_experts=experts,
            num_experts_per_tok=f.require("expert_used_count"),
            sliding_window=None,
        )
        return MixtralConfig(**kw)
    kw.update(architectures=["LlamaForCausalLM"])
    return LlamaConfig(**kw)


def _qwen_moe_config(f: GGUFFile, shared: bool) -> dict[str, Any]:
    kw = _common_config(f)
    kw.update(
        rope_theta=_clean_float(f.arch_get("rope.freq_base", 1_000_000.0)),
        rope_scaling=_rope_scaling(f),
        num_experts=f.require("expert_count"),
        num_experts_per_tok=f.require("expert_used_count"),
        moe_intermediate_size=f.require("expert_feed_forward_length"),
        # llama.cpp renormalises Qwen3-MoE's top-k weights, not Qwen2-MoE's.
        norm_topk_prob=bool(f.arch_get("expert_weights_norm", not shared)),
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    if kw["intermediate_size"] is None:  # no dense layers: any size will do
        kw["intermediate_size"] = kw["moe_intermediate_size"]
    if shared:
        kw["shared_expert_intermediate_size"] = f.require("expert_shared_feed_forward_length")
    return kw


def _qwen3moe_config(f: GGUFFile) -> PretrainedConfig:
    from transformers import Qwen3MoeConfig

    kw = _qwen_moe_config(f, shared=False)
    kw.update(
        architectures=["Qwen3MoeForCausalLM"], attention_bias="blk.0.attn_q.bias" in f.tensors
    )
    return Qwen3MoeConfig(**kw)


def _qwen2moe_config(f: GGUFFile) -> PretrainedConfig:
    from transformers import Qwen2MoeConfig

    kw = _qwen_moe_config(f, shared=True)
    kw.update(architectures=["Qwen2MoeForCausalLM"], qkv_bias="blk.0.attn_q.bias" in f.tensors)
    return Qwen2MoeConfig(**kw)


_ARCHS: dict[str, _ArchSpec] = {
    "gemma3": _ArchSpec("Gemma3ForCausalLM", _gemma3_config, _GEMMA3_LAYER, 1.0, False),
    "llama": _ArchSpec(
        "LlamaForCausalLM",
        _llama_config,
        {**_LLAMA_LAYER, **_moe_layer("block_sparse_moe")},
        0.0,
        True,
    ),
    "qwen2moe": _ArchSpec(
        "Qwen2MoeForCausalLM",
        _qwen2moe_config,
        {**_LLAMA_LAYER, **_moe_layer("mlp"), **_SHARED_EXPERT},
        0.0,
        False,
    ),
    "qwen3moe": _ArchSpec(
        "Qwen3MoeForCausalLM",
        _qwen3moe_config,
        {**_LLAMA_LAYER, **_QK_NORM, **_moe_layer("mlp")},
        0.0,
        False,
    ),
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_ARCHS)


def _spec(f: GGUFFile) -> _ArchSpec:
    arch = f.architecture
    if arch not in _ARCHS:
        raise GGUFLoadError(
            f"{f.path}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return _ARCHS[arch]


def gguf_architecture(path: str | os.PathLike[str]) -> str:
    """``general.architecture`` of a GGUF file (cheap: reads the header only)."""
    with GGUFFile(path) as f:
        return f.architecture


def load_config(path: str | os.PathLike[str]) -> PretrainedConfig:
    """The Hugging Face config of the model in GGUF file ``path`` (header only, ~50 ms)."""
    with GGUFFile(path) as f:
        return _spec(f).build_config(f)


# -- weights --------------------------------------------------------------------------------


def _hf_name(f: GGUFFile, spec: _ArchSpec, name: str) -> str:
    m = _BLOCK_RE.match(name)
    if m and m.group(2) in spec.layer_names:
        return f"model.layers.{m.group(1)}.{spec.layer_names[m.group(2)]}.{m.group(3)}"
    m = _GLOBAL_RE.match(name)
    if m and m.group(1) in _GLOBAL:
        return f"{_GLOBAL[m.group(1)]}.{m.group(2)}"
    raise GGUFLoadError(
        f"{f.path}: tensor {name!r} has no known place in a {f.architecture} model (this "
        "loader understands " + ", ".join(sorted(set(spec.layer_names) | set(_GLOBAL))) + ")"
    )


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: within each head, llama.cpp interleaves the two
    rotary halves (rows 0, d/2, 1, d/2+1, ...); HF keeps them as two contiguous halves."""
    rows = w.shape[0]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    )


def num_tensors(path: str | os.PathLike[str]) -> int:
    """How many tensors ``iter_weights`` yields for the file (one per tensor)."""
    with GGUFFile(path) as f:
        return len(f.tensors)


class GGUFLazyTensor(LazyTensor):
    """A tensor of an open GGUF file, dequantized only in its window when materialised (see
    ``GGUFFile.load_window``), with this loader's conventions applied: the Gemma norm offset
    taken off, llama.cpp's q/k row permutation undone (per head, so a window of whole heads
    unpermutes on its own)."""

    def __init__(
        self,
        f: GGUFFile,
        name: str,
        dtype: torch.dtype,
        norm_offset: float = 0.0,
        unpermute_heads: int | None = None,
        stats: ReadStats | None = None,
    ) -> None:
        info = f.tensors[name]
        super().__init__(info.shape, stats=stats)
        self._file, self._name, self._dtype = f, name, dtype
        self._norm_offset, self._unpermute_heads = norm_offset, unpermute_heads
        if stats is not None:
            stats.offered += info.n_bytes

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def _read(self, bounds: tuple[tuple[int, int], ...]) -> tuple[torch.Tensor, int]:
        shape = self._full_shape
        if len(shape) > 2:  # stacked experts [E, rows, cols]
            inner = math.prod(shape[1:-1])
            if all(b == (0, n) for b, n in zip(bounds[1:-1], shape[1:-1], strict=True)):
                # Whole experts (an expert-parallel rank's): only their rows are read.
                (e0, e1), cols = bounds[0], bounds[-1]
                part, num_bytes = self._matrix((e0 * inner, e1 * inner), cols)
                return part.view(e1 - e0, *shape[1:-1], cols[1] - cols[0]), num_bytes
            full, num_bytes = self._matrix((0, math.prod(shape[:-1])), (0, shape[-1]))
            full = full.view(shape)
            return full[tuple(slice(a, b) for a, b in bounds)], num_bytes
        rows = bounds[0] if len(shape) == 2 else (0, 1)
        tensor, num_bytes = self._matrix(rows, bounds[-1])
        return (tensor if len(shape) == 2 else tensor.view(-1)).to(self._dtype), num_bytes

    def _matrix(self, rows: tuple[int, int], cols: tuple[int, int]) -> tuple[torch.Tensor, int]:
        import torch

        needs_f32 = self._norm_offset or self._unpermute_heads
        tensor, num_bytes = self._file.load_window(
            self._name, torch.float32 if needs_f32 else self._dtype, rows, cols
        )
        if self._norm_offset:
            tensor -= self._norm_offset
        if self._unpermute_heads:
            head_rows = self._full_shape[0] // self._unpermute_heads
            if rows[0] % head_rows or (rows[1] - rows[0]) % head_rows:
                raise GGUFLoadError(
                    f"{self._file.path}: {self._name}: rows {rows} do not cover whole heads of "
                    f"{head_rows} rows; cannot undo llama.cpp's q/k permutation"
                )
            tensor = _unpermute(tensor, (rows[1] - rows[0]) // head_rows)
        return tensor, num_bytes


def quantization_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``quantization_config`` the model loader gives a GGUF model's config (read by
    ``engine.quantization.gguf``): ``{"quant_method": "gguf", "tensor_types": {module: GGML
    type name}}`` for every matrix of the file and every stack of experts
    (``<block>.experts.gate_proj`` ...), header only."""
    with GGUFFile(path) as f:
        spec = _spec(f)
        types = {}
        for name, info in f.tensors.items():
            if name.endswith(".weight") and len(info.shape) in (2, 3):
                module = _hf_name(f, spec, name).removesuffix(".weight")
                types[module] = info.ggml_type.name
    return {"quant_method": "gguf", "tensor_types": types}


def iter_weights(
    path: str | os.PathLike[str],
    hf_config: PretrainedConfig,
    dtype: torch.dtype,
    stats: ReadStats | None = None,
    keep_quantized: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, lazy tensor)`` for every tensor in the file, in file order. A tensor
    is dequantized to float32 and cast to ``dtype`` (as ``transformers`` does) when
    materialised, and only in the window its consumer narrowed it to (a tensor-parallel shard
    reads about ``1 / tp`` of the file). Consume each before asking for the next.

    A matrix of a module for which ``keep_quantized(module)`` is true comes raw instead, as
    ``(f"{module}.qweight", uint8 [rows, K / block_size, type_size])`` (its GGUF blocks; Llama's
    q/k rows unpermuted), for ``engine.quantization.gguf``, which shards it by whole blocks; a
    stack of experts as ``uint8 [E, rows, K / block_size, type_size]``.

    Every tensor's type and name are checked before the first one is yielded, so a bad file
    fails fast and names the offending tensor. ``stats`` counts the file bytes offered and
    read.
    """
    import torch

    with GGUFFile(path) as f:
        spec = _spec(f)
        names = {name: _hf_name(f, spec, name) for name in f.tensors}
        for name in f.tensors:
            f.check_supported(name)
        n_heads = hf_config.num_attention_heads
        n_kv = getattr(hf_config, "num_key_value_heads", None) or n_heads
        for name, hf_name in names.items():
            module = hf_name.removesuffix(".weight")
            if keep_quantized is not None and module != hf_name and keep_quantized(module):
                info = f.tensors[name]
                block, type_size = GGML_QUANT_SIZES[info.ggml_type]
                blocks = torch.from_numpy(f.raw(name).copy())
                blocks = blocks.view(*info.shape[:-1], info.shape[-1] // block, type_size)
                f.release(name)
                if spec.unpermute_qk and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                    blocks = _unpermute(blocks, n_heads if "q_proj" in hf_name else n_kv)
                yield f"{module}.qweight", blocks
                continue
            is_norm = hf_name.endswith("norm.weight")
            heads = None
            if spec.unpermute_qk and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = n_heads if "q_proj" in hf_name else n_kv
            offset = spec.norm_offset if is_norm else 0.0
            tensor = GGUFLazyTensor(f, name, dtype, offset, heads, stats)
            if hf_name.endswith("shared_expert_gate.weight") and tensor.dim() == 1:
                # llama.cpp keeps the [1, H] gate as a vector (a few KiB: read it now)
                tensor = tensor.materialize()[None, :]
            yield hf_name, tensor
            f._release(f.tensors[name])


# -- tokenizer ------------------------------------------------------------------------------

# Gemma's turn format. The base GGUF carries no chat template; this one writes
# <bos><start_of_turn>user\n...<end_of_turn>\n<start_of_turn>model\n, folds a system message
# into the first user turn (Gemma has no system role) and accepts string or list-of-parts
# content (OpenAI style).
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set sys = '' -%}"
    "{%- set msgs = messages -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set c = messages[0]['content'] -%}"
    "{%- if c is not string -%}{%- set c = c | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('\n') -%}{%- endif -%}"
    "{%- set sys = c ~ '\n\n' -%}"
    "{%- set msgs = messages[1:] -%}"
    "{%- endif -%}"
    "{%- for m in msgs -%}"
    "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}"
    "{%- set c = m['content'] -%}"
    "{%- if c is not string -%}{%- set c = c | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('\n') -%}{%- endif -%}"
    "{{ '<start_of_turn>' ~ role ~ '\n' ~ (sys if loop.first else '') ~ (c | trim)"
    " ~ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
_CHAT_TEMPLATES = {"gemma3": GEMMA_CHAT_TEMPLATE}
_TOKENIZER_CACHE_VERSION = 1


def _tokenizer_cache_key(path: Path) -> str:
    """Keyed by name, size and mtime: cheap (no hashing of 250 MB) and changes whenever the
    file is rewritten."""
    st = path.stat()
    return f"{path.stem}-{st.st_size}-{st.st_mtime_ns}-v{_TOKENIZER_CACHE_VERSION}"


def _load_cached_tokenizer(directory: Path) -> PreTrainedTokenizerBase:
    """The cached tokenizer, built straight from its ``tokenizer.json`` by the Rust library.
    ``AutoTokenizer`` would pick the model's tokenizer class, which also parses the 33 MB JSON in
    Python: 3x slower to start and ~30 MB more resident, for identical encodings."""
    from transformers import PreTrainedTokenizerFast

    config = json.loads((directory / "tokenizer_config.json").read_text())
    specials = ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token")
    kwargs = {k: config[k] for k in specials if isinstance(config.get(k), str)}
    template = directory / "chat_template.jinja"
    if template.is_file():
        kwargs["chat_template"] = template.read_text()
    elif config.get("chat_template"):
        kwargs["chat_template"] = config["chat_template"]
    return PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"), **kwargs)


def load_tokenizer(
    path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None
) -> PreTrainedTokenizerBase:
    """A fast tokenizer for GGUF file ``path``, converted by ``transformers`` on first use and
    saved under ``cache_dir/tokenizers/<name>-<size>-<mtime>/`` for every later call
    (``cache_dir`` defaults to ``engine_cache_dir()``: ``$ENGINE_CACHE_DIR`` or
    ``~/.cache/engine``).

    When the file has no ``tokenizer.chat_template`` and its architecture has a known turn
    format (Gemma), that template is set so chat requests work.
    """
    from transformers import AutoTokenizer

    from engine.cache_dir import engine_cache_dir

    path = Path(path).resolve()
    if not path.is_file():
        raise GGUFLoadError(f"{path}: no such GGUF file")
    target = (
        Path(cache_dir if cache_dir is not None else engine_cache_dir())
        / "tokenizers"
        / _tokenizer_cache_key(path)
    )
    if (target / "tokenizer_config.json").is_file():
        return _load_cached_tokenizer(target)
    with GGUFFile(path) as f:
        arch = f.architecture
        has_template = "tokenizer.chat_template" in f.metadata
        tokens = f.metadata.get("tokenizer.ggml.tokens")
    count = getattr(tokens, "length", None)  # a SkippedArray: the list is not decoded
    if count is None and isinstance(tokens, list):
        count = len(tokens)
    size = f"{count:,}-token " if count else ""
    logger.info(
        "converting the %svocabulary of %s to a fast tokenizer (once: transformers reads the "
        "GGUF vocabulary in Python, which takes a while for a large one; later starts load "
        "it from %s)",
        size,
        path.name,
        target,
    )
    start = time.perf_counter()
    try:
        with activity(f"Converting the tokenizer of {path.name}"):
            tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as e:  # transformers raises a variety of types for bad vocabularies
        raise GGUFLoadError(f"{path}: cannot build a tokenizer from the GGUF metadata: {e}") from e
    logger.info("tokenizer converted in %.1f s", time.perf_counter() - start)
    if not has_template and arch in _CHAT_TEMPLATES:
        tok.chat_template = _CHAT_TEMPLATES[arch]
    # Write to a temporary sibling, then rename: concurrent first starts never see a half
    # written cache, and a crash leaves nothing that looks valid.
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        tok.save_pretrained(tmp)
        (tmp / "engine_source.json").write_text(json.dumps({"gguf": str(path)}))
        os.replace(tmp, target)
    except OSError:
        if not (target / "tokenizer_config.json").is_file():
            raise
        # Another process won the race; its copy is as good as ours.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tok
