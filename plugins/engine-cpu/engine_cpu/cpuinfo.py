"""/proc/cpuinfo fields, for the platform's device name and the compiled kernels' CPU flags
(kept apart so that neither of those modules imports the other)."""

from __future__ import annotations

from pathlib import Path


def cpuinfo_field(name: str) -> str | None:
    """The first ``name`` line's value in /proc/cpuinfo (Linux), else None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None
