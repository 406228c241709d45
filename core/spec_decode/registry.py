"""The named registry of speculative proposers (``SpeculativeConfig.method`` -> class).

Entries are ``"module:Class"`` strings, imported when used, so checking a configuration
imports no model code. A proposer class answers ``supports(config, hf_config) -> list[str]``
(why it cannot serve this engine configuration; empty when it can), like attention backends,
and ``create(config, runner)`` builds it. Out-of-tree proposers register a name with
``registry.register(name, "pkg.module:Class")``.
"""

from __future__ import annotations

import importlib
from typing import Any

from engine.config import ConfigError

_BUILTIN_PROPOSERS = {
    "ngram": "engine.spec_decode.ngram:NgramProposer",
    "draft_model": "engine.spec_decode.draft_model:DraftModelProposer",
    "eagle": "engine.spec_decode.eagle:EagleProposer",
    "eagle3": "engine.spec_decode.eagle:EagleProposer",
}


class ProposerRegistry:
    """Speculative proposer classes by method name."""

    def __init__(self) -> None:
        self._entries: dict[str, str | type] = dict(_BUILTIN_PROPOSERS)

    def register(self, method: str, proposer: str | type) -> None:
        """Add or replace the proposer of ``method`` (a class or ``"module:Class"``)."""
        if isinstance(proposer, str) and ":" not in proposer:
            raise ValueError(f"proposer reference {proposer!r} must look like 'module:Class'")
        self._entries[method] = proposer

    def methods(self) -> list[str]:
        return sorted(self._entries)

    def get(self, method: str) -> type:
        """The proposer class of ``method`` (``ConfigError`` listing the known ones)."""
        entry = self._entries.get(method)
        if entry is None:
            raise ConfigError(
                f"no speculative proposer named {method!r}; known: {', '.join(self.methods())}"
            )
        if isinstance(entry, str):
            module, _, name = entry.partition(":")
            entry = getattr(importlib.import_module(module), name)
            self._entries[method] = entry
        return entry

    def reasons(self, config: Any, hf_config: Any) -> list[str]:
        """Why the configured proposer cannot serve ``config`` (empty: it can)."""
        spec = config.speculative
        return list(self.get(spec.method).supports(config, hf_config))

    def check(self, config: Any, hf_config: Any) -> type:
        """The proposer class for ``config.speculative``, or ``ConfigError`` with every
        reason it cannot serve this configuration."""
        cls = self.get(config.speculative.method)
        reasons = cls.supports(config, hf_config)
        if reasons:
            raise ConfigError(
                f"speculative decoding with method {config.speculative.method!r} cannot serve "
                "this configuration: " + "; ".join(reasons)
            )
        return cls


def check_request(params: Any) -> str | None:
    """Why a request cannot run with speculative decoding (None when it can)."""
    if params.n > 1:
        return (
            f"n={params.n} is not supported with speculative decoding (--speculative-config): "
            "each sequence verifies its own drafts; use n=1, or serve without speculation"
        )
    return None
