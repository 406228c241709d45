"""What every quantization method shares: the spec it is checked against, the config base class
(one class per ``--quantization`` name, one instance per model), and the error type.

A quantization method is a ``QuantizationConfig`` subclass registered under a name
(``engine.quantization.registry``). Its class attributes say what it can serve — which checkpoint
formats it reads (``quantization_config.quant_method`` values), on which device types, in which
activation dtypes, from which device capability, and through which named kernels — and
``supports(spec)`` turns them into human-readable reasons, as attention backends do. An instance,
built from a checkpoint's ``quantization_config`` (``from_config``) or from the flag alone
(``from_flag``, online quantization), is the model's ``ModelContext.quant_config``: it picks each
linear layer's ``LinearMethod`` by the layer's checkpoint prefix (``get_linear_method``).
"""

from __future__ import annotations

import fnmatch
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from engine.config import ConfigError

if TYPE_CHECKING:
    from engine.kernels.registry import Kernels
    from engine.layers.linear import LinearBase, LinearMethod

logger = logging.getLogger(__name__)

# Which checkpoint modules feed the fused layers of the built-in models. A model class may
# declare its own ``packed_modules_mapping``; the loader hands it to the config.
DEFAULT_PACKED_MODULES = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}


class QuantizationError(ConfigError):
    """A quantization setting cannot be served: an unknown method, a checkpoint format no
    method reads, a bit width / group size / scheme the method does not support, or a device it
    cannot run on. The message says what is supported."""


@dataclass(frozen=True)
class QuantizationSpec:
    """Where a quantization method is asked to run (``None``: not known yet; ``engine plugins``
    checks methods before any model is chosen).

    ``capability`` is the device's compute capability (CUDA's ``(major, minor)``), None on a
    CPU; ``kernels`` are the ops bound on the platform, so a method can tell whether a real
    kernel serves it or only the torch reference (which dequantizes on every call).
    """

    platform: str | None = None
    device_type: str | None = None
    capability: tuple[int, int] | None = None
    dtype: str | None = None  # the activations' dtype: float32 | bfloat16 | float16
    kernels: Kernels | None = None

    @property
    def is_cpu(self) -> bool:
        return self.device_type == "cpu"

    def has_capability(self, minimum: tuple[int, int]) -> bool:
        """True when the device is known to reach ``minimum`` (a CUDA device's capability)."""
        return self.capability is not None and tuple(self.capability) >= tuple(minimum)


def format_capability(capability: tuple[int, int] | None) -> str:
    return "unknown" if capability is None else f"sm_{capability[0]}{capability[1]}"


class QuantizationConfig:
    """One quantization method: its class describes what it serves, an instance is one model's
    configuration (``ModelContext.quant_config``).

    Subclasses set the class attributes, implement ``from_config`` (and ``from_flag`` when the
    method can quantize an unquantized checkpoint at load) and ``get_linear_method``.
    """

    #: the ``--quantization`` name (vLLM's)
    name: ClassVar[str] = "unnamed"
    #: ``quantization_config.quant_method`` values of the checkpoints this method reads
    checkpoint_formats: ClassVar[tuple[str, ...]] = ()
    #: a one-line description for ``engine plugins``
    description: ClassVar[str] = ""
    device_types: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16", "float16")
    #: the lowest CUDA compute capability served (None: any)
    min_capability: ClassVar[tuple[int, int] | None] = None
    #: named kernels (``engine.kernels``) the method's layers multiply with
    kernel_names: ClassVar[tuple[str, ...]] = ()
    #: True when built by ``from_flag`` (quantizing an unquantized checkpoint at load; set by
    #: the registry): a model may then keep parts the checkpoint's authors never quantized,
    #: such as a vision tower, in full precision.
    online: bool = False

    def __init__(self) -> None:
        # Checkpoint module names that feed each fused layer (set by the loader from the model
        # class; the built-in models' mapping by default).
        self.packed_modules_mapping: dict[str, list[str]] = dict(DEFAULT_PACKED_MODULES)
        # (checkpoint prefix, our prefix) where this checkpoint names our modules otherwise
        # (a multimodal checkpoint's ``language_model.model.*`` for our ``model.*``); set by the
        # loader from the checkpoint's tensor names (``checkpoint_prefixes_in``).
        self.checkpoint_prefixes: list[tuple[str, str]] = []

    # ---- what the method can serve -------------------------------------------------------
    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        """Reasons independent of the model and device (a missing package). Cheap."""
        return []

    @classmethod
    def supports(
        cls, spec: QuantizationSpec, kernel_names: Sequence[str] | None = None
    ) -> list[str]:
        """Human-readable reasons this method cannot run on ``spec``; empty when it can.
        ``kernel_names``: the kernels to check (default: every one the method may use)."""
        reasons = list(cls.unavailable_reasons())
        if spec.device_type is not None and spec.device_type not in cls.device_types:
            reasons.append(f"runs on {'/'.join(cls.device_types)} devices, not {spec.device_type}")
        if spec.dtype is not None and spec.dtype not in cls.supported_dtypes:
            reasons.append(
                f"activation dtype {spec.dtype} not supported "
                f"(supported: {', '.join(cls.supported_dtypes)})"
            )
        if (
            cls.min_capability is not None
            and spec.device_type not in (None, "cpu")
            and spec.capability is not None
            and tuple(spec.capability) < cls.min_capability
        ):
            reasons.append(
                f"needs compute capability {format_capability(cls.min_capability)} or newer, "
                f"the device has {format_capability(spec.capability)}"
            )
        names = cls.kernel_names if kernel_names is None else kernel_names
        reasons += kernel_reasons(names, spec)
        return reasons

    def used_kernels(self) -> tuple[str, ...]:
        """The kernels this configured model multiplies with (default: all the method's)."""
        return self.kernel_names

    def check(self, spec: QuantizationSpec) -> list[str]:
        """Reasons this configured model cannot run on ``spec``: the class's, for the kernels
        it actually uses."""
        return type(self).supports(spec, self.used_kernels())

    def bind(self, spec: QuantizationSpec) -> None:
        """Choose device-dependent modes once the device is known (e.g. FP8 W8A8 where the
        device has FP8 arithmetic, weight-only elsewhere) and log any that the user should know
        of. Called by the registry after ``check`` passed; the default does nothing."""

    # ---- building -------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> QuantizationConfig:
        """The configuration of a checkpoint quantized in one of ``checkpoint_formats``
        (config.json's ``quantization_config``). Raises ``QuantizationError`` naming what is
        supported when the checkpoint uses a bit width, group size or scheme this method does
        not serve."""
        raise NotImplementedError

    @classmethod
    def from_flag(cls) -> QuantizationConfig:
        """The configuration for ``--quantization NAME`` on a checkpoint without a
        ``quantization_config`` (online quantization at load). Methods that only read
        pre-quantized checkpoints refuse."""
        formats = ", ".join(cls.checkpoint_formats) or cls.name
        raise QuantizationError(
            f"--quantization {cls.name} needs a checkpoint quantized in the {formats} format "
            "(config.json with a quantization_config naming it), but this model has none. "
            "Online quantization of an unquantized checkpoint: --quantization fp8."
        )

    def describe(self) -> str:
        """One line for the log: the method and its settings."""
        return self.name

    # ---- per layer --------------------------------------------------------------------------
    def get_linear_method(self, layer: LinearBase, prefix: str) -> LinearMethod | None:
        """The method of the linear layer named ``prefix`` (None: leave it unquantized)."""
        raise NotImplementedError

    def checkpoint_names(self, prefix: str) -> list[str]:
        """The checkpoint module names behind our layer ``prefix``, which the checkpoint's
        ignore lists and per-module rules name: a fused layer (``...qkv_proj``) stands for its
        parts (``...q_proj``, ``...k_proj``, ``...v_proj``), under the checkpoint's prefix
        (``checkpoint_prefixes``)."""
        for theirs, ours in self.checkpoint_prefixes:
            if prefix.startswith(ours):
                prefix = theirs + prefix[len(ours) :]
                break
        head, _, last = prefix.rpartition(".")
        parts = self.packed_modules_mapping.get(last)
        if not parts:
            return [prefix]
        return [f"{head}.{p}" if head else p for p in parts]

    def all_or_none(self, prefix: str, skipped: Iterable[bool]) -> bool:
        """Whether the layer ``prefix`` is skipped, given each of its checkpoint parts' answer;
        a fused layer whose parts disagree cannot be loaded as one layer."""
        answers = list(skipped)
        if all(answers):
            return True
        if not any(answers):
            return False
        raise QuantizationError(
            f"{prefix} fuses {', '.join(self.checkpoint_names(prefix))}, but the checkpoint "
            "quantizes only some of them; a fused layer must be quantized all or none"
        )


def checkpoint_prefixes_in(
    candidates: Iterable[tuple[str, str]], tensor_names: Iterable[str]
) -> list[tuple[str, str]]:
    """Of a model class's ``checkpoint_module_prefixes`` (``(checkpoint prefix, our prefix)``
    pairs, one per layout the model loads), those this checkpoint uses: the first pair for
    each of our prefixes whose checkpoint prefix starts a tensor name, longest ours first."""
    names = list(tensor_names)
    chosen: dict[str, str] = {}
    for theirs, ours in candidates:
        if ours not in chosen and any(n.startswith(theirs) for n in names):
            chosen[ours] = theirs
    return sorted(((t, o) for o, t in chosen.items()), key=lambda pair: -len(pair[1]))


def kernel_reasons(names: Sequence[str], spec: QuantizationSpec) -> list[str]:
    """On a device other than the CPU, the kernels that only the torch reference serves: it
    dequantizes the weights on every call, which is never a silent choice on an accelerator."""
    if spec.kernels is None or spec.device_type in (None, "cpu"):
        return []
    missing = [n for n in names if spec.kernels.is_reference(n)]
    if not missing:
        return []
    return [
        f"no plugin provides {', '.join(missing)} on {spec.platform}: only the torch reference "
        "does, which dequantizes the weights on every call (install engine-triton, or a vendor "
        "plugin that registers these kernels)"
    ]


def matches_module(name: str, patterns: Iterable[str]) -> bool:
    """Whether module ``name`` matches one of ``patterns``: ``re:<regex>`` (compressed-tensors),
    a glob, an exact name, or a name suffix (``lm_head``, ``mlp.down_proj``)."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif pattern == name or name.endswith("." + pattern) or fnmatch.fnmatchcase(name, pattern):
            return True
    return False


def require(value: Any, allowed: Iterable[Any], what: str, method: str, hint: str = "") -> None:
    """Raise ``QuantizationError`` unless ``value`` is one of ``allowed``."""
    allowed = list(allowed)
    if value not in allowed:
        shown = ", ".join(map(str, allowed))
        raise QuantizationError(
            f"{method} checkpoint has {what} {value!r}, which is not supported "
            f"(supported: {shown}){'; ' + hint if hint else ''}"
        )


def config_value(config: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    """The first of ``keys`` present in ``config`` (formats spell the same setting several
    ways), else ``default``."""
    for key in keys:
        if key in config and config[key] is not None:
            return config[key]
    return default
