"""Torch reference implementations of the named kernels: the spec every override must match.

All ops are functional (they return new tensors) except ``write_kv_cache`` and
``qk_norm_rotary``, which write in place. Norms compute in float32 and cast back to the input
dtype.

Mixture-of-experts: ``moe_topk_softmax`` routes (softmax over the experts in float32, top-k,
optional renormalisation) and ``fused_moe`` runs the routed experts (gate/up, SiLU-and-mul,
down, weighted sum over the top-k). The reference groups the token/expert pairs by expert with
one sort and runs one matmul pair per expert that received tokens: no loop over tokens, and
the weights of experts nobody chose are never read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter key/value ([T, num_kv_heads, head_size]) into ``kv_cache``
    ([2, num_blocks, block_size, num_kv_heads, head_size]) at ``slot_mapping`` (int64 [T]);
    negative slots (padding) are skipped. Values are cast to the cache's dtype (an fp8 cache
    stores them rounded, unscaled)."""
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    key, value = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
    if kv_cache.element_size() == 1:  # an fp8 cache: CPU index kernels have no float8 versions
        flat, key, value = flat.view(torch.uint8), key.view(torch.uint8), value.view(torch.uint8)
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight^T + bias``: x [..., K], weight [N, K] (as ``nn.Linear`` stores it), bias [N]
    or None; the result is in x's dtype. Exactly ``torch.nn.functional.linear``."""
    return F.linear(x, weight, bias)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits: [N, V] float (rows may be a strided view, unit stride along V) -> int64 [N]: the
    index of each row's maximum, the first (lowest) one when tied. Exactly
    ``torch.argmax(logits, dim=-1)``: a NaN counts as the maximum, an all -inf row gives 0."""
    return torch.argmax(logits, dim=-1)


def moe_topk_softmax(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing: router_logits [T, E] (any float dtype) -> ``(topk_weights, topk_ids)``,
    float32 [T, top_k] and int32 [T, top_k], in descending weight order.

    The softmax runs in float32 (as transformers' Mixtral and Qwen MoE blocks compute it);
    with ``renormalize`` the chosen weights are divided by their sum (Mixtral always,
    Qwen per ``norm_topk_prob``). Ties go to the lower expert index.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The routed experts of one MoE layer: for every token ``t`` and choice ``k`` with
    ``e = topk_ids[t, k] >= 0``, ``topk_weights[t, k] * w2[e] @ silu_and_mul(w13[e] @ x_t)``,
    summed over ``k``.

    hidden: [T, H]; w13: [E, 2I, H] (each expert's gate rows then its up rows); w2: [E, H, I];
    topk_weights: float32 [T, K]; topk_ids: int [T, K], where -1 marks a choice this rank does
    not hold (an expert placed on another expert-parallel rank): it contributes nothing.
    Returns [T, H] in hidden's dtype.

    Rounding points (the spec for every override): the two matmuls take and return the
    activation dtype; SiLU-and-mul computes in float32 from the rounded gate/up and rounds
    once; the weighted sum over the top-k accumulates in float32 and rounds once at the end.
    """
    num_tokens, hidden_size = hidden.shape
    num_experts = w13.shape[0]
    inter = w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    out = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=hidden.device)
    if num_tokens == 0:
        return out.to(hidden.dtype)
    ids = topk_ids.reshape(-1).long()
    # Choices held elsewhere sort last (key E) and are skipped.
    keys = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)
    order = torch.argsort(keys, stable=True)
    counts = torch.bincount(keys, minlength=num_experts + 1).tolist()
    tokens = order // top_k
    weights = topk_weights.reshape(-1).float()[order]
    x = hidden[tokens]
    start = 0
    for expert, n in enumerate(counts[:num_experts]):
        if n == 0:
            continue
        stop = start + n
        gate_up = F.linear(x[start:stop], w13[expert])
        act = (F.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()).to(hidden.dtype)
        y = F.linear(act, w2[expert]).float() * weights[start:stop, None]
        out.index_add_(0, tokens[start:stop], y)
        start = stop
    return out.to(hidden.dtype)


REFERENCE_KERNELS = {
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "rotary_embedding": rotary_embedding,
    "qk_norm_rotary": qk_norm_rotary,
    "silu_and_mul": silu_and_mul,
    "gelu_tanh_and_mul": gelu_tanh_and_mul,
    "write_kv_cache": write_kv_cache,
    "linear": linear,
    "argmax": argmax,
    "moe_topk_softmax": moe_topk_softmax,
    "fused_moe": fused_moe,
}
