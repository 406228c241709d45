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
