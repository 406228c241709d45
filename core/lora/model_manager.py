"""The device side of multi-LoRA serving: wrapped layers, device slots, the host cache.

``LoRAModelManager(model, config, ...)`` wraps every linear layer of the model's decoder
(``engine.lora.layers.wrap_layer``) and owns:

* the **registered adapters** (``add_adapter(key, request)``): each one read from disk and
  checked against the model when it is added, so a bad adapter fails there, with the reason;
* the **host cache** of prepared adapters (this rank's shards, in the model dtype, pinned on
  GPUs), an LRU of ``max_cpu_loras``; an adapter evicted from it is read from disk again when a
  step needs it;
* the **device slots**, an LRU of ``max_loras``: ``prepare(scheduled)`` gives every adapter of
  the step a slot (copying it in from the host cache when it has none, evicting the least
  recently used adapter the step does not need) and writes the per-token slot mapping.

Adapters are keyed by the engine's key (``Request.lora_id``, unique for the engine's life), not
by the user's ``lora_int_id``, so an adapter reloaded under the same id never meets stale state.
The scheduler guarantees at most ``max_loras`` adapters per step; ``prepare`` checks it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from engine.layers.linear import LinearBase
from engine.lora.errors import LoRAAdapterError
from engine.lora.layers import LoRALayerTarget, wrap_layer
from engine.lora.mapping import LoRABatchMapping
from engine.lora.peft import load_peft_adapter

if TYPE_CHECKING:
    from engine.kernels.registry import Kernels
    from engine.lora.config import LoRAConfig
    from engine.lora.request import LoRARequest
    from engine.scheduler_output import ScheduledRequest

logger = logging.getLogger(__name__)


@dataclass
class PreparedAdapter:
    """An adapter ready for a slot: per wrapped layer, per output slice, this rank's
    ``(A [r, in_r], B [out_r, r])`` (B scaled), in the model dtype."""

    request: LoRARequest
    layers: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]]
    nbytes: int


def decoder_linears(model: nn.Module) -> dict[str, LinearBase]:
    """The linear layers LoRA may target: those of the decoder stack (``model.model``), by
    their checkpoint names (``model.layers.0.self_attn.qkv_proj``)."""
    decoder = getattr(model, "model", None)
    if not isinstance(decoder, nn.Module):
        raise LoRAAdapterError(f"{type(model).__name__} has no decoder stack for LoRA", None)
    return {
        name: module
        for name, module in decoder.named_modules(prefix="model")
        if isinstance(module, LinearBase)
    }


def _slice_modules(name: str, layer: LinearBase, packed: dict[str, list[str]]) -> list[str]:
    """The PEFT module names feeding each output slice of layer ``name``: a fused layer
    (``qkv_proj``) lists its checkpoint modules (``q_proj``, ``k_proj``, ``v_proj``)."""
    parent, _, leaf = name.rpartition(".")
    num_slices = len(layer.output_partition_sizes)
    parts = packed.get(leaf)
    if parts is not None and len(parts) == num_slices:
        return [f"{parent}.{p}" if parent else p for p in parts]
    if num_slices != 1:
        raise ValueError(
            f"{name} has {num_slices} fused output slices but the model's "
            "packed_modules_mapping does not name their checkpoint modules"
        )
    return [name]


class LoRAModelManager:
    """See the module docstring. Built by the model runner after the model is loaded (and
    before the KV cache is sized, so the slot buffers are part of the memory profile)."""

    def __init__(
        self,
        model: nn.Module,
        config: LoRAConfig,
        kernels: Kernels | None,
        device: torch.device,
        max_num_tokens: int,
    ) -> None:
        self.config = config
        self.device = device
        self.num_slots = config.max_loras
        self.max_rank = config.max_lora_rank
        self.mapping = LoRABatchMapping(max_num_tokens, self.num_slots, device)
        fuse = config.fused_shrink
        if fuse is None:
            fuse = device.type != "cpu"
        packed = dict(getattr(model, "packed_modules_mapping", None) or {})
        # A model whose checkpoint nests the decoder (Gemma 3 with images) names an adapter's
        # modules as ours, or refuses those it cannot adapt, with the reason (ValueError).
        self._module_name = getattr(model, "lora_module_name", None)
        self.targets: dict[str, LoRALayerTarget] = {}
        self._by_module: dict[str, tuple[LoRALayerTarget, int]] = {}
        dtype = None
        for name, layer in decoder_linears(model).items():
            wrap_layer(layer, self.num_slots, self.max_rank, self.mapping, kernels, fuse)
            target = LoRALayerTarget(name, layer, _slice_modules(name, layer, packed))
            self.targets[name] = target
            for s, module in enumerate(target.slice_modules):
                self._by_module[module] = (target, s)
            dtype = layer.lora_a_stacked.dtype
        if not self.targets:
            raise LoRAAdapterError(f"{type(model).__name__} has no linear layers for LoRA", None)
        self.dtype = dtype
        self._pin = device.type != "cpu" and torch.cuda.is_available()
        self._registered: dict[int, LoRARequest] = {}
        self._host: OrderedDict[int, PreparedAdapter] = OrderedDict()
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # LRU order, oldest first
        self._slot_owner: list[int | None] = [None] * self.num_slots
        self.num_slot_loads = 0
        self.num_disk_loads = 0
        self.num_fused = sum(
            1 for t in self.targets.values() if t.layer.quant_method.augmented is not None
        )
        logger.info(
            "LoRA: %d linear layers wrapped (%d with the shrink in their GEMM), %d device slots "
            "of rank %d (%.1f MiB), host cache of %d adapters",
            len(self.targets),
            self.num_fused,
            self.num_slots,
            self.max_rank,
            self.slot_bytes() / 2**20,
            config.max_cpu_loras,
        )

    @property
    def module_names(self) -> list[str]:
        """The PEFT module names an adapter may adapt (``model.layers.0.self_attn.q_proj``)."""
        return list(self._by_module)

    def slot_bytes(self) -> int:
        """Device bytes of every layer's slot buffers."""
        return sum(
            t.layer.lora_a_stacked.numel() * t.layer.lora_a_stacked.element_size()
            + t.layer.lora_b_stacked.numel() * t.layer.lora_b_stacked.element_size()
            for t in self.targets.values()
        )

    # ---- adapters -----------------------------------------------------------------------------
    def add_adapter(self, key: int, request: LoRARequest) -> None:
        """Register an adapter under ``key``: read, check and prepare it now (into the host
        cache). Raises ``LoRAAdapterError`` with the reason; nothing is kept then."""
        if key in self._registered:
            return
        prepared = self._prepare_adapter(request)
        self._registered[key] = request
        self._cache_host(key, prepared)

    def remove_adapter(self, key: int) -> None:
        """Forget an adapter: its host copy and its device slot (unknown keys are ignored)."""
        self._registered.pop(key, None)
        self._host.pop(key, None)
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._slot_owner[slot] = None

    def registered(self) -> dict[int, LoRARequest]:
        return dict(self._registered)

    def in_slots(self) -> dict[int, int]:
        """Adapter key -> device slot, for the adapters in a slot now."""
        return dict(self._slot_of)

    def host_cached(self) -> list[int]:
        """Adapter keys in the host cache, least recently used first."""
        return list(self._host)

    def _prepare_adapter(self, request: LoRARequest) -> PreparedAdapter:
        adapter = load_peft_adapter(request.lora_path, self.max_rank)
        name = request.lora_name
        if self._module_name is not None:
            try:
                adapter.modules = {self._module_name(m): w for m, w in adapter.modules.items()}
            except ValueError as e:
                raise LoRAAdapterError(f"LoRA adapter {name!r}: {e}") from None
        unknown = [m for m in adapter.modules if m not in self._by_module]
        if unknown:
            raise LoRAAdapterError(self._unknown_modules_message(name, unknown))
        layers: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]] = {}
        nbytes = 0
        for module, weights in adapter.modules.items():
            target, s = self._by_module[module]
            a, b = target.shard(name, s, weights, self.dtype)
            if self._pin:
                a, b = a.pin_memory(), b.pin_memory()
            layers.setdefault(target.name, [None] * len(target.slice_modules))[s] = (a, b)
            nbytes += a.numel() * a.element_size() + b.numel() * b.element_size()
        self.num_disk_loads += 1
        return PreparedAdapter(request, layers, nbytes)

    def _unknown_modules_message(self, name: str, unknown: list[str]) -> str:
        leaves = sorted({m.split(".")[-1] for m in unknown})
        served = sorted({m.split(".")[-1] for m in self._by_module})
        detail = ""
        if any(".experts." in m for m in unknown):
            detail = " (LoRA on mixture-of-experts experts is not supported)"
        return (
            f"LoRA adapter {name!r} adapts modules the model does not have as linear layers"
            f"{detail}: {', '.join(leaves)} (e.g. {unknown[0]}); the model's LoRA targets are "
            f"{', '.join(served)}"
        )

    def _cache_host(self, key: int, prepared: PreparedAdapter) -> None:
        self._host[key] = prepared
        self._host.move_to_end(key)
        while len(self._host) > int(self.config.max_cpu_loras or self.num_slots):
            self._host.popitem(last=False)

    def _host_copy(self, key: int) -> PreparedAdapter:
        prepared = self._host.get(key)
        if prepared is not None:
            self._host.move_to_end(key)
            return prepared
        request = self._registered.get(key)
        if request is None:
            raise RuntimeError(f"LoRA adapter key {key} is not registered")
        prepared = self._prepare_adapter(request)  # evicted from the host cache: read again
        self._cache_host(key, prepared)
        return prepared

    # ---- slots --------------------------------------------------------------------------------
    def _load_slot(self, slot: int, prepared: PreparedAdapter) -> None:
        rank = self.max_rank
        blocking = not self._pin
        for name, target in self.targets.items():
            a_buf, b_buf = target.layer.lora_a_stacked[slot], target.layer.lora_b_stacked[slot]
            a_buf.zero_()
            b_buf.zero_()
            slices = prepared.layers.get(name)
            if slices is None:
                continue
            start = 0
            for s, pair in enumerate(slices):
                size = target.layer.output_partition_sizes[s]
                if pair is not None:
                    a, b = pair
                    r = a.shape[0]
                    a_buf[s * rank : s * rank + r].copy_(a, non_blocking=not blocking)
                    b_buf[start : start + size, :r].copy_(b, non_blocking=not blocking)
                start += size
        self.num_slot_loads += 1

    def _assign_slots(self, keys: Sequence[int]) -> dict[int, int]:
        """A slot for every adapter key of a step (at most ``num_slots`` of them)."""
        if len(keys) > self.num_slots:
            raise RuntimeError(
                f"a step uses {len(keys)} LoRA adapters but there are only {self.num_slots} "
                "slots (max_loras); the scheduler must not schedule that"
            )
        needed = set(keys)
        for key in keys:
            if key in self._slot_of:
                continue
            prepared = self._host_copy(key)
            if None in self._slot_owner:
                slot = self._slot_owner.index(None)
            else:
                victim = next(k for k in self._slot_of if k not in needed)
                slot = self._slot_of.pop(victim)
            self._load_slot(slot, prepared)
            self._slot_owner[slot] = key
            self._slot_of[key] = slot
        for key in keys:
            self._slot_of.move_to_end(key)
        return {key: self._slot_of[key] for key in keys}

    def prepare(self, scheduled: Sequence[ScheduledRequest]) -> None:
        """Before a step's forward: slots for its adapters and the per-token mapping."""
        keys = list(dict.fromkeys(s.request.lora_id for s in scheduled if s.request.lora_id))
        if not keys:
            self.mapping.set(np.zeros(0, dtype=np.int32))
            return
        slots = self._assign_slots(keys)
        per_request = np.fromiter(
            (slots.get(s.request.lora_id, -1) if s.request.lora_id else -1 for s in scheduled),
            dtype=np.int32,
            count=len(scheduled),
        )
        lens = np.fromiter(
            (s.num_new_tokens for s in scheduled), dtype=np.int64, count=len(scheduled)
        )
        self.mapping.set(np.repeat(per_request, lens))

    def capturing(self) -> Any:
        """Context manager: the LoRA kernels run (on an empty mapping) while graphs are
        captured, so the graphs contain them."""
        return self.mapping.capturing()
