"""Row-wise argmax of the logits (greedy decoding's last step), split over several programs.

torch reduces one [V] row with too few SMs (tens of microseconds for one 128k-151k row on an
H200). Here a grid of (N, SPLITS) programs each scans a slice of its row; with SPLITS > 1 each
stores its partial (value, first index) to a persistent workspace and the last program of the
row to arrive (an atomic counter, reset to 0 by that program) combines them: one launch, no
memset, so it can sit in a CUDA graph.

Semantics are exactly ``torch.argmax(logits, dim=-1)``: ties go to the lowest index, a NaN is
larger than anything (the first NaN wins), and an all -inf row gives 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_triton.kernels.linear import _sm_count
from engine_triton.kernels.pdl import pdl_launch, pdl_wait

MIN_CHUNK = 1024  # fewest logits per program when a row is split
BLOCK = 1024
MAX_SPLITS = 256
# Batches of more rows go to torch.argmax: on an H200, 256 Qwen3 rows took 135 us here (one
# program per row) against torch's 64 us, while one row took 6.6 us against 37.9 (Llama-3.1's
# 128k vocabulary).
MAX_ROWS = 16
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _best(vals, idxs, V):
    """(value, lowest index holding it) over a vector of candidates; NaN beats everything. An
    index of V means "nothing seen" (all -inf)."""
    nan = vals != vals
    has_nan = tl.max(nan.to(tl.int32), axis=0) > 0
    top = tl.max(tl.where(nan, float("-inf"), vals), axis=0)
    hit = tl.where(has_nan, nan, vals == top)
    idx = tl.min(tl.where(hit, idxs, V), axis=0)
    return tl.where(has_nan, float("nan"), top), idx


# N changes every step; V and the row stride are per model, but a padded-vocabulary view or a
# one-row batch could give the stride a value Triton specializes on (1, multiples of 16), and
# a sliced view need not be aligned: no specialization on any of them.
# The split count is a runtime value too (one compiled variant per dtype): a variant compiled in
# the middle of a run costs far more than the kernel saves.
@triton.jit(
    do_not_specialize=["N", "V", "stride_row", "chunk", "splits"],
    do_not_specialize_on_alignment=["logits_ptr"],
)
def _argmax_kernel(
    logits_ptr,
    out_ptr,
    ws_val_ptr,
    ws_idx_ptr,
    counter_ptr,
    N,
    V,
    stride_row,
    chunk,
    splits,
    MAX_SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, V)
    lanes = tl.arange(0, BLOCK)
    row_ptr = logits_ptr + row * stride_row
    # Lane j visits lo + j, lo + j + BLOCK, ...: increasing indices, so taking a value only when
    # it is strictly larger (or the first NaN) keeps the first occurrence within the lane.
    best_v = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK], V, tl.int32)
    for start in range(lo, hi, BLOCK):
        idx = start + lanes
        x = tl.load(row_ptr + idx, mask=idx < hi, other=float("-inf")).to(tl.float32)
        take = (x > best_v) | ((x != x) & (best_v == best_v))
        best_v = tl.where(take, x, best_v)
        best_i = tl.where(take, idx, best_i)
    val, pos = _best(best_v, best_i, V)

    if splits == 1:
        tl.store(out_ptr + row, tl.where(pos >= V, 0, pos).to(tl.int64))
    else:
        slot = row * splits + split
        tl.store(ws_val_ptr + slot, val)
        tl.store(ws_idx_ptr + slot, pos)
        # Every warp's partial stores precede the (single-thread) release of the arrival.
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + row, 1, sem="acq_rel")
        if arrived == splits - 1:
            tl.atomic_xchg(counter_ptr + row, 0)  # ready for the next launch
            sp = tl.arange(0, MAX_SPLITS)
            ok = sp < splits
            parts = row * splits + sp
            vals = tl.load(ws_val_ptr + parts, mask=ok, other=float("-inf"), cache_modifier=".cg")
            idxs = tl.load(ws_idx_ptr + parts, mask=ok, other=0, cache_modifier=".cg")
            idxs = tl.where(ok, idxs, V)
            # A new name: ``pos`` above has the scalar type of the first pass.
            _, first = _best(vals, idxs, V)
            tl.store(out_ptr + row, tl.where(first >= V, 0, first).to(tl.int64))


class _Scratch:
    """Per-device partials (float32 values, int32 indices) and per-row arrival counters (int32,
    kept zeroed by the kernel). Grown, never shrunk or freed: captured graphs keep pointing at
    old buffers."""

    def __init__(self) -> None:
        self.bufs: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._keep: list[torch.Tensor] = []

    def get(self, device: torch.device, numel: int, rows: int):
        bufs = self.bufs.get(device)
        if bufs is None or bufs[0].numel() < numel or bufs[2].numel() < rows:
            if bufs is not None:
                self._keep.extend(bufs)
            size = max(numel, 1 << 12, bufs[0].numel() if bufs else 0)
            n_counters = max(rows, 1 << 10, bufs[2].numel() if bufs else 0)
            bufs = (
                torch.empty(size, dtype=torch.float32, device=device),
                torch.empty(size, dtype=torch.int32, device=device),
                torch.zeros(n_counters, dtype=torch.int32, device=device),
            )
            self.bufs[device] = bufs
        return bufs


_SCRATCH = _Scratch()


def num_splits(n: int, v: int, sms: int) -> int:
    """Programs per row: enough for about two per SM in all, a power of two, each scanning at
    least ``MIN_CHUNK`` logits; 1 once the rows alone fill the SMs."""
    if n >= sms:
        return 1
    want = min(triton.cdiv(2 * sms, n), max(1, v // MIN_CHUNK), MAX_SPLITS)
    return 1 << (want.bit_length() - 1)


def argmax(logits: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)`` for [N, V] float32/bfloat16/float16 logits (rows may be
    strided). ``splits`` (a power of two, at most ``MAX_SPLITS``) overrides the number of
    programs per row. More than ``MAX_ROWS`` rows go to ``torch.argmax`` (faster there)."""
    if (
        logits.dim() != 2
        or logits.dtype not in _DTYPES
        or logits.shape[1] == 0
        or logits.shape[0] > MAX_ROWS
    ):
        return torch.argmax(logits, dim=-1)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    n, v = logits.shape
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    if splits is None:
        splits = num_splits(n, v, _sm_count(logits.device))
    assert 1 <= splits <= MAX_SPLITS and splits & (splits - 1) == 0, splits
    chunk = triton.cdiv(v, splits)
    if splits > 1:
        ws_val, ws_idx, counters = _SCRATCH.get(logits.device, n * splits, n)
    else:
        ws_val = ws_idx = counters = out  # unused
    _argmax_kernel[(n, splits)](
        logits,
        out,
        ws_val,
        ws_idx,
        counters,
        n,
        v,
        logits.stride(0),
        chunk,
        splits,
        MAX_SPLITS=MAX_SPLITS,
        BLOCK=BLOCK,
        num_warps=4,
        **pdl_launch(logits.device),
    )
    return out
