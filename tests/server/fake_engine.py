"""A small deterministic stand-in for ``EngineCore`` (same interface: token ids in,
``EngineCoreOutput``s out), for unit tests of the front end and the HTTP layer that must not
depend on model numerics (engine death, slow steps). The end-to-end tests use the real core."""

from __future__ import annotations

import math
import time

from engine.config import EngineConfig, ModelConfig
from engine.engine_core.messages import EngineCoreOutput, EngineStats
from engine.outputs import Logprob


class FakeInvalidRequest(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class FakePromptTooLong(FakeInvalidRequest):
    def __init__(self, max_model_len: int, num_tokens: int) -> None:
        super().__init__(f"prompt of {num_tokens} tokens exceeds {max_model_len}", "prompt")
        self.max_model_len = max_model_len
        self.num_tokens = num_tokens


class _Seq:
    def __init__(self, index: int) -> None:
        self.index = index
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None


class _Req:
    def __init__(self, req) -> None:
        self.rid = req.request_id
        self.ids = list(req.prompt_token_ids)
        self.params = req.sampling_params
        self.seqs = [_Seq(i) for i in range(self.params.n)]
        self.prefilled = False


class FakeEngine:
    """Generates token ``(prompt_sum + 7 * position + completion_index) % vocab``."""

    def __init__(self, tokenizer, max_model_len: int = 128, step_delay: float = 0.001) -> None:
        self.tokenizer = tokenizer
        self.config = EngineConfig(ModelConfig(model="fake-model", max_model_len=max_model_len))
        self.eos_token_ids: list[int] = []
        self.step_delay = step_delay
        self.vocab = len(tokenizer)
        self.requests: dict[str, _Req] = {}
        self.stats = EngineStats()
        self.fail_on_step: BaseException | None = None
        self.num_total_blocks = 1000

    @property
    def _requests(self) -> dict[str, _Req]:  # what CoreLoop looks at with several clients
        return self.requests

    def add_request(self, req) -> None:
        if req.request_id in self.requests:
            raise FakeInvalidRequest(f"duplicate request id {req.request_id}", "request_id")
        ids = req.prompt_token_ids
        if 0 in ids:
            raise FakeInvalidRequest("token 0 is reserved", "prompt")
        if len(ids) >= self.config.model.max_model_len:
            raise FakePromptTooLong(self.config.model.max_model_len, len(ids))
        self.requests[req.request_id] = _Req(req)

    def abort_requests(self, request_ids):
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            self.requests.pop(rid, None)

    def finish_sequences(self, sequences) -> None:
        for rid, index in sequences:
            r = self.requests.get(rid)
            if r is not None:
                r.seqs[index].finish_reason = "stop"
                if all(s.finish_reason is not None for s in r.seqs):
                    del self.requests[rid]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_used_blocks(self) -> int:
        return sum(
            math.ceil((len(r.ids) + len(s.token_ids)) / 16)
            for r in self.requests.values()
            for s in r.seqs
        )

    def get_stats(self) -> EngineStats:
        s = self.stats
        s.num_running = len(self.requests)
        s.num_used_blocks = self.num_used_blocks
        s.kv_cache_usage = s.num_used_blocks / self.num_total_blocks
        s.time = time.monotonic()
        return EngineStats(**{f: getattr(s, f) for f in s.__struct_fields__})

    def token_for(self, ids: list[int], position: int, index: int) -> int:
        return (sum(ids) + 7 * position + index) % self.vocab

    def step(self) -> list[EngineCoreOutput]:
        if self.fail_on_step is not None:
            raise self.fail_on_step
        time.sleep(self.step_delay)
        results = []
        for rid, r in list(self.requests.items()):
            prompt_chunk = None
            if not r.prefilled:
                r.prefilled = True
                self.stats.prompt_tokens_total += len(r.ids)
                if r.params.prompt_logprobs is not None:
                    prompt_chunk = [{t: Logprob(-1.0, 1)} for t in r.ids[1:]]
            for s in r.seqs:
                if s.finish_reason is not None:
                    continue
                tok = self.token_for(r.ids, len(s.token_ids), s.index)
                s.token_ids.append(tok)
                self.stats.generation_tokens_total += 1
                out = EngineCoreOutput(rid, [tok], s.index, prompt_logprobs=prompt_chunk)
                prompt_chunk = None
                if r.params.logprobs is not None:
                    out.new_logprobs = [{tok: Logprob(-0.5, 1)}]
                if tok in r.params.stop_token_ids:
                    s.finish_reason = out.finish_reason = "stop"
                    out.stop_reason = tok
                elif len(s.token_ids) >= r.params.max_tokens:
                    s.finish_reason = out.finish_reason = "length"
                results.append(out)
            if all(s.finish_reason is not None for s in r.seqs):
                del self.requests[rid]
        return results


class ScriptedEngine(FakeEngine):
    """Answers every request with ``script``, one token per step (as the engine streams),
    then stops the way an end-of-sequence token does (finish "stop", not in the text)."""

    script = ""
    last_params = None

    def add_request(self, req):
        self.last_params = req.sampling_params
        super().add_request(req)

    def step(self) -> list[EngineCoreOutput]:
        script_ids = self.tokenizer(self.script, add_special_tokens=False)["input_ids"]
        results = []
        for rid, r in list(self.requests.items()):
            for c in r.seqs:
                pos = len(c.token_ids)
                if c.finish_reason is not None or pos >= len(script_ids):
                    c.finish_reason = c.finish_reason or "stop"
                    continue
                c.token_ids.append(script_ids[pos])
                out = EngineCoreOutput(rid, [script_ids[pos]], c.index)
                if pos + 1 >= min(len(script_ids), r.params.max_tokens):
                    c.finish_reason = "stop" if pos + 1 >= len(script_ids) else "length"
                    out.finish_reason = c.finish_reason
                results.append(out)
            if all(c.finish_reason is not None for c in r.seqs):
                del self.requests[rid]
        return results
