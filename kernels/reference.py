"""Torch reference implementations of the named kernels: the spec every override must match.

All ops are functional (they return new tensors) except ``write_kv_cache`` and
``qk_norm_rotary``, which write in place. Norms compute in float32 and cast back to the input
dtype.

Mixture-of-experts: ``moe_topk_softmax`` routes (softmax over the experts in float32, top-k,
optional renormalisation) and ``fused_moe`` runs the routed experts (gate/up, SiLU-and-mul,
down, weighted sum over the top-k). The reference groups the token/expert pairs by expert with
one sort and runs one matmul pair per expert that received tokens: no loop over tokens, and
the weights of experts nobody chose are never read. ``fused_moe_fp8`` is the same with FP8
experts (per-channel or block scales), weight-only: it dequantizes each routed expert;
``fused_moe_wna16`` with 4- or 8-bit integer experts in groups (GPTQ, AWQ, compressed-tensors
pack-quantized), weight-only too.

FP8 activations straight from their producer (``rms_norm_quant_fp8``,
``fused_add_rms_norm_quant_fp8``, ``silu_and_mul_quant_fp8``): the op's result in the input
dtype, quantized to e4m3 per token exactly as ``fp8_linear`` quantizes a bf16 ``x``
(``engine.kernels.quantized.fp8_quantize_per_token``), returned as ``(e4m3 [..., H], float32
scale [M, 1])`` (the residual op adds the new residual). They exist so that a platform can
write e4m3 from the norm or activation kernel instead of the bf16 values plus a separate
quantization pass; an override must equal its own platform's unfused op followed by that
quantization bit for bit (``engine.layers.fp8_input`` only fuses where the two ops come from
the same provider).

The quantized matmuls (``fp8_linear``, ``fp8_block_linear``, ``int8_linear``,
``wna16_linear``) are specified in ``engine.kernels.quantized``.

Multi-LoRA: ``add_lora_linear`` adds each token's own adapter (or none) to a linear layer's
output, for every fused output slice, in place (punica's shrink and expand; see its docstring);
``lora_expand_augmented`` is the expand alone, for layers whose base GEMM also computed every
adapter slot's shrink (their A matrices appended to the weight).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from engine.kernels.gguf import gguf_linear
from engine.kernels.quantized import (
    QUANTIZED_REFERENCE_KERNELS,
    dequantize_fp8_experts,
    dequantize_mxfp4_experts,
    dequantize_wna16_experts,
    fp8_quantize_per_token,
)


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


def rms_norm_quant_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm`` quantized per token to e4m3: ``(q [..., H], scale [M, 1])``."""
    return fp8_quantize_per_token(rms_norm(x, weight, eps))


def fused_add_rms_norm_quant_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fused_add_rms_norm`` with the normed output quantized per token to e4m3:
    ``(q [..., H], scale [M, 1], new residual)``."""
    out, summed = fused_add_rms_norm(x, residual, weight, eps)
    q, scale = fp8_quantize_per_token(out)
    return q, scale, summed


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


def silu_and_mul_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu_and_mul`` quantized per token to e4m3: ``(q [..., I], scale [M, 1])``."""
    return fp8_quantize_per_token(silu_and_mul(x))


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

    An fp8 cache (a float8 dtype; ``float8_e4m3fn`` is ``--kv-cache-dtype fp8``) stores
    ``key / k_scale`` and ``value / v_scale`` rounded to that dtype and saturated at its
    largest finite value (+-448 for e4m3); readers multiply back. Other caches store the values
    cast to their dtype (the scales are not used)."""
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    k = to_cache_dtype(key, kv_cache.dtype, k_scale)
    v = to_cache_dtype(value, kv_cache.dtype, v_scale)
    if kv_cache.element_size() == 1:  # index_copy_ has no float8 kernels: copy the bytes
        flat, k, v = flat.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


def _is_fp8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``x`` as stored in a KV cache of ``dtype``: fp8 caches hold ``x / scale`` saturated."""
    if _is_fp8(dtype):
        top = torch.finfo(dtype).max
        return (x.float() / scale).clamp(-top, top).to(dtype)
    return x.to(dtype)


def from_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Cached keys/values in ``dtype`` (an fp8 cache's are multiplied back by ``scale``)."""
    if _is_fp8(x.dtype):
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
    # A stable descending sort, not torch.topk, whose order among equal values is its own
    # (seen on the CPU: a tie in bf16 logits came back higher index first).
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[..., :top_k], ids[..., :top_k]
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
    return routed_experts(hidden, w13.shape[0], lambda e: (w13[e], w2[e]), topk_weights, topk_ids)


#: The expert activations ``fused_moe_biased`` takes: SwiGLU (``silu(gate) * up``, as
#: ``fused_moe``) and GPT-OSS's clamped SwiGLU (``swigluoai_and_mul``).
MOE_ACTIVATIONS = ("silu", "swigluoai")


def swigluoai_and_mul(
    gate: torch.Tensor, up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0
) -> torch.Tensor:
    """GPT-OSS's clamped SwiGLU: with ``g = min(gate, limit)`` and ``u = clamp(up, -limit,
    limit)``, ``(u + 1) * g * sigmoid(alpha * g)``, computed in ``gate``'s dtype."""
    g = gate.clamp(max=limit)
    u = up.clamp(min=-limit, max=limit)
    return (u + 1) * (g * torch.sigmoid(g * alpha))


def fused_moe_biased(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """``fused_moe`` with per-expert biases and a choice of activation (GPT-OSS's experts):
    for every choice ``(t, k)`` with ``e = topk_ids[t, k] >= 0``, ``topk_weights[t, k] *
    (w2[e] @ act(w13[e] @ x_t + w13_bias[e]) + w2_bias[e])``, summed over ``k``.

    w13: [E, 2I, H] (gate rows, then up rows: a checkpoint that interleaves them is split at
    load); w2: [E, H, I]; w13_bias: [E, 2I] and w2_bias: [E, H] in w13's / w2's dtype, or None.
    ``activation`` is one of ``MOE_ACTIVATIONS``: ``"silu"`` (``silu(gate) * up``) or
    ``"swigluoai"`` (``swigluoai_and_mul(gate, up, alpha, limit)``). Under tensor parallelism a
    rank's ``w2_bias`` is zero except on one rank, so the reduced sum adds it once.

    Rounding points as ``fused_moe``'s: each matmul, its bias added, returns the
    activation dtype; the activation computes in float32 from the rounded gate/up and rounds
    once; the weighted sum over the top-k accumulates in float32 and rounds once at the end.
    """
    return routed_expert_calls(
        hidden,
        w13.shape[0],
        biased_expert_mlp(
            hidden, lambda e: (w13[e], w2[e]), w13_bias, w2_bias, activation, alpha, limit
        ),
        topk_weights,
        topk_ids,
    )


def biased_expert_mlp(
    hidden: torch.Tensor,
    expert_weights: Any,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    activation: str,
    alpha: float,
    limit: float,
) -> Any:
    """``fused_moe_biased``'s per-expert computation for ``routed_expert_calls``, with each
    expert's ``(w13 [2I, H], w2 [H, I])`` taken from ``expert_weights(e)`` (stored, or
    dequantized for the call)."""
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(
            f"unknown MoE activation {activation!r}; supported: {', '.join(MOE_ACTIVATIONS)}"
        )

    def expert_mlp(expert: int, x: torch.Tensor) -> torch.Tensor:
        w13, w2 = expert_weights(expert)
        b13 = None if w13_bias is None else w13_bias[expert].to(w13.dtype)
        b2 = None if w2_bias is None else w2_bias[expert].to(w2.dtype)
        gate_up = F.linear(x.to(w13.dtype), w13, b13).to(hidden.dtype).float()
        gate, up = gate_up.chunk(2, dim=-1)
        if activation == "silu":
            act = F.silu(gate) * up
        else:
            act = swigluoai_and_mul(gate, up, alpha, limit)
        return F.linear(act.to(w2.dtype), w2, b2).to(hidden.dtype)

    return expert_mlp


def fused_moe_mxfp4(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scales: torch.Tensor,
    w2_scales: torch.Tensor,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "swigluoai",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """``fused_moe_biased`` with MXFP4 experts (GPT-OSS as released), **weight-only**: each
    expert's weights are ``engine.kernels.quantized.dequantize_mxfp4_experts`` of its blocks
    and scales in hidden's dtype (exact for bfloat16 and float32), the activations stay in
    hidden's dtype.

    ``w13`` uint8 ``[E, 2I, H / 2]`` (each expert's gate rows, then its up rows) and ``w2``
    uint8 ``[E, H, I / 2]``: two E2M1 codes a byte along the input features, low nibble
    first; ``w13_scales`` uint8 ``[E, 2I, H / 32]`` and ``w2_scales`` uint8 ``[E, H, I / 32]``:
    one E8M0 exponent per block of 32 input features. Biases, activation and rounding points
    as ``fused_moe_biased``'s, whose result this equals on the dequantized weights. Only the
    experts that received a token are dequantized, on every call (the portable, slow path).
    """

    def weights(e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            dequantize_mxfp4_experts(w13[e], w13_scales[e], hidden.dtype),
            dequantize_mxfp4_experts(w2[e], w2_scales[e], hidden.dtype),
        )

    mlp = biased_expert_mlp(hidden, weights, w13_bias, w2_bias, activation, alpha, limit)
    return routed_expert_calls(hidden, w13.shape[0], mlp, topk_weights, topk_ids)


def fused_moe_fp8(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    block_size: tuple[int, int] | list[int] | None = None,
) -> torch.Tensor:
    """``fused_moe`` with FP8 (e4m3) experts, **weight-only**: the activations stay in
    hidden's dtype (no W8A8 activation quantization); each expert's weights are
    ``w * scale`` in float32 (``engine.kernels.quantized.dequantize_fp8_experts``).

    ``w13`` [E, 2I, H] and ``w2`` [E, H, I] are float8_e4m3fn. Scales (float32):

    * per output channel (``block_size`` None): ``w13_scale`` [E, 2I], ``w2_scale`` [E, H];
    * per ``block_size = (bn, bk)`` block: ``w13_scale`` [E, 2 * ceil(I / bn), ceil(H / bk)]
      (the gate's block rows, then the up projection's: each half has its own blocks, as in
      the checkpoint, so I need not be a multiple of bn), ``w2_scale``
      [E, ceil(H / bn), ceil(I / bk)]. Partial last blocks are allowed.

    Rounding points as ``fused_moe``: each matmul multiplies hidden-dtype activations by the
    float32 weights in float32 and rounds its output to hidden's dtype. Only the experts that
    received a token are dequantized (on every call: this is the slow, portable path).
    """

    def weights(e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            dequantize_fp8_experts(w13[e], w13_scale[e], block_size, slices=2),
            dequantize_fp8_experts(w2[e], w2_scale[e], block_size),
        )

    return routed_experts(hidden, w13.shape[0], weights, topk_weights, topk_ids)


def fused_moe_wna16(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scales: torch.Tensor,
    w2_scales: torch.Tensor,
    w13_zeros: torch.Tensor | None = None,
    w2_zeros: torch.Tensor | None = None,
    bits: int = 4,
    w13_perm: torch.Tensor | None = None,
    w2_perm: torch.Tensor | None = None,
    w13_offsets: torch.Tensor | None = None,
    w2_offsets: torch.Tensor | None = None,
    w2_bits: int | None = None,
) -> torch.Tensor:
    """``fused_moe`` with ``bits``-bit (4 or 8) integer experts, **weight-only** (W4A16 /
    W8A16): each expert's weights are ``(q - z) * s`` in float32
    (``engine.kernels.quantized.dequantize_wna16_experts``), the activations stay in hidden's
    dtype.

    ``w13`` int32 ``[E, 2I, H * bits / 32]`` (each expert's gate rows then its up rows) and
    ``w2`` int32 ``[E, H, I * bits / 32]``: ``32 / bits`` values per word along the input
    features, lowest bits first (compressed-tensors' ``weight_packed`` layout, whatever the
    checkpoint's). ``w13_scales`` ``[E, 2I, H / g13]`` and ``w2_scales`` ``[E, H, I / g2]``
    (float, any dtype) hold one scale per row and group of ``g`` consecutive input features,
    the group size implied by the shapes (one group per row: the whole row); ``w13_zeros`` /
    ``w2_zeros`` uint8 of the same shapes, the integer zero points, or None for symmetric
    weights (zero point ``2**(bits-1)``).

    ``w13_perm`` ``[E, H]`` / ``w2_perm`` ``[E, I]`` (int32, each optional): act-order
    experts (GPTQ ``desc_act``), whose input features are stored in their own order per
    expert, sorted by group so that each group is contiguous again: stored input feature ``k``
    of expert ``e`` is the activations' feature ``perm[e, k]`` (the product reads
    ``x[..., perm[e]]``, as ``wna16_linear``'s ``perm``).

    ``w13_offsets`` / ``w2_offsets`` (float32, the scales' shapes; each optional, never with
    zero points): that projection's weights are ``q * s + o`` instead, the form of GGUF's blocks
    (``engine.quantization.gguf_moe`` converts Q4_0 ... Q6_K stacks to it). ``w2_bits``: the
    down projection's bit width where it differs from ``bits`` (a Q4_K_M file's Q4_K gate/up
    and Q6_K down stacks: 4 and 8).

    Rounding points as ``fused_moe_fp8``: each matmul multiplies hidden-dtype activations by
    the float32 weights in float32 and rounds its output to hidden's dtype. Only the experts
    that received a token are dequantized, on every call (the portable, slow path).
    """

    def unpermuted(w: torch.Tensor, perm: torch.Tensor | None, e: int) -> torch.Tensor:
        if perm is None:
            return w
        out = torch.empty_like(w)
        out[:, perm[e].long()] = w  # stored feature k is the input's perm[e, k]
        return out

    bits2 = bits if w2_bits is None else w2_bits

    def at(t: torch.Tensor | None, e: int) -> torch.Tensor | None:
        return None if t is None else t[e]

    def weights(e: int) -> tuple[torch.Tensor, torch.Tensor]:
        w13_e = dequantize_wna16_experts(
            w13[e], w13_scales[e], at(w13_zeros, e), bits, at(w13_offsets, e)
        )
        w2_e = dequantize_wna16_experts(
            w2[e], w2_scales[e], at(w2_zeros, e), bits2, at(w2_offsets, e)
        )
        return unpermuted(w13_e, w13_perm, e), unpermuted(w2_e, w2_perm, e)

    return routed_experts(hidden, w13.shape[0], weights, topk_weights, topk_ids)


def routed_experts(
    hidden: torch.Tensor,
    num_experts: int,
    expert_weights: Any,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``fused_moe``'s computation with each expert's ``(w13 [2I, H], w2 [H, I])`` taken from
    ``expert_weights(e)``, called once per expert that received a token. Weights in another
    dtype than ``hidden`` (dequantized float32) multiply the activations in that dtype; every
    matmul's output is rounded to hidden's dtype."""

    def expert_mlp(expert: int, x: torch.Tensor) -> torch.Tensor:
        w13, w2 = expert_weights(expert)
        inter = w13.shape[0] // 2
        gate_up = F.linear(x.to(w13.dtype), w13).to(hidden.dtype)
        act = (F.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()).to(hidden.dtype)
        return F.linear(act.to(w2.dtype), w2).to(hidden.dtype)

    return routed_expert_calls(hidden, num_experts, expert_mlp, topk_weights, topk_ids)


def routed_expert_calls(
    hidden: torch.Tensor,
    num_experts: int,
    expert_mlp: Any,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The routing half of ``fused_moe`` around any expert computation: the (token, choice)
    pairs are sorted by expert, ``expert_mlp(e, x [n, H]) -> [n, H]`` (in hidden's dtype) runs
    once per expert that received ``n > 0`` of them, and the outputs are weighted and summed
    over the top-k in float32, rounded once at the end. Ids outside ``[0, num_experts)`` (-1:
    an expert another rank holds) contribute nothing. The loop runs on the host (one
    synchronisation for the counts), so this serves eager steps only."""
    num_tokens, hidden_size = hidden.shape
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
        y = expert_mlp(expert, x[start:stop]).float() * weights[start:stop, None]
        out.index_add_(0, tokens[start:stop], y)
        start = stop
    return out.to(hidden.dtype)


def add_lora_linear(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    sorted_tokens: torch.Tensor,
    slot_starts: torch.Tensor,
    slice_sizes: tuple[int, ...],
) -> torch.Tensor:
    """A batch of LoRA adapters on one linear layer: for every token ``t`` with
    ``l = token_slots[t] >= 0`` and every output slice ``s`` (columns ``[o_s, o_s + n_s)`` of
    ``y``, ``n_s = slice_sizes[s]``)::

        y[t, o_s : o_s + n_s] += (x[t] @ lora_a[l, s*R : (s+1)*R].T) @ lora_b[l, o_s : o_s + n_s].T

    in place; tokens with slot -1 (no adapter) keep their row. Returns ``y``.

    y: [T, N] with ``N = sum(slice_sizes)`` (the base layer's output); x: [T, K] (its input);
    lora_a: [L, S*R, K] (``S`` slices' A matrices stacked, each zero-padded to the rank ``R``);
    lora_b: [L, N, R] (the slices' B matrices, the LoRA scaling folded in); token_slots: int32
    [T], the slot of each token in ``0..L-1`` or -1. ``sorted_tokens`` (int32 [T], every token
    grouped by slot in slot order, the tokens without a slot last) and ``slot_starts`` (int32
    [L + 1]: slot ``l``'s tokens are ``sorted_tokens[slot_starts[l] : slot_starts[l + 1]]``)
    hold the same mapping grouped (``engine.lora.mapping.group_by_slot``): the GPU kernels run
    one shrink and one expand launch over every slot with them; this reference reads
    ``token_slots``.

    Rounding points (the spec for overrides): the shrink ``x @ A^T`` accumulates in float32 and
    stays float32 (an override may round it to the activation dtype before the expand); the
    expand accumulates in float32 and is added to ``y`` in float32, rounding once.
    """
    rank = lora_b.shape[2]
    slots = token_slots[: x.shape[0]].long()
    for slot in torch.unique(slots).tolist():
        if slot < 0:
            continue
        rows = torch.nonzero(slots == slot).squeeze(1)
        shrunk = x.index_select(0, rows).float() @ lora_a[slot].float().T  # [n, S*R]
        out = y.index_select(0, rows).float()
        start = 0
        for s, size in enumerate(slice_sizes):
            b = lora_b[slot, start : start + size].float()  # [size, R]
            out[:, start : start + size] += shrunk[:, s * rank : (s + 1) * rank] @ b.T
            start += size
        y.index_copy_(0, rows, out.to(y.dtype))
    return y


def lora_expand_augmented(
    y_aug: torch.Tensor,
    out_features: int,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    sorted_tokens: torch.Tensor,
    slot_starts: torch.Tensor,
    slice_sizes: tuple[int, ...],
) -> torch.Tensor:
    """The expand of a LoRA layer whose base GEMM also computed the shrink: ``y_aug`` is
    ``x @ [W; A_0; ...; A_{L-1}]^T`` ([T, N + L*S*R]: the base output, then every slot's
    shrunk values, ``S*R`` columns per slot, the A matrices stacked as ``add_lora_linear``'s
    ``lora_a``). Returns a new contiguous [T, N] (``N = out_features = sum(slice_sizes)``)::

        out[t] = y_aug[t, :N] + per slice s: shrunk_l[t, s*R:(s+1)*R] @ lora_b[l, slice s].T

    with ``l = token_slots[t]`` and ``shrunk_l = y_aug[:, N + l*S*R : N + (l+1)*S*R]``; a token
    with slot -1 gets its base row unchanged. The mapping arguments are ``add_lora_linear``'s.
    Rounding: the shrunk values are as the GEMM rounded them (the activation dtype); the
    expand accumulates in float32 and is added to the base row in float32, rounding once.
    """
    rank = lora_b.shape[2]
    width = len(slice_sizes) * rank
    out = y_aug[:, :out_features].contiguous().clone()
    slots = token_slots[: y_aug.shape[0]].long()
    for slot in torch.unique(slots).tolist():
        if slot < 0:
            continue
        rows = torch.nonzero(slots == slot).squeeze(1)
        first = out_features + slot * width
        shrunk = y_aug.index_select(0, rows)[:, first : first + width].float()
        acc = out.index_select(0, rows).float()
        start = 0
        for s, size in enumerate(slice_sizes):
            b = lora_b[slot, start : start + size].float()
            acc[:, start : start + size] += shrunk[:, s * rank : (s + 1) * rank] @ b.T
            start += size
        out.index_copy_(0, rows, acc.to(out.dtype))
    return out


REFERENCE_KERNELS = {
    **QUANTIZED_REFERENCE_KERNELS,
    "gguf_linear": gguf_linear,
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "rms_norm_quant_fp8": rms_norm_quant_fp8,
    "fused_add_rms_norm_quant_fp8": fused_add_rms_norm_quant_fp8,
    "silu_and_mul_quant_fp8": silu_and_mul_quant_fp8,
    "rotary_embedding": rotary_embedding,
    "qk_norm_rotary": qk_norm_rotary,
    "silu_and_mul": silu_and_mul,
    "gelu_tanh_and_mul": gelu_tanh_and_mul,
    "write_kv_cache": write_kv_cache,
    "linear": linear,
    "argmax": argmax,
    "moe_topk_softmax": moe_topk_softmax,
    "fused_moe": fused_moe,
    "fused_moe_biased": fused_moe_biased,
    "fused_moe_fp8": fused_moe_fp8,
    "fused_moe_wna16": fused_moe_wna16,
    "fused_moe_mxfp4": fused_moe_mxfp4,
    "add_lora_linear": add_lora_linear,
    "lora_expand_augmented": lora_expand_augmented,
}
