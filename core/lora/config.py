"""``LoRAConfig``: the LoRA limits of an engine (``--enable-lora`` and friends); torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import ConfigError


@dataclass
class LoRAConfig:
    """Multi-LoRA serving limits, named as vLLM's flags.

    ``max_loras`` (``--max-loras``): adapters one step may run, i.e. the device slots each LoRA
    layer holds; the scheduler never puts more distinct adapters in one step. ``max_lora_rank``
    (``--max-lora-rank``): the largest adapter rank accepted; every slot is this wide, so it
    sizes the device buffers and the kernels' work. ``max_cpu_loras`` (``--max-cpu-loras``):
    adapters kept loaded in host memory (an LRU cache; evicted adapters are read from disk again
    when a request needs them); None means ``max_loras``.

    ``fused_shrink`` (``--lora-fused-shrink``, this engine's): compute the adapters' shrink in
    the base GEMM of unquantized layers (their A matrices appended to the weight, see
    ``engine.lora.layers``); None: on accelerators, not on the CPU (whose oneDNN-packed
    weights cannot grow rows); False: a separate shrink kernel everywhere.
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    fused_shrink: bool | None = None

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ConfigError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ConfigError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif self.max_cpu_loras < self.max_loras:
            raise ConfigError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}), "
                "as in vLLM: the adapters of one step are staged in host memory"
            )
