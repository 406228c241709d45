"""A small deterministic stand-in for ``LLMEngine`` (same interface), for unit tests of the
async loop and the HTTP layer that must not depend on model numerics (engine death, slow
steps). The end-to-end tests use the real engine."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from engine.config import EngineConfig, ModelConfig
from engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


class FakeInvalidRequest(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class FakePromptTooLong(FakeInvalidRequest):
    def __init__(self, max_model_len: int, num_tokens: int) -> None:
        super().__init__(f"prompt of {num_tokens} tokens exceeds {max_model_len}", "prompt")
        self.max_model_len = max_model_len
        self.num_tokens = num_tokens


@dataclass
class FakeStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0


class _Req:
    def __init__(self, rid, prompt, ids, params):
        self.rid, self.prompt, self.ids, self.params = rid, prompt, ids, params
        self.outputs = [CompletionOutput(i, "", []) for i in range(params.n)]
        if params.logprobs is not None:
            for c in self.outputs:
                c.logprobs = []
        self.metrics = RequestMetrics(time.monotonic())
        self.prefilled = False
        self.prompt_lps = None


class FakeEngine:
    """Generates token ``(prompt_sum + 7 * position + completion_index) % vocab``."""

    def __init__(self, tokenizer, max_model_len: int = 128, step_delay: float = 0.001) -> None:
        self.tokenizer = tokenizer
        self.config = EngineConfig(ModelConfig(model="fake-model", max_model_len=max_model_len))
        self.step_delay = step_delay
        self.vocab = len(tokenizer)
        self.requests: dict[str, _Req] = {}
        self.stats = FakeStats()
        self.fail_on_step: BaseException | None = None
        self.num_total_blocks = 1000

    def add_request(self, request_id, prompt, params, prompt_token_ids=None, priority=0):
        if request_id in self.requests:
            raise FakeInvalidRequest(f"duplicate request id {request_id}", "request_id")
        ids = prompt_token_ids
        if ids is None:
            ids = self.tokenizer(prompt)["input_ids"]
        if 0 in ids:
            raise FakeInvalidRequest("token 0 is reserved", "prompt")
        if len(ids) >= self.config.model.max_model_len:
            raise FakePromptTooLong(self.config.model.max_model_len, len(ids))
        self.requests[request_id] = _Req(request_id, prompt, list(ids), params)

    def abort_request(self, request_ids):
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            self.requests.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_used_blocks(self) -> int:
        return sum(
            math.ceil((len(r.ids) + len(c.token_ids)) / 16)
            for r in self.requests.values()
            for c in r.outputs
        )

    def get_stats(self) -> FakeStats:
        s = self.stats
        s.num_running = len(self.requests)
        s.kv_cache_usage = self.num_used_blocks / self.num_total_blocks
        return FakeStats(**vars(s))

    def token_for(self, ids: list[int], position: int, index: int) -> int:
        return (sum(ids) + 7 * position + index) % self.vocab

    def step(self) -> list[RequestOutput]:
        if self.fail_on_step is not None:
            raise self.fail_on_step
        time.sleep(self.step_delay)
        results = []
        now = time.monotonic()
        for rid, r in list(self.requests.items()):
            if not r.prefilled:
                r.prefilled = True
                self.stats.prompt_tokens_total += len(r.ids)
                if r.params.prompt_logprobs is not None:
                    r.prompt_lps = [None] + [
                        {t: Logprob(-1.0, 1, self.tokenizer.decode([t]))} for t in r.ids[1:]
                    ]
            new_ids, new_texts = [], []
            for c in r.outputs:
                if c.finish_reason is not None:
                    new_ids.append([])
                    new_texts.append("")
                    continue
                tok = self.token_for(r.ids, len(c.token_ids), c.index)
                c.token_ids.append(tok)
                text = self.tokenizer.decode([tok])
                c.text += text
                if c.logprobs is not None:
                    c.logprobs.append({tok: Logprob(-0.5, 1, text)})
                self.stats.generation_tokens_total += 1
                new_ids.append([tok])
                new_texts.append(text)
                if tok in r.params.stop_token_ids:
                    c.finish_reason, c.stop_reason = "stop", tok
                elif len(c.token_ids) >= r.params.max_tokens:
                    c.finish_reason = "length"
            finished = all(c.finish_reason is not None for c in r.outputs)
            if finished:
                del self.requests[rid]
                r.metrics.finished_time = now
            results.append(
                RequestOutput(
                    rid,
                    r.prompt,
                    r.ids,
                    [CompletionOutput(**vars(c)) for c in r.outputs],
                    finished,
                    prompt_logprobs=r.prompt_lps,
                    metrics=r.metrics,
                    new_token_ids=new_ids,
                    new_texts=new_texts,
                )
            )
        return results
