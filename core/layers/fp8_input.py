"""FP8 activations written by the kernel that produces them, not by a second pass.

An FP8 linear with W8A8 and dynamic per-token scales quantizes its bf16 input to e4m3 first
(``quantize_fp8`` in engine-triton: one more kernel per projection, 8% of a 256-row step of
Llama-3.1-8B on an H100). When the input comes straight from an RMSNorm or a SiLU-and-mul
that feeds nothing else, that kernel can write e4m3 and the per-token scales itself
(``*_quant_fp8`` in the kernel registry) and hand the linear an
``engine.kernels.quantized.Fp8Activation``. vLLM does the same (its fusion passes on norms
and SiLU-and-mul).

How it is wired:

* **Models declare** which producer feeds which linear alone, as ``(producer, consumer)``
  sub-module paths in a class attribute ``fp8_input_producers`` (the Llama decoder layer:
  ``input_layernorm -> self_attn.qkv_proj`` and ``post_attention_layernorm ->
  mlp.gate_up_proj``; the gated MLP: ``act_fn -> down_proj``). A producer is a module with
  ``fp8_fusion_reasons()`` and ``feed_fp8(consumer)`` (``RMSNorm``, ``GatedActivation``).
* **After loading** (``link_fp8_inputs``, called by the model loader) a pair is linked when
  the producer can write e4m3 exactly (its fused op comes from the same kernel provider as its
  plain op) and the consumer's method takes an ``Fp8Activation`` at all
  (``LinearBase.fp8_input_min_rows()`` is not None: ``Fp8LinearMethod`` with W8A8 and
  dynamic scales, on a bound ``fp8_linear`` that accepts one).
* **At every call** the linked producer asks its consumer again from how many rows it takes
  one (``fp8_input_min_rows``) and compares the row count: engine-triton multiplies up to 16
  rows weight-only, so decode batches that small keep the plain path, and a method swapped in
  after loading (a LoRA wrapper, which answers None) is never handed one. The check is on
  shapes only, so CUDA graph capture records whichever path the captured batch size takes.

The result is bit-identical to the unfused path: the fused kernels quantize the values the
plain op would have stored, with ``fp8_linear``'s formula (``engine.kernels.reference``).
Static activation scales, block-wise (128-group) FP8 and weight-only FP8 (the CPU) stay
unfused.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from torch import nn

    from engine.layers.linear import LinearBase

logger = logging.getLogger(__name__)

#: the class attribute a module declares its (producer, consumer) pairs in
PRODUCERS_ATTR = "fp8_input_producers"


class FeedsFp8:
    """The consumer side of an ``Fp8InputProducer`` (a mixin of ``RMSNorm`` and
    ``GatedActivation``): the linear it is linked to, held in a tuple so that it is not
    registered as a submodule, and whether a call of so many rows writes e4m3 for it."""

    _fp8_consumer: tuple[LinearBase, ...] = ()

    def feed_fp8(self, consumer: LinearBase | None) -> None:
        """Write e4m3 for ``consumer`` (the only user of this module's output) whenever it
        takes it (``consumer.fp8_input_min_rows()``); None: always return the plain output."""
        self._fp8_consumer = () if consumer is None else (consumer,)

    def _writes_fp8(self, rows: int) -> bool:
        """Whether a call of ``rows`` rows hands the linked linear an ``Fp8Activation``: it is
        asked at every call, so a method swapped in later answers for itself."""
        if not self._fp8_consumer:
            return False
        min_rows = self._fp8_consumer[0].fp8_input_min_rows()
        return min_rows is not None and rows >= min_rows


@runtime_checkable
class Fp8InputProducer(Protocol):
    """A module that can return an ``Fp8Activation`` for the linear its output feeds."""

    def fp8_fusion_reasons(self) -> list[str]:
        """Why it cannot write e4m3 exactly as the linear would quantize (empty: it can)."""

    def feed_fp8(self, consumer: LinearBase | None) -> None:
        """Write e4m3 for ``consumer`` when it takes it (None: never)."""


def exact_fusion_reasons(kernels: object, *pairs: tuple[str, str]) -> list[str]:
    """Why the fused ops of ``pairs`` ((plain op, fused op) names) may differ from their plain
    op followed by ``fp8_linear``'s quantization: each fused op must come from the provider of
    the op it replaces (the torch reference for both, or one plugin for both), which computes
    the values the same way; a fused reference next to a plugin's own norm could round
    differently."""
    provider = getattr(kernels, "provider", None)
    if provider is None:
        return ["its ops are not bound from a kernel registry"]
    return [
        f"{fused} comes from {provider(fused)} but {plain} from {provider(plain)}"
        for plain, fused in pairs
        if provider(plain) != provider(fused)
    ]


def _pair_reasons(producer: object, consumer: object) -> list[str]:
    if not isinstance(producer, Fp8InputProducer):
        return [f"{type(producer).__name__} cannot write FP8"]
    fp8_input_min_rows = getattr(consumer, "fp8_input_min_rows", None)
    if fp8_input_min_rows is None:
        return [f"{type(consumer).__name__} is not a linear layer"]
    reasons = list(producer.fp8_fusion_reasons())
    if fp8_input_min_rows() is None:
        method = getattr(consumer, "quant_method", None)
        reasons.append(f"its method ({getattr(method, 'name', method)}) takes no FP8 input")
    return reasons


def link_fp8_inputs(model: nn.Module) -> dict[str, list[str]]:
    """Link every declared (producer, consumer) pair of ``model`` that can be fused, unlink
    the others. Returns ``{"producer -> consumer": reasons}`` (empty reasons: linked)."""
    result: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        for producer_path, consumer_path in getattr(module, PRODUCERS_ATTR, ()):
            producer = module.get_submodule(producer_path)
            consumer = module.get_submodule(consumer_path)
            reasons = _pair_reasons(producer, consumer)
            if isinstance(producer, Fp8InputProducer):
                producer.feed_fp8(None if reasons else consumer)  # type: ignore[arg-type]
            prefix = f"{name}." if name else ""
            result[f"{prefix}{producer_path} -> {prefix}{consumer_path}"] = reasons
    linked = sum(not r for r in result.values())
    if linked:
        logger.info("fp8: %d norm/activation outputs written as FP8 for their linears", linked)
    return result


def unlink_fp8_inputs(model: nn.Module) -> None:
    """Every producer of ``model`` returns its plain output again (tests compare the paths)."""
    for module in model.modules():
        if isinstance(module, Fp8InputProducer):
            module.feed_fp8(None)
