"""Tiny random Hugging Face models built offline, for tests, examples and conformance runs.

``build_tiny_model(tmp_dir, "llama")`` writes a real model directory (config.json, safetensors
weights, a byte-level BPE tokenizer trained on a built-in text, a chat template) so the real
loading code runs and nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_CORPUS = """The quick brown fox jumps over the lazy dog. A paged KV cache stores keys and values
in fixed-size blocks, reached through block tables, shared by reference counts and reused across
requests by prefix hash. Continuous batching schedules every iteration: running decodes first,
then chunks of waiting prompts within a token budget. Numbers 0123456789 and punctuation !?.,;:
Émigré café naïve coöperate — façade; 東京 北京 こんにちは 안녕하세요 🙂🚀 emoji and UTF-8 text.
def main(): return sum(x * x for x in range(10))  # code-like text with symbols {}[]()<>=+-*/
"""

ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    # Natively implemented too (core/models/phi3.py, gemma2.py); the others run through the
    # transformers modeling backend.
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "granite": ("GraniteConfig", "GraniteForCausalLM"),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM"),
    "phi": ("PhiConfig", "PhiForCausalLM"),
    "cohere": ("CohereConfig", "CohereForCausalLM"),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
}
# Settings that make each architecture's peculiarities bite on tiny sizes: small sliding
# windows (prompts exceed them), soft-caps and multipliers away from 1, partial rotary.
TINY_EXTRA: dict[str, dict[str, Any]] = {
    "phi3": {"partial_rotary_factor": 0.75},
    "gemma2": {
        "head_dim": 16,
        "query_pre_attn_scalar": 24,
        "sliding_window": 8,
        "attn_logit_softcapping": 10.0,
        "final_logit_softcapping": 8.0,
        "tie_word_embeddings": True,
    },
    "granite": {
        "embedding_multiplier": 3.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.2,
        "logits_scaling": 2.0,
    },
    "cohere": {"logit_scale": 0.5, "tie_word_embeddings": True},
    "starcoder2": {"sliding_window": 8, "use_bias": True},
    "gpt_neox": {"rotary_pct": 0.5},
    "phi": {"partial_rotary_factor": 0.5},
    "gpt2": {"tie_word_embeddings": True},
    # GPT-OSS: sliding and full layers alternate; a small clamp so that the experts' clamped
    # SwiGLU bites; YaRN from a short original context, as the released configs (from 4,096).
    "gpt_oss": {
        "head_dim": 16,
        "sliding_window": 8,
        "swiglu_limit": 1.5,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 16.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
    },
}
# Mixture-of-experts settings for build_tiny_model: many experts, top-2 and top-8, a shared
# expert, dense layers among sparse ones (Qwen's decoder_sparse_step / mlp_only_layers).
TINY_MOE = {
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen2_moe": {
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 48,
        "shared_expert_intermediate_size": 96,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
    },
    "qwen3_moe": {
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "head_dim": 16,
    },
    "gpt_oss": {"num_local_experts": 16, "num_experts_per_tok": 4},
}


def build_tokenizer(out_dir: str | Path, vocab_size: int = 384) -> Any:
    """Train a byte-level BPE tokenizer on a small built-in text and save it with special
    tokens (<s>, </s>, <unk>, <pad>, chat markers) and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [
        "<unk>",
        "<s>",
        "</s>",
        "<pad>",
        "<|user|>",
        "<|assistant|>",
        "<|system|>",
        "<|end|>",
    ]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    dtype: str = "float32",
    **config_overrides: Any,
) -> Path:
    """Write a tiny random model of ``arch`` (a key of ``ARCHITECTURES``: llama, mistral,
    qwen2, qwen3, phi3, gemma2, ...; the MoE mixtral, qwen2_moe, qwen3_moe with ``TINY_MOE``'s
    expert settings; ``TINY_EXTRA``'s settings for the others) with its tokenizer to
    ``out_dir`` and return the path."""
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out)
    config_cls, model_cls = ARCHITECTURES[arch]
    kwargs: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    if arch == "qwen3":
        kwargs["head_dim"] = hidden_size // num_heads
    kwargs.update(TINY_MOE.get(arch, {}))
    kwargs.update(TINY_EXTRA.get(arch, {}))
    kwargs.update(config_overrides)
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    # Random init of this size gives near-uniform logits; widen the weights so greedy
    # decoding is decisive and token-exact comparisons are meaningful.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.5 / param.shape[-1] ** 0.5 * 4)
            elif "norm" in name:
                param.uniform_(0.8, 1.2)
            elif name.endswith(".sinks"):
                # GPT-OSS's per-head softmax sinks: from nearly none to most of the weight.
                param.uniform_(-2.0, 3.0)
            else:
                param.normal_(0.0, 0.1)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(str(out))
    return out


# --- save_tiny_model (from the models branch): configs of every supported architecture.

# Small but not degenerate: GQA, several layers, head_dim > rotary minimum.
_BASE = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", **_BASE},
    "llama3": {
        "model_type": "llama",
        **_BASE,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "mistral": {"model_type": "mistral", **_BASE, "sliding_window": None},
    "mistral_sliding": {"model_type": "mistral", **_BASE, "sliding_window": 6},
    "qwen2": {
        "model_type": "qwen2",
        **_BASE,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
    },
    "qwen2_sliding": {
        "model_type": "qwen2",
        **_BASE,
        "use_sliding_window": True,
        "sliding_window": 5,
        "max_window_layers": 1,
    },
    "qwen3": {"model_type": "qwen3", **_BASE, "head_dim": 32, "tie_word_embeddings": True},
    # Phi-3 / Phi-4: q/k/v and gate/up fused in the checkpoint, partial rotary (Phi-4-mini),
    # and LongRoPE (short factors below original_max_position_embeddings, with the attention
    # factor sqrt(1 + ln 2 / ln 256)).
    "phi3": {"model_type": "phi3", **_BASE, "partial_rotary_factor": 0.75},
    "phi3_longrope": {
        "model_type": "phi3",
        **_BASE,
        "original_max_position_embeddings": 256,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 1.7, 2.0],
            "long_factor": [1.0, 2.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0],
        },
    },
    # Gemma 2: alternating window, attention and final logit soft-capping, query_pre_attn_scalar.
    "gemma2": {
        "model_type": "gemma2",
        **_BASE,
        "head_dim": 16,
        "query_pre_attn_scalar": 24,
        "sliding_window": 5,
        "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 3.0,
    },
    # Mixture of experts: many experts, top-2 / top-4 / top-8, with and without
    # renormalisation, a shared expert, dense layers among the sparse ones. A wider init than
    # transformers' default so that routing is decisive (near-uniform router logits would
    # hide routing mistakes).
    "mixtral": {
        "model_type": "mixtral",
        **_BASE,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "initializer_range": 0.1,
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        **_BASE,
        "num_hidden_layers": 4,
        "head_dim": 32,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "mlp_only_layers": [2],
        "initializer_range": 0.1,
    },
    "qwen2_moe": {
        "model_type": "qwen2_moe",
        **_BASE,
        "num_hidden_layers": 4,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 48,
        "shared_expert_intermediate_size": 96,
        "norm_topk_prob": False,
        "decoder_sparse_step": 2,
        "initializer_range": 0.1,
    },
    "qwen3_yarn": {
        "model_type": "qwen3",
        **_BASE,
        "head_dim": 32,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
}


def tiny_config(kind: str, **overrides: Any) -> Any:
    """A transformers config for one of ``TINY_CONFIGS`` with ``overrides`` applied."""
    from transformers import AutoConfig

    if kind not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny model {kind!r}; known: {', '.join(TINY_CONFIGS)}")
    kwargs = {**TINY_CONFIGS[kind], **overrides}
    return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)


def save_tiny_model(
    kind: str, path: str | Path, seed: int = 0, dtype: Any = None, **overrides: Any
) -> Path:
    """Build a random ``kind`` model with transformers and save it (safetensors) to ``path``.

    ``dtype`` is a torch dtype (default float32); ``overrides`` change config fields (e.g.
    ``hidden_size``, ``num_hidden_layers``, ``initializer_range``). Returns ``path``.
    """
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(kind, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype or torch.float32)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    return path


# --- Gemma 3 multimodal (the 4B/12B/27B layout) with a tiny SigLIP vision tower.

TINY_GEMMA3_TEXT: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,  # 5 sliding-window layers, then 1 global one
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "query_pre_attn_scalar": 24,  # != head_dim, as in 27B, so the scale is read from config
    "sliding_window": 8,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    },
}

TINY_SIGLIP: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": 56,  # a 4 x 4 patch grid, average-pooled to 2 x 2 = 4 tokens per image
    "patch_size": 14,
    "vision_use_head": False,  # as the released Gemma 3 vision configs
}
TINY_GEMMA3_TOKENS_PER_IMAGE = 4

# Gemma 3's chat template, shortened: turns with text and image parts (an image part renders
# as <start_of_image>, which the processor expands into the image's placeholder tokens).
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<start_of_image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def build_tiny_gemma3_multimodal(
    out_dir: str | Path,
    seed: int = 0,
    dtype: str = "float32",
    vision_use_head: bool = False,
    **text_overrides: Any,
) -> Path:
    """Write a random ``Gemma3ForConditionalGeneration`` (``TINY_GEMMA3_TEXT`` text model, a
    ``TINY_SIGLIP`` vision tower, the projector) with its tokenizer and processor to
    ``out_dir``; returns it.

    The tokenizer has Gemma 3's image tokens (``<start_of_image>``, ``<end_of_image>``,
    ``<image_soft_token>``, as special tokens inside the vocabulary like the released models'),
    an image-aware chat template (``GEMMA3_CHAT_TEMPLATE``), and a ``Gemma3Processor``
    (56 x 56 images, ``TINY_GEMMA3_TOKENS_PER_IMAGE`` soft tokens per image) is saved beside it,
    so ``AutoProcessor.from_pretrained(out_dir)`` works as for a released checkpoint. Norm
    weights are randomised too (HF initialises Gemma's to zero, which would hide a missing
    ``1 + w``) and matrices widened so greedy decoding is decisive.
    """
    import torch
    import transformers
    from transformers import (
        AutoTokenizer,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3Processor,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    tokenizer = AutoTokenizer.from_pretrained(
        str(out),
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    )
    tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out))
    vocab = len(tokenizer)
    text = dict(
        TINY_GEMMA3_TEXT,
        vocab_size=vocab,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **text_overrides,
    )
    size = TINY_SIGLIP["image_size"]
    processor = Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessor(size={"height": size, "width": size}),
        tokenizer=tokenizer,
        image_seq_length=TINY_GEMMA3_TOKENS_PER_IMAGE,
    )
    processor.save_pretrained(str(out))
    config = Gemma3Config(
        text_config=text,
        vision_config={**TINY_SIGLIP, "vision_use_head": vision_use_head},
        mm_tokens_per_image=TINY_GEMMA3_TOKENS_PER_IMAGE,
        boi_token_index=tokenizer.boi_token_id,
        eoi_token_index=tokenizer.eoi_token_id,
        image_token_index=tokenizer.image_token_id,
    )
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
            elif p.dim() >= 2:
                p.normal_(0.0, 1.0 / p[0].numel() ** 0.5)
    model.to(getattr(torch, dtype)).save_pretrained(str(out))
    return out


# --- EAGLE / EAGLE-3 draft heads in their published checkpoint layouts (random weights).


def build_tiny_eagle_head(
    out_dir: str | Path,
    target_dir: str | Path,
    kind: str = "eagle",
    *,
    fc_bias: bool = False,
    draft_vocab_size: int | None = None,
    aux_layer_ids: list[int] | None = None,
    fmt: str = "safetensors",
    seed: int = 0,
    scale: float = 0.05,
) -> Path:
    """Write a random EAGLE (``kind="eagle"``, as ``yuhuili/EAGLE-LLaMA3-Instruct-8B``: a
    one-layer Llama config, ``fc`` over ``[embed; hidden]``, layer 0 without
    ``input_layernorm``, no embedding or LM head of its own) or EAGLE-3 head (``"eagle3"``, as
    ``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``: ``LlamaForCausalLMEagle3``, ``fc`` over three
    target hidden states, ``midlayer.*`` with ``hidden_norm``, ``norm``, its own ``lm_head``
    over ``draft_vocab_size`` tokens with ``d2t``/``t2d``) for the target model at
    ``target_dir``. ``fmt="bin"`` writes ``pytorch_model.bin`` as the original EAGLE releases
    do. Returns the path."""
    import json

    import torch
    from transformers import AutoConfig

    target = AutoConfig.from_pretrained(str(target_dir))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    h = target.hidden_size
    heads = target.num_attention_heads
    kv_heads = getattr(target, "num_key_value_heads", None) or heads
    hd = getattr(target, "head_dim", None) or h // heads
    inter = target.intermediate_size
    vocab = target.vocab_size
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale * 4

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(h, generator=gen)

    config: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hd,
        "max_position_embeddings": target.max_position_embeddings,
        "rms_norm_eps": target.rms_norm_eps,
        "vocab_size": vocab,
        "hidden_act": "silu",
        "rope_theta": getattr(target, "rope_theta", None)
        or (getattr(target, "rope_parameters", None) or {}).get("rope_theta", 10000.0),
        "torch_dtype": "float32",
        "bos_token_id": target.bos_token_id,
        "eos_token_id": target.eos_token_id,
    }
    tensors: dict[str, torch.Tensor] = {}
    if kind == "eagle":
        config["architectures"] = ["LlamaForCausalLM"]
        prefix = "layers.0."
        tensors["fc.weight"] = rand(h, 2 * h)
        if fc_bias:
            tensors["fc.bias"] = rand(h)
        qkv_in = h
    elif kind == "eagle3":
        dv = draft_vocab_size or vocab
        config["architectures"] = ["LlamaForCausalLMEagle3"]
        config["draft_vocab_size"] = dv
        if aux_layer_ids is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)}
        prefix = "midlayer."
        tensors["fc.weight"] = rand(h, 3 * h)
        tensors[prefix + "input_layernorm.weight"] = norm()
        tensors[prefix + "hidden_norm.weight"] = norm()
        tensors["norm.weight"] = norm()
        tensors["lm_head.weight"] = rand(dv, h)
        # Draft token d is target token d + d2t[d]: here every other target token.
        chosen = torch.arange(dv) * (vocab // dv) if dv < vocab else torch.arange(dv)
        tensors["d2t"] = (chosen - torch.arange(dv)).to(torch.int64)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[chosen] = True
        tensors["t2d"] = t2d
        qkv_in = 2 * h
    else:
        raise ValueError(f"kind must be 'eagle' or 'eagle3', got {kind!r}")
    tensors[prefix + "self_attn.q_proj.weight"] = rand(heads * hd, qkv_in)
    tensors[prefix + "self_attn.k_proj.weight"] = rand(kv_heads * hd, qkv_in)
    tensors[prefix + "self_attn.v_proj.weight"] = rand(kv_heads * hd, qkv_in)
    tensors[prefix + "self_attn.o_proj.weight"] = rand(h, heads * hd)
    tensors[prefix + "mlp.gate_proj.weight"] = rand(inter, h)
    tensors[prefix + "mlp.up_proj.weight"] = rand(inter, h)
    tensors[prefix + "mlp.down_proj.weight"] = rand(h, inter)
    tensors[prefix + "post_attention_layernorm.weight"] = norm()
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if fmt == "bin":
        torch.save(tensors, out / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out
