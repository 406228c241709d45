"""Gated activations (``act(gate) * up``) through the kernel registry."""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.registry import Kernels

# HF ``hidden_act`` names -> kernel op computing act(gate) * up on a [T, 2I] input.
_GATED_ACTS = {
    "silu": "silu_and_mul",
    "swish": "silu_and_mul",
    "gelu_pytorch_tanh": "gelu_tanh_and_mul",
    "gelu_tanh": "gelu_tanh_and_mul",
}


class GatedActivation(nn.Module):
    """``x [T, 2I]`` (gate then up) -> ``act(gate) * up [T, I]`` with one kernel call."""

    def __init__(self, hidden_act: str, kernels: Kernels) -> None:
        super().__init__()
        if hidden_act not in _GATED_ACTS:
            raise ValueError(
                f"activation {hidden_act!r} is not supported; supported: "
                f"{', '.join(sorted(_GATED_ACTS))}"
            )
        self.hidden_act = hidden_act
        self.op = getattr(kernels, _GATED_ACTS[hidden_act])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x)

    def extra_repr(self) -> str:
        return self.hidden_act
