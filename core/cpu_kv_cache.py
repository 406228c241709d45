"""How big the KV cache is on a CPU, where no profiling pass can tell (pure Python, no torch).

On a CPU the cache is allocated zero-filled, so every byte of it is resident from start-up and
taken from the same RAM as everything else on the machine. ``plan_cpu_kv_cache`` gives it the
smallest of:

* **what requests can use**: ``max_num_seqs`` requests of ``max_model_len`` tokens at once
  (each request's blocks in every KV-cache group, a sliding-window group only its window plus
  one step's chunk), plus the scheduler's null block. More would never be touched;
* **the budget**: ``cpu_kv_cache_gb`` when given (vLLM's ``VLLM_CPU_KVCACHE_SPACE``), else
  ``DEFAULT_BUDGET_GIB`` (vLLM's default), but never more than ``MEMORY_FRACTION`` of the memory
  available once the weights are loaded (psutil, and the cgroup limit in a container). The
  one-shot commands (``engine generate``, ``engine chat``) pass ``ONE_SHOT_BUDGET_GIB``.

When the budget cannot hold one request of the model's full context and the user did not set
``max_model_len``, the context is lowered to what fits (and logged); when the user did set it,
that is a ``ConfigError`` with the numbers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.config import ConfigError

logger = logging.getLogger(__name__)

GiB = 1 << 30
DEFAULT_BUDGET_GIB = 4.0
ONE_SHOT_BUDGET_GIB = 0.5
MEMORY_FRACTION = 0.5
# (limit, usage) files of a cgroup memory controller: v2, then v1.
CGROUP_MEMORY_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def available_memory() -> int | None:
    """Bytes of memory this process can still take: psutil's ``available``, lowered to the
    headroom under a cgroup memory limit (containers); None when it cannot be told."""
    candidates = []
    try:
        import psutil

        candidates.append(int(psutil.virtual_memory().available))
    except Exception:  # noqa: BLE001 - psutil missing or unsupported here: no bound from it
        pass
    for limit_file, usage_file in CGROUP_MEMORY_FILES:
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:  # "max" or a huge v1 value: no limit
            candidates.append(max(int(limit) - usage, 0))
        break
    return min(candidates) if candidates else None


@dataclass(frozen=True)
class CpuKVCachePlan:
    """The chosen size: ``num_blocks`` (null block included), the ``max_model_len`` it serves
    (lowered only when the user left it unset) and ``reason``, the log line's explanation."""

    num_blocks: int
    max_model_len: int
    reason: str


def plan_cpu_kv_cache(
    *,
    bytes_per_block: int,
    blocks_for_len: Callable[[int], int],
    max_num_seqs: int,
    max_model_len: int,
    max_model_len_fixed: bool,
    budget_gib: float | None,
    available_bytes: int | None,
) -> CpuKVCachePlan:
    """Size the CPU KV cache (see the module docstring). ``blocks_for_len(n)`` is what one
    request of ``n`` tokens holds at most; it grows with ``n``."""
    if budget_gib is None:
        budget = int(DEFAULT_BUDGET_GIB * GiB)
        source = f"the default {DEFAULT_BUDGET_GIB:g} GiB budget (--cpu-kv-cache-gb)"
        if available_bytes is not None and MEMORY_FRACTION * available_bytes < budget:
            budget = int(MEMORY_FRACTION * available_bytes)
            source = (
                f"{MEMORY_FRACTION:.0%} of the {human_bytes(available_bytes)} of memory available"
            )
    else:
        budget = int(budget_gib * GiB)
        source = f"the cpu_kv_cache_gb={budget_gib:g} budget"
        if available_bytes is not None and budget > available_bytes:
            logger.warning(
                "cpu_kv_cache_gb=%g is more than the %s of memory available: the machine may "
                "swap or kill the process",
                budget_gib,
                human_bytes(available_bytes),
            )
    budget_blocks = budget // bytes_per_block
    per_request = blocks_for_len(max_model_len)
    need_blocks = max_num_seqs * per_request + 1  # + the scheduler's reserved null block

    def need_text(length: int, per: int) -> str:
        return (
            f"max_num_seqs={max_num_seqs} requests of max_model_len={length} "
            f"({per} blocks each, + 1 null block)"
        )

    if budget_blocks >= need_blocks:
        reason = (
            f"all that {need_text(max_model_len, per_request)} can use, within {source} "
            f"({human_bytes(budget)})"
        )
        return CpuKVCachePlan(need_blocks, max_model_len, reason)
    if budget_blocks >= per_request + 1:
        reason = (
            f"capped by {source}; {need_text(max_model_len, per_request)} could use "
            f"{human_bytes(need_blocks * bytes_per_block)}"
        )
        return CpuKVCachePlan(budget_blocks, max_model_len, reason)

    one_request = f"{per_request} ({human_bytes(per_request * bytes_per_block)})"
    if max_model_len_fixed:
        raise ConfigError(
            f"{source} holds {budget_blocks} KV blocks but one request of "
            f"max_model_len={max_model_len} needs {one_request}; raise --cpu-kv-cache-gb "
            "(cpu_kv_cache_gb) or lower --max-model-len"
        )
    fit = _longest_fitting(blocks_for_len, budget_blocks - 1, max_model_len)
    if fit < 2:
        raise ConfigError(
            f"{source} holds {budget_blocks} KV blocks, too few for any request (one of "
            f"max_model_len={max_model_len} needs {one_request}); raise --cpu-kv-cache-gb "
            "(cpu_kv_cache_gb)"
        )
    per_fit = blocks_for_len(fit)
    num_blocks = min(budget_blocks, max_num_seqs * per_fit + 1)
    reason = (
        f"{source}; one request of the model's max_model_len={max_model_len} would need "
        f"{one_request}, so max_model_len is lowered to {fit}, the longest that fits (set "
        "--max-model-len, or raise --cpu-kv-cache-gb)"
    )
    return CpuKVCachePlan(num_blocks, fit, reason)


def _longest_fitting(blocks_for_len: Callable[[int], int], blocks: int, upper: int) -> int:
    """The largest ``n <= upper`` with ``blocks_for_len(n) <= blocks`` (0 if none)."""
    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if blocks_for_len(mid) <= blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo
