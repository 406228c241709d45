"""Rotary position embeddings: the cos/sin cache and the scaling variants HF configs declare.

The cache layout follows the kernels contract: float32 ``[max_position, rot_dim]`` with the
``rot_dim / 2`` cosines then the ``rot_dim / 2`` sines of ``position * inv_freq``. Inverse
frequencies are computed exactly as transformers does (float32, same formulas), so rotated
queries/keys match it bit for bit in float32.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from engine.kernels.registry import Kernels
from engine.layers.layernorm import RMSNorm

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The rope settings of ``hf_config`` as one flat dict with at least ``rope_type`` and
    ``rope_theta`` (plus ``factor`` etc. for scaled variants, ``partial_rotary_factor`` when
    set).

    Understands both transformers 5 (``rope_parameters``, possibly nested per layer type as in
    Gemma 3) and transformers 4 (``rope_theta`` + ``rope_scaling``) configs.
    """
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
    else:
        params = dict(params)
        if layer_type is not None and isinstance(params.get(layer_type), dict):
            params = dict(params[layer_type])
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    partial = getattr(hf_config, "partial_rotary_factor", None)
    if partial is not None:
        params.setdefault("partial_rotary_factor", partial)
    if params["rope_type"] == "su":  # Phi-3's name for LongRoPE before transformers 4.42
        params["rope_type"] = "longrope"
    if params["rope_type"] in ("llama3", "longrope"):
        # Phi-3 keeps it at the top level of its config.
        original = getattr(hf_config, "original_max_position_embeddings", None)
        params.setdefault(
            "original_max_position_embeddings", original or hf_config.max_position_embeddings
        )
    if params["rope_type"] == "longrope":
        params.setdefault("max_position_embeddings", hf_config.max_position_embeddings)
    return params


def compute_inv_freq(rot_dim: int, params: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """float32 [rot_dim / 2] inverse frequencies for the rope variant in ``params``, and the
    factor that scales cos/sin (1.0 except for YaRN)."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    base = float(params["rope_theta"])
    exponents = torch.arange(0, rot_dim, 2, dtype=torch.int64).to(torch.float32) / rot_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "llama3":
        factor = params["factor"]
        low_factor = params["low_freq_factor"]
        high_factor = params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        low_wavelen = old_len / low_factor
        high_wavelen = old_len / high_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by ``factor``, short ones kept, the band between them
        # interpolated smoothly (Llama 3.1's recipe).
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_factor) / (high_factor - low_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        return _yarn(rot_dim, base, params)
    if rope_type == "longrope":
        return longrope_inv_freq(rot_dim, params, long=False)
    return inv_freq, 1.0


def longrope_inv_freq(
    rot_dim: int, params: dict[str, Any], long: bool
) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3 / Phi-4): each frequency divided by its ``short_factor`` (or, with
    ``long``, ``long_factor``) entry; cos/sin scaled by ``attention_factor``, by default
    ``sqrt(1 + ln(s) / ln(original_max))`` with ``s = max_position_embeddings /
    original_max_position_embeddings`` (transformers' formulas, in float32)."""
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or params["max_position_embeddings"] / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    ext = torch.tensor(params["long_factor" if long else "short_factor"], dtype=torch.float32)
    if ext.numel() != rot_dim // 2:
        raise ValueError(
            f"longrope {'long' if long else 'short'}_factor has {ext.numel()} entries, the "
            f"rotary dims need {rot_dim // 2}"
        )
    exponents = torch.arange(0, rot_dim, 2, dtype=torch.int64).to(torch.float32) / rot_dim
    return 1.0 / (ext * float(params["rope_theta"]) ** exponents), float(attention_factor)


def _yarn(rot_dim: int, base: float, params: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023): interpolate low frequencies by ``factor``, keep high ones,
    ramp between the dims that rotate ``beta_slow`` and ``beta_fast`` times over the original
    context; cos/sin are scaled by the attention factor ``0.1 * ln(factor) + 1``."""
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or params["max_position_embeddings"] / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        )
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return rot_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, rot_dim, 2).to(torch.float32) / rot_dim)
    extrapolation = 1 - ramp  # share of each dim that keeps its original frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)


def get_rope(
    head_size: int, max_position: int, params: dict[str, Any], kernels: Kernels
) -> RotaryEmbedding:
    """The rotary embedding for ``params`` (``rope_parameters(...)``): a
    ``LongRopeRotaryEmbedding`` for ``longrope``, else a ``RotaryEmbedding``."""
    if params.get("rope_type") == "longrope":
        return LongRopeRotaryEmbedding(head_size, max_position, params, kernels)
    return RotaryEmbedding(head_size, max_position, params, kernels)


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings to the first ``rot_dim`` dims of every query/key head, after
    the optional per-head q/k RMSNorm, in one ``kernels.qk_norm_rotary`` call."""

    def __init__(
        self,
        head_size: int,
        max_position: int,
        params: dict[str, Any],
        kernels: Kernels,
        is_neox: bool = True,
    ) -> None:
        super().__init__()
        if params.get("rope_type") == "longrope" and not isinstance(self, LongRopeRotaryEmbedding):
            raise ValueError(
                "longrope needs both factor tables: build it with get_rope (a "
                "LongRopeRotaryEmbedding), whose rope_positions the model must apply"
            )
        self.head_size = head_size
        self.rot_dim = int(head_size * float(params.get("partial_rotary_factor", 1.0)))
        self.is_neox = is_neox
        self.kernels = kernels
        self.params = params
        # Computed on the CPU so every device gets the same values, then moved with the model.
        with torch.device("cpu"):
            cache = _cos_sin(max_position, *compute_inv_freq(self.rot_dim, params))
        self.register_buffer(
            "cos_sin_cache", cache.to(torch.get_default_device()), persistent=False
        )

    def forward(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: int64 [T]; query [T, H*D], key [T, Hkv*D] (views of the fused qkv output)
        -> (query, key), normed per head by ``q_norm``/``k_norm`` when given (Qwen3, Gemma 3),
        then rotated. Writes into ``query`` and ``key``: norm and rotary are one kernel."""
        eps = 1e-6
        for norm in (q_norm, k_norm):
            if norm is not None:
                if norm.hidden_size != self.head_size:
                    raise ValueError(
                        f"q/k norm over {norm.hidden_size} dims, heads have {self.head_size}"
                    )
                eps = norm.eps
        if q_norm is not None and k_norm is not None and q_norm.eps != k_norm.eps:
            raise ValueError(f"q_norm eps {q_norm.eps} != k_norm eps {k_norm.eps}")
        return self.kernels.qk_norm_rotary(
            positions,
            query,
            key,
            self.cos_sin_cache,
            self.head_size,
            self.is_neox,
            None if q_norm is None else q_norm.scale(),
            None if k_norm is None else k_norm.scale(),
            eps,
        )

    def extra_repr(self) -> str:
        return f"rot_dim={self.rot_dim}, type={self.params['rope_type']}, theta={self.params['rope_theta']}"


def _cos_sin(max_position: int, inv_freq: torch.Tensor, scale: float) -> torch.Tensor:
    """float32 ``[max_position, rot_dim]``: cosines then sines of ``position * inv_freq``,
    times ``scale``."""
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    cos, sin = freqs.cos(), freqs.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return torch.cat((cos, sin), dim=-1)


class LongRopeRotaryEmbedding(RotaryEmbedding):
    """LongRoPE with both factor sets: the cache holds the short-factor table for positions
    ``[0, max_position)`` and the long-factor one after it, and ``rope_positions`` picks, per
    token, the long table when its request's context exceeds ``original_max_position_
    embeddings``.

    That is transformers' rule (long factors once the sequence is longer than the original
    context) applied to each request of the batch on its own, so a request's result does not
    depend on what it is batched with. Keys already in the KV cache keep the rotation they were
    written with: a request that grows past the original context in decode (or in a later
    prefill chunk), or that reuses prefix-cache blocks written by a shorter request, attends to
    short-rotated keys there, where transformers' ``generate`` would recompute the whole
    sequence once with the long factors.
    """

    def __init__(
        self,
        head_size: int,
        max_position: int,
        params: dict[str, Any],
        kernels: Kernels,
        is_neox: bool = True,
    ) -> None:
        super().__init__(head_size, max_position, params, kernels, is_neox)
        self.max_position = max_position
        self.original_max_position = int(params["original_max_position_embeddings"])
        with torch.device("cpu"):
            long = _cos_sin(max_position, *longrope_inv_freq(self.rot_dim, params, long=True))
        cache = torch.cat((self.cos_sin_cache, long.to(self.cos_sin_cache.device)))
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def rope_positions(
        self, positions: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor
    ) -> torch.Tensor:
        """Cache rows for ``positions`` [T]: ``position`` for tokens of requests whose context
        (``seq_lens``, after this step) is within the original length, ``position +
        max_position`` (the long table) for the others. Device ops only (graph-capturable)."""
        tokens = torch.arange(positions.shape[0], device=positions.device, dtype=torch.int32)
        request = torch.searchsorted(query_start_loc[1:].to(torch.int32), tokens, right=True)
        request = request.clamp(max=max(seq_lens.shape[0] - 1, 0))
        long = seq_lens.to(torch.int64)[request] > self.original_max_position
        return positions + long.to(positions.dtype) * self.max_position
