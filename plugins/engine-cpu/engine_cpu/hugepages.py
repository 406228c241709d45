"""Packed weights in transparent huge pages.

A decode step streams every weight once (the embedded Gemma 3's vocabulary alone is 189 MB a
token), and with 4 KiB pages that is a TLB miss every 4 KiB: on the 2-core EPYC VM of
docs/benchmarks.md (nested paging, where a miss walks two page tables) the Q8_0 vocabulary
product took 7.8 ms a token from ``torch.empty`` memory and 3.4 ms from 2 MiB pages, the same
instructions on the same bytes. Linux hands out huge pages to a private anonymous mapping
advised ``MADV_HUGEPAGE`` where transparent huge pages are ``always`` or ``madvise`` (the
common default); with ``never``, or off Linux, the memory is ordinary pages and nothing else
changes.

``empty(shape, dtype)`` returns an uninitialized CPU tensor carved from 2 MiB-aligned mappings
of at least ``_CHUNK`` bytes (a tensor that large gets its own), 64-byte aligned within them, so
the many small layers of a model share huge pages instead of each rounding up to one. A mapping
is unmapped when the last tensor carved from it is freed (each holds a reference to it).
"""

from __future__ import annotations

import ctypes
import math
import mmap
import threading

import torch

_HUGE = 2 << 20  # the x86-64 huge page
_CHUNK = 32 << 20
_ALIGN = 64


class _Arena:
    """The mapping small tensors are carved from now; guarded by a lock (loads may be threaded)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.mm: mmap.mmap | None = None
        self.at = 0  # next free offset in mm
        self.end = 0


_arena = _Arena()


def _map(nbytes: int) -> tuple[mmap.mmap, int]:
    """A private anonymous mapping advised for huge pages that holds ``nbytes`` from a 2 MiB
    boundary; returns it and the offset of that boundary."""
    mm = mmap.mmap(
        -1,
        nbytes + _HUGE,
        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
        prot=mmap.PROT_READ | mmap.PROT_WRITE,
    )
    # MADV_HUGEPAGE before the first touch, so that the page faults allocate huge pages (after
    # it, only khugepaged's slow background scan would collapse them).
    mm.madvise(mmap.MADV_HUGEPAGE)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    return mm, -addr % _HUGE


def supported() -> bool:
    """Whether this platform can advise huge pages (Linux, with Python's ``MADV_HUGEPAGE``)."""
    return hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_ANONYMOUS")


def empty(shape: tuple[int, ...] | list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialized contiguous CPU tensor in huge-page-advised memory (``torch.empty`` where
    the platform cannot advise them)."""
    if not supported():
        return torch.empty(shape, dtype=dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = max(math.prod(shape) * itemsize, 1)
    if nbytes >= _CHUNK:
        mm, start = _map(nbytes)
    else:
        with _arena.lock:
            if _arena.mm is None or _arena.at + nbytes > _arena.end:
                _arena.mm, _arena.at = _map(_CHUNK)
                _arena.end = _arena.at + _CHUNK
            mm, start = _arena.mm, _arena.at
            _arena.at += -(-nbytes // _ALIGN) * _ALIGN
    # torch.frombuffer keeps a reference to mm for as long as the tensor lives
    flat = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=start)
    return flat[: math.prod(shape) * itemsize].view(dtype).view(shape)
