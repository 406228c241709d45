"""``ModelContext``: everything a model class needs to build itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from engine.attention_backends.interface import AttentionBackend
    from engine.kernels.registry import Kernels


@dataclass
class ModelContext:
    """Passed to ``Model(ctx)``.

    ``hf_config`` is the transformers config; ``dtype`` the torch dtype of weights and
    activations; ``kernels`` the platform's bound ops; ``attn_backend_cls`` the selected
    attention backend class (each ``Attention`` layer instantiates it); ``device`` where the
    model lives (parameters are created under it as the default device by the loader).
    """

    hf_config: Any
    dtype: torch.dtype
    kernels: Kernels
    attn_backend_cls: type[AttentionBackend]
    device: torch.device
