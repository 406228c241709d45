"""Programmatic dependent launch (PDL) for the decode path's kernels (NVIDIA sm_90 and newer).

A decode step is a chain of about ten small kernels per layer, each of which waits for the one
before it to finish, drain and flush before its own blocks are even scheduled. With PDL a kernel
is launched with ``launch_pdl=True`` and may start while its predecessor in the stream is still
running: its blocks become resident early and wait in ``griddepcontrol.wait`` until the
predecessor has completed and its memory is visible, so the launch and block-scheduling latency
of each boundary overlaps the previous kernel's tail. CUDA graph capture keeps these as
programmatic edges, so the captured decode graphs get the same overlap.

The contract, for every kernel launched with ``**pdl_launch(device)``:

* it takes ``USE_PDL: tl.constexpr`` and calls ``pdl_wait(USE_PDL)`` before any load of data
  an earlier kernel may write (activations, caches, counters, workspaces) and before any store
  (its output may reuse memory that the predecessor is still reading); no program may return
  before it. Only index arithmetic may precede it, or, through ``pdl_prefetch_wait``, the load
  of a first weight tile;
* ``pdl_wait`` then lets the next kernel in the stream launch. Because every PDL kernel waits
  for its predecessor's completion before it completes, completion stays transitive along the
  stream, as without PDL.

``ENGINE_TRITON_PDL=0`` turns it off (every launch as before); it is on by default where the
device supports it. The interpreter and other platforms never see it (``USE_PDL`` is a
constexpr, so the branch is not compiled).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

ENV = "ENGINE_TRITON_PDL"
# One-row weight-streaming kernels (the bf16 and FP8 skinny GEMVs) load their first weight tile
# before waiting for the previous kernel (``pdl_prefetch_wait``); False waits first.
PREFETCH_WEIGHTS = True
_SUPPORTED: dict[int, bool] = {}


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait until the previous kernel in the stream has completed and its writes are visible,
    then allow the next kernel to launch. A no-op unless ``USE_PDL``."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_prefetch_wait(ptrs, USE_PDL: tl.constexpr):
    """Load ``ptrs``, then ``pdl_wait``; returns the loaded tile. A weight-streaming kernel's
    first tile is then in flight while the previous kernel drains, instead of after it.

    Only for memory that the kernel right before this one cannot be writing: the load is not
    ordered after it. Weights qualify: they are written at load time, and LoRA slot copies
    (the rows a LoRA layer appends to its weight) happen between steps, so a norm or an
    activation kernel that waits for them always comes between them and a GEMV."""
    tile = tl.load(ptrs)
    pdl_wait(USE_PDL)
    return tile


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL: a CUDA (not ROCm) device of compute
    capability 9.0 or newer, not interpreted, and ``ENGINE_TRITON_PDL`` not ``0``."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    if os.environ.get(ENV, "1").strip() in ("0", "false", "False"):
        return False
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    supported = _SUPPORTED.get(idx)
    if supported is None:
        supported = _SUPPORTED[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return supported


def pdl_launch(device: torch.device) -> dict:
    """Launch keyword arguments for a kernel that honours the contract above: ``USE_PDL`` and
    Triton's ``launch_pdl`` when ``pdl_enabled(device)``, else nothing (``USE_PDL`` defaults
    to False)."""
    if pdl_enabled(device):
        return {"USE_PDL": True, "launch_pdl": True}
    return {}
