"""``ModelContext``: everything a model class needs to build itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.parallel import SINGLE_PROCESS, ParallelContext

if TYPE_CHECKING:
    import torch

    from engine.attention_backends.interface import AttentionBackend
    from engine.kernels.registry import Kernels
    from engine.layers.linear import QuantizationConfig


@dataclass
class ModelContext:
    """Passed to ``Model(ctx)``.

    ``hf_config`` is the transformers config; ``dtype`` the torch dtype of weights and
    activations; ``kernels`` the platform's bound ops; ``attn_backend_cls`` the selected
    attention backend class (each ``Attention`` layer instantiates it); ``device`` where the
    model lives (parameters are created under it as the default device by the loader);
    ``parallel`` this process's tensor/pipeline-parallel place (one process by default), which
    the linear and embedding layers shard by; ``quant_config`` the model's quantization (None:
    unquantized), which picks each linear layer's method; ``multimodal_config`` the engine's
    ``MultiModalConfig`` (None: its defaults), which tells a multimodal model whether to build
    its vision tower (``limit_mm_per_prompt`` of 0 images: text only).
    """

    hf_config: Any
    dtype: torch.dtype
    kernels: Kernels
    attn_backend_cls: type[AttentionBackend]
    device: torch.device
    parallel: ParallelContext = field(default=SINGLE_PROCESS)
    quant_config: QuantizationConfig | None = None
    multimodal_config: Any = None
