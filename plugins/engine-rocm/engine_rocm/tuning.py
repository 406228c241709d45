"""Launch configurations of engine-triton's paged-attention kernels on AMD GPUs, as data.

Keys are gfx families (``engine_rocm.gfx.family``: gfx94 for MI300X/MI325X, gfx95 for
MI350/MI355, gfx90 for MI200/MI250, gfx110/gfx120 for RDNA3/RDNA4); values give, per kernel
regime, the tile sizes and launch parameters that replace the kernels' defaults (those were
measured on an NVIDIA H200). On AMD, ``num_warps`` counts wavefronts: 64 lanes on CDNA, 32 on
RDNA, so 4 warps are 256 threads on an MI300 and 128 on a Radeon. AMD's stream pipeliner wants
``num_stages`` of 1 or 2 (software pipelining deeper than that spills the 64 KiB LDS).

**None of these numbers was measured in this repository: no AMD GPU was available.** They are
starting points following AMD's published Triton tuning advice (smaller pipelines, 64-wide
wavefronts, tiles of 64 or more on CDNA3/4, shorter tiles on RDNA's smaller register files);
replace them with a sweep (``python -m engine_triton.benchmark``) on the hardware and record it
in docs/benchmarks.md.
"""

from __future__ import annotations

from engine_rocm.gfx import family

REGIMES = ("prefill", "decode", "decode_split", "decode_many_splits")

TUNING: dict[str, dict[str, dict[str, int]]] = {
    # CDNA3: MI300X, MI300A, MI325X (304 CUs, 64 KiB LDS per CU).
    "gfx94": {
        "prefill": {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 1},
        "decode": {"block_n": 64, "num_warps": 4, "num_stages": 1},
        "decode_split": {"block_n": 64, "num_warps": 4, "num_stages": 1},
        "decode_many_splits": {"block_n": 128, "num_warps": 4, "num_stages": 1},
    },
    # CDNA4: MI350X, MI355X (160 KiB LDS per CU: one more pipeline stage fits).
    "gfx95": {
        "prefill": {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 2},
        "decode": {"block_n": 64, "num_warps": 4, "num_stages": 2},
        "decode_split": {"block_n": 64, "num_warps": 4, "num_stages": 2},
        "decode_many_splits": {"block_n": 128, "num_warps": 4, "num_stages": 2},
    },
    # CDNA2: MI210, MI250X.
    "gfx90": {
        "prefill": {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 1},
        "decode": {"block_n": 64, "num_warps": 4, "num_stages": 1},
        "decode_split": {"block_n": 32, "num_warps": 4, "num_stages": 1},
        "decode_many_splits": {"block_n": 64, "num_warps": 4, "num_stages": 1},
    },
    # RDNA3 (Radeon RX 7900, PRO W7900) and RDNA4: wave32, smaller register files.
    "gfx110": {
        "prefill": {"block_m": 32, "block_n": 32, "num_warps": 4, "num_stages": 1},
        "decode": {"block_n": 32, "num_warps": 4, "num_stages": 1},
        "decode_split": {"block_n": 32, "num_warps": 4, "num_stages": 1},
        "decode_many_splits": {"block_n": 32, "num_warps": 4, "num_stages": 1},
    },
    "gfx120": {
        "prefill": {"block_m": 32, "block_n": 32, "num_warps": 4, "num_stages": 1},
        "decode": {"block_n": 32, "num_warps": 4, "num_stages": 1},
        "decode_split": {"block_n": 32, "num_warps": 4, "num_stages": 1},
        "decode_many_splits": {"block_n": 32, "num_warps": 4, "num_stages": 1},
    },
}


def tuning_for(arch: str) -> tuple[str | None, dict[str, dict[str, int]]]:
    """``(family key, table)`` for ``arch`` (``"gfx942"``); ``(None, {})`` when no family
    matches (the kernels then use their defaults)."""
    fam = family(arch)
    for key in sorted(TUNING, key=len, reverse=True):  # the most specific prefix first
        if fam.startswith(key):
            return key, TUNING[key]
    return None, {}
