"""A float64 oracle for paged attention, and random paged batches to test kernels with.

Independent of every backend: it gathers each request's keys and values position by position
and applies the masks of ``engine.attention_backends.interface`` literally.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    """A random batch over a paged cache whose blocks are shuffled (tables are not ranges)."""

    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, Hkv, D] the new tokens' keys
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, page, Hkv, D], prefix already written
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: list[int]
    block_size: int
    num_decodes: int


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    device: str = "cpu",
    spare_blocks: int = 3,
) -> PagedBatch:
    """Random queries, keys and values; the cached prefix of every request is random too, the
    new tokens' slots are returned in ``slot_mapping`` but not yet written."""
    rnd = random.Random(torch.randint(0, 2**31, ()).item())
    need = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(need) + spare_blocks
    ids = list(range(num_blocks))
    rnd.shuffle(ids)
    tables, slots, at = [], [], 0
    for n_blocks, q_len, s_len in zip(need, query_lens, seq_lens, strict=True):
        table = ids[at : at + n_blocks]
        at += n_blocks
        tables.append(table)
        for p in range(s_len - q_len, s_len):
            slots.append(table[p // block_size] * block_size + p % block_size)
    t = sum(query_lens)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size).to(dtype)
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
        num_decodes += 1
    return PagedBatch(
        query=torch.randn(t, num_heads, head_size).to(dtype).to(device),
        key=torch.randn(t, num_kv_heads, head_size).to(dtype).to(device),
        value=torch.randn(t, num_kv_heads, head_size).to(dtype).to(device),
        kv_cache=kv_cache.to(device),
        query_lens=list(query_lens),
        seq_lens=list(seq_lens),
        block_tables=tables,
        slot_mapping=slots,
        block_size=block_size,
        num_decodes=num_decodes,
    )


def reference_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """float64 attention of every request's queries over its cached context: [T, H, D].

    With ``sinks`` (``[H]``, attention sinks) each request goes through the dense sink oracle of
    ``tests/test_attention_sinks.py`` (checked there against transformers' GPT-OSS attention)
    on the keys and values gathered here."""
    if sinks is not None:
        from test_attention_sinks import dense_sink_attention

        sinks = sinks.detach().cpu()
    query, kv_cache = query.cpu().double(), kv_cache.cpu().double()
    t, h, d = query.shape
    page, hkv = kv_cache.shape[2], kv_cache.shape[3]
    out = torch.zeros(t, h, d, dtype=torch.float64)
    start = 0
    for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
        pos = torch.arange(s_len)
        blocks = torch.tensor(table, dtype=torch.long)[pos // page]
        k = kv_cache[0][blocks, pos % page].repeat_interleave(h // hkv, dim=1)  # [L, H, D]
        v = kv_cache[1][blocks, pos % page].repeat_interleave(h // hkv, dim=1)
        q = query[start : start + q_len]
        if sinks is not None:
            kv = kv_cache[:, blocks, pos % page]  # [2, L, Hkv, D]
            out[start : start + q_len] = dense_sink_attention(
                q, kv[0], kv[1], scale, sinks, sliding_window or None, logit_softcap or None
            ).double()
            start += q_len
            continue
        s = torch.einsum("thd,lhd->htl", q, k) * scale
        if logit_softcap:
            s = logit_softcap * torch.tanh(s / logit_softcap)
        qp = torch.arange(s_len - q_len, s_len)[:, None]
        kp = pos[None, :]
        visible = kp <= qp
        if sliding_window:
            visible &= (qp - kp) < sliding_window
        s = s.masked_fill(~visible[None], float("-inf"))
        out[start : start + q_len] = torch.einsum("htl,lhd->thd", s.softmax(-1), v)
        start += q_len
    return out


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64; NaN anywhere gives inf."""
    out = out.detach().cpu().double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm()).item()


def worst_head_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest ``rel_error`` of one query head (``[T, H, D]``, each head's tokens
    together): a head whose output an attention sink shrinks to almost nothing is held to the
    same relative bound as the others, where one norm over all heads would hide its error."""
    out = out.detach().cpu().double()
    if not torch.isfinite(out).all():
        return float("inf")
    diff = (out - ref).transpose(0, 1).flatten(1).norm(dim=1)
    return (diff / ref.transpose(0, 1).flatten(1).norm(dim=1)).max().item()


# Relative-error bounds against the float64 oracle (METHOD.md's ranges).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


class CascadeLog:
    """What ``record_cascades`` saw: the length of every shared prefix the model runner chose
    (eager layouts and graph replays alike), of those replayed through a cascade graph, and
    how many ``paged_decode`` calls ran a shared pass (with graphs recorded, only their
    warm-up and capture calls reach Python)."""

    def __init__(self) -> None:
        self.lengths: list[int] = []
        self.graph_lengths: list[int] = []
        self.shared_passes = 0

    def clear(self) -> None:
        self.lengths.clear()
        self.graph_lengths.clear()
        self.shared_passes = 0


def record_cascades(monkeypatch, min_decodes: int, min_prefix: int = 256) -> CascadeLog:
    """Lower the triton backend's cascade thresholds to a test's batch (``min_decodes``
    holders, ``min_prefix`` tokens, no minimum saving) and record every shared prefix the
    model runner chose, and those replayed through cascade decode graphs."""
    import engine_triton.kernels.attention as attention
    from engine.cuda_graphs import DecodeGraphs
    from engine.model_runner import ModelRunner
    from engine_triton.attention import TritonAttentionBackend

    monkeypatch.setattr(TritonAttentionBackend, "cascade_min_decodes", min_decodes)
    monkeypatch.setattr(TritonAttentionBackend, "CASCADE_MIN_PREFIX", min_prefix)
    monkeypatch.setattr(TritonAttentionBackend, "CASCADE_MIN_SAVED", 0)
    log = CascadeLog()
    choose, replay = ModelRunner._cascade_prefix, DecodeGraphs.replay
    decode = attention.paged_decode

    def recording_decode(*args, **kwargs):
        log.shared_passes += kwargs.get("cascade_prefix") is not None
        return decode(*args, **kwargs)

    def recording_choose(self, *args, **kwargs):
        prefix = choose(self, *args, **kwargs)
        if prefix is not None:
            log.lengths.append(prefix.length)
        return prefix

    def recording_replay(self, *args, **kwargs):
        prefix = kwargs.get("shared_prefix", args[5] if len(args) > 5 else None)
        if prefix is not None:
            log.graph_lengths.append(prefix.length)
        return replay(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "_cascade_prefix", recording_choose)
    monkeypatch.setattr(DecodeGraphs, "replay", recording_replay)
    monkeypatch.setattr(attention, "paged_decode", recording_decode)
    return log
