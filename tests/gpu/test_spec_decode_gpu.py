"""Speculative decoding on a CUDA GPU: engine-triton with CUDA graphs (the verify graphs of
k + 1 tokens per request, the draft model's and EAGLE head's decode graphs), with and without
asynchronous scheduling; greedy tokens identical to plain decoding, every block returned."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.testing.tiny_models import build_tiny_eagle_head, build_tokenizer, save_tiny_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """Small random weights: greedy output repeats itself, so lookup drafts are often right."""
    path = tmp_path_factory.mktemp("spec_gpu")
    tok = build_tokenizer(path)
    return str(save_tiny_model("llama", path, vocab_size=len(tok), num_hidden_layers=4,
                               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id, initializer_range=0.05))  # fmt: skip


def _prompts() -> list[list[int]]:
    rng = random.Random(1)
    out = []
    for n in [2, 5, 9, 16, 17, 33, 60, 100, 150, 7, 12, 40]:
        base = [rng.randrange(10, 300) for _ in range(max(2, n // 3))]
        out.append((base * 4)[:n])
    out.append(out[7][:64] + [11, 12])  # a prefix hit
    return out


def _run(path, spec=None, **kw):
    llm = LLM(path, dtype="float32", block_size=16, max_num_batched_tokens=256,
              num_gpu_blocks_override=400, speculative_config=spec, **kw)  # fmt: skip
    runner = llm.llm_engine.runner
    replays = []
    if runner.verify_graphs is not None:
        run = runner.verify_graphs.run

        def counted(scheduled, rows=None):
            hidden = run(scheduled, rows)
            replays.append(hidden is not None)
            return hidden

        runner.verify_graphs.run = counted
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    info = (sum(replays), stats.spec_decoding, llm.llm_engine.num_used_blocks)
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outs], info


@pytest.fixture(scope="module")
def plain_tokens(model):
    return _run(model, platform="cuda", attention_backend="triton")[0]


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_speculative_decoding_with_cuda_graphs(model, plain_tokens, tmp_path, method,
                                               async_scheduling):  # fmt: skip
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}  # fmt: skip
    if method == "draft_model":  # the target as its own draft: every draft accepted
        spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 3}
    elif method == "eagle3":
        head = build_tiny_eagle_head(tmp_path / "head", model, "eagle3", aux_layer_ids=[1, 2, 3])
        spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    tokens, (replays, sd, used) = _run(model, spec, platform="cuda", attention_backend="triton",
                                       async_scheduling=async_scheduling)  # fmt: skip
    assert tokens == plain_tokens
    assert used == 0
    assert replays > 0, "no verification step replayed a CUDA graph"
    assert sd.num_drafts > 0
    if method == "draft_model":
        assert sd.num_accepted_tokens == sd.num_draft_tokens
    elif method == "ngram":
        assert sd.num_accepted_tokens > 0
