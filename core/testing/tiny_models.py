"""Tiny random Hugging Face models saved to a directory, for tests and benchmarks.

``save_tiny_model("llama", path)`` builds the model with transformers (``from_config`` with a
fixed seed) and ``save_pretrained``s it as safetensors: the engine's real loading code then runs
on it and transformers can be compared against it. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
