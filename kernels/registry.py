"""The kernel registry: named ops with torch references that plugins override per platform.

Plugins register implementations from their ``engine_kernels(registry)`` hook::

    registry.register("rms_norm", my_rms_norm, platforms=("cuda", "rocm"), priority=10,
                      provider="engine-llm-triton")

``resolve(platform)`` then binds, for every op, the highest-priority implementation that lists
that platform (or all platforms); the torch reference sits at priority 0 everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

KERNEL_NAMES = (
    "rms_norm",
    "fused_add_rms_norm",
    "rotary_embedding",
    "qk_norm_rotary",
    "silu_and_mul",
    "gelu_tanh_and_mul",
    # The norms and SiLU-and-mul writing e4m3 per token for an FP8 linear (W8A8).
    "rms_norm_quant_fp8",
    "fused_add_rms_norm_quant_fp8",
    "silu_and_mul_quant_fp8",
    "write_kv_cache",
    "linear",
    "argmax",
    "moe_topk_softmax",
    "fused_moe",
    # Experts with biases and a choice of activation, GPT-OSS's clamped SwiGLU among them
    # (engine.kernels.reference.fused_moe_biased).
    "fused_moe_biased",
    # FP8 experts, weight-only (engine.kernels.reference.fused_moe_fp8).
    "fused_moe_fp8",
    # 4/8-bit integer experts in groups (GPTQ, AWQ, compressed-tensors), weight-only
    # (engine.kernels.reference.fused_moe_wna16).
    "fused_moe_wna16",
    # MXFP4 experts (GPT-OSS as released) with biases and a choice of activation, weight-only
    # (engine.kernels.reference.fused_moe_mxfp4).
    "fused_moe_mxfp4",
    # Quantized matmuls (engine.kernels.quantized); wna16_linear carries its own prepack.
    "fp8_linear",
    "fp8_block_linear",
    "int8_linear",
    "wna16_linear",
    "add_lora_linear",
    "lora_expand_augmented",
    # GGUF blocks kept quantized (engine.kernels.gguf), with their own prepack too.
    "gguf_linear",
)

# Ops with their own weight layout: an implementation is an object with a ``prepack`` method
# (run once at load) besides ``__call__`` (see ``engine.kernels.quantized``).
PREPACKED_KERNELS = frozenset({"wna16_linear", "gguf_linear"})


class KernelError(ValueError):
    """A kernel was registered under an unknown name or with a bad argument."""


@dataclass(frozen=True)
class KernelImpl:
    """One registered implementation of a named op."""

    name: str
    fn: Callable[..., Any]
    platforms: tuple[str, ...] | None  # None: every platform
    priority: int
    provider: str

    def serves(self, platform: str) -> bool:
        return self.platforms is None or platform in self.platforms


class Kernels:
    """The ops bound for one platform; call them as attributes: ``kernels.rms_norm(x, w, eps)``."""

    def __init__(self, platform: str, impls: dict[str, KernelImpl]) -> None:
        self.platform = platform
        self.impls = impls
        for name, impl in impls.items():
            setattr(self, name, impl.fn)

    def provider(self, name: str) -> str:
        return self.impls[name].provider

    def is_reference(self, name: str) -> bool:
        """Whether op ``name`` is bound to the core's torch reference (no plugin overrides it
        on this platform)."""
        return self.impls[name].priority <= 0


class KernelRegistry:
    """All registered implementations of all named ops (see ``KERNEL_NAMES``)."""

    def __init__(self, with_reference: bool = True) -> None:
        self._impls: dict[str, list[KernelImpl]] = {name: [] for name in KERNEL_NAMES}
        self._default_provider = "unknown"
        if with_reference:
            from engine.kernels.reference import REFERENCE_KERNELS

            for name, fn in REFERENCE_KERNELS.items():
                self.register(name, fn, priority=0, provider="engine-llm (torch reference)")

    def register(
        self,
        name: str,
        fn: Callable[..., Any],
        *,
        platforms: Iterable[str] | None = None,
        priority: int = 10,
        provider: str | None = None,
    ) -> None:
        """Add an implementation of op ``name``. ``platforms`` lists the platform names it
        serves (None: all); ``provider`` defaults to the plugin whose hook is running."""
        provider = self._default_provider if provider is None else provider
        if name not in self._impls:
            raise KernelError(
                f"{provider} registered unknown kernel {name!r}; known kernels: "
                f"{', '.join(KERNEL_NAMES)}"
            )
        if not callable(fn):
            raise KernelError(f"{provider} registered a non-callable for kernel {name!r}")
        if name in PREPACKED_KERNELS and not callable(getattr(fn, "prepack", None)):
            raise KernelError(
                f"{provider} registered kernel {name!r} without a prepack method: this op has "
                "its own weight layout, so an implementation is an object with prepack(...) "
                "(run once at load) and __call__(x, packed, ...); see engine.kernels.quantized"
            )
        plats = tuple(platforms) if platforms is not None else None
        self._impls[name].append(KernelImpl(name, fn, plats, priority, provider))

    @contextmanager
    def providing(self, provider: str) -> Iterator[None]:
        """Credit registrations that name no provider to ``provider`` (the plugin manager
        wraps each plugin's ``engine_kernels`` hook in this)."""
        previous, self._default_provider = self._default_provider, provider
        try:
            yield
        finally:
            self._default_provider = previous

    def implementations(self, name: str) -> list[KernelImpl]:
        return sorted(self._impls[name], key=lambda i: -i.priority)

    def resolve(self, platform: str) -> Kernels:
        chosen = {}
        for name in KERNEL_NAMES:
            for impl in self.implementations(name):
                if impl.serves(platform):
                    chosen[name] = impl
                    break
            else:
                raise KernelError(
                    f"no implementation of kernel {name!r} serves platform {platform!r}"
                )
        return Kernels(platform, chosen)

    def overrides(self) -> list[KernelImpl]:
        """Every non-reference implementation, for ``engine plugins``."""
        return [i for impls in self._impls.values() for i in impls if i.priority > 0]
