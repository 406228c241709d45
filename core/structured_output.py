"""Structured outputs: compile a request's constraint with xgrammar and mask its logits.

One ``StructuredOutputManager`` per engine owns xgrammar's ``TokenizerInfo`` (built from the
model's Hugging Face tokenizer and the model's own vocabulary size, which may be larger than
the tokenizer's: padded ids are never allowed) and a ``GrammarCompiler``; compiled grammars are
cached by their constraint. Each constrained sequence has a ``GrammarMatcher``: before a step
the engine asks it for the packed bitmask of allowed next tokens (``SamplingRow.token_bitmask``),
the sampler applies the masks with ``apply_token_bitmask``, and after the step the engine
feeds each sampled token back with ``accept_token``. The matcher only ever advances on newly
sampled tokens, so re-running a prefill (preemption by recompute) cannot re-accept old ones.

xgrammar is imported on first use: an engine that never sees a structured request never
loads it.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from typing import Any

import torch

from engine.sampling_params import SamplingParamsError, StructuredOutputsParams

# Compiled grammars kept per engine (xgrammar's own compiler cache sits below this one).
_CACHE_SIZE = 256
_COMPILER_THREADS = 8
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " and sometimes a failed
# check's text; the user needs the sentence after them.
_XGR_PREFIX = re.compile(r"^\s*(\[[\d:]+\]\s*)?(\S+\.(cc|h|cpp):\d+:\s*)?")
_XGR_CHECK = re.compile(r"^Check failed: \(.*?\) is false:\s*")


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as e:  # a broken install, not a bad request: say what to install
        raise RuntimeError(
            "structured outputs need the xgrammar package (pip install 'xgrammar>=0.2.9')"
        ) from e
    return xgrammar


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices``.

    JSON string literals are also valid EBNF string literals for xgrammar (the same escapes),
    so ``json.dumps`` quotes each choice safely.
    """
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def grammar_key(params: StructuredOutputsParams) -> tuple:
    """A hashable key that is equal for constraints that compile to the same grammar."""
    kind = params.kind
    if kind == "json":
        schema = params.json
        if isinstance(schema, str):
            schema = json.loads(schema)
        return ("json", json.dumps(schema, sort_keys=True), params.disable_any_whitespace)
    if kind == "json_object":
        return ("json_object", params.disable_any_whitespace)
    if kind == "choice":
        return ("choice", tuple(params.choice or ()))
    return (kind, getattr(params, kind))


def _clean_error(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    first, _, rest = text.partition("\n")
    first = _XGR_CHECK.sub("", _XGR_PREFIX.sub("", first))
    return (first + ("\n" + rest if rest.strip() else "")).strip()


class StructuredOutputManager:
    """Compiles constraints for one model and hands out matchers and bitmasks.

    ``vocab_size`` is the model's logits width (lm_head rows), ``eos_token_ids`` the ids that
    end generation: the grammar allows them once the constrained value is complete.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = [t for t in eos_token_ids if 0 <= t < self.vocab_size]
        self._compiler: Any = None
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        # The server compiles on worker threads (see ``AsyncEngine.add_request``) while the
        # engine thread may look grammars up: the compiler's creation and the cache are shared.
        self._lock = threading.Lock()

    @property
    def compiler(self) -> Any:
        """xgrammar's ``GrammarCompiler`` for this model (built on first use: about 1.5 s
        for Gemma 3's 262k-token vocabulary on a 2-core CPU)."""
        with self._lock:
            if self._compiler is None:
                self._compiler = self._build_compiler()
            return self._compiler

    def _build_compiler(self) -> Any:
        xgr = _xgrammar()
        if not self.stop_token_ids:
            raise SamplingParamsError(
                "structured outputs need an end-of-sequence token to end the output, and "
                "this model's tokenizer and config name none",
                "structured_outputs",
            )
        info = xgr.TokenizerInfo.from_huggingface(
            self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
        )
        threads = max(1, min(_COMPILER_THREADS, os.cpu_count() or 1))
        return xgr.GrammarCompiler(info, max_threads=threads)

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``params`` (cached; thread-safe). A constraint xgrammar
        cannot compile is a ``SamplingParamsError`` naming it and xgrammar's reason."""
        key = grammar_key(params)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        compiler = self.compiler
        kind = params.kind
        any_whitespace = not params.disable_any_whitespace
        try:
            if kind == "json":
                schema = params.json
                text = schema if isinstance(schema, str) else json.dumps(schema)
                compiled = compiler.compile_json_schema(text, any_whitespace=any_whitespace)
            elif kind == "json_object":
                # OpenAI's json_object mode: an object, any keys (not any JSON value).
                compiled = compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=any_whitespace
                )
            elif kind == "regex":
                compiled = compiler.compile_regex(params.regex)
            elif kind == "choice":
                compiled = compiler.compile_grammar(choice_grammar(params.choice or []))
            else:
                compiled = compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            what = {
                "json": "JSON schema",
                "json_object": "JSON object grammar",
                "regex": "regex",
                "choice": "choice",
                "grammar": "grammar (EBNF with a root rule)",
            }[kind]
            raise SamplingParamsError(
                f"structured_outputs.{kind}: invalid {what}: {_clean_error(e)}",
                "structured_outputs",
            ) from None
        with self._lock:
            self._cache[key] = compiled
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def new_matcher(self, params: StructuredOutputsParams) -> Any:
        """A fresh ``GrammarMatcher`` for one sequence constrained by ``params``."""
        return _xgrammar().GrammarMatcher(self.compile(params))

    def bitmasks(self, matchers: list[Any]) -> torch.Tensor:
        """The packed allowed-token bitmasks (int32 ``[len(matchers), ceil(V / 32)]`` on the
        host) of each matcher's next token."""
        xgr = _xgrammar()
        masks = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        for i, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(masks, i)
        return masks


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int]) -> None:
    """Set ``logits[indices[k], t]`` to -inf for every token ``t`` that ``bitmask[k]`` forbids.

    ``logits`` is ``[N, V]`` (rows may be strided, columns contiguous); ``bitmask`` is xgrammar's
    packed int32 ``[len(indices), ceil(V / 32)]`` on the host. CPU logits use xgrammar's CPU
    kernel, CUDA logits its Triton kernel when Triton is present; other devices its portable
    torch implementation (no compilation).
    """
    xgr = _xgrammar()
    device = logits.device
    vocab = logits.shape[1]
    if device.type == "cpu":
        backend = "cpu"
    elif device.type == "cuda" and _has_triton():
        backend = "triton"
    else:
        backend = "torch_native"
    # The kernels index the bitmask by the logits row, so scatter our rows to their positions.
    if indices == list(range(logits.shape[0])):
        full, rows = bitmask, None
    else:
        full = torch.zeros((logits.shape[0], bitmask.shape[1]), dtype=torch.int32)
        full[torch.tensor(indices, dtype=torch.long)] = bitmask
        rows = indices
    full = full.to(device, non_blocking=False)
    xgr.apply_token_bitmask_inplace(logits, full, vocab_size=vocab, indices=rows, backend=backend)


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
