"""The ``sdpa`` attention backend: paged attention through ``torch.nn.functional``'s
``scaled_dot_product_attention``, one request at a time.

A fall-back for CUDA devices where Triton is missing: each request's context is gathered from
the paged cache through its block table into a dense ``[Hkv, L, D]`` tensor, a boolean mask
expresses causality over the cached prefix and the sliding window, and SDPA (which picks a
fused kernel for the dense problem) attends. Soft-capping has no SDPA form, so those models take
an explicit float32 softmax instead. Correctness over speed: the loop over requests runs in
Python and the backend is never captured in a CUDA graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from engine.attention_backends.interface import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    import torch


class SdpaAttentionBackend(AttentionBackend):
    """Gather-then-SDPA paged attention (GQA, sliding window, soft-cap, bidirectional spans);
    CUDA and CPU."""

    name: ClassVar[str] = "sdpa"
    device_types: ClassVar[tuple[str, ...]] = ("cuda", "cpu")
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16", "float16")
    supports_sliding_window: ClassVar[bool] = True
    supports_logit_softcap: ClassVar[bool] = True
    supports_bidirectional_spans: ClassVar[bool] = True

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

        from engine.kernels.reference import write_kv_cache

        n = metadata.num_actual_tokens
        write_kv_cache(key[:n], value[:n], kv_cache, metadata.slot_mapping[:n])
        out = torch.zeros_like(query)
        qsl, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        page = kv_cache.shape[2]
        for i in range(metadata.num_seqs):
            lo, hi, seq_len = qsl[i], qsl[i + 1], seq_lens[i]
            if hi == lo:
                continue
            positions = torch.arange(seq_len, device=query.device)
            blocks = metadata.block_table[i, : (seq_len + page - 1) // page].long()
            slots = blocks[positions // page] * page + positions % page
            flat = kv_cache.flatten(1, 2)  # [2, num_blocks * page, Hkv, D]
            k = flat[0, slots].transpose(0, 1)  # [Hkv, L, D]
            v = flat[1, slots].transpose(0, 1)
            q = query[lo:hi].transpose(0, 1)  # [H, q_len, D]
            q_pos = positions[seq_len - (hi - lo) :, None]
            limit = q_pos
            spans = metadata.bidirectional_spans_cpu
            if spans and spans[i]:
                limit = q_pos.clone()
                first = seq_len - (hi - lo)
                for start, end in spans[i]:  # queries in a span see keys up to its end
                    a, b = max(start, first) - first, min(end, seq_len) - first
                    if b > a:
                        limit[a:b] = min(end, seq_len) - 1
            mask = positions[None, :] <= limit
            if self.sliding_window:
                mask &= q_pos - positions[None, :] < self.sliding_window
            out[lo:hi] = self._attend(q, k, v, mask).transpose(0, 1)
        return out

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        import torch
        import torch.nn.functional as F

        group = self.num_heads // self.num_kv_heads
        if group > 1:
            k = k.repeat_interleave(group, dim=0)
            v = v.repeat_interleave(group, dim=0)
        if not self.logit_softcap:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        scores = torch.einsum("hqd,hkd->hqk", q.float(), k.float()) * self.scale
        scores = self.logit_softcap * torch.tanh(scores / self.logit_softcap)
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        return torch.einsum("hqk,hkd->hqd", probs, v.float()).to(q.dtype)
