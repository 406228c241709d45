"""Rotary position embedding (neox halves or GPT-J interleaved pairs, partial rotary).

One program per token rotates every query and key head of that token, so ``cos``/``sin`` are
read once per token.

``rotary_embedding`` copies dims past ``rot_dim`` unchanged and returns new contiguous
``[T, heads * head_size]`` tensors, as its reference does. ``qk_norm_rotary`` first applies the
per-head q/k RMSNorm (Qwen3, Gemma 3) in registers and writes into the q/k slices of the qkv
output in place: one launch instead of three per layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_triton.kernels.pdl import pdl_launch, pdl_wait


def _contiguous_copy(x: torch.Tensor) -> torch.Tensor:
    """A new contiguous ``[T, heads * head_size]`` copy of ``x`` (one copy, whatever its
    layout)."""
    return x.clone(memory_format=torch.contiguous_format).view(x.shape[0], -1)


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
    # The fused kernel without norm weights, on copies: one rotary kernel to maintain.
    q_out, k_out = _contiguous_copy(query), _contiguous_copy(key)
    qk_norm_rotary(positions, q_out, k_out, cos_sin_cache, head_size, is_neox)
    return q_out, k_out


@triton.jit
def _norm_rotate_heads_in_place(
    ptr,
    stride,
    w_ptr,
    tok,
    cos,
    sin,
    num_heads,
    head_size,
    half,
    rot_dim,
    eps,
    HAS_NORM: tl.constexpr,
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
    row = ptr + tok * stride + heads * head_size
    ty = ptr.dtype.element_ty
    x1 = tl.load(row + d1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + d2, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        # The head's mean square covers all head_size dims, rotated or not; the rotated pair is
        # already in registers, so only a partial-rotary tail is read separately.
        sq = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        if TAIL_PAD > 0:
            j = rot_dim + tl.arange(0, TAIL_PAD)[None, :]
            tmask = (heads < num_heads) & (j < head_size)
            xt = tl.load(row + j, mask=tmask, other=0.0).to(tl.float32)
            sq += tl.sum(xt * xt, axis=1)
        r = tl.rsqrt(sq / head_size + eps)[:, None]
        w1 = tl.load(w_ptr + d1, mask=i < half, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + d2, mask=i < half, other=0.0).to(tl.float32)
        # Rounded to the activation dtype, as the separate rms_norm op hands it to rotary.
        x1 = (x1 * r * w1).to(ty).to(tl.float32)
        x2 = (x2 * r * w2).to(ty).to(tl.float32)
        if TAIL_PAD > 0:
            wt = tl.load(w_ptr + j, mask=j < head_size, other=0.0).to(tl.float32)
            tl.store(row + j, (xt * r * wt).to(ty), mask=tmask)
    # Without a norm a partial-rotary tail stays as it is: in place, nothing to copy.
    tl.store(row + d1, (x1 * cos - x2 * sin).to(ty), mask=mask)
    tl.store(row + d2, (x2 * cos + x1 * sin).to(ty), mask=mask)


# Positions may be a slice of a persistent buffer: do not compile a variant per alignment (see
# attention._prefill_kernel). The token count is the grid, never an argument, so a new batch
# size compiles nothing.
@triton.jit(do_not_specialize_on_alignment=["pos_ptr"])
def _qk_norm_rotary_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    q_w_ptr,
    k_w_ptr,
    q_stride,
    k_stride,
    cache_stride,
    num_q_heads,
    num_k_heads,
    head_size,
    rot_dim,
    eps,
    HAS_Q_NORM: tl.constexpr,
    HAS_K_NORM: tl.constexpr,
    IS_NEOX: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    half = rot_dim // 2
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    i = tl.arange(0, HALF_PAD)[None, :]
    cmask = i < half
    cos = tl.load(cache_ptr + pos * cache_stride + i, mask=cmask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * cache_stride + half + i, mask=cmask, other=0.0).to(tl.float32)
    _norm_rotate_heads_in_place(
        q_ptr, q_stride, q_w_ptr, tok, cos, sin, num_q_heads, head_size, half, rot_dim, eps,
        HAS_Q_NORM, IS_NEOX, Q_HEADS_PAD, HALF_PAD, TAIL_PAD,
    )  # fmt: skip
    _norm_rotate_heads_in_place(
        k_ptr, k_stride, k_w_ptr, tok, cos, sin, num_k_heads, head_size, half, rot_dim, eps,
        HAS_K_NORM, IS_NEOX, K_HEADS_PAD, HALF_PAD, TAIL_PAD,
    )  # fmt: skip


def _in_place_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[T, heads * head_size]`` rows with unit column stride that share its memory,
    or a contiguous copy when no such view exists (the caller copies the result back)."""
    if x.dim() == 2 and x.stride(-1) == 1:
        return x
    return x.reshape(x.shape[0], -1).contiguous()


def qk_norm_rotary(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    is_neox: bool = True,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``engine.kernels.reference.qk_norm_rotary``: per-head RMSNorm of q/k heads (when
    weights are given) then rotary, in one launch, written into ``query`` and ``key``."""
    num_tokens = positions.shape[0]
    q, k = _in_place_rows(query), _in_place_rows(key)
    rot_dim = cos_sin_cache.shape[-1]
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    q_w = q if q_weight is None else q_weight.contiguous()  # q/k: unread placeholders
    k_w = k if k_weight is None else k_weight.contiguous()
    nq, nk = q.shape[1] // head_size, k.shape[1] // head_size
    half_pad = triton.next_power_of_2(max(rot_dim // 2, 1))
    tail = head_size - rot_dim
    # One program holds every q head of its token: wide models get more warps so that each
    # thread keeps a few dozen values, not hundreds.
    num_warps = min(max(triton.next_power_of_2(nq) * half_pad // 1024, 4), 16)
    if num_tokens:
        _qk_norm_rotary_kernel[(num_tokens,)](
            positions,
            q,
            k,
            cache,
            q_w,
            k_w,
            q.stride(0),
            k.stride(0),
            cache.stride(0),
            nq,
            nk,
            head_size,
            rot_dim,
            eps,
            HAS_Q_NORM=q_weight is not None,
            HAS_K_NORM=k_weight is not None,
            IS_NEOX=is_neox,
            Q_HEADS_PAD=triton.next_power_of_2(nq),
            K_HEADS_PAD=triton.next_power_of_2(nk),
            HALF_PAD=half_pad,
            TAIL_PAD=triton.next_power_of_2(tail) if tail > 0 else 0,
            num_warps=num_warps,
            **pdl_launch(q.device),
        )
    if q is not query:
        query.copy_(q.view(query.shape))
    if k is not key:
        key.copy_(k.view(key.shape))
    return query, key
