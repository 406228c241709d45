"""CPU overrides of the norm and rotary kernels: the reference's arithmetic in far fewer ops.

A decode step of a small model on the CPU is dominated by op dispatch, not arithmetic: the
reference ``rms_norm`` is about ten aten calls (``float``, ``pow``, ``mean``, ``add``,
``rsqrt``, two ``mul``, casts), and Gemma 3 runs six norms a layer. Here:

* ``rms_norm``: ``torch.rms_norm`` on the float32 upcast (aten's fused CPU kernel, taken when
  input and weight are both float32), then one cast back. Its result equals the reference's
  bit for bit: the same float32 ``x * rsqrt(mean(x^2) + eps) * w``, rounded once to the
  activation dtype (checked on random inputs in float32, bfloat16 and float16, strided
  per-head views included; ``tests/test_cpu_kernels.py``). The bfloat16 input with a float32
  weight would dispatch to aten's composite path instead (a warning, and the reference's op
  count again), hence the explicit upcast.
* ``fused_add_rms_norm``: the residual sum is one ``add`` in the activation dtype, which the
  CPU computes in float32 and rounds once, as the reference's ``(x.float() + r.float()).to()``.
* ``qk_norm_rotary`` (the halves-rotating "neox" layout over the whole head, Gemma/Qwen/Llama):
  query and key are normed as above (rounded to the activation dtype, as the reference's
  separate ops return them), then rotated with the cos/sin rows gathered once per call:
  ``x * cos + swap_halves(x) * (-sin, sin)`` is ``(x1 c - x2 s, x2 c + x1 s)`` exactly
  (``a - b == a + (-b)`` in IEEE arithmetic), and the float32 result is rounded into the
  query/key columns by the ``copy_`` that writes them. Interleaved pairs and partial rotary
  go to the reference.
"""

from __future__ import annotations

import torch

from engine.kernels import reference


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """See ``engine.kernels.reference.rms_norm``."""
    h = x.shape[-1]
    return torch.rms_norm(x.float(), (h,), weight.float(), eps).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``engine.kernels.reference.fused_add_rms_norm``."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def _normed(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """float32 ``[T, heads, D]``: the per-head norm rounded to ``x``'s dtype as the reference's
    separate ``rms_norm`` returns it (no rounding in float32), or ``x`` upcast."""
    if weight is None:
        return x.float()
    out = torch.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps)
    if x.dtype != torch.float32:
        out = out.to(x.dtype).float()
    return out


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
    """See ``engine.kernels.reference.qk_norm_rotary`` (in place into ``query`` and ``key``)."""
    rot_dim = cos_sin_cache.shape[-1]
    if not is_neox or rot_dim != head_size:
        return reference.qk_norm_rotary(
            positions, query, key, cos_sin_cache, head_size, is_neox, q_weight, k_weight, eps
        )
    t, half = query.shape[0], rot_dim // 2
    # [T, 1, 2, half]: (cos, cos) multiplies x, (-sin, sin) multiplies x with its halves swapped.
    cs = cos_sin_cache.index_select(0, positions).float().view(t, 1, 2, half)
    cos = cs[:, :, :1]
    sin = cs[:, :, 1:]
    signed_sin = torch.cat((-sin, sin), dim=2)
    for x, weight in ((query, q_weight), (key, k_weight)):
        xf = _normed(x.view(t, -1, head_size), weight, eps).view(t, -1, 2, half)
        x.view(t, -1, 2, half).copy_(xf * cos + xf.flip(2) * signed_sin)
    return query, key


NORM_KERNELS = {
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "qk_norm_rotary": qk_norm_rotary,
}
