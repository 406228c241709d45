"""4-bit weights of bfloat16 models on NVIDIA GPUs (sm_80+) in torch's int4 tile layout.

torch ships a tensor-core int4 matmul for few rows, ``torch.ops.aten._weight_int4pack_mm``
("tinygemm", from gpt-fast), over weights converted by ``_convert_weight_to_int4pack``. On the
Llama-3.1-8B projections it beat our Triton W4A16 kernels at every batch of 1 to 16 rows (H100,
2026-12-06, ``docs/benchmarks.md``: 67.7 against 86.6 us per layer at one row, 258.4 against
394.9 at sixteen), so 4-bit layers of bf16 models keep their weights in its layout:

* up to ``MAX_ROWS`` (16) rows: ``_weight_int4pack_mm``;
* from ``MAX_ROWS + 1`` to ``GEMM_MAX_ROWS`` rows: ``int4gemm.gemm``, a Triton GEMM that reads
  these tiles directly (each 4-bit weight read and unpacked once per row block of up to
  128-256 rows, in bf16 registers feeding the tensor cores as the MMA's A operand; no bf16
  copy of the weight; bias fused). ``GEMM_MAX_ROWS`` is 512, from the GPU sweep
  (``python -m engine_triton.quant_benchmark --int4-gemm-sweep``; H100, 2026-12-07: the four
  Llama-3.1-8B projections in 0.26x the dequantize + cuBLAS time at 32 rows, 0.63x at 256,
  0.89x at 512);
* more rows: the weight dequantized to bf16 by ``_int4pack_dequant_kernel`` (this module, in
  Triton) and multiplied by cuBLAS, which beat torch's kernel from 32 rows on (it writes and
  reads the whole weight in bf16 on every call, which the GEMM above avoids).

**The layout** (CUDA; ``inner`` = k-tiles of 16 per super-tile, 8 here where K allows):
``int32 [N / 8, K / (16 * inner), 32, inner / 2]``. Word ``[nt, ko, t, p]`` holds eight 4-bit
values of output row ``n = 8 nt + t // 4``; its field ``f`` (bits ``4f .. 4f+3``), with
``f = 4 lo + j``, is the weight at input ``k = 16 inner ko + 32 p + 8 j + 2 (t % 4) + lo``: the
B-operand fragments of the m16n8k16 MMA for two consecutive k-tiles. ``pack_reference`` builds
it in plain torch from that description (the GPU test checks it against torch's converter).

**The numbers**: ``w = (q - 8) * scale + zero`` with ``scale_zero`` ``bf16 [K / group, N, 2]``
(scale, then zero); a checkpoint's integer zero point ``z`` becomes ``zero = (8 - z) * scale``,
so ``w = (q - z) * scale`` up to the bf16 rounding of the scale and the zero (at the 8B
shapes, 0.30-0.47% largest error over the largest output against the float32 product, where
the Triton kernels' fp16/float32 scales gave 0.25-0.41%; ``docs/benchmarks.md``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine_triton.kernels import int4gemm

# Rows up to which torch's kernel multiplies.
MAX_ROWS = 16
# Rows up to which (from MAX_ROWS + 1) int4gemm's GEMM multiplies, reading the 4-bit tiles
# once; above, dequantize + cuBLAS. 512 is what the GPU sweep (``quant_benchmark
# --int4-gemm-sweep``, which prints the value it measured) chose on an H100; 0 turns the GEMM
# off. ``ENGINE_TRITON_INT4_GEMM_MAX_ROWS`` overrides it for a process (benchmarks try a value
# without editing the module).
GEMM_MAX_ROWS = int(os.environ.get("ENGINE_TRITON_INT4_GEMM_MAX_ROWS", "512"))
GROUP_SIZES = (32, 64, 128, 256)


def inner_k_tiles(k: int) -> int | None:
    """The widest k super-tile (8, 4 or 2 tiles of 16) that divides ``k``; None if none."""
    for inner in (8, 4, 2):
        if k % (16 * inner) == 0:
            return inner
    return None


def supported(n: int, k: int, bits: int, group_size: int, device: torch.device, dtype) -> bool:
    """Whether a layer can use this layout: 4-bit, bf16 activations, torch's group sizes, N a
    multiple of 8 and K of 32, on a CUDA (not ROCm: another layout there) device of compute
    capability 8.0 or newer."""
    if bits != 4 or dtype != torch.bfloat16 or group_size not in GROUP_SIZES:
        return False
    if n % 8 or k % group_size or inner_k_tiles(k) is None:
        return False
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(idx)[0] >= 8


def _field_indices(n: int, k: int, inner: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, input) index of every field of the layout, shaped ``[N/8, K/(16 inner), 32,
    inner/2, 8]``."""
    nt = torch.arange(n // 8, device=device).view(-1, 1, 1, 1, 1)
    ko = torch.arange(k // (16 * inner), device=device).view(1, -1, 1, 1, 1)
    t = torch.arange(32, device=device).view(1, 1, -1, 1, 1)
    p = torch.arange(inner // 2, device=device).view(1, 1, 1, -1, 1)
    f = torch.arange(8, device=device).view(1, 1, 1, 1, -1)
    rows = 8 * nt + t // 4
    cols = 16 * inner * ko + 32 * p + 8 * (f % 4) + 2 * (t % 4) + f // 4
    return rows, cols


def pack_reference(q: torch.Tensor, inner: int) -> torch.Tensor:
    """``q`` (``[N, K]`` integers 0..15) in the layout above, built from its description."""
    n, k = q.shape
    rows, cols = _field_indices(n, k, inner, q.device)
    fields = q.to(torch.int64)[rows, cols] << (4 * torch.arange(8, device=q.device))
    words = fields.sum(dim=-1)  # disjoint bits: the sum is the OR
    return (words - ((words >> 31) << 32)).to(torch.int32)  # two's complement of bit 31


def unpack_reference(words: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of ``pack_reference``: ``[N, K]`` uint8 values 0..15."""
    inner = 2 * words.shape[-1]
    rows, cols = _field_indices(n, k, inner, words.device)
    shifts = 4 * torch.arange(8, device=words.device)
    fields = (words.to(torch.int64)[..., None] >> shifts) & 0xF
    q = torch.empty((n, k), dtype=torch.uint8, device=words.device)
    q[rows.expand_as(fields), cols.expand_as(fields)] = fields.to(torch.uint8)
    return q


def pack(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int):
    """``{"int4pack", "scale_zero"}`` of a ``[N, K]`` 4-bit weight with ``[N, K / group]``
    scales and integer zero points. On CUDA torch's own converter packs (the GPU test holds it
    to ``pack_reference``); elsewhere (interpreter tests) the reference does."""
    n, k = qweight.shape
    inner = inner_k_tiles(k)
    if inner is None:
        raise ValueError(f"int4pack: K={k} is not a multiple of 32")
    q = qweight.to(torch.uint8)
    if q.is_cuda:
        packed_bytes = ((q[:, 0::2] << 4) | q[:, 1::2]).contiguous()  # even k in the high half
        words = torch._convert_weight_to_int4pack(packed_bytes, inner)
    else:
        words = pack_reference(q, inner)
    s = scales.to(torch.float32)
    zero = (8.0 - zeros.to(torch.float32)) * s
    scale_zero = torch.stack([s, zero], dim=-1).transpose(0, 1).to(torch.bfloat16).contiguous()
    return {"int4pack": words, "scale_zero": scale_zero}


@triton.jit
def _int4pack_dequant_kernel(
    w_ptr,
    sz_ptr,
    out_ptr,
    N,
    GROUP,
    stride_wn,
    stride_on,
    INNER: tl.constexpr,
    BLOCK_NT: tl.constexpr,
):
    """``BLOCK_NT`` row tiles (8 rows each) by one k super-tile (``16 INNER`` inputs): the
    words are loaded as stored, split into their eight fields, and the fields reordered in
    registers into ``[rows, k]`` so that the store is row-contiguous."""
    P: tl.constexpr = INNER // 2
    pid_n = tl.program_id(0)
    ko = tl.program_id(1)
    nt = pid_n * BLOCK_NT + tl.arange(0, BLOCK_NT)
    nt_ok = nt < N // 8
    t = tl.arange(0, 32)
    p = tl.arange(0, P)
    offs = (
        nt.to(tl.int64)[:, None, None] * stride_wn
        + ko * (32 * P)
        + t[None, :, None] * P
        + p[None, None, :]
    )
    words = tl.load(w_ptr + offs, mask=nt_ok[:, None, None], other=0)  # [B, 32, P]
    shifts = tl.arange(0, 8) * 4
    q = (words[:, :, :, None] >> shifts[None, None, None, :]) & 0xF  # [B, 32 (t), P, 8 (f)]
    # t = 4 r + c and f = 4 lo + j: [B, r, c, p, lo, j] -> [B, r, p, j, c, lo], whose last
    # four dims are k = 32 p + 8 j + 2 c + lo within the super-tile.
    q = tl.reshape(q, (BLOCK_NT, 8, 4, P, 2, 4))
    q = tl.permute(q, (0, 1, 3, 5, 2, 4))
    q = tl.reshape(q, (BLOCK_NT * 8, 16 * INNER))
    rows = pid_n * BLOCK_NT * 8 + tl.arange(0, BLOCK_NT * 8)
    cols = ko * (16 * INNER) + tl.arange(0, 16 * INNER)
    ok = (rows < N)[:, None]
    sz = ((cols // GROUP).to(tl.int64)[None, :] * N + rows[:, None]) * 2
    scale = tl.load(sz_ptr + sz, mask=ok, other=0.0).to(tl.float32)
    zero = tl.load(sz_ptr + sz + 1, mask=ok, other=0.0).to(tl.float32)
    w = (q.to(tl.float32) - 8.0) * scale + zero
    tl.store(
        out_ptr + rows.to(tl.int64)[:, None] * stride_on + cols[None, :],
        w.to(out_ptr.dtype.element_ty),
        mask=ok,
    )


def dequantize(packed: dict[str, torch.Tensor], n: int, group_size: int) -> torch.Tensor:
    """The dense bf16 weight ``[N, K]`` of a packed layer."""
    words, scale_zero = packed["int4pack"], packed["scale_zero"]
    inner = 2 * words.shape[-1]
    k = words.shape[1] * 16 * inner
    out = torch.empty((n, k), dtype=torch.bfloat16, device=words.device)
    block_nt = 4
    grid = (triton.cdiv(n // 8, block_nt), words.shape[1])
    _int4pack_dequant_kernel[grid](
        words, scale_zero, out, n, group_size, words.stride(0), out.stride(0),
        INNER=inner, BLOCK_NT=block_nt, num_warps=4,
    )  # fmt: skip
    return out


def linear(
    x: torch.Tensor,
    packed: dict[str, torch.Tensor],
    group_size: int,
    bias: torch.Tensor | None,
    perm: torch.Tensor | None,
) -> torch.Tensor:
    """``x [M, K] @ W^T (+ bias)`` for a packed layer (``x`` bf16, rows in the checkpoint's
    input order; ``perm`` is an act-order permutation)."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"int4pack layers take bfloat16 activations, got {x.dtype}")
    n = packed["scale_zero"].shape[1]
    m, k = x.shape
    if MAX_ROWS < m <= GEMM_MAX_ROWS and int4gemm.supported(k, group_size):
        return int4gemm.gemm(x, packed["int4pack"], packed["scale_zero"], group_size, perm, bias)
    xp = x.index_select(1, perm) if perm is not None else x
    if not xp.is_contiguous():
        xp = xp.contiguous()
    if xp.shape[0] <= MAX_ROWS:
        y = torch._weight_int4pack_mm(xp, packed["int4pack"], group_size, packed["scale_zero"])
    else:
        y = torch.nn.functional.linear(xp, dequantize(packed, n, group_size))
    if bias is not None:
        y += bias
    return y
