"""The ``flash-attn`` attention backend: the ``flash_attn`` package's paged varlen kernel.

Offered only where ``flash_attn`` (FlashAttention 2.6 or newer) is importable. One
``flash_attn_varlen_func`` call covers a whole step, decodes and prefill chunks alike, reading
keys and values through the block table; its paged mode needs blocks of a multiple of 256
tokens (``--block-size 256``). The new keys and values are written first with the reference
scatter, into the engine's default cache layout, whose halves are exactly the
``[num_blocks, block_size, Hkv, D]`` caches that flash_attn reads.

Not exercised in this repository's tests (the package is not installed there); its shape
follows flash_attn's documented ``flash_attn_varlen_func`` arguments.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, ClassVar

from engine.attention_backends.interface import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    import torch


class FlashAttnBackend(AttentionBackend):
    """FlashAttention-2 paged varlen attention (GQA, sliding window, soft-cap)."""

    name: ClassVar[str] = "flash-attn"
    device_types: ClassVar[tuple[str, ...]] = ("cuda",)
    supported_dtypes: ClassVar[tuple[str, ...]] = ("bfloat16", "float16")
    supported_head_sizes: ClassVar[tuple[int, ...]] = (32, 64, 96, 128, 160, 192, 224, 256)
    supported_block_sizes: ClassVar[tuple[int, ...]] = (256, 512, 1024)
    supports_sliding_window: ClassVar[bool] = True
    supports_logit_softcap: ClassVar[bool] = True

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        if importlib.util.find_spec("flash_attn") is None:
            return ["flash_attn is not installed"]
        return []

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """See ``AttentionBackend.forward``."""
        import torch
        from flash_attn import flash_attn_varlen_func

        from engine.kernels.reference import write_kv_cache

        n = metadata.num_actual_tokens
        write_kv_cache(key[:n], value[:n], kv_cache, metadata.slot_mapping[:n])
        cu_k = torch.zeros(metadata.num_seqs + 1, dtype=torch.int32, device=query.device)
        torch.cumsum(metadata.seq_lens, dim=0, out=cu_k[1:])
        window = (self.sliding_window - 1, 0) if self.sliding_window else (-1, -1)
        out = torch.zeros_like(query)
        out[:n] = flash_attn_varlen_func(
            query[:n],
            kv_cache[0],
            kv_cache[1],
            cu_seqlens_q=metadata.query_start_loc,
            cu_seqlens_k=cu_k,
            max_seqlen_q=metadata.max_query_len,
            max_seqlen_k=metadata.max_seq_len,
            softmax_scale=self.scale,
            causal=True,
            window_size=window,
            softcap=self.logit_softcap or 0.0,
            block_table=metadata.block_table,
        )
        return out
