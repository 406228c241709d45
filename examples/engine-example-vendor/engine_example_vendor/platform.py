"""The ``examplevendor`` platform: a simulated device that computes on the host CPU."""

from __future__ import annotations

import os
from typing import Any, ClassVar

from engine.platforms.interface import Platform

DEVICE_ENV = "EXAMPLE_VENDOR_DEVICE"


class ExampleVendorPlatform(Platform):
    """A vendor platform. Priority 200 puts it above the built-in ones (100) and the CPU (0)
    whenever it is available, which is only when ``EXAMPLE_VENDOR_DEVICE=1``."""

    name: ClassVar[str] = "examplevendor"
    device_type: ClassVar[str] = "cpu"
    dist_backend: ClassVar[str] = "gloo"
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")
    priority: ClassVar[int] = 200

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        # Real plugins ask their driver here, cheaply (no device context, no heavy imports).
        if os.environ.get(DEVICE_ENV) != "1":
            return [f"no example vendor device (simulated: set {DEVICE_ENV}=1)"]
        return []

    @classmethod
    def device_name(cls, index: int = 0) -> str:
        return f"Example Vendor Simulated Device {index}"

    @classmethod
    def total_memory(cls, index: int = 0) -> int:
        import psutil

        return int(psutil.virtual_memory().total)

    @classmethod
    def free_memory(cls, index: int = 0) -> int:
        import psutil

        return int(psutil.virtual_memory().available)

    @classmethod
    def peak_memory(cls, index: int = 0) -> int:
        import psutil

        # The simulated device has no allocator statistics; the process's RSS bounds it.
        return int(psutil.Process().memory_info().rss)

    @classmethod
    def default_attention_backends(cls, config: Any = None) -> list[str]:
        return ["example", "torch"]
