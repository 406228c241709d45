"""The engine on a CUDA GPU against its CPU path: a tiny float32 model, many mixed-length
prompts, greedy tokens identical. Covers the triton backend with CUDA-graph decode (batch sizes
that need padding), eager mode, the sdpa fall-back, and KV sizing by memory profiling."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.testing.tiny_models import build_tiny_model

pytestmark = pytest.mark.gpu
NUM_NEW = 24


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def tiny_model(request, tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp(request.param), request.param))


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    lengths = [1, 3, 7, 16, 17, 40, 64, 100, 129, 200, 333]
    prompts = [[rng.randrange(10, 300) for _ in range(n)] for n in lengths]
    prompts.append(prompts[8][:96] + [rng.randrange(10, 300) for _ in range(5)])  # prefix hit
    return prompts


def _run(path: str, **kwargs) -> tuple[list[list[int]], object]:
    llm = LLM(path, dtype="float32", block_size=16, max_num_batched_tokens=256, **kwargs)
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]
    runner = llm.llm_engine.runner
    info = (runner.graphs is not None, runner.num_blocks)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, info


@pytest.fixture(scope="module")
def cpu_tokens(tiny_model):
    return _run(tiny_model, platform="cpu", attention_backend="torch")[0]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_triton_with_cuda_graphs_matches_cpu(tiny_model, cpu_tokens, async_scheduling):
    """Decode graphs, with the sampled tokens fed back inside the graph (asynchronous
    scheduling, the GPU default) and from the host."""
    tokens, (graphs, _) = _run(
        tiny_model,
        platform="cuda",
        attention_backend="triton",
        num_gpu_blocks_override=512,
        async_scheduling=async_scheduling,
    )
    assert graphs, "decode graphs were not captured"
    assert tokens == cpu_tokens


def test_triton_eager_matches_cpu(tiny_model, cpu_tokens):
    tokens, (graphs, _) = _run(
        tiny_model,
        platform="cuda",
        attention_backend="triton",
        enforce_eager=True,
        num_gpu_blocks_override=512,
    )
    assert not graphs
    assert tokens == cpu_tokens


def test_cascade_attention_matches_cpu(tiny_model, monkeypatch):
    """40 requests behind one 320-token prefix: their decode steps run cascade attention
    through the captured cascade decode graphs (thresholds lowered to this batch) and give
    the CPU path's greedy tokens."""
    from paged_reference import record_cascades

    log = record_cascades(monkeypatch, min_decodes=8)
    rng = random.Random(1)
    prefix = [rng.randrange(10, 300) for _ in range(320)]
    prompts = [prefix + [rng.randrange(10, 300) for _ in range(1 + i)] for i in range(40)]
    prompts.append([rng.randrange(10, 300) for _ in range(350)])  # shares nothing
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)

    def run(**kwargs) -> list[list[int]]:
        llm = LLM(tiny_model, dtype="float32", block_size=16, max_num_batched_tokens=2048,
                  **kwargs)  # fmt: skip
        llm.generate(prompts[:1], params, use_tqdm=False)  # the prefix in the cache
        outs = llm.generate(prompts, params, use_tqdm=False)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        return [o.outputs[0].token_ids for o in outs]

    expected = run(platform="cpu", attention_backend="torch")
    log.clear()
    tokens = run(platform="cuda", attention_backend="triton", num_gpu_blocks_override=512)
    assert max(log.graph_lengths, default=0) == 320, "no graph replay ran cascade attention"
    assert tokens == expected


def test_sdpa_matches_cpu(tiny_model, cpu_tokens):
    tokens, (graphs, _) = _run(
        tiny_model, platform="cuda", attention_backend="sdpa", num_gpu_blocks_override=512
    )
    assert not graphs  # sdpa loops on host lengths: never captured
    assert tokens == cpu_tokens


def test_kv_cache_sized_by_profiling(tiny_model):
    """No override: the cache gets what a profiled forward leaves of 2% of the GPU."""
    llm = LLM(tiny_model, dtype="float32", platform="cuda", gpu_memory_utilization=0.02,
              max_num_seqs=8, max_num_batched_tokens=512)  # fmt: skip
    runner = llm.llm_engine.runner
    budget = 0.02 * torch.cuda.mem_get_info()[1]
    kv_bytes = sum(t.numel() * t.element_size() for t in runner.kv_caches)
    assert runner.num_blocks > 0
    assert 0.5 * budget < kv_bytes < budget
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()


def test_kv_cache_too_small_is_a_clear_error(tiny_model):
    from engine.config import ConfigError

    with pytest.raises(ConfigError, match="not enough device memory"):
        LLM(tiny_model, dtype="float32", platform="cuda", gpu_memory_utilization=1e-6)
