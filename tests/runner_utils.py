"""Helpers for model-level tests: a CPU runner on a tiny model and a hand-driven "scheduler".

The greedy sampler here is a test stand-in (the real one lives in ``engine.sampler``): it records
the logits it is given so tests can compare them with transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from engine.attention_backends.torch_ref import TorchReferenceBackend
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.kernels import KernelRegistry
from engine.model_runner import ModelRunner
from engine.platforms.interface import Platform
from engine.request import Request
from engine.scheduler_output import ScheduledRequest, SchedulerOutput


class CpuTestPlatform(Platform):
    name = "cpu"
    device_type = "cpu"


@dataclass
class _Out:
    token_ids: list[list[int]]
    logprobs: list


@dataclass
class RecordingGreedySampler:
    """Argmax per row; keeps every logits tensor it saw."""

    seen: list[torch.Tensor] = field(default_factory=list)

    def sample(self, logits, rows):
        self.seen.append(logits.clone())
        return _Out([[int(t)] for t in logits.argmax(-1)], [None] * len(rows))


def make_runner(model_dir, block_size=4, num_blocks=128, dtype="float32", max_model_len=None):
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype=dtype, max_model_len=max_model_len),
        cache=CacheConfig(block_size=block_size, num_gpu_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256),
    )
    sampler = RecordingGreedySampler()
    runner = ModelRunner(
        config,
        CpuTestPlatform,
        KernelRegistry().resolve("cpu"),
        TorchReferenceBackend,
        sampler,
    )
    runner.load_model()
    runner.kv_cache_groups()
    runner.allocate_kv_cache(runner.determine_num_blocks())
    return runner, sampler


class BlockAllocator:
    """Hands out block ids per request and group, shuffled so tables are not contiguous."""

    def __init__(self, num_blocks: int, num_groups: int, seed: int = 0) -> None:
        import random

        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[str, list[list[int]]] = {}
        self.num_groups = num_groups

    def table(self, req_id: str, num_tokens: int, block_size: int) -> list[list[int]]:
        tables = self.tables.setdefault(req_id, [[] for _ in range(self.num_groups)])
        need = math.ceil(num_tokens / block_size)
        for t in tables:
            while len(t) < need:
                t.append(self.free.pop())
        return [list(t) for t in tables]


def schedule(requests_and_chunks, alloc, block_size, blocks_to_copy=()):
    """Build a SchedulerOutput from (request, num_new_tokens) in the given order; advances the
    requests' ``num_computed_tokens``."""
    scheduled = []
    for req, n in requests_and_chunks:
        start = req.num_computed_tokens
        samples = start + n >= req.num_tokens
        scheduled.append(
            ScheduledRequest(
                req, start, n, alloc.table(req.request_id, start + n, block_size), samples
            )
        )
        req.num_computed_tokens += n
    return SchedulerOutput(scheduled, sum(n for _, n in requests_and_chunks), list(blocks_to_copy))


def new_request(rid: str, prompt: list[int]) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(prompt), max_tokens=64)
