"""RMSNorm through the kernel registry (``rms_norm`` / ``fused_add_rms_norm``, and their
``*_quant_fp8`` forms when it feeds an FP8 linear: ``engine.layers.fp8_input``)."""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.quantized import Fp8Activation
from engine.kernels.registry import Kernels
from engine.layers.fp8_input import FeedsFp8, exact_fusion_reasons
from engine.layers.weight_utils import new_parameter


class RMSNorm(FeedsFp8, nn.Module):
    """Root-mean-square norm over the last dim.

    ``forward(x)`` returns the normed ``x``; ``forward(x, residual)`` first adds ``x`` to the
    residual stream and returns ``(normed, new_residual)`` (one fused kernel call). With
    ``weight_offset=1.0`` the effective scale is ``1 + weight`` (Gemma's convention), computed in
    float32 from the checkpoint's weight.

    Linked to the one linear its output feeds (``feed_fp8``; ``engine.layers.fp8_input``),
    it returns an ``Fp8Activation`` in place of the normed ``x`` whenever that linear takes
    one for this many rows (the residual is returned as before).
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        kernels: Kernels,
        dtype: torch.dtype | None = None,
        weight_offset: float = 0.0,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.kernels = kernels
        self.weight_offset = weight_offset
        self.weight = new_parameter((hidden_size,), dtype)

    def scale(self) -> torch.Tensor:
        """The effective weight the kernels multiply by (``weight``, or ``weight + offset`` in
        float32)."""
        if self.weight_offset:
            return self.weight.float() + self.weight_offset
        return self.weight

    def fp8_fusion_reasons(self) -> list[str]:
        """Why this norm cannot write its output as e4m3 for an FP8 linear, exactly as the
        linear would quantize it (empty: it can)."""
        return exact_fusion_reasons(
            self.kernels,
            ("rms_norm", "rms_norm_quant_fp8"),
            ("fused_add_rms_norm", "fused_add_rms_norm_quant_fp8"),
        )

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | Fp8Activation | tuple[torch.Tensor | Fp8Activation, torch.Tensor]:
        shape = x.shape
        if self._writes_fp8(x.numel() // self.hidden_size):
            return self._forward_fp8(x, residual)
        if residual is None:
            # Per-head norms (q/k norm) pass a [T, H, D] view of the fused qkv output: rms_norm
            # normalises the last dim of any shape, so it goes in without a reshape (a copy).
            return self.kernels.rms_norm(x, self.scale(), self.eps).view(shape)
        x2 = x.reshape(-1, self.hidden_size)
        out, res = self.kernels.fused_add_rms_norm(
            x2, residual.reshape(-1, self.hidden_size), self.scale(), self.eps
        )
        return out.view(shape), res.view(shape)

    def _forward_fp8(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> Fp8Activation | tuple[Fp8Activation, torch.Tensor]:
        shape = x.shape
        x2 = x.reshape(-1, self.hidden_size)
        if residual is None:
            q, scale = self.kernels.rms_norm_quant_fp8(x2, self.scale(), self.eps)
            return Fp8Activation(q.view(shape), scale, x.dtype)
        q, scale, res = self.kernels.fused_add_rms_norm_quant_fp8(
            x2, residual.reshape(-1, self.hidden_size), self.scale(), self.eps
        )
        return Fp8Activation(q.view(shape), scale, x.dtype), res.view(shape)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, offset={self.weight_offset}"
