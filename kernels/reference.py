"""Torch reference implementations of the named kernels: the spec every override must match.

All ops are functional (they return new tensors) except ``write_kv_cache`` and
``qk_norm_rotary``, which write in place. Norms compute in float32 and cast back to the input
dtype. The quantized matmuls (``fp8_linear``, ``fp8_block_linear``, ``int8_linear``,
``wna16_linear``) are specified in ``engine.kernels.quantized``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.gguf import gguf_linear
from engine.kernels.quantized import QUANTIZED_REFERENCE_KERNELS


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim. x: [T, H] (or any leading
    shape, possibly a strided view such as per-head [T, heads, head_size]), weight: [H]."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * weight.float()).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual``; returns ``(rms_norm(residual), residual)``."""
    summed = (x.float() + residual.float()).to(x.dtype)
    return rms_norm(summed, weight, eps), summed


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding on the first ``rot_dim`` dims of each head.

    positions: int64 [T]; query: [T, num_heads * head_size]; key: [T, num_kv_heads * head_size];
    cos_sin_cache: float32 [max_position, rot_dim] holding ``cos`` (rot_dim/2) then ``sin``
    (rot_dim/2). ``is_neox`` rotates halves (Llama/Qwen/Gemma in HF layout); otherwise
    interleaved pairs (GPT-J). Returns new (query, key) in the input dtype.
    """
    rot_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)  # [T, rot_dim/2]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        x = x.view(t, -1, head_size)
        rot, rest = x[..., :rot_dim].float(), x[..., rot_dim:]
        c, s = cos[:, None, :], sin[:, None, :]
        if is_neox:
            x1, x2 = rot.chunk(2, dim=-1)
            out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
        return torch.cat((out.to(x.dtype), rest), dim=-1).view(t, -1)

    return rotate(query), rotate(key)


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
    """Per-head RMSNorm of the query heads (when ``q_weight`` is given) and of the key heads
    (when ``k_weight`` is given), then ``rotary_embedding``, written **in place** into ``query``
    and ``key``, which are returned.

    Exactly ``rms_norm`` over each head (weights ``[head_size]``, one ``eps``; the normed value
    is rounded to the activation dtype, as the separate op returns it) followed by
    ``rotary_embedding`` with the same arguments. ``query``/``key`` are ``[T, heads *
    head_size]``, typically column slices of a fused qkv projection's output (strided rows):
    fusing the three ops saves two launches per layer (Qwen3's q_norm/k_norm), and without
    weights it is rotary alone, in place.
    """
    t = query.shape[0]
    q, k = query, key
    if q_weight is not None:
        q = rms_norm(q.unflatten(-1, (-1, head_size)), q_weight, eps).view(t, -1)
    if k_weight is not None:
        k = rms_norm(k.unflatten(-1, (-1, head_size)), k_weight, eps).view(t, -1)
    q, k = rotary_embedding(positions, q, k, cos_sin_cache, head_size, is_neox)
    query.copy_(q)
    key.copy_(k)
    return query, key


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] (gate then up) -> silu(gate) * up: [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] (gate then up) -> gelu_tanh(gate) * up: [T, I] (Gemma's GeGLU)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Scatter key/value ([T, num_kv_heads, head_size]) into ``kv_cache``
    ([2, num_blocks, block_size, num_kv_heads, head_size]) at ``slot_mapping`` (int64 [T]);
    negative slots (padding) are skipped.

    An FP8 cache (``float8_e4m3fn``, ``--kv-cache-dtype fp8``) stores ``key / k_scale`` and
    ``value / v_scale`` rounded to e4m3 and saturated at +-448; readers multiply back. Other
    caches store the values cast to their dtype (the scales are not used)."""
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    k = to_cache_dtype(key, kv_cache.dtype, k_scale)
    v = to_cache_dtype(value, kv_cache.dtype, v_scale)
    if kv_cache.dtype == torch.float8_e4m3fn:  # index_copy_ has no FP8 kernels: copy the bytes
        flat, k, v = flat.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``x`` as stored in a KV cache of ``dtype``: FP8 caches hold ``x / scale`` saturated."""
    if dtype == torch.float8_e4m3fn:
        return (x.float() / scale).clamp(-448.0, 448.0).to(dtype)
    return x.to(dtype)


def from_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Cached keys/values in ``dtype`` (an FP8 cache's are multiplied back by ``scale``)."""
    if x.dtype == torch.float8_e4m3fn:
        return (x.float() * scale).to(dtype)
    return x.to(dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight^T + bias``: x [..., K], weight [N, K] (as ``nn.Linear`` stores it), bias [N]
    or None; the result is in x's dtype. Exactly ``torch.nn.functional.linear``."""
    return F.linear(x, weight, bias)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits: [N, V] float (rows may be a strided view, unit stride along V) -> int64 [N]: the
    index of each row's maximum, the first (lowest) one when tied. Exactly
    ``torch.argmax(logits, dim=-1)``: a NaN counts as the maximum, an all -inf row gives 0."""
    return torch.argmax(logits, dim=-1)


REFERENCE_KERNELS = {
    **QUANTIZED_REFERENCE_KERNELS,
    "gguf_linear": gguf_linear,
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "rotary_embedding": rotary_embedding,
    "qk_norm_rotary": qk_norm_rotary,
    "silu_and_mul": silu_and_mul,
    "gelu_tanh_and_mul": gelu_tanh_and_mul,
    "write_kv_cache": write_kv_cache,
    "linear": linear,
    "argmax": argmax,
}
