"""GGUF matmuls: ``gguf_linear`` (spec: ``engine.kernels.gguf.GGUFLinear``).

``prepack`` decodes the GGUF blocks once (``engine.kernels.gguf.unpack``) into one layout for
every kept type, transposed so a program's loads of its ``BLOCK_N`` output features are
coalesced:

* ``values``: uint8 ``[K / 2, N]`` for the 4-bit types (input feature ``2i`` in the low nibble
  of row ``i``, ``2i + 1`` in the high one), uint8 ``[K, N]`` for 5-, 6- and 8-bit types;
* ``scale`` / ``offset``: float32 ``[K / group, N]`` (``W = scale * v + offset`` exactly as the
  GGUF block says: both are products of a float16 and a small integer, exact in float32).

That is 4 + 2 bits per weight for Q4_0/Q4_K (groups of 32), 8 + 2 for Q5/Q8, 8 + 4 for Q6_K
(groups of 16): a little more than the blocks, a third to two thirds of bf16.

``_gguf_kernel`` — one program per ``BLOCK_N`` output features (and ``BLOCK_M`` rows) and K
slice: per K tile, the values are dequantized in registers (``scale * v + offset`` in float32,
the group of each feature looked up per element) and multiplied with the activations: by FMA
and a reduction for one row (decode GEMV), by ``tl.dot`` in the activation dtype for more.
Up to 16 rows the K dimension is split so that small projections still fill the GPU
(``_split_k``); the float32 partial sums are added afterwards. Untuned: no GPU has run it yet.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.kernels import gguf as ref


@triton.jit(do_not_specialize=["M"])
def _gguf_kernel(
    x_ptr,
    v_ptr,
    s_ptr,
    o_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K_PER_SPLIT,
    GROUP,
    stride_xm,
    stride_vk,
    stride_sg,
    stride_ym,
    NIBBLES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_c = tl.minimum(rows, M - 1)
    # Output features are masked, never clamped: they are the contiguous dimension of the
    # repacked values, and a clamp hides that from the compiler (uncoalesced loads).
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_k * K_PER_SPLIT
    for k0 in range(k_lo, k_lo + K_PER_SPLIT, BLOCK_K):
        k = k0 + ks  # K_PER_SPLIT is a multiple of BLOCK_K
        if NIBBLES:
            byte = tl.load(
                v_ptr + (k // 2).to(tl.int64)[:, None] * stride_vk + cols[None, :],
                mask=col_ok[None, :],
                other=0,
            )
            v = (byte >> ((k % 2) * 4).to(tl.uint8)[:, None]) & 15
        else:
            v = tl.load(
                v_ptr + k.to(tl.int64)[:, None] * stride_vk + cols[None, :],
                mask=col_ok[None, :],
                other=0,
            )
        g = (k // GROUP).to(tl.int64)[:, None] * stride_sg + cols[None, :]
        s = tl.load(s_ptr + g, mask=col_ok[None, :], other=0.0)
        w = s * v.to(tl.float32) + tl.load(o_ptr + g, mask=col_ok[None, :], other=0.0)
        if DOT:
            xk = tl.load(x_ptr + rows_c.to(tl.int64)[:, None] * stride_xm + k[None, :])
            acc += tl.dot(xk, w.to(xk.dtype), input_precision=PRECISION)
        else:
            xk = tl.load(x_ptr + k).to(tl.float32)  # one row
            acc += tl.sum(w * xk[:, None], axis=0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    mask = (rows < M)[:, None] & col_ok[None, :]
    # With split-K, y is the float32 partial sums [SPLIT_K, M, N] (summed by the caller).
    y_offs = pid_k * M * N + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]
    tl.store(y_ptr + y_offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _split_k(programs: int, k_tiles: int, device: torch.device) -> int:
    """How many K slices a decode-sized product runs in: enough programs to give every SM about
    two (a 640-feature projection has 20 tiles of 32 features), each slice a whole number of K
    tiles. The partial sums are added by one torch reduction."""
    if device.type != "cuda":
        return 1 if k_tiles < 4 else 2  # the interpreter: still exercise the split path
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    split = 1
    while programs * split * 2 <= 2 * sms and k_tiles % (split * 2) == 0 and split < 16:
        split *= 2
    return split


class TritonGGUFLinear:
    """``gguf_linear`` through ``_gguf_kernel`` (see the module docstring)."""

    def prepack(
        self, blocks: torch.Tensor, *, qtype: int, dtype: torch.dtype | None = None
    ) -> dict[str, torch.Tensor]:
        t = ref.gguf_type(qtype)
        values, scale, offset = ref.unpack(blocks, qtype)
        if t.bits == 4:
            values = values[:, 0::2] | (values[:, 1::2] << 4)
        return {
            "values": values.t().contiguous(),
            "scale": scale.t().contiguous(),
            "offset": offset.t().contiguous(),
        }

    def __call__(
        self,
        x: torch.Tensor,
        packed: dict[str, torch.Tensor],
        *,
        qtype: int,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        t = ref.gguf_type(qtype)
        values, scale, offset = packed["values"], packed["scale"], packed["offset"]
        n = values.shape[1]
        k = scale.shape[0] * t.group
        x2 = x.reshape(-1, k)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        m = x2.shape[0]
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        if m == 0:
            return y.view(*x.shape[:-1], n)
        block_k = 64 if k % 64 == 0 else 32
        if m == 1:
            block_m, block_n, dot, warps = 1, 32, False, 4
        else:
            block_m = 16 if m <= 16 else (32 if m <= 64 else 64)
            block_n, dot, warps = 64, True, 4
        grid_n, grid_m = triton.cdiv(n, block_n), triton.cdiv(m, block_m)
        split = _split_k(grid_n * grid_m, k // block_k, x.device) if m <= 16 else 1
        out = y if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        has_bias = bias is not None and split == 1
        _gguf_kernel[(grid_n, grid_m, split)](
            x2,
            values,
            scale,
            offset,
            bias if has_bias else out,
            out,
            m,
            n,
            k // split,
            t.group,
            x2.stride(0),
            values.stride(0),
            scale.stride(0),
            out.stride(-2),
            NIBBLES=t.bits == 4,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            DOT=dot,
            HAS_BIAS=has_bias,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=warps,
        )
        if split > 1:
            total = out.sum(0)
            if bias is not None:
                total += bias.float()
            y.copy_(total)
        return y.view(*x.shape[:-1], n)


gguf_linear = TritonGGUFLinear()
