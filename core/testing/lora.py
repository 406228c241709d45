"""LoRA adapters for tests, made with ``peft`` on a tiny model (nothing is downloaded).

``make_peft_adapter(model_dir, out_dir, rank=8, targets=...)`` wraps the model with
``peft.get_peft_model``, gives every ``lora_B`` random non-zero values (PEFT initialises them
to zero, which would make the adapter a no-op) and saves the adapter in the PEFT format;
``merged_model(model_dir, adapter_dir)`` is the reference it must match: transformers' model
with the adapter merged into its weights (``merge_and_unload``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    rank: int = 8,
    alpha: float | None = None,
    targets: list[str] | None = None,
    seed: int = 0,
    use_rslora: bool = False,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    b_std: float = 0.5,
    dtype: str = "float32",
    **config: Any,
) -> Path:
    """Save a random LoRA adapter of the model in ``model_dir`` to ``out_dir`` (returned).

    ``alpha`` defaults to ``2 * rank``; ``targets`` to every linear projection; extra
    ``config`` keys go to ``peft.LoraConfig`` (e.g. ``use_dora=True`` to build one the engine
    must refuse)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    lora_config = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else 2 * rank,
        target_modules=list(targets or ALL_LINEAR),
        use_rslora=use_rslora,
        rank_pattern=dict(rank_pattern or {}),
        alpha_pattern=dict(alpha_pattern or {}),
        lora_dropout=0.0,
        **config,
    )
    peft_model = get_peft_model(model, lora_config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name:
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[1] ** 0.5)
            elif "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * b_std / param.shape[1] ** 0.5)
    out = Path(out_dir)
    peft_model.save_pretrained(str(out))
    return out


def merged_model(model_dir: str | Path, adapter_dir: str | Path | None, dtype: str = "float32"):
    """transformers' model with the adapter merged (``merge_and_unload``); the base model for
    ``adapter_dir=None``. In eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    return model.eval()


def hf_greedy(model: Any, prompt_ids: list[int], num_new: int) -> list[int]:
    """``num_new`` greedy tokens of a transformers model, end-of-sequence tokens included (as
    the engine's ``ignore_eos``; ``generate(min_new_tokens=...)`` would suppress them)."""
    import torch

    ids = torch.tensor([prompt_ids])
    past = None
    tokens: list[int] = []
    with torch.no_grad():
        for _ in range(num_new):
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            ids = torch.tensor([[token]])
    return tokens
