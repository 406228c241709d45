"""Gated activations (``act(gate) * up``) through the kernel registry."""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.quantized import Fp8Activation
from engine.kernels.registry import Kernels
from engine.layers.fp8_input import FeedsFp8, exact_fusion_reasons

# HF ``hidden_act`` names -> kernel op computing act(gate) * up on a [T, 2I] input.
_GATED_ACTS = {
    "silu": "silu_and_mul",
    "swish": "silu_and_mul",
    "gelu_pytorch_tanh": "gelu_tanh_and_mul",
    "gelu_tanh": "gelu_tanh_and_mul",
}
# The ops writing e4m3 per token for an FP8 linear (``engine.layers.fp8_input``).
_FP8_OPS = {"silu_and_mul": "silu_and_mul_quant_fp8"}


class GatedActivation(FeedsFp8, nn.Module):
    """``x [T, 2I]`` (gate then up) -> ``act(gate) * up [T, I]`` with one kernel call.

    Linked to the linear it feeds (``feed_fp8``), a SiLU activation returns an
    ``Fp8Activation`` whenever that linear takes one for this many rows."""

    def __init__(self, hidden_act: str, kernels: Kernels) -> None:
        super().__init__()
        if hidden_act not in _GATED_ACTS:
            raise ValueError(
                f"activation {hidden_act!r} is not supported; supported: "
                f"{', '.join(sorted(_GATED_ACTS))}"
            )
        self.hidden_act = hidden_act
        self.kernels = kernels
        self.op = getattr(kernels, _GATED_ACTS[hidden_act])

    def fp8_fusion_reasons(self) -> list[str]:
        """Why this activation cannot write e4m3 for an FP8 linear exactly as the linear would
        quantize it (empty: it can)."""
        plain = _GATED_ACTS[self.hidden_act]
        if plain not in _FP8_OPS:
            return [f"no kernel writes {self.hidden_act!r}-and-mul as FP8"]
        return exact_fusion_reasons(self.kernels, (plain, _FP8_OPS[plain]))

    def forward(self, x: torch.Tensor) -> torch.Tensor | Fp8Activation:
        if self._writes_fp8(x.numel() // x.shape[-1]):
            q, scale = getattr(self.kernels, _FP8_OPS[_GATED_ACTS[self.hidden_act]])(x)
            return Fp8Activation(q, scale, x.dtype)
        return self.op(x)

    def extra_repr(self) -> str:
        return self.hidden_act
