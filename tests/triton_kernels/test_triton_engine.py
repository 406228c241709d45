"""The whole engine on the CPU with engine-llm-triton: its attention backend and every kernel run
in Triton's interpreter, and greedy tokens equal the torch reference path's exactly."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.testing.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("qwen3"), "qwen3"))


def _generate(path: str, backend: str) -> list[list[int]]:
    llm = LLM(path, attention_backend=backend, dtype="float32", block_size=4,
              max_num_batched_tokens=8, platform="cpu")  # fmt: skip
    first = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    prompts = [first, [12, 13, 14], first[:8] + [40, 41, 42]]  # the last shares 2 blocks
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without a GPU")
def test_engine_on_triton_interpreter_matches_torch(tiny_qwen3, monkeypatch):
    import engine_triton.kernels as triton_kernels

    register = triton_kernels.register
    # Serve the CPU platform too (the plugin registers for GPUs only).
    monkeypatch.setattr(
        triton_kernels, "register", lambda registry: register(registry, platforms=("cpu",))
    )
    expected = _generate(tiny_qwen3, "torch")
    # Chunked prefill (8-token budget), decodes and a prefix-cache hit all go through Triton.
    assert _generate(tiny_qwen3, "triton") == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without a GPU")
def test_cascade_attention_in_the_engine_matches_torch(tiny_qwen3, monkeypatch):
    """Decodes that share cached prefix blocks go through cascade attention (the thresholds
    lowered to this tiny batch): eagerly in the steps that also carry a prefill chunk, and
    through the cascade decode graphs' buffers (``capture_graphs(eager=True)``: 9 decodes
    padded to a graph of 16) in the others; the greedy tokens are the torch path's. With
    ``disable_cascade_attn`` no cascade graph is captured and no prefix is looked for."""
    from paged_reference import record_cascades

    import engine_triton.kernels as triton_kernels

    register = triton_kernels.register
    monkeypatch.setattr(
        triton_kernels, "register", lambda registry: register(registry, platforms=("cpu",))
    )
    log = record_cascades(monkeypatch, min_decodes=2, min_prefix=4)
    prefix = list(range(20, 33))  # 13 tokens: 3 whole blocks of 4 shared
    # The last prompt shares nothing: its decodes attend as usual beside the cascade.
    prompts = [prefix + [40 + i] * (1 + i % 3) for i in range(8)] + [list(range(60, 75))]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def engine(backend: str, **kw) -> LLM:
        return LLM(tiny_qwen3, attention_backend=backend, dtype="float32", block_size=4,
                   max_num_batched_tokens=24, max_num_seqs=16, platform="cpu", **kw)  # fmt: skip

    def run(llm: LLM) -> list[list[int]]:
        llm.generate(prompts[:1], params, use_tqdm=False)  # caches the prefix blocks
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    expected = run(engine("torch"))
    llm = engine("triton")
    runner = llm.llm_engine.runner
    runner.capture_graphs(eager=True)
    assert runner.graphs.cascade_sizes == [8, 16]
    assert run(llm) == expected
    # 3 blocks, in graph replays and in the eager steps that carry prefill chunks (24 tokens).
    assert max(log.graph_lengths, default=0) == 12, log.graph_lengths
    assert len(log.lengths) > len(log.graph_lengths), log.lengths
    # Replays of eager "graphs" run the model: each layer of a cascade replay does a shared pass.
    assert log.shared_passes > len(log.graph_lengths) > 0
    off = engine("triton", disable_cascade_attn=True).llm_engine.runner
    off.capture_graphs(eager=True)
    assert off.graphs.cascade_sizes == [] and not off._cascade
