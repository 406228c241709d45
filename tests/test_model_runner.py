"""ModelRunner: KV-cache groups and sizing, cache allocation, prompt logprobs plumbing."""

from __future__ import annotations

import math
import types

import pytest
import torch
from runner_utils import BlockAllocator, make_runner, new_request, schedule
from transformers import AutoModelForCausalLM

from engine.config import ConfigError
from engine.outputs import Logprob
from engine.sampler import SamplingRow
from engine.sampling_params import SamplingParams
from engine.testing.tiny_models import save_tiny_model


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    # Layer 0 full attention, layers 1-2 sliding window 5: two KV-cache groups.
    return save_tiny_model("qwen2_sliding", tmp_path_factory.mktemp("q2"), seed=2)


def test_groups_full_first_and_shared_cache_tensors(hybrid_dir):
    runner, _ = make_runner(hybrid_dir, block_size=4, num_blocks=10)
    assert runner.kv_cache_groups() == [None, 5]
    layers = runner.model.attention_layers()
    assert [layer.kv_group for layer in layers] == [0, 1, 1]
    # The i-th layer of each group shares a tensor: 2 tensors for 3 layers.
    assert len(runner.kv_caches) == 2
    assert layers[0].kv_cache is layers[1].kv_cache
    assert layers[2].kv_cache is not layers[0].kv_cache
    per_layer = 2 * 4 * 2 * 16 * 4  # k+v, block_size, kv_heads, head_size, fp32
    assert runner.bytes_per_block() == 2 * per_layer
    assert runner.kv_caches[0].shape == (2, 10, 4, 2, 16)


def test_cpu_cache_sizing(hybrid_dir):
    runner, _ = make_runner(hybrid_dir, block_size=4)
    runner.config.cache.num_gpu_blocks = None
    full, window = runner.kv_cache_groups()
    assert full is None and window is not None
    # max_model_len 512: the full group holds every block, the sliding group only its window
    # plus one step's chunk (max_num_batched_tokens 256).
    per_request = 512 // 4 + min(512 // 4, math.ceil((window - 1 + 256) / 4) + 1)
    assert per_request < 2 * 512 // 4
    assert runner.blocks_per_request() == per_request
    runner.config.cache.cpu_kv_cache_gb = 1.0
    # 1 GiB holds far more than 16 max-length requests: capped.
    assert runner.determine_num_blocks() == 16 * per_request + 1
    runner.config.cache.cpu_kv_cache_gb = 0.001
    assert runner.determine_num_blocks() == int(0.001 * 2**30) // runner.bytes_per_block()
    runner.config.cache.cpu_kv_cache_gb = 0.0001
    with pytest.raises(ConfigError, match=f"max_model_len=512 needs {per_request}"):
        runner.determine_num_blocks()


class FakeAccelerator:
    """A platform that reports memory numbers without a device (the runner stays on CPU)."""

    device_type = "cpu"
    total = 0
    peak = 0

    @classmethod
    def synchronize(cls, index=0):  # the Platform interface's signature
        pass

    @classmethod
    def reset_peak_memory(cls, index=0):  # the Platform interface's signature
        pass

    @classmethod
    def peak_memory(cls, index=0):  # the Platform interface's signature
        return cls.peak

    @classmethod
    def total_memory(cls, index=0):  # the Platform interface's signature
        return cls.total


def test_profiled_sizing_uses_budget_minus_peak(hybrid_dir):
    runner, _ = make_runner(hybrid_dir, block_size=4)
    runner.platform = FakeAccelerator
    per_block, per_request = runner.bytes_per_block(), runner.blocks_per_request()
    FakeAccelerator.total = 100 * 2**20
    FakeAccelerator.peak = 10 * 2**20
    n = runner._profile_num_blocks(per_block, per_request)
    # The temporary profiling cache is freed again.
    assert runner.kv_caches == [] and all(
        layer.kv_cache is None for layer in runner.model.attention_layers()
    )
    # peak_memory includes the temporary profiling cache, which is subtracted back.
    assert n > (int(100 * 2**20 * 0.9) - 10 * 2**20) // per_block
    FakeAccelerator.total = 2**20
    with pytest.raises(ConfigError, match="not enough device memory") as e:
        runner._profile_num_blocks(per_block, per_request)
    assert "weights" in str(e.value) and "max_model_len=512" in str(e.value)


def test_multiple_samples_and_logprobs_pass_through(hybrid_dir):
    runner, _ = make_runner(hybrid_dir)

    class TwoSamples:
        def sample(self, logits, rows):
            top = logits.topk(2, dim=-1).indices.tolist()
            lp = [[{t: Logprob(0.0)} for t in r] for r in top]
            return types.SimpleNamespace(token_ids=top, logprobs=lp)

    runner.sampler = TwoSamples()
    alloc = BlockAllocator(runner.num_blocks, 2)
    req = new_request("p", [5, 6, 7, 8, 9])
    out = runner.execute(schedule([(req, 5)], alloc, runner.block_size), {"p": object()})
    assert len(out.sampled["p"]) == 2 and len(out.logprobs["p"]) == 2


def test_prompt_logprobs_over_chunks(hybrid_dir):
    """Prompt logprobs come from the logits at each previous position; the chunks' lists
    concatenated give one entry per prompt token after the first."""
    from engine.sampler import Sampler

    hf = AutoModelForCausalLM.from_pretrained(hybrid_dir, dtype=torch.float32).eval()
    runner, _ = make_runner(hybrid_dir)
    runner.sampler = Sampler(runner.vocab_size, runner.device)
    alloc = BlockAllocator(runner.num_blocks, 2)
    prompt = [11, 42, 7, 99, 3, 250, 17, 8, 64]
    req = new_request("p", prompt)
    out = runner.execute(schedule([(req, 4)], alloc, runner.block_size), {}, {"p": 2})
    entries = out.prompt_logprobs["p"]
    assert len(entries) == 4 and out.sampled == {}
    row = SamplingRow(SamplingParams(temperature=0.0), prompt, [], [None])
    out = runner.execute(schedule([(req, 5)], alloc, runner.block_size), {"p": row}, {"p": 2})
    entries += out.prompt_logprobs["p"]
    assert len(entries) == len(prompt) - 1
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    for j in range(1, len(prompt)):
        entry = entries[j - 1]
        assert abs(entry[prompt[j]].logprob - float(ref[j - 1, prompt[j]])) < 1e-4
        assert len(entry) >= 2
    assert out.sampled["p"] == [int(ref[-1].argmax())]
