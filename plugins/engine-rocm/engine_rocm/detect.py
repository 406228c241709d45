"""Counting AMD GPUs without initialising HIP.

Tried in order: the ``amdsmi`` Python bindings (shipped with ROCm), then the KFD topology in
``/sys/class/kfd/kfd/topology/nodes`` (a node with a non-zero ``gfx_target_version`` is a GPU;
CPU nodes report 0).
"""

from __future__ import annotations

from pathlib import Path

KFD_NODES = Path("/sys/class/kfd/kfd/topology/nodes")


def _amdsmi_count() -> tuple[int | None, str]:
    try:
        import amdsmi
    except ImportError:
        return None, "amdsmi not installed"
    try:
        amdsmi.amdsmi_init()
    except Exception as exc:
        return None, f"amdsmi unavailable ({exc})"
    try:
        return len(amdsmi.amdsmi_get_processor_handles()), "amdsmi"
    except Exception as exc:
        return None, f"amdsmi could not list devices ({exc})"
    finally:
        try:
            amdsmi.amdsmi_shut_down()
        except Exception:
            pass


def _kfd_count() -> tuple[int | None, str]:
    if not KFD_NODES.is_dir():
        return None, "/sys/class/kfd absent (no amdgpu kernel driver loaded)"
    count = 0
    try:
        for node in KFD_NODES.iterdir():
            props = node / "properties"
            if not props.is_file():
                continue
            for line in props.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "gfx_target_version" and value.strip() not in ("", "0"):
                    count += 1
                    break
    except OSError as exc:
        return None, f"cannot read {KFD_NODES} ({exc})"
    return count, str(KFD_NODES)


def amd_gpu_count() -> tuple[int, str]:
    """``(count, how)``; ``(0, notes)`` with every probe's failure when none could tell."""
    notes = []
    for probe in (_amdsmi_count, _kfd_count):
        count, how = probe()
        if count is not None:
            return count, how
        notes.append(how)
    return 0, "; ".join(notes)
