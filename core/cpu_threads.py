"""How many threads the engine computes with on the host CPU (``--cpu-threads``).

torch runs its CPU kernels (and MKL's, oneDNN's) on one OpenMP team of ``N`` threads, the
calling thread included. An op is as slow as its slowest thread, so a team larger than the
cores this process really gets, or cores that other busy threads also want, makes every op wait
for a descheduled thread: on 2 shared cores, 2 threads decoded at a third of the speed of 1.
The default is therefore the *physical* cores this process may use: its CPU affinity (taskset,
cpusets), counted in physical cores when SMT siblings are present, and a cgroup CPU quota
(``docker --cpus``); ``OMP_NUM_THREADS``, when set, is taken as the user's choice.

Between two parallel regions, GNU OpenMP (torch's) keeps its idle threads spinning for a while
(``OMP_WAIT_POLICY`` unset). On cores shared with other work those spinning threads take the
CPU the others, and the team's own late thread, need: on 2 cores shared with other jobs, 2
threads decoded 0.5 tok/s spinning and 4.4 tok/s with ``OMP_WAIT_POLICY=PASSIVE`` (threads
sleep at once). ``prefer_passive_openmp`` makes PASSIVE the default of the ``engine`` command;
libgomp reads it when torch is imported, so it has to be set before that (with ``LLM(...)`` in
your own program, set it in the environment).

Sleeping at once has its own price: every parallel region then starts by waking the team, and a
decode step of a small model is hundreds of short regions. On the 2-vCPU Xeon VM (2026-12-05)
one 1536 x 640 bf16 oneDNN product took 116 us with PASSIVE and 28 us when idle threads spun,
and the embedded Gemma 3 decoded at 16.9 against 22.0 tok/s at batch 1. So with PASSIVE the
engine also sets ``GOMP_SPINCOUNT`` (``SPIN_BEFORE_SLEEP``: libgomp counts about 100,000 spins a
millisecond) unless the user set it: idle threads spin for about a millisecond, which covers
the gaps between the ops of a step, then sleep as before. Under load (two busy processes on
the two cores) the bounded spin decoded as fast as PASSIVE (about 10 tok/s both), not the
collapse an unbounded spin gives. ``OMP_WAIT_POLICY`` set by the user leaves both alone.

``apply_cpu_threads`` sets torch's intra-op team (MKL's follows it) and keeps Hugging Face
tokenizers' Rayon pool, one more thread per core, from competing with it
(``TOKENIZERS_PARALLELISM=false`` unless set: the engine tokenizes one prompt at a time, and a
forked process would otherwise warn and switch it off anyway).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# (quota, period) of a cgroup CPU controller: v2 holds both in one file, v1 in two.
CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"
CGROUP_V1_CPU = ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")


@dataclass(frozen=True)
class CpuThreads:
    """The thread count and where it came from (for the start-up log line)."""

    num_threads: int
    reason: str


def _cgroup_cpu_limit() -> int | None:
    """Whole CPUs allowed by a cgroup quota (rounded up), or None without one."""
    try:
        quota, period = Path(CGROUP_CPU_MAX).read_text().split()[:2]
        if quota != "max":
            return max(1, math.ceil(int(quota) / int(period)))
        return None
    except (OSError, ValueError):
        pass
    try:
        quota = int(Path(CGROUP_V1_CPU[0]).read_text())
        period = int(Path(CGROUP_V1_CPU[1]).read_text())
    except (OSError, ValueError):
        return None
    return max(1, math.ceil(quota / period)) if quota > 0 and period > 0 else None


def available_physical_cores() -> tuple[int, str]:
    """Physical cores this process may run on, and how that was found."""
    logical = os.cpu_count() or 1
    try:
        import psutil

        physical = psutil.cpu_count(logical=False) or logical
    except Exception:  # noqa: BLE001 - psutil missing or unsupported: assume no SMT
        physical = logical
    threads_per_core = max(1, round(logical / physical))
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else logical
    cores = max(1, allowed // threads_per_core)
    how = f"{cores} physical core(s) in this process's CPU affinity ({allowed} logical CPU(s)"
    how += f", {threads_per_core} per core)" if threads_per_core > 1 else ")"
    quota = _cgroup_cpu_limit()
    if quota is not None and quota < cores:
        return quota, f"the cgroup CPU quota of {quota} CPU(s) ({how})"
    return cores, how


def resolve_cpu_threads(requested: int | None) -> CpuThreads:
    """``requested`` (``--cpu-threads``) when given, else ``OMP_NUM_THREADS`` when set, else
    the physical cores available."""
    if requested is not None:
        return CpuThreads(requested, "--cpu-threads")
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return CpuThreads(int(env), "OMP_NUM_THREADS")
    cores, how = available_physical_cores()
    return CpuThreads(cores, how)


# libgomp's spins before an idle thread sleeps (about a millisecond; see the module docstring).
SPIN_BEFORE_SLEEP = "100000"


def prefer_passive_openmp() -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` with a bounded spin (``GOMP_SPINCOUNT``) unless the user chose
    a policy; effective only before torch (libgomp) is loaded, which the CLI guarantees by
    calling this first."""
    if "OMP_WAIT_POLICY" in os.environ:
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ.setdefault("GOMP_SPINCOUNT", SPIN_BEFORE_SLEEP)


def apply_cpu_threads(requested: int | None) -> CpuThreads:
    """Size torch's CPU thread team (see the module docstring) and log the choice."""
    import torch

    choice = resolve_cpu_threads(requested)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(choice.num_threads)
    policy = os.environ.get("OMP_WAIT_POLICY") or "unset: idle threads spin"
    if os.environ.get("GOMP_SPINCOUNT"):
        policy += f" (GOMP_SPINCOUNT={os.environ['GOMP_SPINCOUNT']})"
    logger.info(
        "CPU threads: %d (from %s; --cpu-threads to change); OpenMP wait policy %s",
        choice.num_threads,
        choice.reason,
        policy,
    )
    return choice
