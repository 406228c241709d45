"""Clients of engine cores: how a front end adds requests and receives token-level outputs.

Synchronous (the offline ``LLMEngine``):

- ``InprocClient``: the core lives in this process; ``get_outputs`` runs one of its steps.
  The default for ``LLM``: nothing is encoded or copied, so offline throughput is the core's.
- ``SyncMPClient``: one engine-core process per data-parallel rank (``engine.engine_core.proc``).

Asynchronous (the HTTP server's ``AsyncEngine``, see ``engine.engine_core.async_client``).
"""

from __future__ import annotations

import weakref
from typing import Any

from engine.engine_core.messages import EngineCoreOutput, EngineCoreRequest, EngineStats
from engine.engine_core.utility_results import combine_utility_results


class InprocClient:
    """The engine core in the caller's process, driven step by step."""

    def __init__(self, core: Any) -> None:
        self.core = core

    @property
    def eos_token_ids(self) -> list[int]:
        return self.core.eos_token_ids

    @property
    def vocab_size(self) -> int:
        return int(self.core.runner.vocab_size)

    @property
    def image_input_spec(self) -> Any:
        return self.core.image_input_spec

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        for request in requests:
            self.core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def finish_sequences(self, sequences: list[tuple[str, int]]) -> None:
        self.core.finish_sequences(sequences)

    def get_outputs(self, waiting: bool = True) -> list[EngineCoreOutput]:
        """One step's outputs (a step in flight is completed even when nothing waits)."""
        return self.core.step()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def get_stats(self) -> EngineStats:
        return self.core.get_stats()

    def num_used_blocks(self) -> int:
        return self.core.num_used_blocks

    def check_health(self) -> None:
        """Raise when the core's model workers failed (``WorkerFailedError``)."""
        self.core.check_health()

    def set_failure_callback(self, callback: Any) -> None:
        self.core.set_failure_callback(callback)

    def call_utility(self, method: str, *args: Any) -> Any:
        """``core.<method>(*args)`` (``UTILITY_METHODS``: the LoRA adapter calls)."""
        from engine.engine_core.messages import UTILITY_METHODS

        if method not in UTILITY_METHODS:
            raise ValueError(f"unknown engine utility call {method!r}")
        return getattr(self.core, method)(*args)

    def shutdown(self) -> None:
        """Stop the core's model workers, if any (tensor/pipeline parallelism)."""
        self.core.shutdown()


# ------------------------------------------------------------------------- shared by MP clients
def apply_ready(config: Any, ready: Any) -> None:
    """Fill the front end's copy of the config with what the core resolved while loading."""
    model = config.model
    model.model = ready.model
    model.max_model_len = ready.max_model_len
    model.dtype = ready.dtype
    if model.served_model_name is None:
        model.served_model_name = ready.served_model_name
    model.default_sampling = dict(ready.default_sampling)
    config.platform = ready.platform
    config.scheduler.async_scheduling = ready.async_scheduling
    # The step limits the core's platform chose for the unset flags.
    config.scheduler.max_num_seqs = ready.max_num_seqs
    config.scheduler.max_num_batched_tokens = ready.max_num_batched_tokens
    config.scheduler.defaulted = ()
    config.max_logprobs = ready.max_logprobs
    if ready.implementation is not None:
        model.implementation = ready.implementation
    model.runner_type = ready.runner_type
    if ready.pooler_config is not None:
        from engine.pooling import PoolerConfig

        model.pooler_config = PoolerConfig(**ready.pooler_config)


def startup_error(failed: Any) -> BaseException:
    """The exception a front end raises for a core that failed to load: a configuration or
    plugin problem stays one paragraph (``ConfigError``), anything else keeps its traceback."""
    from engine.config import ConfigError

    if failed.user_error:
        return ConfigError(failed.message)
    return RuntimeError(
        f"engine core {failed.engine_index} failed to start: {failed.message}\n"
        f"{failed.traceback}".rstrip()
    )


def dead_error(engine_index: int, proc: Any = None, failed: Any = None) -> BaseException:
    """The ``EngineDeadError`` for a core that failed in a step or whose process died."""
    from engine.errors import EngineDeadError

    if failed is not None:
        return EngineDeadError(f"engine core {engine_index} failed: {failed.message}")
    how = proc.describe_exit() if proc is not None else "exited"
    pid = f" (pid {proc.pid})" if proc is not None else ""
    return EngineDeadError(f"engine core {engine_index}{pid} {how}")


class SyncMPClient:
    """Engine cores in processes of their own (one per data-parallel rank), for the
    synchronous ``LLMEngine``. Requests are routed by ``DataParallelRouter``."""

    def __init__(self, config: Any, processes: Any) -> None:
        import zmq

        from engine.engine_core.messages import Codec
        from engine.engine_core.routing import DataParallelRouter
        from engine.engine_core.transport import make_socket
        from engine.tokenizer import load_tokenizer

        self.config = config
        self.processes = processes
        conn = processes.connection(0)
        self._codec = Codec()
        self._ctx = zmq.Context(io_threads=1)
        self._out = make_socket(self._ctx, zmq.PULL, conn.output_address, bind=True)
        self._ins = [make_socket(self._ctx, zmq.PUSH, a, bind=False) for a in conn.input_addresses]
        self._pending: list[Any] = []  # outputs received while waiting for something else
        self._stats: dict[int, EngineStats] = {}
        self._closed = False
        self.dead: BaseException | None = None
        self.tokenizer = (  # while the cores load
            None if config.model.skip_tokenizer_init else load_tokenizer(config.model)
        )
        ready = self._wait_ready(len(conn.input_addresses))
        self.ready = ready  # what each core resolved (CoreReady)
        first = ready[0]
        apply_ready(config, first)
        self.vocab_size = first.vocab_size
        self.eos_token_ids = list(first.eos_token_ids)
        self.image_input_spec = first.image_input_spec
        self.router = DataParallelRouter(
            len(ready), first.block_size, enable_prefix_caching=first.enable_prefix_caching
        )
        # An LLM dropped without shutdown() stops its cores when it is collected.
        self._finalizer = weakref.finalize(self, processes.stop)

    @classmethod
    def start(cls, config: Any) -> SyncMPClient:
        from engine.engine_core.proc import EngineCoreProcesses
        from engine.runtime import resolve_model_source

        resolve_model_source(config)
        processes = EngineCoreProcesses(config, num_clients=1)
        try:
            return cls(config, processes)
        except BaseException:
            processes.stop()
            raise

    # ------------------------------------------------------------------ receiving
    def _receive(self, timeout_ms: int) -> Any | None:
        """One message, or None after ``timeout_ms``; raises if a core process died."""
        if self._out.poll(timeout_ms):
            return self._codec.from_core.decode(self._out.recv(copy=False).buffer)
        for i, proc in enumerate(self.processes.procs):
            if not proc.is_alive():
                self.dead = dead_error(i, proc)
                raise self.dead
        return None

    def _wait_ready(self, num_engines: int) -> list[Any]:
        from engine.engine_core.messages import CoreFailed, CoreReady

        ready: dict[int, Any] = {}
        while len(ready) < num_engines:
            try:
                msg = self._receive(100)
            except BaseException as e:
                raise RuntimeError(f"{e} while loading the model") from None
            if isinstance(msg, CoreReady):
                ready[msg.engine_index] = msg
            elif isinstance(msg, CoreFailed):
                raise startup_error(msg)
        return [ready[i] for i in range(num_engines)]

    def _handle(self, msg: Any) -> list[Any]:
        """Route a message; returns its outputs (if it is an ``EngineCoreOutputs``)."""
        from engine.engine_core.messages import CoreFailed, EngineCoreOutputs

        if isinstance(msg, EngineCoreOutputs):
            if msg.stats is not None:
                self._stats[msg.engine_index] = msg.stats
                self.router.on_stats(msg.engine_index, msg.stats)
            self.router.on_outputs(msg.outputs)
            return msg.outputs
        if isinstance(msg, CoreFailed):
            self.dead = dead_error(msg.engine_index, failed=msg)
            raise self.dead
        return []

    def check_health(self) -> None:
        """Raise ``EngineDeadError`` when a core failed or this client was shut down."""
        self._check()

    def _check(self) -> None:
        if self.dead is not None:
            raise self.dead
        if self._closed:
            from engine.errors import EngineDeadError

            raise EngineDeadError("the engine was shut down")

    # ------------------------------------------------------------------ requests
    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Route and send; wait until every core took (or refused) its share."""
        from engine.engine_core.messages import AddRequests, AddResult, raise_request_error

        self._check()
        per_engine: dict[int, list[EngineCoreRequest]] = {}
        for req in requests:
            engine, hashes = self.router.choose(req.prompt_token_ids)
            self.router.add(req.request_id, engine, req.sampling_params.n, hashes)
            per_engine.setdefault(engine, []).append(req)
        for engine, reqs in per_engine.items():
            self._ins[engine].send(self._codec.encode(AddRequests(reqs)))
        waiting = set(per_engine)
        rejected = []
        while waiting:
            msg = self._receive(100)
            if msg is None:
                continue
            if isinstance(msg, AddResult):
                waiting.discard(msg.engine_index)
                rejected += msg.rejected
                for err in msg.rejected:
                    self.router.request_done(err.request_id)
            else:
                self._pending += self._handle(msg)
        if rejected:
            raise_request_error(rejected[0])

    def _send_by_engine(self, items: list[Any], key: Any, make: Any) -> None:
        by_engine: dict[int, list[Any]] = {}
        for item in items:
            engine = self.router.engine_of(key(item))
            if engine is not None:
                by_engine.setdefault(engine, []).append(item)
        for engine, part in by_engine.items():
            self._ins[engine].send(self._codec.encode(make(part)))

    def abort_requests(self, request_ids: list[str]) -> None:
        from engine.engine_core.messages import AbortRequests

        if self._closed or self.dead is not None:
            return
        self._send_by_engine(list(request_ids), lambda r: r, AbortRequests)
        for rid in request_ids:
            self.router.request_done(rid)

    def finish_sequences(self, sequences: list[tuple[str, int]]) -> None:
        from engine.engine_core.messages import FinishSequences

        self._send_by_engine(sequences, lambda s: s[0], FinishSequences)
        for rid, index in sequences:
            self.router.sequence_done(rid, index)

    def get_outputs(self, waiting: bool = True) -> list[EngineCoreOutput]:
        """Outputs received so far, waiting for some when ``waiting`` (requests unfinished)."""
        self._check()
        if self._pending:
            outputs, self._pending = self._pending, []
            return outputs
        outputs: list[Any] = []
        timeout = 100 if waiting else 0
        while True:
            msg = self._receive(timeout)
            if msg is None:
                if outputs or not waiting:
                    return outputs
                continue
            outputs += self._handle(msg)
            timeout = 0  # take what else is there without waiting

    def has_unfinished_requests(self) -> bool:
        return False  # the front end tracks its requests; the cores drain themselves

    def get_stats(self) -> EngineStats:
        """Fresh stats of every core, summed."""
        by_engine = self.get_stats_by_engine()
        return sum_stats([by_engine[i] for i in sorted(by_engine)])

    def get_stats_by_engine(self) -> dict[int, EngineStats]:
        """Fresh stats of every core, by data-parallel rank."""
        from engine.engine_core.messages import EngineCoreOutputs, GetStats

        self._check()
        for sock in self._ins:
            sock.send(self._codec.encode(GetStats(0)))
        fresh: dict[int, EngineStats] = {}
        while len(fresh) < len(self._ins):
            msg = self._receive(100)
            if msg is None:
                continue
            if isinstance(msg, EngineCoreOutputs) and msg.stats is not None and not msg.outputs:
                fresh[msg.engine_index] = msg.stats
            self._pending += self._handle(msg)
        return fresh

    def num_used_blocks(self) -> int:
        return self.get_stats().num_used_blocks

    def call_utility(self, method: str, *args: Any) -> Any:
        """Run ``EngineCore.<method>(*args)`` (``UTILITY_METHODS``) on every core (a LoRA
        adapter is loaded or removed in each data-parallel rank) and combine their answers,
        or raise what a core raised. ``add_lora`` is all or nothing, as in the asynchronous
        clients (``engine.engine_core.lora_loads``): cores that loaded an adapter another
        refused drop it again before the refusal is raised, naming the core and its reason."""
        from engine.engine_core.messages import UTILITY_METHODS

        self._check()
        if method not in UTILITY_METHODS:
            raise ValueError(f"unknown engine utility call {method!r}")
        if method == "add_lora":
            from engine.engine_core.lora_loads import add_lora_everywhere, run_calls

            return run_calls(add_lora_everywhere(list(args), len(self._ins)), self._call_each)
        results = self._call_each(method, list(args), list(range(len(self._ins))))
        return combine_utility_results(method, results)

    def _call_each(self, method: str, args: list[Any], engines: list[int]) -> list[Any]:
        """Every asked core's ``UtilityResult`` of one call, in the order of ``engines``."""
        from engine.engine_core.messages import UtilityCall, UtilityResult

        self._check()
        self._call_id = call_id = getattr(self, "_call_id", 0) + 1
        for engine in engines:
            self._ins[engine].send(self._codec.encode(UtilityCall(call_id, method, args, 0)))
        results: dict[int, Any] = {}
        while len(results) < len(engines):
            msg = self._receive(100)
            if msg is None:
                continue
            if isinstance(msg, UtilityResult):
                if msg.call_id == call_id:
                    results[msg.engine_index] = msg
                continue
            self._pending += self._handle(msg)
        return [results[i] for i in engines]

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._finalizer()
        for sock in (self._out, *self._ins):
            sock.close(linger=0)
        self._ctx.term()


def sum_stats(stats: list[EngineStats]) -> EngineStats:
    """The stats of several engine cores as one (counters and request gauges summed, KV-cache
    usage averaged: every core has its own cache of the same size)."""
    if not stats:
        return EngineStats()
    total = EngineStats(time=max(s.time for s in stats))
    for s in stats:
        total.num_running += s.num_running
        total.num_waiting += s.num_waiting
        total.prefix_cache_queries += s.prefix_cache_queries
        total.prefix_cache_hits += s.prefix_cache_hits
        total.num_preemptions += s.num_preemptions
        total.prompt_tokens_total += s.prompt_tokens_total
        total.generation_tokens_total += s.generation_tokens_total
        total.num_used_blocks += s.num_used_blocks
        total.encoder_cache_queries += s.encoder_cache_queries
        total.encoder_cache_hits += s.encoder_cache_hits
        total.kv_cache_usage += s.kv_cache_usage / len(stats)
        if s.spec_decoding is not None:
            total.spec_decoding = _add_spec_stats(total.spec_decoding, s.spec_decoding)
    return total


def _add_spec_stats(total: Any, s: Any) -> Any:
    """Speculative-decoding counters of two cores added (every core drafts the same number
    of tokens per step)."""
    if total is None:
        return s.copy()
    total.num_drafts += s.num_drafts
    total.num_draft_tokens += s.num_draft_tokens
    total.num_accepted_tokens += s.num_accepted_tokens
    total.num_accepted_tokens_per_pos = [
        a + b
        for a, b in zip(
            total.num_accepted_tokens_per_pos, s.num_accepted_tokens_per_pos, strict=False
        )
    ]
    return total
