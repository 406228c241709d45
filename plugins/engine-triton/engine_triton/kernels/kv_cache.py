"""The KV-cache write (``reshape_and_cache``): scatter each token's key/value to its slot.

Cache layout (the default of ``AttentionBackend.kv_cache_shape``):
``[2, num_blocks, block_size, num_kv_heads, head_size]``; slot ``s`` is row ``s`` of the
flattened ``[num_blocks * block_size, num_kv_heads * head_size]`` view. Negative slots mark
padding tokens and are skipped (every load and store of that program is masked off).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_triton.kernels.pdl import pdl_launch, pdl_wait


# The slot mapping is sliced past the decodes, so its alignment changes from step to step; do
# not compile a variant per alignment (see attention._prefill_kernel).
@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_ptr,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    half_stride,
    num_kv_heads,
    head_size,
    k_scale,
    v_scale,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    FP8: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, DIM_PAD)[None, :]
    mask = (h < num_kv_heads) & (d < head_size) & (slot >= 0)  # padding: no access at all
    slot = tl.maximum(slot, 0)
    row = num_kv_heads * head_size
    dst = cache_ptr + slot * row + h * head_size + d
    ty = cache_ptr.dtype.element_ty
    k = tl.load(k_ptr + tok * k_stride_t + h * k_stride_h + d, mask=mask)
    v = tl.load(v_ptr + tok * v_stride_t + h * v_stride_h + d, mask=mask)
    if FP8:  # e4m3 of value / scale, saturated (the reference's to_cache_dtype)
        k = _to_fp8(k, k_scale)
        v = _to_fp8(v, v_scale)
    tl.store(dst, k.to(ty), mask=mask)
    tl.store(dst + half_stride, v.to(ty), mask=mask)


@triton.jit
def _to_fp8(x, scale):
    y = tl.div_rn(x.to(tl.float32), scale)
    return tl.minimum(tl.maximum(y, -448.0), 448.0).to(tl.float8e4nv)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write key/value ``[T, num_kv_heads, head_size]`` into ``kv_cache`` at ``slot_mapping``
    (``[T]``; negative entries are skipped). In place. An FP8 cache stores ``key / k_scale``
    and ``value / v_scale`` in e4m3."""
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    num_kv_heads, head_size = kv_cache.shape[3], kv_cache.shape[4]
    key = key.view(key.shape[0], num_kv_heads, head_size) if key.dim() == 2 else key
    value = value.view(value.shape[0], num_kv_heads, head_size) if value.dim() == 2 else value
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    assert kv_cache.is_contiguous(), "the KV cache must be contiguous"
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        num_kv_heads,
        head_size,
        float(k_scale),
        float(v_scale),
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_size),
        FP8=kv_cache.dtype == torch.float8_e4m3fn,
        num_warps=4,
        **pdl_launch(key.device),
    )
