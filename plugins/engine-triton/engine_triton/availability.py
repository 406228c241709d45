"""Whether Triton can run here, as reasons (for the backend's ``unavailable_reasons``).

Triton compiles for NVIDIA and AMD GPUs. On a CPU it only runs in its interpreter, enabled with
``TRITON_INTERPRET=1`` (slow; meant for tests).
"""

from __future__ import annotations

import os

from engine.platforms.detect import module_available


def interpreter_enabled() -> bool:
    """True when ``TRITON_INTERPRET=1`` is set (Triton then runs kernels on the CPU)."""
    return os.environ.get("TRITON_INTERPRET", "").strip() in ("1", "true", "True")


def triton_unavailable_reasons(device_type: str | None = None) -> list[str]:
    """Why Triton cannot run kernels on ``device_type`` (``cpu``/``cuda``; None: not known)."""
    if not module_available("triton"):
        return ["the triton package is not installed (pip install engine-llm-triton[triton])"]
    if device_type == "cpu" and not interpreter_enabled():
        return ["on the CPU Triton runs only under its interpreter: set TRITON_INTERPRET=1"]
    return []
