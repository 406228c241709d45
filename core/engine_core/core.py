"""``EngineCore``: the step loop that ties scheduler, model runner and sampler together.

It takes requests as token ids plus ``SamplingParams`` (``EngineCoreRequest``) and returns, per
step, token-level outputs (``EngineCoreOutput``: new token ids, logprobs, finish reason, cached
prompt tokens). One ``step()`` asks the scheduler for a batch, runs it through the model runner
(which samples), feeds the sampled tokens back to the scheduler and checks the token-level stop
conditions (EOS, stop token ids, ``max_tokens``, the context length, a grammar's end). Text is
the front end's business (``engine.output_processor``): detokenization, stop strings (the front
end then ends the sequence here with ``finish_sequences``) and ``RequestOutput``.

The core runs in the caller's process (``engine.engine_core.client.InprocClient``, what the
offline ``LLM`` uses by default) or in an engine-core process of its own
(``engine.engine_core.proc``) behind ZMQ, which is how ``engine serve`` runs it.

A user request with ``n > 1`` becomes one sequence until its prompt is computed; its first step
samples ``n`` tokens from the same logits and forks ``n - 1`` child sequences that share the
prompt's KV blocks (copy-on-write for the last, partial block).

A request with a ``lora_request`` runs with that LoRA adapter (``engine.lora``): the adapter is
loaded and checked when first used (or by ``add_lora``), and ``engine.lora.registry`` counts
its requests in flight so that ``remove_lora`` unloads it only after they finished.

A request with ``structured_outputs`` gets one xgrammar matcher per sequence (see
``engine.structured_output``): ``_launch`` turns each matcher's state into its row's token
bitmask, ``_append_tokens`` advances the matcher by every sampled token and finishes the
sequence ("stop") once the grammar has accepted its end. Such requests read the tokens sampled
so far, so their steps always run synchronously.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from engine.engine_core.messages import EngineCoreOutput, EngineCoreRequest, EngineStats
from engine.errors import InvalidRequestError, PromptTooLongError
from engine.outputs import Logprob
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.tokenizer import TokenIdRange

logger = logging.getLogger(__name__)


@dataclass
class _Sequence:
    """Core-side state of one completion (one scheduler ``Request``)."""

    index: int
    request: Request
    generator: Any
    finish_reason: str | None = None
    # xgrammar GrammarMatcher of a structured-outputs sequence: its state is that after every
    # token in ``request.output_token_ids``.
    matcher: Any = None


@dataclass
class _InFlight:
    """A launched step: what was scheduled and the runner's handle on its results."""

    sched: Any
    pending: Any
    time: float


@dataclass
class _RequestState:
    """Core-side state of one user request (one or ``n`` sequences)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[_Sequence]
    needs_fork: bool
    client_index: int = 0
    first_scheduled_time: float | None = None
    reported_scheduled: bool = False
    pending_child_generators: list[Any] = field(default_factory=list)
    lora_id: int = 0  # the core's key of the request's LoRA adapter (0: none)

    @property
    def plain(self) -> bool:
        """No sampling feature that reads earlier tokens on the host: may run one step ahead."""
        return _is_plain(self.params)


def _is_plain(params: SamplingParams) -> bool:
    """Whether sampling for these params needs nothing the host learns only when a step
    completes (so the next step may be scheduled before that)."""
    return (
        params.n == 1
        and params.logprobs is None
        and params.prompt_logprobs is None
        and not params.reads_output_tokens
    )


def _discarded_row() -> Any:
    from engine.sampler import SamplingRow

    return SamplingRow(SamplingParams(temperature=0.0), [], [], [None])


class EngineCore:
    """The engine loop. Build with ``EngineCore.from_config(config)``."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Any,
        runner: Any,
        scheduler: Any,
        eos_token_ids: list[int],
        runtime: Any = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.runner = runner
        self.scheduler = scheduler
        self.eos_token_ids = eos_token_ids
        self.runtime = runtime
        self._requests: dict[str, _RequestState] = {}
        self._seq_owner: dict[str, tuple[_RequestState, _Sequence]] = {}
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._async = bool(getattr(scheduler, "async_output", False))
        # Launched steps not completed yet: at most one, or one per pipeline stage.
        self._in_flight: deque[_InFlight] = deque()
        self._max_in_flight = max(1, int(getattr(runner, "max_concurrent_batches", 1)))
        self._structured: Any = None  # StructuredOutputManager, built on first use
        self._structured_lock = threading.Lock()  # grammars may compile on other threads
        self.lora: Any = None  # engine.lora.registry.LoRARegistry with --enable-lora
        if getattr(config, "lora", None) is not None:
            from engine.lora.registry import LoRARegistry

            self.lora = LoRARegistry(runner.add_lora, runner.remove_lora)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, config: EngineConfig) -> EngineCore:
        """Load plugins, choose the platform and attention backend, load the model and
        tokenizer, size the KV cache and build the scheduler."""
        from engine.runtime import build_engine_parts

        return cls(config, *build_engine_parts(config))

    @property
    def max_model_len(self) -> int:
        return int(self.config.model.max_model_len)

    @functools.cached_property
    def token_id_range(self) -> TokenIdRange:
        """The token ids requests may name (prompt, ``logit_bias``, ``stop_token_ids``)."""
        return TokenIdRange.of(self.tokenizer, self.config.model.hf_config)

    @property
    def num_used_blocks(self) -> int:
        return self.scheduler.num_used_blocks

    @property
    def structured_outputs(self) -> Any:
        """The ``StructuredOutputManager`` of this engine (built, and xgrammar imported, on
        the first request with structured outputs)."""
        with self._structured_lock:
            if self._structured is None:
                from engine.structured_output import StructuredOutputManager

                self._structured = StructuredOutputManager(
                    self.tokenizer, self.runner.vocab_size, self.eos_token_ids
                )
            return self._structured

    # ------------------------------------------------------------------ requests
    def add_request(self, req: EngineCoreRequest) -> None:
        """Validate and queue a request. Raises ``InvalidRequestError`` (or
        ``SamplingParamsError``) before any work starts; the engine stays usable.

        ``req.mm_features`` are the prompt's images (``engine.multimodal.MultiModalFeature``,
        from the front end's processor: plain arrays, placeholder offsets in
        ``prompt_token_ids``). ``req.lora_request`` (an ``engine.lora.request.LoRARequest``)
        runs it with that adapter, loading it first if the core does not have it (a bad
        adapter is an ``InvalidRequestError`` naming the reason); with
        ``req.lora_loaded_only`` (the server's requests) it runs with the adapter loaded under
        that name now, and is refused (``LoRAAdapterNotLoadedError``) when there is none."""
        request_id, params = req.request_id, req.sampling_params
        mm_features, lora_request = req.mm_features, req.lora_request
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        if self._check_runner(req.pooling_params):
            self._add_pooling_request(req)
            return
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling params must be a SamplingParams", "params")
        if params.max_logprobs > self.config.max_logprobs:
            params.max_logprobs = self.config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.config.max_logprobs:
                raise SamplingParamsError(
                    f"{name} must be at most {self.config.max_logprobs}, got {value}", name
                )
        prompt_token_ids = req.prompt_token_ids
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        ids = self.token_id_range  # below max(tokenizer size, model vocabulary), as in vLLM
        ids.check(prompt_token_ids, "prompt", needs_row=True)
        if params.logit_bias:
            ids.check(params.logit_bias, "logit_bias", needs_row=True)
        ids.check(params.stop_token_ids, "stop_token_ids")
        if len(prompt_token_ids) >= self.max_model_len:
            raise PromptTooLongError(len(prompt_token_ids), self.max_model_len)
        if mm_features:
            mm_features = self._check_images(mm_features, prompt_token_ids)
        room = self.max_model_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        matcher = None
        if self.config.speculative is not None:
            from engine.spec_decode import check_request

            reason = check_request(params)
            if reason is not None:
                raise SamplingParamsError(reason, "n")
        if params.structured_outputs is not None:
            # Compiling here makes a bad schema/regex/grammar an error of add_request.
            matcher = self.structured_outputs.new_matcher(params.structured_outputs)

        state = _RequestState(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            params=params,
            seqs=[],
            needs_fork=params.n > 1,
            client_index=req.client_index,
        )
        generators = [self._make_generator(params, i) for i in range(params.n)]
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            max_tokens=max_tokens,
            arrival_time=req.arrival_time,
            priority=req.priority,
            mm_features=mm_features or [],
        )
        state.seqs.append(_Sequence(0, request, generators[0], matcher=matcher))
        state.pending_child_generators = generators[1:]
        # Prompt logprobs need logits at every prompt position, so no prefix-cache skipping.
        # The adapter is loaded (and checked) here, after everything else was validated.
        state.lora_id = request.lora_id = self._acquire_lora(
            lora_request, getattr(req, "lora_loaded_only", False)
        )
        try:
            self.scheduler.add_request(
                request, allow_prefix_hit=params.prompt_logprobs is None
            )  # may raise RequestRejectedError (a ValueError)
        except BaseException:
            self._release_lora(state)
            raise
        self._requests[request_id] = state
        self._seq_owner[request_id] = (state, state.seqs[0])
        self._prompt_tokens_total += len(prompt_token_ids)

    @property
    def runner_type(self) -> str:
        """``generate`` or ``pooling`` (embeddings), as ``--runner`` resolved."""
        return getattr(self.config.model, "runner_type", "generate") or "generate"

    def _check_runner(self, pooling_params: Any) -> bool:
        """Whether the request pools; raises ``InvalidRequestError`` naming what this model
        supports when the request asks for the other kind of work."""
        model = self.config.model.served_model_name or self.config.model.model
        if self.runner_type == "pooling" and pooling_params is None:
            raise InvalidRequestError(
                f"the model {model!r} is an embedding (pooling) model: it supports embeddings "
                "(LLM.embed, /v1/embeddings), not generation",
                "model",
            )
        if self.runner_type != "pooling" and pooling_params is not None:
            raise InvalidRequestError(
                f"the model {model!r} is a generative model: it supports generation "
                "(completions, chat), not embeddings; serve an embedding model, or this one "
                "with --runner pooling",
                "model",
            )
        return pooling_params is not None

    def _add_pooling_request(self, req: EngineCoreRequest) -> None:
        """Queue an embedding request: its whole prompt runs in one step, then it finishes
        with the pooled vector (``engine.pooling``)."""
        from engine.pooling_params import PoolingParams

        params = req.pooling_params
        if not isinstance(params, PoolingParams):
            raise InvalidRequestError("pooling params must be a PoolingParams", "params")
        self.config.model.pooler_config.check(params)
        prompt_token_ids = req.prompt_token_ids
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", "input")
        self.token_id_range.check(prompt_token_ids, "input", needs_row=True)
        if req.mm_features or req.lora_request is not None:
            raise InvalidRequestError("embedding requests take neither images nor LoRA", "input")
        if len(prompt_token_ids) > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"the input has {len(prompt_token_ids)} tokens. Shorten the input.",
                "input",
            )
        request = Request(
            request_id=req.request_id,
            prompt_token_ids=prompt_token_ids,
            max_tokens=0,
            arrival_time=req.arrival_time,
            priority=req.priority,
            pooling_params=params,
        )
        self.scheduler.add_request(request, allow_prefix_hit=False)
        state = _RequestState(
            request_id=req.request_id,
            prompt_token_ids=prompt_token_ids,
            params=req.sampling_params,
            seqs=[_Sequence(0, request, None)],
            needs_fork=False,
            client_index=req.client_index,
        )
        self._requests[req.request_id] = state
        self._seq_owner[req.request_id] = (state, state.seqs[0])
        self._prompt_tokens_total += len(prompt_token_ids)

    @property
    def image_input_spec(self) -> Any:
        """How the model takes images (``engine.multimodal.ImageInputSpec``; None: text only)."""
        return getattr(self.runner, "image_input_spec", None)

    def _check_images(self, features: list[Any], prompt_token_ids: list[int]) -> list[Any]:
        from engine.multimodal.inputs import check_features

        spec = self.image_input_spec
        limit = self.config.multimodal.limit("image")
        if spec is None or limit == 0:
            raise InvalidRequestError(
                "this model takes no image inputs (a text model, or one served with "
                'limit_mm_per_prompt={"image": 0})',
                "multi_modal_data",
            )
        if len(features) > limit:
            raise InvalidRequestError(
                f"the prompt has {len(features)} images; at most {limit} are allowed per prompt "
                "(--limit-mm-per-prompt)",
                "multi_modal_data",
            )
        try:
            return check_features(features, prompt_token_ids, spec)
        except ValueError as e:
            raise InvalidRequestError(str(e), "multi_modal_data") from None

    def abort_requests(self, request_ids: str | list[str]) -> None:
        """Stop requests now and free their KV blocks; unknown ids are ignored."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            state = self._requests.pop(request_id, None)
            if state is None:
                continue
            self._release_lora(state)
            for seq in state.seqs:
                self.scheduler.finish_request(
                    seq.request.request_id, RequestStatus.FINISHED_ABORTED
                )
                self._seq_owner.pop(seq.request.request_id, None)
                seq.matcher = None

    def finish_sequences(self, sequences: list[tuple[str, int]]) -> None:
        """End sequences the front end stopped (a stop string matched its text): ``(request
        id, completion index)`` pairs. Their KV blocks are freed now; nothing more is output
        for them. Unknown or already finished ones are ignored."""
        for request_id, index in sequences:
            state = self._requests.get(request_id)
            # Text exists only after the fork (its step samples every first token), so the
            # index names a sequence of its own.
            if state is None or index >= len(state.seqs):
                continue
            seq = state.seqs[index]
            if seq.finish_reason is None:
                self._finish(state, seq, "stop")

    # ------------------------------------------------------------------ LoRA adapters
    def add_lora(self, lora_request: Any, unique_name: bool = False) -> bool:
        """Load a LoRA adapter now (vLLM's ``add_lora``): later requests naming it start at
        once. Raises ``InvalidRequestError`` with the reason when it cannot be served, or
        (``unique_name``, the server's loads) when another id holds its name."""
        self._require_lora()
        self.lora.add(lora_request, unique_name=unique_name)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Remove a LoRA adapter (False: not loaded). Requests already using it finish on it;
        it is unloaded after the last one."""
        return self._require_lora().remove(lora_int_id)

    def list_loras(self) -> set[int]:
        """The ``lora_int_id`` of every loaded adapter."""
        return set() if self.lora is None else self.lora.list_ids()

    def lora_adapters(self) -> list[Any]:
        """The ``LoRARequest`` of every loaded adapter (what the server's front ends serve)."""
        return [] if self.lora is None else self.lora.requests()

    def _require_lora(self) -> Any:
        if self.lora is None:
            raise InvalidRequestError(
                "LoRA is not enabled: start the engine with --enable-lora (LLM(enable_lora=True))",
                "lora_request",
            )
        return self.lora

    def _acquire_lora(self, lora_request: Any, loaded_only: bool = False) -> int:
        if lora_request is None:
            return 0
        if loaded_only:
            return self._require_lora().acquire_loaded(lora_request)
        return self._require_lora().acquire(lora_request)

    def _release_lora(self, state: _RequestState) -> None:
        if state.lora_id and self.lora is not None:
            self.lora.release(state.lora_id)
            state.lora_id = 0

    def has_unfinished_requests(self) -> bool:
        """Whether any request is unfinished, or a step is still in flight."""
        return bool(self._requests) or bool(self._in_flight)

    def check_health(self) -> None:
        """Raise when the model's workers failed (``WorkerFailedError``); cheap."""
        check = getattr(self.runner, "check_health", None)
        if check is not None:
            check()

    def set_failure_callback(self, callback: Any) -> None:
        """Have ``callback()`` called once (from another thread) when a worker fails."""
        register = getattr(self.runner, "set_failure_callback", None)
        if register is not None:
            register(callback)

    def shutdown(self) -> None:
        """Stop the model's workers (idempotent; in-process models need nothing)."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    def get_stats(self) -> EngineStats:
        s = self.scheduler.stats()
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_cache_usage=s.kv_usage,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            num_used_blocks=s.num_used_blocks,
            time=time.monotonic(),
            spec_decoding=getattr(s, "spec_decoding", None),
            encoder_cache_queries=getattr(s, "encoder_cache_queries", 0),
            encoder_cache_hits=getattr(s, "encoder_cache_hits", 0),
        )

    # ------------------------------------------------------------------ the step
    def step(self) -> list[EngineCoreOutput]:
        """Run one scheduled batch and return what each progressed sequence gained.

        With asynchronous scheduling (``SchedulerConfig.async_scheduling``) one step may be
        in flight between calls: a call schedules and launches the next step, then completes
        the one before it while the device runs the new one, so the outputs returned are one
        step behind. With pipeline parallelism one step per stage may be in flight (each with
        other requests), so the stages work on different micro-batches at once. Steps whose
        sampling needs the host to know every earlier token (penalties, ``min_tokens``,
        logprobs, ``n > 1``) run synchronously.
        """
        if not self._async:
            sched = self.scheduler.schedule()
            if sched.is_empty:
                return []
            return self._complete(self._launch(sched))
        in_flight = self._in_flight
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return self._complete(in_flight.popleft()) if in_flight else []
        outputs: list[EngineCoreOutput] = []
        overlap = self._overlappable(sched)
        if not overlap:
            while in_flight:  # this step's sampling reads those tokens
                outputs += self._complete(in_flight.popleft())
        current = self._launch(sched)
        if overlap:
            in_flight.append(current)
            if len(in_flight) > self._max_in_flight:
                outputs += self._complete(in_flight.popleft())
        else:
            outputs += self._complete(current)
        return outputs

    def _overlappable(self, sched: Any) -> bool:
        """Whether a step may stay in flight while the next one is scheduled."""
        for sr in sched.scheduled:
            if sr.spec_token_ids or sr.num_to_propose:
                return False  # speculative: the next step needs this one's accepted tokens
            owner = self._seq_owner.get(sr.request.request_id)
            if owner is not None and not owner[0].plain:  # n > 1 is never plain: it forks
                return False
        return True

    def _launch(self, sched: Any) -> _InFlight:
        """Build the sampling rows of a scheduled step and launch it on the runner."""
        from engine.sampler import SamplingRow

        now = time.monotonic()
        rows: dict[str, SamplingRow] = {}
        prompt_logprobs: dict[str, int] = {}
        constrained: list[tuple[SamplingRow, Any]] = []
        for sr in sched.scheduled:
            owner = self._seq_owner.get(sr.request.request_id)
            if owner is None:
                # Finished by the step completed just before this launch: its sample here
                # is discarded, but the runner needs a row for it.
                if sr.samples:
                    rows[sr.request.request_id] = _discarded_row()
                continue
            state, seq = owner
            if state.first_scheduled_time is None:
                state.first_scheduled_time = now
            params = state.params
            if sr.samples:
                forking = state.needs_fork and seq.index == 0
                outputs = sr.request.output_token_ids
                if sr.output_index >= 0 and not state.plain:
                    # Penalties and min_tokens read the tokens sampled before this step.
                    outputs = outputs[: sr.output_index]
                rows[sr.request.request_id] = SamplingRow(
                    params=params,
                    prompt_token_ids=state.prompt_token_ids,
                    output_token_ids=outputs,
                    generators=(
                        [seq.generator] + state.pending_child_generators
                        if forking
                        else [seq.generator]
                    ),
                    num_samples=params.n if forking else 1,
                    eos_token_ids=self.eos_token_ids,
                )
                if seq.matcher is not None:
                    constrained.append(
                        (rows[sr.request.request_id], seq.matcher, sr.spec_token_ids)
                    )
            if (
                params.prompt_logprobs is not None
                and seq.index == 0
                and sr.start < len(state.prompt_token_ids)
            ):
                prompt_logprobs[sr.request.request_id] = params.prompt_logprobs
        if constrained:
            # Structured requests never overlap a step, so each matcher has seen every token.
            masks = self.structured_outputs.bitmasks([m for _, m, _ in constrained])
            for k, (row, _, _) in enumerate(constrained):
                row.token_bitmask = masks[k]
            for row, matcher, drafts in constrained:
                if drafts:  # one mask per verified position (speculative decoding)
                    from engine.spec_decode.grammar import draft_bitmasks

                    row.token_bitmask = draft_bitmasks(
                        self.structured_outputs, matcher, drafts, row.token_bitmask
                    )
        pending = self.runner.execute_async(sched, rows, prompt_logprobs)
        return _InFlight(sched, pending, now)

    def _complete(self, step: _InFlight) -> list[EngineCoreOutput]:
        """Wait for a launched step's results, feed them to the scheduler and the requests'
        state, and return what every sequence that progressed gained."""
        out = self.runner.collect(step.pending)
        sched = step.sched
        owner = self._seq_owner
        forks: list[tuple[_RequestState, list[int], list[Any]]] = []
        to_scheduler: dict[str, list[int]] = {}
        for seq_id, tokens in out.sampled.items():
            if seq_id not in owner:  # finished or aborted while the step was in flight
                continue
            state, seq = owner[seq_id]
            if state.needs_fork and seq.index == 0:
                forks.append((state, tokens, out.logprobs.get(seq_id)))
                tokens = tokens[:1]
            to_scheduler[seq_id] = tokens
        self.scheduler.update_from_output(sched, to_scheduler)

        outputs: list[EngineCoreOutput] = []
        prompt_chunks: dict[str, list] = {}
        for seq_id, chunk in out.prompt_logprobs.items():
            if seq_id in owner:
                prompt_chunks[seq_id] = chunk
        forked_ids = set()
        for state, tokens, logprobs in forks:
            forked_ids.add(state.seqs[0].request.request_id)
            self._fork(state, tokens, logprobs, outputs, prompt_chunks.pop(state.request_id, None))
        for seq_id, tokens in to_scheduler.items():
            if seq_id in forked_ids:  # the fork above accounted for this sample
                continue
            state, seq = owner[seq_id]
            outputs.append(
                self._append_tokens(
                    state, seq, tokens, out.logprobs.get(seq_id), prompt_chunks.pop(seq_id, None)
                )
            )
        for seq_id, chunk in prompt_chunks.items():  # a prompt chunk that sampled nothing
            state, seq = owner[seq_id]
            outputs.append(EngineCoreOutput(state.request_id, [], prompt_logprobs=chunk))
        for seq_id, vector in out.pooled.items():  # embeddings: done after their one step
            if seq_id not in owner:
                continue
            state, seq = owner[seq_id]
            done = EngineCoreOutput(state.request_id, [], pooled=vector)
            if state.first_scheduled_time is not None:
                done.first_scheduled_time = state.first_scheduled_time
            outputs.append(self._finish(state, seq, "stop", done))
        if out.draft_token_ids:
            self._set_drafts(out.draft_token_ids)
        return outputs

    # ------------------------------------------------------------------ helpers
    def _make_generator(self, params: SamplingParams, index: int) -> Any:
        if params.seed is None or params.is_greedy:
            return None
        import torch

        gen = torch.Generator(device=self.runner.device)
        gen.manual_seed(params.seed + index)
        return gen

    def _fork(
        self,
        state: _RequestState,
        tokens: list[int],
        logprobs: Any,
        outputs: list[EngineCoreOutput],
        prompt_chunk: list | None,
    ) -> None:
        """Split a parent that sampled ``n`` first tokens into ``n`` sequences."""
        parent = state.seqs[0]
        children = []
        # Every child starts from the grammar state the n first tokens were sampled in.
        child_matchers = [
            parent.matcher.fork() if parent.matcher is not None else None
            for _ in range(1, state.params.n)
        ]
        for i in range(1, state.params.n):
            child = Request(
                request_id=f"{state.request_id}#{i}",
                prompt_token_ids=state.prompt_token_ids,
                max_tokens=parent.request.max_tokens,
                arrival_time=parent.request.arrival_time,
                priority=parent.request.priority,
                output_token_ids=[tokens[i]],
                parent_id=parent.request.request_id,
                mm_features=parent.request.mm_features,  # recomputed after a preemption
                lora_id=parent.request.lora_id,
            )
            seq = _Sequence(i, child, state.pending_child_generators[i - 1])
            seq.matcher = child_matchers[i - 1]
            state.seqs.append(seq)
            self._seq_owner[child.request_id] = (state, seq)
            children.append(child)
        self.scheduler.fork_request(parent.request.request_id, children)
        state.needs_fork = False
        state.pending_child_generators = []
        for seq in state.seqs:
            token = tokens[seq.index]
            lp = [logprobs[seq.index]] if logprobs else None
            outputs.append(
                self._append_tokens(
                    state, seq, [token], lp, prompt_chunk if seq.index == 0 else None
                )
            )

    def _set_drafts(self, drafts: dict[str, list[int]]) -> None:
        """Hand the drafts proposed after a step to the scheduler, for sequences still
        running; a structured sequence keeps only the prefix its grammar allows."""
        owner = self._seq_owner
        keep = {}
        for seq_id, tokens in drafts.items():
            if seq_id not in owner:  # finished by this step
                continue
            matcher = owner[seq_id][1].matcher
            if matcher is not None:
                from engine.spec_decode.grammar import valid_prefix

                tokens = valid_prefix(matcher, tokens)
            if tokens:
                keep[seq_id] = tokens
        self.scheduler.update_draft_token_ids(keep)

    def _append_tokens(
        self,
        state: _RequestState,
        seq: _Sequence,
        tokens: list[int],
        logprobs: list[dict[int, Logprob]] | None,
        prompt_chunk: list | None = None,
    ) -> EngineCoreOutput:
        """Account for newly sampled tokens (already appended to the scheduler's request),
        check the token-level stop conditions and return the sequence's output. ``logprobs``
        has one entry per token.

        Several tokens come from a speculative verification; the first that ends the
        sequence (EOS, a stop token, ``max_tokens``, the grammar's end) is its last, and the
        ones after it are dropped from the request."""
        params = state.params
        request = seq.request
        if len(tokens) > 1:
            keep = self._tokens_before_stop(state, seq, tokens)
            if keep < len(tokens):
                del request.output_token_ids[len(request.output_token_ids) - len(tokens) + keep :]
                tokens = tokens[:keep]
                if logprobs:
                    logprobs = logprobs[:keep]
        self._generation_tokens_total += len(tokens)
        out = EngineCoreOutput(
            state.request_id,
            tokens,
            seq.index,
            request.num_cached_tokens,
            new_logprobs=list(logprobs) if logprobs else None,
            prompt_logprobs=prompt_chunk,
        )
        if not state.reported_scheduled:
            state.reported_scheduled = True
            out.first_scheduled_time = state.first_scheduled_time

        num_out = request.num_output_tokens
        last = tokens[-1]
        if seq.matcher is not None:
            for token in tokens:
                if not seq.matcher.accept_token(token):
                    # The mask allowed only grammar tokens, so this is a bug, not bad input.
                    logger.error(
                        "request %s: sampled token %d is not allowed by its structured "
                        "outputs grammar; aborting the sequence",
                        request.request_id,
                        token,
                    )
                    return self._finish(state, seq, "abort", out)
            if seq.matcher.is_terminated():
                # The grammar accepted its end (an EOS): the structured value is complete.
                out.stop_reason = None if last in self.eos_token_ids else last
                return self._finish(state, seq, "stop", out)
        if not params.ignore_eos and last in self.eos_token_ids and num_out >= params.min_tokens:
            return self._finish(state, seq, "stop", out)
        if last in params.stop_token_ids and num_out >= params.min_tokens:
            out.stop_reason = last
            return self._finish(state, seq, "stop", out)
        if num_out >= request.max_tokens or (
            request.num_prompt_tokens + num_out >= self.max_model_len
        ):
            return self._finish(state, seq, "length", out)
        return out

    def _tokens_before_stop(self, state: _RequestState, seq: _Sequence, tokens: list[int]) -> int:
        """How many of ``tokens`` (the newest of the request's outputs) to keep: up to and
        including the first one that ends the sequence."""
        params = state.params
        request = seq.request
        first_out = request.num_output_tokens - len(tokens)  # outputs before these
        eos = () if params.ignore_eos else self.eos_token_ids
        stops = params.stop_token_ids
        limit = min(request.max_tokens, self.max_model_len - request.num_prompt_tokens)
        matcher = seq.matcher
        accepted = 0
        keep = len(tokens)
        for i, token in enumerate(tokens):
            num_out = first_out + i + 1
            if matcher is not None:
                if not matcher.accept_token(token):
                    keep = i + 1  # _append_tokens reports it
                    break
                accepted += 1
                if matcher.is_terminated():
                    keep = i + 1
                    break
            if num_out >= params.min_tokens and (token in eos or token in stops):
                keep = i + 1
                break
            if num_out >= limit:
                keep = i + 1
                break
        if matcher is not None and accepted:
            matcher.rollback(accepted)  # _append_tokens feeds the kept tokens again
        return keep

    def _finish(
        self,
        state: _RequestState,
        seq: _Sequence,
        reason: str,
        out: EngineCoreOutput | None = None,
    ) -> EngineCoreOutput | None:
        seq.finish_reason = reason
        seq.matcher = None
        request = seq.request
        if request.num_output_placeholders:  # a step already scheduled past the end
            del request.output_token_ids[request.num_output_tokens :]
            request.num_output_placeholders = 0
        status = {
            "stop": RequestStatus.FINISHED_STOPPED,
            "length": RequestStatus.FINISHED_LENGTH,
            "abort": RequestStatus.FINISHED_ABORTED,
        }[reason]
        self.scheduler.finish_request(seq.request.request_id, status)
        self._seq_owner.pop(seq.request.request_id, None)
        if not state.needs_fork and all(s.finish_reason is not None for s in state.seqs):
            self._requests.pop(state.request_id, None)
            self._release_lora(state)
        if out is not None:
            out.finish_reason = reason
        return out
