"""RMSNorm through the kernel registry (``rms_norm`` / ``fused_add_rms_norm``)."""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.registry import Kernels
from engine.layers.weight_utils import new_parameter


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim.

    ``forward(x)`` returns the normed ``x``; ``forward(x, residual)`` first adds ``x`` to the
    residual stream and returns ``(normed, new_residual)`` (one fused kernel call). With
    ``weight_offset=1.0`` the effective scale is ``1 + weight`` (Gemma's convention), computed in
    float32 from the checkpoint's weight.
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

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        if residual is None:
            # Per-head norms (q/k norm) pass a [T, H, D] view of the fused qkv output: rms_norm
            # normalises the last dim of any shape, so it goes in without a reshape (a copy).
            return self.kernels.rms_norm(x, self.scale(), self.eps).view(shape)
        x2 = x.reshape(-1, self.hidden_size)
        out, res = self.kernels.fused_add_rms_norm(
            x2, residual.reshape(-1, self.hidden_size), self.scale(), self.eps
        )
        return out.view(shape), res.view(shape)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, offset={self.weight_offset}"
