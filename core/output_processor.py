"""The front end's half of the engine: token-level core outputs in, ``RequestOutput`` out.

The engine core (``engine.engine_core.core``) returns, per step, the token ids each sequence
gained with their logprobs and the token-level finish reason (EOS, stop token, length). The
``OutputProcessor`` owns everything that needs text: incremental detokenization, stop strings
(a match ends the sequence here and is reported in ``ProcessedOutputs.sequences_to_finish``,
which the caller sends to the core so its KV blocks are freed), the hold-back of text that may
still become a stop string, logprob token texts, and the ``RequestOutput`` objects callers see.

It also measures what the server's metrics need (time to first token, inter-token latencies,
end-to-end latency) since it is the one place that sees every token of every request.

The order of the stop checks is the one a single-process engine had: the core's EOS, stop
tokens and grammar end win over a stop string found in the same step's text; a stop string wins
over ``length``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from engine.detokenizer import check_stop_strings, pending_stop_chars
from engine.errors import InvalidRequestError
from engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams, SamplingParamsError

# ``output_interval`` for requests that want only their final output (offline batches).
FINAL_ONLY = 0


def check_without_tokenizer(prompt_token_ids: list[int] | None, params: SamplingParams) -> None:
    """What a request may not ask of an engine built with ``skip_tokenizer_init`` (the front
    end has no tokenizer: no text prompts, stop strings or structured outputs)."""
    flag = "the engine was started with skip_tokenizer_init=True (--skip-tokenizer-init)"
    if prompt_token_ids is None:
        raise InvalidRequestError(
            f"text prompts cannot be used: {flag}, so no tokenizer is loaded; pass token ids "
            "(prompt_token_ids)",
            "prompt",
        )
    if params.stop:
        raise SamplingParamsError(
            f"stop strings cannot be matched: {flag}, so the output is not detokenized; use "
            "stop_token_ids",
            "stop",
        )
    if params.structured_outputs is not None:
        raise SamplingParamsError(
            f"structured outputs need the tokenizer's vocabulary, and {flag}",
            "structured_outputs",
        )


@dataclass
class _SequenceText:
    """Front-end state of one completion."""

    index: int
    detokenizer: Any
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted_text_len: int = 0
    emitted_token_len: int = 0
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[_SequenceText]
    metrics: RequestMetrics
    output_interval: int
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    num_unfinished: int = 1


@dataclass
class IterationStats:
    """Latencies measured while processing one batch of core outputs (seconds)."""

    first_token_latencies: list[float] = field(default_factory=list)
    # Previous-token time -> how many requests got a token now after a token then: a decode
    # batch mostly shares one previous time, so this stays small.
    previous_token_times: dict[float, int] = field(default_factory=dict)
    # (end-to-end latency, finish reason of every completion) of each finished request.
    finished: list[tuple[float, list[str | None]]] = field(default_factory=list)


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    # Sequences a stop string ended: the core must stop them (request id, completion index).
    sequences_to_finish: list[tuple[str, int]]
    stats: IterationStats | None = None


class OutputProcessor:
    """Detokenizes core outputs and assembles ``RequestOutput``s (front end, one per engine
    client). ``collect_stats`` turns on the latency measurements the server's metrics need."""

    def __init__(self, tokenizer: Any, collect_stats: bool = False) -> None:
        self.tokenizer = tokenizer
        self.collect_stats = collect_stats
        self._requests: dict[str, _RequestState] = {}
        # Embedding requests: (prompt, token ids, metrics) until their vector arrives.
        self._pooling: dict[str, tuple[str | None, list[int], RequestMetrics]] = {}

    def add_pooling_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], arrival: float
    ) -> None:
        """Track an embedding request: one ``EmbeddingRequestOutput`` when its vector comes."""
        self._pooling[request_id] = (prompt, prompt_token_ids, RequestMetrics(arrival))

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        output_interval: int = 1,
    ) -> None:
        """Track a request the core accepted. ``output_interval``: a streaming request gets a
        ``RequestOutput`` for its first token, then once at least this many new tokens
        arrived, and when it finishes (vLLM's ``--stream-interval``); ``FINAL_ONLY`` (0): only
        when it finishes."""
        from engine.detokenizer import IncrementalDetokenizer

        if self.tokenizer is None:
            check_without_tokenizer(prompt_token_ids, params)
        seqs = []
        for i in range(params.n):
            detok = (
                IncrementalDetokenizer(
                    self.tokenizer,
                    prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    spaces_between_special_tokens=params.spaces_between_special_tokens,
                )
                if params.detokenize and self.tokenizer is not None
                else None
            )
            seqs.append(
                _SequenceText(i, detok, logprobs=[] if params.logprobs is not None else None)
            )
        self._requests[request_id] = _RequestState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            seqs=seqs,
            metrics=RequestMetrics(arrival_time=arrival_time),
            output_interval=output_interval,
            num_unfinished=params.n,
        )

    def abort_requests(self, request_ids: list[str]) -> None:
        """Forget requests (aborted by the caller); unknown ids are ignored."""
        for request_id in request_ids:
            self._requests.pop(request_id, None)
            self._pooling.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._pooling)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests) + len(self._pooling)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests or request_id in self._pooling

    # ------------------------------------------------------------------ outputs
    def process_outputs(self, outputs: list[Any], now: float | None = None) -> ProcessedOutputs:
        """Apply one batch of ``EngineCoreOutput``s (in the order the core produced them)."""
        if now is None:
            now = time.monotonic()
        requests = self._requests
        stats = IterationStats() if self.collect_stats else None
        touched: dict[str, _RequestState] = {}
        to_finish: list[tuple[str, int]] = []
        embeddings: list[Any] = []
        for o in outputs:
            state = requests.get(o.request_id)
            if state is None:  # aborted meanwhile, or an embedding
                if o.request_id in self._pooling and o.finish_reason is not None:
                    embeddings.append(self._embedding(o, now))
                continue
            if o.prompt_logprobs is not None:
                self._add_prompt_logprobs(state, o.prompt_logprobs)
            if o.first_scheduled_time is not None:
                state.metrics.first_scheduled_time = o.first_scheduled_time
            seq = state.seqs[o.index]
            tokens = o.new_token_ids
            if seq.finish_reason is not None or not tokens:
                continue  # a stop string ended it; the core learns of it after this step
            if o.index == 0:
                state.num_cached_tokens = o.num_cached_tokens
            if o.request_id not in touched:  # the request's first tokens in this batch
                touched[o.request_id] = state
                metrics = state.metrics
                last = metrics.last_token_time
                if last is None:
                    metrics.first_token_time = now
                    if stats is not None:
                        stats.first_token_latencies.append(now - metrics.arrival_time)
                elif stats is not None:
                    stats.previous_token_times[last] = stats.previous_token_times.get(last, 0) + 1
                metrics.last_token_time = now
            if self._append_tokens(state, seq, o):
                to_finish.append((o.request_id, o.index))

        result: list[RequestOutput] = []
        for state in touched.values():
            finished = state.num_unfinished == 0
            if finished:
                del requests[state.request_id]
                state.metrics.finished_time = now
                if stats is not None:
                    stats.finished.append(
                        (now - state.metrics.arrival_time, [s.finish_reason for s in state.seqs])
                    )
            elif not self._due(state):
                continue
            result.append(self._make_output(state, finished))
        result.extend(e for e in embeddings if e is not None)
        return ProcessedOutputs(result, to_finish, stats)

    def _embedding(self, o: Any, now: float) -> Any:
        """The ``EmbeddingRequestOutput`` of a finished pooling request (None: aborted)."""
        import numpy as np

        from engine.outputs import EmbeddingOutput, EmbeddingRequestOutput

        prompt, ids, metrics = self._pooling.pop(o.request_id)
        if o.pooled is None:
            return None
        metrics.finished_time = now
        metrics.first_scheduled_time = o.first_scheduled_time
        vector = np.frombuffer(o.pooled, dtype="<f4").tolist()
        return EmbeddingRequestOutput(
            o.request_id, EmbeddingOutput(vector), ids, True, prompt, metrics
        )

    def _due(self, state: _RequestState) -> bool:
        """Whether an unfinished request has gained enough tokens for an output: the first
        token at once (it sets the time to first token), then every ``output_interval``."""
        interval = state.output_interval
        if interval == 1:
            return True
        if interval == FINAL_ONLY:
            return False
        return any(
            s.emitted_token_len == 0 or len(s.token_ids) - s.emitted_token_len >= interval
            for s in state.seqs
        )

    def _append_tokens(self, state: _RequestState, seq: _SequenceText, o: Any) -> bool:
        """Take a sequence's new tokens; return True when a stop string ended it here and
        the core has not ended it itself (so the core must be told)."""
        tokens = o.new_token_ids
        params = state.params
        seq.token_ids.extend(tokens)
        logprobs = o.new_logprobs
        if logprobs is not None and seq.logprobs is not None:
            for token, entry in zip(tokens[len(tokens) - len(logprobs) :], logprobs, strict=True):
                self._decode_logprobs(entry)
                seq.logprobs.append(entry)
                if token in entry:
                    seq.cumulative_logprob += entry[token].logprob
        new_text = ""
        if seq.detokenizer is not None:
            new_text = seq.detokenizer.add_tokens(tokens)
            seq.text += new_text
        core_reason = o.finish_reason
        if (
            params.stop
            and seq.detokenizer is not None
            and core_reason in (None, "length")
            and len(seq.token_ids) >= params.min_tokens
        ):
            hit = check_stop_strings(
                seq.text, len(new_text), params.stop, params.include_stop_str_in_output
            )
            if hit is not None:
                truncate_to, stop_str = hit
                seq.text = seq.text[:truncate_to]
                self._finish(state, seq, "stop", stop_str)
                return core_reason is None
        if core_reason is not None:
            self._finish(state, seq, core_reason, o.stop_reason)
        return False

    def _finish(
        self, state: _RequestState, seq: _SequenceText, reason: str, stop_reason: Any
    ) -> None:
        if seq.detokenizer is not None and not isinstance(stop_reason, str):
            seq.text += seq.detokenizer.flush()  # an incomplete character held back, if any
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        state.num_unfinished -= 1

    def _add_prompt_logprobs(self, state: _RequestState, chunk: list) -> None:
        if state.prompt_logprobs is None:
            state.prompt_logprobs = [None]  # the first prompt token has no logprob
        room = len(state.prompt_token_ids) - len(state.prompt_logprobs)
        for entry in chunk[:room]:
            if entry is not None:
                self._decode_logprobs(entry)
            state.prompt_logprobs.append(entry)

    def _decode_logprobs(self, entry: dict[int, Logprob]) -> None:
        if self.tokenizer is None:  # skip_tokenizer_init: decoded_token stays None (as vLLM)
            return
        for token_id, lp in entry.items():
            if lp.decoded_token is None:
                lp.decoded_token = self.tokenizer.decode([token_id])

    def _make_output(self, state: _RequestState, finished: bool) -> RequestOutput:
        # Once per streaming request per step: positional arguments, no repeated lookups.
        completions, new_ids, new_texts = [], [], []
        params = state.params
        hold_back = bool(params.stop) and not params.include_stop_str_in_output
        for seq in state.seqs:
            ids = seq.token_ids
            text = seq.text
            emitted = seq.emitted_text_len
            visible = len(text)
            if hold_back and seq.finish_reason is None:
                # Hold back a tail that may be the start of a stop string still to come.
                visible -= pending_stop_chars(text, params.stop)
            if visible < emitted:
                visible = emitted
            new_texts.append(text[emitted:visible])
            seq.emitted_text_len = visible
            new_ids.append(ids[seq.emitted_token_len :])
            seq.emitted_token_len = len(ids)
            logprobs = seq.logprobs
            completions.append(
                CompletionOutput(
                    seq.index,
                    text,
                    ids.copy(),
                    seq.cumulative_logprob if logprobs is not None else None,
                    logprobs,
                    seq.finish_reason,
                    seq.stop_reason,
                )
            )
        return RequestOutput(
            state.request_id,
            state.prompt,
            state.prompt_token_ids,
            completions,
            finished,
            state.prompt_logprobs,
            state.num_cached_tokens,
            state.metrics,
            new_ids,
            new_texts,
        )
