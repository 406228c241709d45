"""The named registry of speculative proposers (``SpeculativeConfig.method`` -> class).

Entries are ``"module:Class"`` strings, imported when used, so checking a configuration
imports no model code. A proposer class answers ``supports(config, hf_config) -> list[str]``
(why it cannot serve this engine configuration; empty when it can), like attention backends,
and ``create(config, runner)`` builds it. A class that sets ``supports_tensor_parallel = True``
runs on every tensor-parallel rank of a multi-process replica (each worker's runner builds
its own proposer and the reporting rank returns the drafts); no proposer runs under pipeline
parallelism (a verification must complete before its request's next step, and the stages keep
other requests' steps in flight). Out-of-tree proposers register a name with
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
        cls = self.get(config.speculative.method)
        return parallel_reasons(cls, config) + list(cls.supports(config, hf_config))

    def check(self, config: Any, hf_config: Any) -> type:
        """The proposer class for ``config.speculative``, or ``ConfigError`` with every
        reason it cannot serve this configuration."""
        cls = self.get(config.speculative.method)
        reasons = parallel_reasons(cls, config) + list(cls.supports(config, hf_config))
        if reasons:
            raise ConfigError(
                f"speculative decoding with method {config.speculative.method!r} cannot serve "
                "this configuration: " + "; ".join(reasons)
            )
        return cls


def parallel_reasons(cls: type, config: Any) -> list[str]:
    """Why proposer ``cls`` cannot run in ``config.parallel``'s layout (see the module
    docstring)."""
    parallel = getattr(config, "parallel", None)
    if parallel is None:
        return []
    method = config.speculative.method
    reasons = []
    if parallel.pipeline_parallel_size > 1:
        reasons.append(
            f"pipeline_parallel_size={parallel.pipeline_parallel_size}: speculative decoding "
            "does not run under pipeline parallelism (use --tensor-parallel-size, or serve "
            "without --speculative-config)"
        )
    tp = parallel.tensor_parallel_size
    if tp > 1 and not getattr(cls, "supports_tensor_parallel", False):
        reasons.append(
            f"tensor_parallel_size={tp}: the {method!r} proposer runs on one device only "
            "(method 'ngram' runs under tensor parallelism)"
        )
    return reasons


def check_request(params: Any) -> str | None:
    """Why a request cannot run with speculative decoding (None when it can)."""
    if params.n > 1:
        return (
            f"n={params.n} is not supported with speculative decoding (--speculative-config): "
            "each sequence verifies its own drafts; use n=1, or serve without speculation"
        )
    return None
