"""The portable torch reference paged-attention backend (``--attention-backend torch``).

This backend is the executable spec of the conventions in ``interface.py``: every other backend
is tested against it. It runs on any torch device and dtype and favours plain, checkable torch
over speed, while staying usable on a CPU:

* all decodes of a step are attended together: their keys/values are gathered through the block
  tables into one padded ``[B, Hkv, L, D]`` tensor with a visibility mask, one attention call;
* each prefill chunk gathers its own context (cached prefix plus the new tokens) and runs one
  attention call with an explicit mask (``is_causal`` when there is no prefix to see).

Scores, softmax and the weighted sum run in float32 whatever the model dtype, so bf16/fp16
results differ from an exact computation only by the final rounding. Soft-capping and attention
sinks (``self.sinks``: one more float32 score per query head, with no value) take an explicit
scores-then-softmax path instead of SDPA. An FP8 cache (``--kv-cache-dtype fp8``: e4m3; the
conformance kit also runs e4m3fnuz and e5m2) holds ``key / k_scale`` and ``value / v_scale`` in
that dtype; they are multiplied back as they are gathered.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from engine.attention_backends.interface import AttentionBackend, AttentionMetadata
from engine.kernels.reference import from_cache_dtype, write_kv_cache


def _select(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``cache.index_select(0, index)``; an FP8 cache is gathered as bytes (portable)."""
    if cache.element_size() == 1 and cache.is_floating_point():
        return cache.view(torch.uint8).index_select(0, index).view(cache.dtype)
    return cache.index_select(0, index)


class TorchReferenceBackend(AttentionBackend):
    """Reference paged attention in plain torch: any device, fp32/bf16/fp16, GQA, sliding window,
    logit soft-capping, attention sinks and bidirectional spans."""

    name: ClassVar[str] = "torch"
    # Plain torch ops only, so any device torch can drive (ROCm presents itself as "cuda").
    device_types: ClassVar[tuple[str, ...]] = ("cpu", "cuda", "xla", "mps", "xpu", "hpu", "npu")
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16", "float16")
    supports_sliding_window: ClassVar[bool] = True
    supports_logit_softcap: ClassVar[bool] = True
    supports_bidirectional_spans: ClassVar[bool] = True
    supports_attention_sinks: ClassVar[bool] = True
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = (
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
    )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """See ``AttentionBackend.forward``."""
        self._write_kv(key, value, kv_cache, metadata)
        # Rows past num_actual_tokens (padding) stay zero.
        out = torch.zeros_like(query)
        qsl = metadata.query_start_loc_cpu
        seq_lens = metadata.seq_lens_cpu
        nd = metadata.num_decodes
        if nd:
            out[:nd] = self._decode(query[:nd], kv_cache, metadata, seq_lens[:nd])
        for i in range(nd, metadata.num_seqs):
            lo, hi = qsl[i], qsl[i + 1]
            if hi > lo:
                out[lo:hi] = self._prefill(query[lo:hi], kv_cache, metadata, i, seq_lens[i])
        return out

    # ---- helpers (``_write_kv`` and ``_decode`` are what a faster subclass overrides) ---------
    def _write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        """The step's keys and values (its first ``num_actual_tokens`` rows) into the cache."""
        num_tokens = metadata.num_actual_tokens
        write_kv_cache(
            key[:num_tokens],
            value[:num_tokens],
            kv_cache,
            metadata.slot_mapping[:num_tokens],
            self.k_scale,
            self.v_scale,
        )

    def _window_start(self, first_query_pos: int) -> int:
        """The first key position any query at or after ``first_query_pos`` can see."""
        if self.sliding_window is None:
            return 0
        return max(0, first_query_pos - self.sliding_window + 1)

    def _gather(
        self,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        first_block: torch.Tensor,
        num_blocks: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gather ``num_blocks`` consecutive logical blocks per row, starting at ``first_block``.

        block_table: int32 [B, W]; first_block: int64 [B]. Returns keys and values
        [B, Hkv, num_blocks * block_size, D] and the logical key positions [B, L] of each
        gathered slot (which the caller masks against the sequence length and window).
        """
        block_size = kv_cache.shape[2]
        logical = first_block[:, None] + torch.arange(num_blocks, device=block_table.device)
        # Logical blocks past a table's end, and placeholder ids of blocks that fell out of a
        # sliding window, are only ever masked out: clamp them to valid indices for the gather.
        idx = logical.clamp(max=block_table.shape[1] - 1)
        physical = block_table.gather(1, idx).long().clamp(0, kv_cache.shape[1] - 1)
        b = physical.shape[0]
        flat = physical.flatten()
        # index_select rather than advanced indexing: the same gather, far faster on CPU. An
        # fp8 cache is gathered as bytes (portable) and read back as float32, times the
        # layer's scales.
        shape = (b, num_blocks * block_size, *kv_cache.shape[3:])
        keys = _select(kv_cache[0], flat).view(shape)
        values = _select(kv_cache[1], flat).view(shape)
        if kv_cache.element_size() == 1:  # an fp8 cache: scaled values
            keys = from_cache_dtype(keys, torch.float32, self.k_scale)
            values = from_cache_dtype(values, torch.float32, self.v_scale)
        positions = (
            logical[:, :, None] * block_size + torch.arange(block_size, device=logical.device)
        ).view(b, -1)
        return keys.transpose(1, 2), values.transpose(1, 2), positions

    def _visible(
        self, query_pos: torch.Tensor, key_pos: torch.Tensor, key_limit: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Mask [..., Lq, Lk]: True where a query at ``query_pos`` [..., Lq] sees a key at
        ``key_pos`` [..., Lk] (causal, plus the sliding window when set). ``key_limit``
        [..., Lq], when given, is the last key position each query sees (its own position, or
        the end of its bidirectional span minus one)."""
        q = query_pos[..., :, None]
        k = key_pos[..., None, :]
        mask = k <= (q if key_limit is None else key_limit[..., :, None])
        if self.sliding_window is not None:
            mask &= (q - k) < self.sliding_window
        return mask

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """q: [B, H, Lq, D]; k, v: [B, Hkv, Lk, D]; mask: bool [B, Lq, Lk] or None for plain
        causal attention with Lq == Lk. Returns [B, H, Lq, D] in float32."""
        q, k, v = q.float(), k.float(), v.float()
        if self.logit_softcap is None and self.sinks is None:
            attn_mask = None if mask is None else mask[:, None]
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=attn_mask,
                is_causal=mask is None,
                scale=self.scale,
                enable_gqa=k.shape[1] != q.shape[1],
            )
        # Soft-capping sits between the scores and the softmax, and a sink is one more column
        # of the softmax: SDPA exposes neither.
        b, h, lq, d = q.shape
        hkv = k.shape[1]
        group = h // hkv
        qg = q.reshape(b, hkv, group * lq, d)  # query head h uses kv head h // (h // hkv)
        scores = torch.matmul(qg, k.transpose(-1, -2)) * self.scale
        if self.logit_softcap is not None:
            scores = self.logit_softcap * torch.tanh(scores / self.logit_softcap)
        if mask is None:
            lk = k.shape[2]
            mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)[None]
        mask = mask[:, None, None].expand(b, hkv, group, lq, -1).reshape(b, hkv, -1, mask.shape[-1])
        scores = scores.masked_fill(~mask, float("-inf"))
        if self.sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            # Row (kv head kh, query head kh * group + g, query i) gets sinks[kh * group + g] as
            # an extra, never-masked, value-less score, in float32 (not soft-capped).
            sink = self.sinks.to(device=q.device, dtype=torch.float32).view(1, hkv, group, 1, 1)
            sink = sink.expand(b, hkv, group, lq, 1).reshape(b, hkv, group * lq, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        return torch.matmul(probs, v).reshape(b, h, lq, d)

    def _decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        seq_lens: list[int],
    ) -> torch.Tensor:
        """All decodes at once. query: [B, H, D] -> [B, H, D]."""
        bs = md.block_size
        b = query.shape[0]
        device = query.device
        first = [self._window_start(n - 1) // bs for n in seq_lens]
        last = [(n - 1) // bs for n in seq_lens]
        num_blocks = max(hi - lo for lo, hi in zip(first, last, strict=True)) + 1
        keys, values, key_pos = self._gather(
            kv_cache,
            md.block_table[:b],
            torch.tensor(first, dtype=torch.long, device=device),
            num_blocks,
        )
        query_pos = md.seq_lens[:b].long()[:, None] - 1  # [B, 1]
        mask = self._visible(query_pos, key_pos)  # [B, 1, L]
        out = self._attend(query[:, :, None, :], keys, values, mask)
        return out[:, :, 0, :].to(query.dtype)

    def _prefill(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        i: int,
        seq_len: int,
    ) -> torch.Tensor:
        """One request's chunk. query: [Lq, H, D] -> [Lq, H, D]."""
        bs = md.block_size
        lq = query.shape[0]
        device = query.device
        first_pos = seq_len - lq
        first = self._window_start(first_pos) // bs
        num_blocks = (seq_len - 1) // bs - first + 1
        keys, values, key_pos = self._gather(
            kv_cache,
            md.block_table[i : i + 1],
            torch.tensor([first], dtype=torch.long, device=device),
            num_blocks,
        )
        lk = seq_len - first * bs
        keys, values, key_pos = keys[:, :, :lk], values[:, :, :lk], key_pos[:, :lk]
        q = query.transpose(0, 1)[None]  # [1, H, Lq, D]
        spans = md.bidirectional_spans_cpu[i] if md.bidirectional_spans_cpu else None
        if lk == lq and self.sliding_window is None and not spans:
            mask = None  # no prefix: plain causal attention over the new tokens
        else:
            query_pos = torch.arange(first_pos, seq_len, device=device)[None]
            limit = None
            if spans:
                limit = query_pos.clone()
                for start, end in spans:  # queries in [start, end) see keys up to end - 1
                    lo, hi = max(start, first_pos) - first_pos, min(end, seq_len) - first_pos
                    if hi > lo:
                        limit[:, lo:hi] = min(end, seq_len) - 1
            mask = self._visible(query_pos, key_pos, limit)
        out = self._attend(q, keys, values, mask)
        return out[0].transpose(0, 1).to(query.dtype)
