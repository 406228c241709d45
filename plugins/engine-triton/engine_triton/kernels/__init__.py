"""Triton kernel overrides, registered for the cuda and rocm platforms.

``register(registry)`` is called from the plugin's ``engine_kernels`` hook (only when the
``triton`` package is importable). Register each kernel with
``registry.register(name, fn, platforms=("cuda", "rocm"), priority=10)``; the provider defaults
to this distribution. Every kernel must match ``engine.kernels.reference`` on random inputs
(the conformance kit, ``-p engine.testing.conformance``, checks it).
"""

from __future__ import annotations

from typing import Any


def register(registry: Any) -> None:
    """Register the Triton kernels with ``registry`` (an ``engine.kernels.KernelRegistry``)."""
    # Nothing yet: the Triton kernels (rms_norm, rotary_embedding, silu_and_mul, ...) are
    # written by the Triton engineer and registered here for platforms=("cuda", "rocm").
    return None
