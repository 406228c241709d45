"""Rotary position embedding (neox halves or GPT-J interleaved pairs, partial rotary).

One program per token rotates every query and key head of that token, so ``cos``/``sin`` are
read once per token. Dims past ``rot_dim`` are copied unchanged. Outputs are new contiguous
``[T, heads * head_size]`` tensors, as the reference returns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    src_stride,
    dst_stride,
    tok,
    cos,
    sin,
    num_heads,
    head_size,
    half,
    rot_dim,
    IS_NEOX: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    TAIL_PAD: tl.constexpr,
):
    heads = tl.arange(0, HEADS_PAD)[:, None]
    i = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < num_heads) & (i < half)
    if IS_NEOX:
        d1 = i
        d2 = i + half
    else:
        d1 = 2 * i
        d2 = 2 * i + 1
    src = src_ptr + tok * src_stride + heads * head_size
    dst = dst_ptr + tok * dst_stride + heads * head_size
    x1 = tl.load(src + d1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + d2, mask=mask, other=0.0).to(tl.float32)
    ty = dst_ptr.dtype.element_ty
    tl.store(dst + d1, (x1 * cos - x2 * sin).to(ty), mask=mask)
    tl.store(dst + d2, (x2 * cos + x1 * sin).to(ty), mask=mask)
    if TAIL_PAD > 0:  # partial rotary: copy the unrotated dims
        j = rot_dim + tl.arange(0, TAIL_PAD)[None, :]
        tmask = (heads < num_heads) & (j < head_size)
        tl.store(dst + j, tl.load(src + j, mask=tmask, other=0.0), mask=tmask)


@triton.jit
def _rotary_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    q_out_ptr,
    k_out_ptr,
    q_stride,
    k_stride,
    q_out_stride,
    k_out_stride,
    cache_stride,
    num_q_heads,
    num_k_heads,
    head_size,
    rot_dim,
    IS_NEOX: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    TAIL_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    half = rot_dim // 2
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    i = tl.arange(0, HALF_PAD)[None, :]
    cmask = i < half
    cos = tl.load(cache_ptr + pos * cache_stride + i, mask=cmask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * cache_stride + half + i, mask=cmask, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr, q_out_ptr, q_stride, q_out_stride, tok, cos, sin, num_q_heads, head_size, half,
        rot_dim, IS_NEOX, Q_HEADS_PAD, HALF_PAD, TAIL_PAD,
    )  # fmt: skip
    _rotate_heads(
        k_ptr, k_out_ptr, k_stride, k_out_stride, tok, cos, sin, num_k_heads, head_size, half,
        rot_dim, IS_NEOX, K_HEADS_PAD, HALF_PAD, TAIL_PAD,
    )  # fmt: skip


def _rows(x: torch.Tensor) -> torch.Tensor:
    x = x.reshape(x.shape[0], -1)
    return x if x.stride(-1) == 1 else x.contiguous()


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``engine.kernels.reference.rotary_embedding``: rotate the first ``rot_dim``
    (= ``cos_sin_cache.shape[-1]``) dims of every head; returns new (query, key)."""
    num_tokens = positions.shape[0]
    q, k = _rows(query), _rows(key)
    q_out = torch.empty((num_tokens, q.shape[1]), dtype=query.dtype, device=query.device)
    k_out = torch.empty((num_tokens, k.shape[1]), dtype=key.dtype, device=key.device)
    rot_dim = cos_sin_cache.shape[-1]
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    nq, nk = q.shape[1] // head_size, k.shape[1] // head_size
    tail = head_size - rot_dim
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            positions,
            q,
            k,
            cache,
            q_out,
            k_out,
            q.stride(0),
            k.stride(0),
            q_out.stride(0),
            k_out.stride(0),
            cache.stride(0),
            nq,
            nk,
            head_size,
            rot_dim,
            IS_NEOX=is_neox,
            Q_HEADS_PAD=triton.next_power_of_2(nq),
            K_HEADS_PAD=triton.next_power_of_2(nk),
            HALF_PAD=triton.next_power_of_2(max(rot_dim // 2, 1)),
            TAIL_PAD=triton.next_power_of_2(tail) if tail > 0 else 0,
            num_warps=4,
        )
    return q_out, k_out
