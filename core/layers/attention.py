"""The ``Attention`` layer: one model layer's view of the selected attention backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from engine.attention_backends.interface import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    """Paged attention for one layer.

    The model runner sets ``kv_cache`` (this layer's cache tensor) and ``kv_group`` (the index of
    its KV-cache group, i.e. which entry of the per-group metadata list it reads). q/k/v come in
    flat ([T, heads * head_size]) and the output leaves flat.

    ``sinks=True`` (GPT-OSS) gives the layer a float32 parameter ``sinks`` [num_heads] (this
    rank's heads; the model loads it, slicing it for tensor parallelism) of learned per-head
    logits that join each query's softmax (``attention_backends/interface.py``); the backend
    reads the same tensor as ``impl.sinks`` and must declare ``supports_attention_sinks``.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        num_kv_heads: int,
        scale: float,
        backend_cls: type[AttentionBackend],
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        sinks: bool = False,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        self.impl = backend_cls(
            num_heads, head_size, num_kv_heads, scale, sliding_window, logit_softcap
        )
        self.sinks: nn.Parameter | None = None
        if sinks:
            if not getattr(backend_cls, "supports_attention_sinks", False):
                raise ValueError(
                    f"attention backend {backend_cls.name} does not support attention sinks"
                )
            # float32 whatever the model dtype: the backends add it to float32 scores.
            self.sinks = nn.Parameter(
                torch.zeros(num_heads, dtype=torch.float32), requires_grad=False
            )
            # The same Parameter object: Module.to/_apply replace its data in place (or swap
            # its contents), so the backend sees the moved or loaded values. ``forward``
            # re-points it should anything install a new Parameter.
            self.impl.sinks = self.sinks
        self.kv_cache: torch.Tensor | None = None
        self.kv_group: int = 0

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_metadata: list[AttentionMetadata],
    ) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError("Attention.kv_cache is not set: the model runner allocates it")
        if self.impl.sinks is not self.sinks:  # a Parameter replaced after construction
            self.impl.sinks = self.sinks
        t = query.shape[0]
        out = self.impl.forward(
            query.view(t, self.num_heads, self.head_size),
            key.view(t, self.num_kv_heads, self.head_size),
            value.view(t, self.num_kv_heads, self.head_size),
            self.kv_cache,
            attn_metadata[self.kv_group],
        )
        return out.reshape(t, self.num_heads * self.head_size)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_size={self.head_size}, "
            f"window={self.sliding_window}, sinks={self.sinks is not None}, "
            f"backend={self.impl.name}"
        )
