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

The compiled versions (``csrc/cpu_ops.c``, the ``avx2`` family of ``engine_cpu.native``) do
each of the three in one call where the activations are float32 or bfloat16 and the rows have
unit stride: the same float32 arithmetic in the same order, rounded once to the activation
dtype, with sums of squares in eight float32 lanes (so a result can differ from torch's in the
last bit). A decode step of the embedded Gemma 3 270M runs 127 of these; torch's
``rms_norm`` alone cost about 16 us a call there, the compiled one about 2. The torch forms
above remain for float16, other layouts, and CPUs without AVX2 (or ``ENGINE_CPU_NATIVE=0``).
"""

from __future__ import annotations

import torch

from engine.kernels import reference
from engine_cpu import native

_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def _lib(*tensors: torch.Tensor):
    """The AVX2 library when every tensor is a float32/bfloat16 CPU tensor of one dtype whose
    last dimension has unit stride; None otherwise (the torch path then runs). Cheap: it runs
    on every norm of a decode step."""
    dtype = tensors[0].dtype
    if dtype not in _NATIVE_DTYPES:
        return None
    for t in tensors:
        if t.dtype != dtype or not t.is_cpu or t.stride(-1) != 1:
            return None
    return native.load("avx2")


def _rows(x: torch.Tensor) -> tuple[int, int, int, int] | None:
    """``x`` [..., D] as (T, H, row stride, head stride) of rows of D values: a 2-D tensor is
    T rows (H = 1); a 3-D one T x H rows; None for other layouts."""
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    if x.dim() == 3:
        return x.shape[0], x.shape[1], x.stride(0), x.stride(1)
    return None


_F32 = "_engine_cpu_float32"


def _float32(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` as a contiguous float32 tensor, the copy of a 16-bit one made once and kept
    on it (until it is written to: its version counter): a cast per call is a torch op that
    a native plan's recording refuses, and a bf16 model's norm weights are bf16."""
    if weight.dtype == torch.float32 and weight.is_contiguous():
        return weight
    cached = getattr(weight, _F32, None)
    if cached is not None and cached[0] == weight._version:
        return cached[1]
    w = weight.float().contiguous()
    setattr(weight, _F32, (weight._version, w))
    return w


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """See ``engine.kernels.reference.rms_norm``."""
    h = x.shape[-1]
    lib = _lib(x)
    rows = _rows(x) if lib is not None else None
    if rows is None:
        return torch.rms_norm(x.float(), (h,), weight.float(), eps).to(x.dtype)
    t, heads, row, head = rows
    # (empty_like of a contiguous tensor costs a third of torch.empty(shape, dtype=...))
    out = torch.empty_like(x) if x.is_contiguous() else torch.empty(x.shape, dtype=x.dtype)
    orow, ohead = (out.stride(0), out.stride(1) if out.dim() == 3 else 0)
    w = _float32(weight)
    bf16 = int(x.dtype == torch.bfloat16)
    lib.cpu_rms_norm(
        x.data_ptr(), row, head, out.data_ptr(), orow, ohead, bf16, t, heads, h, w.data_ptr(), eps
    )
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``engine.kernels.reference.fused_add_rms_norm``."""
    lib = _lib(x, residual)
    if lib is None or x.dim() != 2 or residual.dim() != 2:
        summed = x + residual
        return rms_norm(summed, weight, eps), summed
    t, d = x.shape
    normed = torch.empty_like(residual, memory_format=torch.contiguous_format)
    summed = torch.empty_like(normed)
    w = _float32(weight)
    lib.cpu_fused_add_rms_norm(
        x.data_ptr(),
        x.stride(0),
        residual.data_ptr(),
        residual.stride(0),
        normed.data_ptr(),
        summed.data_ptr(),
        int(x.dtype == torch.bfloat16),
        t,
        d,
        w.data_ptr(),
        eps,
    )
    return normed, summed


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
    lib = _lib(query, key)
    if lib is not None and query.dim() == 2 and key.dim() == 2:
        t = query.shape[0]
        pos = positions.to(torch.int64).contiguous()
        cs = _float32(cos_sin_cache)
        qw = None if q_weight is None else _float32(q_weight)
        kw = None if k_weight is None else _float32(k_weight)
        lib.cpu_qk_norm_rotary(
            query.data_ptr(),
            query.stride(0),
            query.shape[1] // head_size,
            key.data_ptr(),
            key.stride(0),
            key.shape[1] // head_size,
            int(query.dtype == torch.bfloat16),
            t,
            head_size,
            pos.data_ptr(),
            cs.data_ptr(),
            None if qw is None else qw.data_ptr(),
            None if kw is None else kw.data_ptr(),
            eps,
        )
        return query, key
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
