"""Token embedding and the LM head (tied to the embedding or separate)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.registry import Kernels
from engine.layers.linear import linear_op
from engine.layers.weight_utils import new_parameter


class VocabEmbedding(nn.Module):
    """Token id -> vector. ``embed_scale`` multiplies the result, rounded to the weight dtype
    first (Gemma scales by ``sqrt(hidden_size)`` that way)."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype | None = None,
        embed_scale: float | None = None,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.embed_scale = embed_scale
        self.weight = new_parameter((vocab_size, hidden_size), dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(input_ids, self.weight)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype, device=x.device)
        return x


class LMHead(nn.Module):
    """hidden [N, H] -> float32 logits [N, V]. ``tie(embedding)`` shares the embedding matrix;
    ``final_logit_softcap`` applies ``cap * tanh(logits / cap)`` (Gemma 2). The product goes
    through ``kernels.linear`` when ``kernels`` is given, else ``F.linear``."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype | None = None,
        final_logit_softcap: float | None = None,
        *,
        kernels: Kernels | None = None,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.final_logit_softcap = final_logit_softcap
        self.weight = new_parameter((vocab_size, hidden_size), dtype)
        self._linear = linear_op(kernels)

    def tie(self, embedding: VocabEmbedding) -> None:
        """Use the embedding's weight as the output projection (no copy)."""
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """Logits in float32, or with ``float32=False`` in the weights' dtype when no softcap
        applies (enough for an argmax, and it skips converting [N, V])."""
        return self.finish_logits(self._linear(hidden, self.weight, None), float32)

    def finish_logits(self, logits: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """The upcast and softcap applied to raw ``hidden @ weight.T`` logits."""
        if not float32 and self.final_logit_softcap is None:
            return logits
        logits = logits.float()
        if self.final_logit_softcap is not None:
            cap = self.final_logit_softcap
            logits = cap * torch.tanh(logits / cap)
        return logits
