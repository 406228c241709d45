"""A minimal greedy engine loop over the real scheduler and model runner, for model tests and
benchmarks that must not depend on the full engine (no detokenizer, no stop strings).

``GreedyDriver(model_path, dtype=...)`` builds a CPU ``ModelRunner`` with the torch reference
attention backend and a ``Scheduler`` with one KV-cache group per sliding window, then
``generate(prompts, num_new)`` runs continuous batching to completion and returns each prompt's
greedy tokens (and, on request, the logits that chose them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.request import Request, RequestStatus


class _CpuPlatform:
    """Just what ``ModelRunner`` asks of a platform on the CPU."""

    name = "cpu"
    device_type = "cpu"

    @staticmethod
    def torch_device(index: int = 0) -> torch.device:  # the Platform hook's signature
        return torch.device("cpu")


@dataclass
class _Result:
    token_ids: list[list[int]]
    logprobs: Any


@dataclass
class ArgmaxSampler:
    """Greedy sampling; optionally keeps each step's logits (float32, on the CPU)."""

    keep_logits: bool = False
    seen: list[torch.Tensor] = field(default_factory=list)

    def sample(self, logits: torch.Tensor, rows: list[Any]) -> _Result:
        if self.keep_logits:
            self.seen.append(logits.detach().float().cpu())
        return _Result([[int(t)] for t in logits.argmax(-1).tolist()], None)


class GreedyDriver:
    """Greedy continuous batching: ``Scheduler`` -> ``ModelRunner.execute`` -> argmax."""

    def __init__(
        self,
        model: str,
        dtype: str = "float32",
        block_size: int = 16,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int = 512,
        max_model_len: int | None = None,
        num_blocks: int | None = None,
        keep_logits: bool = False,
        attn_backend_cls: Any = None,
    ) -> None:
        from engine.attention_backends.torch_ref import TorchReferenceBackend
        from engine.kernels import KernelRegistry
        from engine.model_runner import ModelRunner

        self.config = EngineConfig(
            model=ModelConfig(model=str(model), dtype=dtype, max_model_len=max_model_len),
            cache=CacheConfig(block_size=block_size, num_gpu_blocks=num_blocks),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
            ),
        )
        self.sampler = ArgmaxSampler(keep_logits)
        self.runner = ModelRunner(
            self.config,
            _CpuPlatform,
            KernelRegistry().resolve("cpu"),
            attn_backend_cls or TorchReferenceBackend,
            self.sampler,
        )
        self.runner.load_model()
        self.groups = self.runner.kv_cache_groups()
        self.runner.allocate_kv_cache(self.runner.determine_num_blocks())
        self._ids = 0

    def generate(
        self, prompts: list[list[int]], num_new: int
    ) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
        """Greedy-decode ``num_new`` tokens for every prompt, all batched together. Returns the
        tokens and (with ``keep_logits``) each prompt's chosen-step logits rows."""
        from engine.kv_cache_manager import KVCacheGroupSpec
        from engine.scheduler import Scheduler

        cfg = self.config
        scheduler = Scheduler(
            cfg.scheduler,
            cfg.cache,
            cfg.model.max_model_len,
            self.runner.num_blocks,
            [KVCacheGroupSpec(sliding_window=w) for w in self.groups],
        )
        requests = []
        for prompt in prompts:
            self._ids += 1
            req = Request(
                request_id=f"g{self._ids}", prompt_token_ids=list(prompt), max_tokens=num_new
            )
            requests.append(req)
            scheduler.add_request(req)
        logits: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in requests}
        while scheduler.has_unfinished():
            step = scheduler.schedule()
            rows = {s.request.request_id: None for s in step.scheduled if s.samples}
            self.sampler.seen.clear()
            out = self.runner.execute(step, rows)
            scheduler.update_from_output(step, out.sampled)
            sampling = [s.request for s in step.scheduled if s.samples]
            for j, req in enumerate(sampling):
                if self.sampler.keep_logits:
                    logits[req.request_id].append(self.sampler.seen[0][j])
                if len(req.output_token_ids) >= num_new:
                    scheduler.finish_request(req.request_id, RequestStatus.FINISHED_LENGTH)
        assert scheduler.kv.num_used_blocks == 0, "blocks leaked"
        return [r.output_token_ids[:num_new] for r in requests], [
            logits[r.request_id] for r in requests
        ]
