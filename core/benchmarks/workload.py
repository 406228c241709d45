"""Benchmark inputs: built-in model shapes (config.json only, for ``--load-format dummy``) and
random token-id workloads.

The random workload draws, per request and in this order, a prompt length, the prompt's token
ids (uniform in ``[10, vocab - 10)``) and an output length, from ``random.Random(seed)``. With
``--seed 0``, 256 prompts and lengths in [100, 1024] this is nano-vllm's benchmark exactly as
the vLLM peer measurement in ``shared/peers/vllm`` drew it; ``--seed 3`` with 128 in and 512
out is its batch-1 decode workload.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any

# Public config.json values of the checkpoints (architecture-defining fields only).
BUILTIN_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        hidden_act="silu",
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        attention_bias=False,
        use_sliding_window=False,
        sliding_window=None,
        bos_token_id=151643,
        eos_token_id=151645,
        dtype="bfloat16",
    ),
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        hidden_act="silu",
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling={
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009],
        dtype="bfloat16",
    ),
    # Mixture of experts: 48 layers of 128 experts (top-8, 768 wide), 3.3B active parameters.
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        hidden_act="silu",
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_bias=False,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=48,
        bos_token_id=151643,
        eos_token_id=151645,
        torch_dtype="bfloat16",
    ),
    # Mixtral-8x7B-v0.1: 32 layers of 8 experts (top-2, 14336 wide), 12.9B active of 46.7B.
    "mixtral-8x7b": dict(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        hidden_act="silu",
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-5,
        sliding_window=None,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
    ),
    # gpt-oss-20b: 24 layers of 32 experts (top-4, 2880 wide, with biases), attention sinks,
    # sliding (128) and full layers alternating; 3.6B active of 20.9B parameters. The released
    # checkpoint's MXFP4 experts are dequantized at load, so this bf16 shape is what runs.
    "gpt-oss-20b": dict(
        architectures=["GptOssForCausalLM"],
        model_type="gpt_oss",
        vocab_size=201088,
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        num_local_experts=32,
        num_experts_per_tok=4,
        sliding_window=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        swiglu_limit=7.0,
        attention_bias=True,
        hidden_act="silu",
        tie_word_embeddings=False,
        bos_token_id=199998,
        eos_token_id=200002,
        pad_token_id=199999,
        torch_dtype="bfloat16",
    ),
}
# The 8B shape as an AWQ 4-bit checkpoint (the vLLM kit's ``llama3-8b-awq``): config.json
# with its quantization_config, for --load-format dummy (random packed weights).
BUILTIN_SHAPES["llama-3.1-8b-awq"] = dict(
    BUILTIN_SHAPES["llama-3.1-8b"],
    quantization_config={
        "quant_method": "awq",
        "bits": 4,
        "group_size": 128,
        "zero_point": True,
        "version": "gemm",
    },
)
# Qwen3-30B-A3B-FP8's config (block-wise FP8: 128x128 weight_scale_inv, dynamic activations),
# for --load-format dummy: random e4m3 experts and linears (FP8 MoE benchmarks).
BUILTIN_SHAPES["qwen3-30b-a3b-fp8"] = dict(
    BUILTIN_SHAPES["qwen3-30b-a3b"],
    quantization_config={
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    },
)
# Qwen3-30B-A3B-GPTQ-Int4's config (4-bit, groups of 128, symmetric, no act-order), for
# --load-format dummy: random packed experts and linears (W4A16 MoE benchmarks).
BUILTIN_SHAPES["qwen3-30b-a3b-gptq-int4"] = dict(
    BUILTIN_SHAPES["qwen3-30b-a3b"],
    quantization_config={
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "desc_act": False,
        "sym": True,
        "checkpoint_format": "gptq",
    },
)
# gpt-oss-20b as released: its experts in MXFP4 (the checkpoint's quantization_config), for
# --load-format dummy: random E2M1 codes and exponents, kept in MXFP4 where a plugin provides
# fused_moe_mxfp4 and dequantized at load elsewhere (engine.quantization.mxfp4).
BUILTIN_SHAPES["gpt-oss-20b-mxfp4"] = dict(
    BUILTIN_SHAPES["gpt-oss-20b"],
    quantization_config={
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    },
)
ALIASES = {
    "llama3-8b": "llama-3.1-8b",
    "llama-3-8b": "llama-3.1-8b",
    "qwen3-0.6B": "qwen3-0.6b",
    "qwen3-30b": "qwen3-30b-a3b",
    "qwen3-30b-fp8": "qwen3-30b-a3b-fp8",
    "qwen3-30b-gptq": "qwen3-30b-a3b-gptq-int4",
    "mixtral-8x7b-v0.1": "mixtral-8x7b",
    "mixtral": "mixtral-8x7b",
    "llama3-8b-awq": "llama-3.1-8b-awq",
    "gpt-oss": "gpt-oss-20b",
    "gpt-oss-mxfp4": "gpt-oss-20b-mxfp4",
}
# Draft shapes for speculative decoding with the Llama-3.1-8B shape (same vocabulary): a
# Llama-3.2-1B draft model, and EAGLE / EAGLE-3 heads as yuhuili's for Llama-3.1-8B-Instruct.
_LLAMA3_ROPE = dict(BUILTIN_SHAPES["llama-3.1-8b"]["rope_scaling"])
BUILTIN_SHAPES["llama-3.2-1b"] = dict(
    BUILTIN_SHAPES["llama-3.1-8b"],
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    tie_word_embeddings=True,
    rope_scaling=dict(_LLAMA3_ROPE, factor=32.0),
)
BUILTIN_SHAPES["eagle-llama-3.1-8b"] = dict(BUILTIN_SHAPES["llama-3.1-8b"], num_hidden_layers=1)
BUILTIN_SHAPES["eagle3-llama-3.1-8b"] = dict(
    BUILTIN_SHAPES["llama-3.1-8b"],
    architectures=["LlamaForCausalLMEagle3"],
    num_hidden_layers=1,
    draft_vocab_size=32000,
)


def builtin_shape(name: str) -> str | None:
    """The canonical built-in shape for ``name`` (case-insensitive), or None."""
    key = ALIASES.get(name, name).lower()
    key = ALIASES.get(key, key)
    return key if key in BUILTIN_SHAPES else None


def write_builtin_model(name: str, root: str, word_level_tokenizer: bool = False) -> str:
    """Write ``config.json`` for a built-in shape under ``root`` and return the directory.

    The tokenizer is a small stand-in, which the engine loads but the offline benchmarks never
    use (prompts are token ids and outputs are not detokenized), or, with
    ``word_level_tokenizer``, one that covers the whole vocabulary (token ``i`` is the word
    ``t<i>``), so that a server streams real text for random weights."""
    import transformers

    shape = builtin_shape(name)
    if shape is None:
        raise KeyError(name)
    values = dict(BUILTIN_SHAPES[shape])
    model_type = values.pop("model_type")
    path = os.path.join(root, shape)
    os.makedirs(path, exist_ok=True)
    config = transformers.AutoConfig.for_model(model_type, **values)
    config.save_pretrained(path)
    if word_level_tokenizer:
        eos = values["eos_token_id"]
        write_word_level_tokenizer(
            values["vocab_size"],
            path,
            values["bos_token_id"],
            eos if isinstance(eos, int) else eos[0],
        )
        return path
    from engine.testing.tiny_models import build_tokenizer

    build_tokenizer(path)
    return path


def write_word_level_tokenizer(
    vocab_size: int, out_dir: str | None = None, bos_id: int = 1, eos_id: int = 2
) -> Any:
    """A fast tokenizer whose token ``i`` is the word ``t<i>``: every id decodes to text, so
    detokenization and streaming cost what they cost for a real model. Saved to ``out_dir``
    when given, with a plain chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=f"t{bos_id}", eos_token=f"t{eos_id}", unk_token="t0"
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}t3{% endif %}"
    )
    if out_dir is not None:
        fast.save_pretrained(out_dir)
    return fast


@dataclass
class Workload:
    """Token-id prompts and one output length per request."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def input_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def length_range(length: int, ratio: float) -> tuple[int, int]:
    """vLLM's ``--random-range-ratio``: lengths uniform in
    ``[length * (1 - ratio), length * (1 + ratio)]`` (at least 1)."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    return max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))


def random_workload(
    num_prompts: int,
    input_range: tuple[int, int],
    output_range: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
) -> Workload:
    """``num_prompts`` random requests with lengths uniform in the (inclusive) ranges."""
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(num_prompts):
        prompt, out = _random_request(rng, input_range, output_range, vocab_size)
        prompts.append(prompt)
        outs.append(out)
    return Workload(prompts, outs)


def _random_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    """``n`` token ids uniform in ``[10, vocab - 10)`` (clear of special tokens at the ends)."""
    return [rng.randrange(10, vocab_size - 10) for _ in range(n)]


def _random_request(
    rng: random.Random,
    input_range: tuple[int, int],
    output_range: tuple[int, int],
    vocab_size: int,
) -> tuple[list[int], int]:
    """One request's prompt and output length, drawn in the order the module docstring gives
    (the seeded workloads depend on it)."""
    n = rng.randint(*input_range)
    prompt = _random_ids(rng, n, vocab_size)
    return prompt, rng.randint(*output_range)


# The mixed serving workload (``--workload mixed``), three request kinds drawn per request:
# (share, input range, output range). Chat turns open with one of four 256-token system
# prompts (prefix-cache hits, as in real chat traffic); long-context requests are prefill-heavy;
# generation requests are decode-heavy.
MIXED_KINDS = (
    ("chat", 0.5, (64, 512), (64, 384)),
    ("long-context", 0.3, (1024, 3072), (64, 256)),
    ("generation", 0.2, (32, 256), (512, 1536)),
)
MIXED_SYSTEM_PROMPT_LEN = 256


def mixed_workload(num_prompts: int, vocab_size: int, seed: int = 0) -> Workload:
    """The mixed workload: per request, in this order from ``random.Random(seed)``, a kind (by
    ``MIXED_KINDS`` shares), a prompt length, the prompt's token ids (uniform in
    ``[10, vocab - 10)``; chat prompts start with system prompt ``i % 4``, drawn first from
    ``random.Random(seed + 1)``) and an output length. 512 requests with seed 0 hold about 400k
    prompt and 190k output tokens."""
    sys_rng = random.Random(seed + 1)
    systems = [_random_ids(sys_rng, MIXED_SYSTEM_PROMPT_LEN, vocab_size) for _ in range(4)]
    rng = random.Random(seed)
    prompts, outs = [], []
    for i in range(num_prompts):
        u, acc = rng.random(), 0.0
        for kind in MIXED_KINDS:
            acc += kind[1]
            if u < acc or kind is MIXED_KINDS[-1]:
                break
        name, _, input_range, output_range = kind
        body, out = _random_request(rng, input_range, output_range, vocab_size)
        prompts.append(systems[i % 4] + body if name == "chat" else body)
        outs.append(out)
    return Workload(prompts, outs)


# The shared-prefix workload (``--workload shared-prefix``): every request opens with the same
# 2,000-token system prompt, then its own user turn; what a prefix cache should make cost only
# the new tokens.
SHARED_PREFIX_LEN = 2000
SHARED_PREFIX_SUFFIX = (64, 512)
SHARED_PREFIX_OUTPUT = (64, 384)


def shared_prefix_workload(num_prompts: int, vocab_size: int, seed: int = 0) -> Workload:
    """``num_prompts`` requests behind one ``SHARED_PREFIX_LEN``-token prefix (drawn first from
    ``random.Random(seed + 1)``), each followed, in this order from ``random.Random(seed)``,
    by a suffix length in ``SHARED_PREFIX_SUFFIX``, its token ids and an output length in
    ``SHARED_PREFIX_OUTPUT``."""
    prefix = _random_ids(random.Random(seed + 1), SHARED_PREFIX_LEN, vocab_size)
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(num_prompts):
        body, out = _random_request(rng, SHARED_PREFIX_SUFFIX, SHARED_PREFIX_OUTPUT, vocab_size)
        prompts.append(prefix + body)
        outs.append(out)
    return Workload(prompts, outs)


WORKLOADS = ("random", "mixed", "shared-prefix")


def named_workload(name: str, num_prompts: int, vocab_size: int, seed: int = 0) -> Workload:
    """The fixed workloads by name (``--workload``): ``mixed`` or ``shared-prefix``."""
    if name == "mixed":
        return mixed_workload(num_prompts, vocab_size, seed)
    if name == "shared-prefix":
        return shared_prefix_workload(num_prompts, vocab_size, seed)
    raise ValueError(f"unknown workload {name!r}; choose mixed or shared-prefix")


def warmup_workload(vocab_size: int) -> Workload:
    """Eight short requests (64..288 prompt tokens, 32 new each), run untimed first."""
    prompts = [[(7 * i + j) % (vocab_size - 20) + 10 for j in range(64 + 32 * i)] for i in range(8)]
    return Workload(prompts, [32] * 8)
