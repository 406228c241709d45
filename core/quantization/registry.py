"""The quantization-method registry: every ``--quantization`` name, built-in or from a plugin.

The core registers its methods (``BUILTIN_METHODS``); plugins add theirs from the
``engine_quantization_methods(registry)`` hook::

    registry.register("myint4", "my_vendor.quant:MyInt4Config")

Entries are named by qualified name (imported when first used) or by class. ``resolve`` turns
``--quantization`` and the checkpoint's ``quantization_config`` into the model's configuration:

* no flag: the method that reads the checkpoint's ``quant_method`` (the one named after it
  first), or None for an unquantized checkpoint;
* a flag and a quantized checkpoint: the named method, if it reads that format;
* a flag and an unquantized checkpoint: the method's online quantization (``from_flag``;
  ``fp8`` quantizes a bf16 checkpoint at load), or a refusal;
* in every case the configured method's reasons on the device (``check``) must be empty.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.lazy_class import LazyClass
from engine.quantization.base import QuantizationConfig, QuantizationError, QuantizationSpec

if TYPE_CHECKING:
    from engine.plugins import PluginManager

logger = logging.getLogger(__name__)

CORE_PROVIDER = "engine-llm"  # the distribution (engine.version.DISTRIBUTION_NAME)

# name -> qualified class name; imported only when used.
BUILTIN_METHODS = {
    "fp8": "engine.quantization.fp8:Fp8Config",
    "compressed-tensors": "engine.quantization.compressed_tensors:CompressedTensorsConfig",
    "gptq": "engine.quantization.gptq:GPTQConfig",
    "awq": "engine.quantization.awq:AWQConfig",
    "gguf": "engine.quantization.gguf:GGUFConfig",
    "mxfp4": "engine.quantization.mxfp4:Mxfp4Config",
}
# ``--quantization`` spellings that mean a registered name.
ALIASES = {"compressed_tensors": "compressed-tensors", "fp8_e4m3": "fp8"}


@dataclass(eq=False)
class MethodEntry(LazyClass[QuantizationConfig]):
    """One registered method: its name, where it comes from and (once imported) its class."""

    base = QuantizationConfig
    error = QuantizationError

    provider: str

    def label(self) -> str:
        return f"quantization method {self.name!r} ({self.qualname}, from {self.provider})"

    def advice(self) -> str:
        return f" Fix or reinstall {self.provider}."


class QuantizationRegistry:
    """Every named quantization method (see the module docstring)."""

    def __init__(self, with_builtins: bool = True) -> None:
        self._entries: dict[str, MethodEntry] = {}
        self._default_provider = "unknown"
        if with_builtins:
            for name, target in BUILTIN_METHODS.items():
                self.register(name, target, provider=CORE_PROVIDER)

    @classmethod
    def from_plugins(cls, pm: PluginManager | None) -> QuantizationRegistry:
        """The built-ins plus what every loaded plugin registers through
        ``engine_quantization_methods`` (``PluginManager.quantization_methods``)."""
        return cls() if pm is None else pm.quantization_methods()

    def register(
        self,
        name: str,
        target: type[QuantizationConfig] | str,
        *,
        provider: str | None = None,
    ) -> None:
        """Add method ``name`` (a ``QuantizationConfig`` subclass or its ``module:Class``).
        A name registered twice is an error naming both providers."""
        provider = provider or self._default_provider
        if not name or name == "auto" or name in ALIASES:
            raise QuantizationError(f"{provider} registered an invalid method name {name!r}")
        if name in self._entries:
            raise QuantizationError(
                f"quantization method {name!r} is registered by both "
                f"{self._entries[name].provider} and {provider}; names must be unique"
            )
        self._entries[name] = MethodEntry(name, target, provider)

    @contextmanager
    def providing(self, provider: str) -> Iterator[None]:
        """Credit registrations that name no provider to ``provider`` (the plugin manager wraps
        each plugin's ``engine_quantization_methods`` hook in this)."""
        previous, self._default_provider = self._default_provider, provider
        try:
            yield
        finally:
            self._default_provider = previous

    # ---- lookup ---------------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return ALIASES.get(name, name) in self._entries

    def __iter__(self) -> Iterator[MethodEntry]:
        return iter(self._entries.values())

    def names(self) -> list[str]:
        return list(self._entries)

    def entry(self, name: str) -> MethodEntry:
        key = ALIASES.get(name, name)
        if key not in self._entries:
            raise QuantizationError(
                f"Unknown quantization method {name!r}. Valid names: {', '.join(self._entries)} "
                "(`engine plugins` lists them with what each can run here)."
            )
        return self._entries[key]

    def readers(self, quant_method: str) -> list[MethodEntry]:
        """The methods that read checkpoints whose ``quant_method`` is ``quant_method``, the
        one named after the format first."""
        found = [e for e in self if quant_method in e.load().checkpoint_formats]
        return sorted(found, key=lambda e: e.name != quant_method)

    # ---- resolution -------------------------------------------------------------------------
    def resolve(
        self,
        requested: str | None,
        checkpoint_config: Mapping[str, Any] | None,
        spec: QuantizationSpec,
    ) -> QuantizationConfig | None:
        """The model's quantization configuration (see the module docstring), or None for an
        unquantized model. Raises ``QuantizationError`` with the reasons and what is supported."""
        requested = None if requested in (None, "", "auto", "none") else requested
        fmt = None
        if checkpoint_config is not None:
            fmt = checkpoint_config.get("quant_method")
            if not fmt:
                raise QuantizationError(
                    "config.json's quantization_config has no quant_method; formats read here: "
                    + self._formats_text()
                )
        if requested is None and fmt is None:
            return None
        if requested is not None:
            entry = self.entry(requested)
            cls = entry.load()
            if fmt is None:
                config = cls.from_flag()
                config.online = True
            elif fmt in cls.checkpoint_formats:
                config = cls.from_config(checkpoint_config)
            else:
                raise QuantizationError(
                    f"--quantization {entry.name} does not read this checkpoint, which is "
                    f"quantized in the {fmt!r} format (config.json quantization_config); "
                    f"{entry.name} reads {', '.join(cls.checkpoint_formats) or 'no checkpoints'}. "
                    "Leave --quantization unset to use the checkpoint's own method."
                )
        else:
            readers = self.readers(fmt)
            if not readers:
                raise QuantizationError(
                    f"the checkpoint is quantized in the {fmt!r} format, which no quantization "
                    f"method here reads. Formats read here: {self._formats_text()}."
                )
            entry = readers[0]
            config = entry.load().from_config(checkpoint_config)
        reasons = config.check(spec)
        if reasons:
            raise QuantizationError(
                f"quantization method {entry.name!r} (from {entry.provider}) cannot run "
                f"{config.describe()} on platform {spec.platform!r}: {'; '.join(reasons)}"
            )
        config.bind(spec)
        logger.info(
            "quantization: %s (method %s from %s)", config.describe(), entry.name, entry.provider
        )
        return config

    def _formats_text(self) -> str:
        parts = []
        for e in self:
            try:
                formats = e.load().checkpoint_formats
            except QuantizationError:
                continue
            if formats:
                parts.append(f"{', '.join(formats)} ({e.name})")
        return "; ".join(parts)


def checkpoint_quantization_config(hf_config: Any) -> dict[str, Any] | None:
    """config.json's ``quantization_config`` as a dict (also under a multimodal
    ``text_config``), or None."""
    for config in (hf_config, getattr(hf_config, "text_config", None)):
        value = getattr(config, "quantization_config", None) if config is not None else None
        if value is None:
            continue
        if hasattr(value, "to_dict"):
            value = value.to_dict()
        if not isinstance(value, Mapping):
            raise QuantizationError(
                f"config.json's quantization_config is a {type(value).__name__}, not an object"
            )
        return dict(value)
    return None
