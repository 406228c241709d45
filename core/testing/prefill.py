"""Run a model once, without the engine loop: build it through the real loader (with the
quantization method the registry picks, as the engine does) and run one prefill forward over a
prompt, returning every position's logits. For tests and the quantization benchmarks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.attention_backends.interface import BatchLayout
from engine.attention_backends.torch_ref import TorchReferenceBackend
from engine.config import ModelConfig
from engine.loader import load_hf_config, load_model
from engine.plugins import PluginManager
from engine.quantization import QuantizationSpec, checkpoint_quantization_config

PROMPT = [5, 9, 11, 40, 3, 7, 100, 23, 57, 81, 12, 200, 33, 64, 2, 19, 150, 77, 45, 8, 99, 31]
BLOCK = 4


def build_model(
    model_dir: str | Path,
    quantization: str | None = None,
    dtype: str = "float32",
    load_format: str = "auto",
    activation_quant: bool | None = None,
    kernels: Any = None,
    device: str = "cpu",
) -> tuple[torch.nn.Module, Any]:
    """(model, quant_config) loaded on ``device``; ``activation_quant`` forces FP8/INT8 W8A8
    (True) or weight-only (False) instead of the device's choice. ``kernels`` default to the
    platform's (``cpu`` or ``cuda``); on a GPU the method's reasons are not checked, so a test
    may run the torch references there on purpose."""
    pm = PluginManager.from_env()
    platform = "cpu" if device == "cpu" else "cuda"
    kernels = kernels or pm.kernel_registry().resolve(platform)
    config = ModelConfig(
        model=str(model_dir), dtype=dtype, load_format=load_format, quantization=quantization
    )
    hf = load_hf_config(config)
    spec = QuantizationSpec(platform=platform, device_type=platform, dtype=dtype)
    quant = pm.quantization_methods().resolve(
        quantization, checkpoint_quantization_config(hf), spec
    )
    if quant is not None and activation_quant is not None:
        quant.activation_quant = activation_quant
    model = load_model(config, kernels, TorchReferenceBackend, device, quant_config=quant)
    return model, quant


def prefill_logits(model: torch.nn.Module, prompt: list[int] = PROMPT) -> torch.Tensor:
    """float32 logits ``[len(prompt), vocab]`` of one prefill of ``prompt``."""
    t = len(prompt)
    blocks = -(-t // BLOCK)
    weight = model.model.embed_tokens.weight
    for layer in model.attention_layers():
        shape = TorchReferenceBackend.kv_cache_shape(
            blocks, BLOCK, layer.num_kv_heads, layer.head_size
        )
        layer.kv_cache = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
    layout = BatchLayout([t], [t], [list(range(blocks))], list(range(t)), BLOCK, 0)
    md = TorchReferenceBackend.build_metadata(layout, weight.device)
    with torch.inference_mode():
        ids = torch.tensor(prompt, device=weight.device)
        hidden = model(ids, torch.arange(t, device=weight.device), [md])
        return model.compute_logits(hidden).float().cpu()
