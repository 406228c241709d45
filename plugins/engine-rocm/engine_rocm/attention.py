"""``triton-rocm``: engine-triton's paged attention with AMD launch configurations.

The kernels are engine-triton's (they compile for AMD through Triton's AMDGPU backend); this
backend only picks their tile sizes and launch parameters per gfx family from
``engine_rocm.tuning``, read from the device's ``gcnArchName`` once per device. On a device
without a table (or on the CPU under ``TRITON_INTERPRET=1``) the kernels' defaults apply, and
that is logged once.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, ClassVar

from engine_triton.attention import TritonAttentionBackend

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_ARCH_BY_DEVICE: dict[Any, str | None] = {}


def device_arch(device: torch.device) -> str | None:
    """The gfx architecture of a HIP device (``"gfx942"``), or None for other devices."""
    import torch

    if device.type != "cuda" or not getattr(torch.version, "hip", None):
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _ARCH_BY_DEVICE:
        name = getattr(torch.cuda.get_device_properties(index), "gcnArchName", "") or ""
        _ARCH_BY_DEVICE[index] = name.split(":")[0] or None
    return _ARCH_BY_DEVICE[index]


class RocmTritonAttentionBackend(TritonAttentionBackend):
    """Triton paged attention tuned per AMD gfx family (GQA, sliding window, soft-cap; attention
    sinks as the triton backend declares them: inherited, with ``self.sinks`` passed to the
    kernels)."""

    name: ClassVar[str] = "triton-rocm"
    _logged: ClassVar[set[str | None]] = set()

    def launch_configs(self, device: torch.device) -> dict[str, dict]:
        from engine_rocm.tuning import tuning_for

        arch = device_arch(device)
        key, table = tuning_for(arch) if arch else (None, {})
        if arch not in self._logged:
            self._logged.add(arch)
            if key is None:
                logger.info("triton-rocm: no tuning table for %s; kernel defaults", arch or device)
            else:
                logger.info("triton-rocm: %s uses the %s tuning table", arch, key)
        return table
