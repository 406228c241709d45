"""Finding AMD GPUs and their architectures without initialising HIP.

Probes, in order, stopping at the first that answers: the ``amdsmi`` Python bindings (shipped
with ROCm), the KFD topology in ``/sys/class/kfd/kfd/topology/nodes`` (a node with a non-zero
``gfx_target_version`` is a GPU; CPU nodes report 0), and ``rocm-smi --showproductname --json``.
Each failure is kept as a note for the "why not" message. None of them creates a HIP context:
amdsmi and rocm-smi talk to the driver's management interface, KFD is a sysfs read.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from engine_rocm.gfx import gfx_from_target_version

KFD_NODES = Path("/sys/class/kfd/kfd/topology/nodes")


@dataclass
class AmdGpus:
    """What a probe saw: how many GPUs, their gfx architectures (when it could tell) and which
    probe answered (or, for none, every probe's failure)."""

    count: int
    archs: list[str] = field(default_factory=list)
    how: str = ""


def _amdsmi() -> AmdGpus | str:
    try:
        import amdsmi
    except ImportError:
        return "amdsmi not installed"
    try:
        amdsmi.amdsmi_init()
    except Exception as exc:
        return f"amdsmi unavailable ({exc})"
    try:
        handles = amdsmi.amdsmi_get_processor_handles()
        archs = []
        for handle in handles:
            try:
                info = amdsmi.amdsmi_get_gpu_asic_info(handle)
                arch = str(info.get("target_graphics_version", "")).strip()
                if arch:
                    archs.append(arch if arch.startswith("gfx") else f"gfx{arch}")
            except Exception:
                pass
        return AmdGpus(len(handles), archs if len(archs) == len(handles) else [], "amdsmi")
    except Exception as exc:
        return f"amdsmi could not list devices ({exc})"
    finally:
        try:
            amdsmi.amdsmi_shut_down()
        except Exception:
            pass


def _kfd(nodes: Path | None = None) -> AmdGpus | str:
    nodes = KFD_NODES if nodes is None else nodes
    if not nodes.is_dir():
        return f"{nodes.parent.parent.parent} absent (no amdgpu kernel driver loaded)"
    archs = []
    try:
        for node in sorted(nodes.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else 0):
            props = node / "properties"
            if not props.is_file():
                continue
            for line in props.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "gfx_target_version" and value.strip() not in ("", "0"):
                    archs.append(gfx_from_target_version(int(value)))
                    break
    except (OSError, ValueError) as exc:
        return f"cannot read {nodes} ({exc})"
    return AmdGpus(len(archs), archs, str(nodes))


def _rocm_smi() -> AmdGpus | str:
    smi = shutil.which("rocm-smi")
    if smi is None:
        return "rocm-smi not found"
    try:
        out = subprocess.run(
            [smi, "--showproductname", "--json"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"rocm-smi failed ({exc})"
    if out.returncode != 0:
        return f"rocm-smi exited {out.returncode}: {out.stderr.strip()[:200]}"
    try:
        cards = {k: v for k, v in json.loads(out.stdout).items() if k.startswith("card")}
    except (ValueError, AttributeError) as exc:
        return f"rocm-smi printed no JSON ({exc})"
    archs = []
    for card in cards.values():
        arch = str(card.get("GFX Version", "")).strip().lower()
        if arch.startswith("gfx"):
            archs.append(arch)
    return AmdGpus(len(cards), archs if len(archs) == len(cards) else [], "rocm-smi")


PROBES = (_amdsmi, _kfd, _rocm_smi)


def amd_gpus() -> AmdGpus:
    """The first probe's answer; ``AmdGpus(0, [], notes)`` when none could tell."""
    notes = []
    for probe in PROBES:
        result = probe()
        if isinstance(result, AmdGpus):
            return result
        notes.append(result)
    return AmdGpus(0, [], "; ".join(notes))


def amd_gpu_count() -> tuple[int, str]:
    """``(count, how)``; ``(0, notes)`` with every probe's failure when none could tell."""
    gpus = amd_gpus()
    return gpus.count, gpus.how
