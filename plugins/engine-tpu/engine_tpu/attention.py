"""Attention backends for XLA devices.

* ``xla`` — paged attention written for XLA: no data-dependent Python control flow and no
  host round trip, only tensor ops whose shapes are those of the inputs, so with the runner's
  shape buckets (``engine.shape_buckets``) one graph serves every step of a bucket. Each token
  gathers its request's context through the block table (``[T, W * block_size]`` keys per
  layer), which is simple and exact but costs memory linear in tokens times context: it is the
  portable path (XLA's CPU device, tests) and the fall-back where the Pallas kernel is absent.
* ``pallas`` — torch_xla's ``ragged_paged_attention`` (the Pallas TPU kernel), on TPUs only.
  Its KV cache interleaves keys and values along the head dimension, as the kernel reads it.
  It has not run on a TPU in this repository's CI (docs/testing.md says so).

Both write the step's keys and values first. A negative slot must not be written; without a
branch on device data, such tokens write the same value as the step's first real token to that
token's own slot (or, in a step with no real token, slot 0's current value back), so duplicate
writes agree and nothing outside the real slots changes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from engine.attention_backends.interface import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    import torch


def _pjrt_device() -> str:
    import os

    return os.environ.get("PJRT_DEVICE", "").strip().upper()


def write_slots(flat: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
    """``flat[slots[t]] = values[t]`` for ``slots[t] >= 0``, in place, with static shapes.

    flat: [S, ...]; values: [T, ...] (cast to flat's dtype); slots: int64 [T]."""
    import torch

    values = values.to(flat.dtype)
    valid = slots >= 0
    # The first real token (0 when there is none), as a 1-element index: indexing with a 0-dim
    # tensor would turn it into a Python int, a device-to-host sync in the middle of the graph.
    first = torch.argmax(valid.to(torch.int32)).view(1)
    any_valid = valid.any()
    target = torch.where(valid, slots, slots.index_select(0, first).clamp(min=0))
    fill = torch.where(any_valid, values.index_select(0, first)[0], flat[0])  # padding writes
    target = torch.where(any_valid, target, torch.zeros_like(target))
    shape = (-1,) + (1,) * (values.dim() - 1)
    flat.index_copy_(0, target, torch.where(valid.view(shape), values, fill.unsqueeze(0)))


class XlaAttentionBackend(AttentionBackend):
    """Paged attention in plain torch ops with static shapes (GQA, sliding window, soft-cap)."""

    name: ClassVar[str] = "xla"
    device_types: ClassVar[tuple[str, ...]] = ("xla", "cpu")
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16", "float16")
    supports_sliding_window: ClassVar[bool] = True
    supports_logit_softcap: ClassVar[bool] = True

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """See ``AttentionBackend.forward``. Reads only the metadata's tensors, never its
        Python numbers, so the graph depends on shapes alone."""
        import torch

        num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
        flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
        slots = metadata.slot_mapping
        t = query.shape[0]
        write_slots(flat[0], key[: slots.shape[0]], slots)
        write_slots(flat[1], value[: slots.shape[0]], slots)

        device = query.device
        qsl = metadata.query_start_loc.long()
        seq_lens = metadata.seq_lens.long()
        table = metadata.block_table.long()
        b, width = table.shape
        tok = torch.arange(t, device=device)
        # Each token's request: how many requests end at or before it (searchsorted has no XLA
        # lowering and would run on the host, a sync in every layer).
        req = (tok[:, None] >= qsl[None, 1:]).sum(dim=1).clamp(max=b - 1)
        real = tok < qsl[-1]
        q_pos = seq_lens[req] - (qsl[req + 1] - tok)  # each token's position in its sequence

        ctx = width * block_size
        ctx_slots = table[:, :, None] * block_size + torch.arange(block_size, device=device)
        ctx_slots = ctx_slots.reshape(b, ctx)
        tok_slots = ctx_slots.index_select(0, req).reshape(-1)  # [T * ctx]
        hkv, d = kv_cache.shape[3], kv_cache.shape[4]
        keys = flat[0].index_select(0, tok_slots).view(t, ctx, hkv, d).float()
        values = flat[1].index_select(0, tok_slots).view(t, ctx, hkv, d).float()

        key_pos = torch.arange(ctx, device=device)
        visible = (key_pos[None, :] <= q_pos[:, None]) & real[:, None]
        if self.sliding_window is not None:
            visible &= (q_pos[:, None] - key_pos[None, :]) < self.sliding_window

        group = self.num_heads // self.num_kv_heads
        q = query.float().view(t, hkv, group, d)
        scores = torch.einsum("tkgd,tlkd->tkgl", q, keys) * self.scale
        if self.logit_softcap is not None:
            scores = self.logit_softcap * torch.tanh(scores / self.logit_softcap)
        # A finite floor, not -inf: padding tokens see nothing, and their rows are zeroed below.
        floor = torch.finfo(torch.float32).min
        scores = scores.masked_fill(~visible[:, None, None, :], floor)
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("tkgl,tlkd->tkgd", probs, values).reshape(t, self.num_heads, d)
        out = torch.where(real[:, None, None], out, torch.zeros_like(out))
        return out.to(query.dtype)


class PallasAttentionBackend(AttentionBackend):
    """torch_xla's ``ragged_paged_attention`` Pallas kernel (TPU only)."""

    name: ClassVar[str] = "pallas"
    device_types: ClassVar[tuple[str, ...]] = ("xla",)
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")
    supports_sliding_window: ClassVar[bool] = True
    supports_logit_softcap: ClassVar[bool] = True

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        from engine.platforms.detect import module_available

        if not module_available("torch_xla"):
            return ["torch_xla is not installed"]
        if _pjrt_device() not in ("", "TPU"):
            return [
                f"the Pallas kernel runs on TPUs only (PJRT_DEVICE={_pjrt_device()}); "
                "use the 'xla' backend"
            ]
        return []

    @classmethod
    def kv_cache_shape(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """The kernel's layout: ``[num_blocks, block_size, 2 * num_kv_heads, head_size]`` with
        keys at even and values at odd head indices."""
        return (num_blocks, block_size, 2 * num_kv_heads, head_size)

    @classmethod
    def copy_blocks(cls, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        kv_cache[dst] = kv_cache[src]  # the block dimension is dim 0 here

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
        from torch_xla.experimental.custom_kernel import ragged_paged_attention

        num_blocks, block_size, combined, d = kv_cache.shape
        slots = metadata.slot_mapping
        n = slots.shape[0]
        kv = torch.stack((key[:n], value[:n]), dim=2).reshape(n, combined, d)  # k0 v0 k1 v1 ..
        write_slots(kv_cache.view(num_blocks * block_size, combined, d), kv, slots)
        num_seqs = torch.tensor([metadata.num_seqs], dtype=torch.int32, device=query.device)
        out = ragged_paged_attention(
            query,
            kv_cache,
            metadata.seq_lens,
            metadata.block_table,
            metadata.query_start_loc,
            num_seqs,
            sm_scale=self.scale,
            sliding_window=self.sliding_window,
            soft_cap=self.logit_softcap,
        )
        return out.to(query.dtype)
