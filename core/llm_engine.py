"""``LLMEngine``: the synchronous front end the offline ``LLM`` drives.

It tokenizes prompts, hands them to an engine core as token ids (``EngineCoreRequest``) through
a client, and turns the core's token-level outputs into ``RequestOutput``s with an
``OutputProcessor`` (detokenization, stop strings). The client is the in-process one
(``InprocClient``: the core runs in this process and ``step()`` runs one of its steps) or
``SyncMPClient`` (one engine-core process per data-parallel rank, over ZMQ). The HTTP server
runs the same core and output processor behind ``engine.server.async_engine.AsyncEngine``.
"""

from __future__ import annotations

import time
from typing import Any

from engine.config import EngineConfig
from engine.engine_core.messages import EngineCoreRequest, EngineStats
from engine.errors import InvalidRequestError
from engine.output_processor import FINAL_ONLY, OutputProcessor, check_without_tokenizer
from engine.outputs import RequestOutput
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams


class LLMEngine:
    """Build with ``LLMEngine.from_config(config)``; drive with ``add_request`` and
    ``step()`` until ``has_unfinished_requests()`` is false."""

    def __init__(self, config: EngineConfig, tokenizer: Any, client: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.client = client
        self.output_processor = OutputProcessor(tokenizer)

    @classmethod
    def from_config(cls, config: EngineConfig, *, multiprocess: bool | None = None) -> LLMEngine:
        """An engine for ``config``: the core in this process, or (``multiprocess``, the
        default when ``config.parallel.data_parallel_size > 1``) one engine-core process per
        data-parallel rank."""
        dp = config.parallel.data_parallel_size
        if multiprocess is None:
            multiprocess = dp > 1
        if not multiprocess:
            if dp != 1:
                from engine.config import ConfigError

                raise ConfigError(
                    f"data_parallel_size={dp} needs engine-core processes (multiprocess=True)"
                )
            from engine.engine_core.client import InprocClient
            from engine.engine_core.core import EngineCore

            core = EngineCore.from_config(config)
            return cls(config, core.tokenizer, InprocClient(core))
        from engine.engine_core.client import SyncMPClient

        client = SyncMPClient.start(config)
        return cls(config, client.tokenizer, client)

    # ------------------------------------------------------------------ properties
    @property
    def max_model_len(self) -> int:
        return int(self.config.model.max_model_len)

    @property
    def eos_token_ids(self) -> list[int]:
        return self.client.eos_token_ids

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary (may exceed the tokenizer's: padded embedding rows)."""
        return self.client.vocab_size

    @property
    def core(self) -> Any:
        """The ``EngineCore`` when it runs in this process (else ``AttributeError``)."""
        core = getattr(self.client, "core", None)
        if core is None:
            raise AttributeError(
                "the engine core runs in other processes (data parallelism): it has no "
                "in-process runner, scheduler or core"
            )
        return core

    @property
    def runner(self) -> Any:
        """The in-process core's ``ModelRunner``."""
        return self.core.runner

    @property
    def scheduler(self) -> Any:
        """The in-process core's ``Scheduler``."""
        return self.core.scheduler

    @property
    def structured_outputs(self) -> Any:
        """The in-process core's ``StructuredOutputManager``."""
        return self.core.structured_outputs

    @property
    def num_used_blocks(self) -> int:
        """KV blocks held by requests, over every engine core."""
        return self.client.num_used_blocks()

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams | PoolingParams,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        final_only: bool = False,
        mm_features: list[Any] | None = None,
        lora_request: Any = None,
    ) -> None:
        """Validate and queue a request. Raises ``InvalidRequestError`` (or
        ``SamplingParamsError``) before any work starts; the engine stays usable.

        ``final_only`` requests produce a ``RequestOutput`` only when they finish (what offline
        batch generation needs; it saves copying every running request's tokens each step).
        Others produce one after every step in which they progressed, for streaming.

        ``mm_features`` are the prompt's images (``engine.multimodal.MultiModalFeature``, from
        the front end's processor); ``lora_request`` (an ``engine.lora.request.LoRARequest``)
        runs it with that adapter, which the engine core loads if it does not have it yet.
        Both travel with the request to the core."""
        self.add_requests(
            [
                (
                    request_id,
                    prompt,
                    params,
                    prompt_token_ids,
                    priority,
                    arrival_time,
                    final_only,
                    mm_features,
                    lora_request,
                )
            ]
        )

    def add_requests(self, requests: list[tuple]) -> None:
        """Add several requests at once: tuples of ``add_request``'s arguments, in its order
        (the last two, ``mm_features`` and ``lora_request``, may be left out).
        With engine-core processes they travel in one message per core. If one is refused,
        none stays queued and the error is raised."""
        batch: list[EngineCoreRequest] = []
        seen: set[str] = set()
        processor = self.output_processor
        now = time.monotonic()
        try:
            for request_id, prompt, params, ids, priority, arrival, final_only, *extra in requests:
                mm_features, lora_request = (*extra, None, None)[:2]
                if request_id in processor or request_id in seen:
                    raise InvalidRequestError(
                        f"request id {request_id!r} is already in use", "request_id"
                    )
                pooling = params if isinstance(params, PoolingParams) else None
                if pooling is not None:
                    params = SamplingParams(max_tokens=1)  # unused by a pooling request
                if not isinstance(params, SamplingParams):
                    raise InvalidRequestError(
                        "params must be a SamplingParams (or PoolingParams)", "params"
                    )
                if self.tokenizer is None:
                    check_without_tokenizer(ids, params)
                if ids is None:
                    if prompt is None:
                        raise InvalidRequestError(
                            "a request needs a prompt or prompt_token_ids", "prompt"
                        )
                    ids = self.tokenizer(prompt).input_ids
                ids = list(ids)
                arrival = arrival or now
                if pooling is not None:
                    processor.add_pooling_request(request_id, prompt, ids, arrival)
                else:
                    processor.add_request(
                        request_id, prompt, ids, params, arrival, FINAL_ONLY if final_only else 1
                    )
                batch.append(
                    EngineCoreRequest(
                        request_id,
                        ids,
                        params,
                        arrival,
                        priority,
                        mm_features=mm_features or None,
                        lora_request=lora_request,
                        pooling_params=pooling,
                    )
                )
                seen.add(request_id)
            self.client.add_requests(batch)
        except BaseException:
            ids = [r.request_id for r in batch]
            processor.abort_requests(ids)
            self.client.abort_requests(ids)
            raise

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests now and free their KV blocks; unknown ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.output_processor.abort_requests(ids)
        self.client.abort_requests(ids)

    # ------------------------------------------------------------------ LoRA adapters
    def add_lora(self, lora_request: Any) -> bool:
        """Load a LoRA adapter in every engine core (vLLM's ``add_lora``): later requests
        naming it start at once. Raises ``InvalidRequestError`` with the reason when it cannot
        be served."""
        return self.client.call_utility("add_lora", lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Remove a LoRA adapter from every engine core (False: none had it). Requests already
        using it finish on it; it is unloaded after the last one."""
        return self.client.call_utility("remove_lora", lora_int_id)

    def list_loras(self) -> set[int]:
        """The ``lora_int_id`` of every loaded adapter (over every engine core)."""
        return self.client.call_utility("list_loras")

    @property
    def image_input_spec(self) -> Any:
        """How the model takes images (``engine.multimodal.ImageInputSpec``; None: text only)."""
        return self.client.image_input_spec

    def has_unfinished_requests(self) -> bool:
        """Whether any request is unfinished (or, in process, a step is still in flight)."""
        return self.output_processor.has_unfinished_requests() or (
            self.client.has_unfinished_requests()
        )

    def get_stats(self) -> EngineStats:
        """The engine cores' counters and gauges (summed over data-parallel ranks)."""
        return self.client.get_stats()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Run one engine step (in process) or take the outputs the cores sent (waiting for
        some), and return the requests that progressed (finished ones, for ``final_only``)."""
        outputs = self.client.get_outputs(self.output_processor.has_unfinished_requests())
        if not outputs:
            return []
        processed = self.output_processor.process_outputs(outputs)
        if processed.sequences_to_finish:
            self.client.finish_sequences(processed.sequences_to_finish)
        return processed.request_outputs

    def check_health(self) -> None:
        """Raise when the engine failed: a model worker died (``WorkerFailedError``, tensor or
        pipeline parallelism) or an engine-core process did (``EngineDeadError``); cheap."""
        check = getattr(self.client, "check_health", None)
        if check is not None:
            check()

    def set_failure_callback(self, callback: Any) -> None:
        """Have ``callback()`` called once (from another thread) when a model worker fails
        (in-process core only; engine-core processes report their failures themselves)."""
        register = getattr(self.client, "set_failure_callback", None)
        if register is not None:
            register(callback)

    def shutdown(self) -> None:
        """Stop the engine-core processes and the model's worker processes, if any
        (idempotent)."""
        self.client.shutdown()
