"""Speculative verification on engine-triton under the interpreter: steps of 1 + k query
tokens per request go through the Triton varlen path, eagerly and through the verify-graph
machinery (``DecodeGraphs(query_len=k + 1)`` run eagerly: padded requests, slot -1 pads,
context lengths ``start + q``), and greedy tokens equal the torch reference without
speculation."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.testing.tiny_models import build_tiny_eagle_head, build_tokenizer, save_tiny_model

SPEC = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
        "prompt_lookup_max": 2}  # fmt: skip


@pytest.fixture(scope="module")
def repetitive_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_rep")
    tok = build_tokenizer(path)
    return str(save_tiny_model("llama", path, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                               initializer_range=0.05, num_hidden_layers=2))  # fmt: skip


def _generate(llm: LLM) -> list[list[int]]:
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [30, 31, 30, 31, 30]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without a GPU")
@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_verification_on_triton_matches_torch(repetitive_llama, monkeypatch, method, tmp_path):
    """The draft model is the target itself: every draft is accepted, which holds only if
    its mirrored KV and its decode steps (through the draft's own graph buffers) are right.
    The EAGLE-3 head (random) reads the target's layer states, kept by the graph buffers."""
    import engine_triton.kernels as triton_kernels

    register = triton_kernels.register
    monkeypatch.setattr(
        triton_kernels, "register", lambda registry: register(registry, platforms=("cpu",))
    )
    kw = dict(dtype="float32", block_size=4, max_num_batched_tokens=16, platform="cpu",
              max_num_seqs=4)  # fmt: skip
    expected = _generate(LLM(repetitive_llama, attention_backend="torch", **kw))
    spec = dict(SPEC)
    if method == "draft_model":
        spec = {"method": "draft_model", "model": repetitive_llama, "num_speculative_tokens": 2}
    elif method == "eagle3":
        head = build_tiny_eagle_head(tmp_path / "head", repetitive_llama, "eagle3",
                                     aux_layer_ids=[0, 1, 1])  # fmt: skip
        spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 2}
    llm = LLM(repetitive_llama, attention_backend="triton", speculative_config=spec, **kw)
    runner = llm.llm_engine.runner
    if method == "ngram":  # eager verification steps (the proposers' mirror runs them too)
        assert _generate(llm) == expected
        assert llm.llm_engine.get_stats().spec_decoding.num_accepted_tokens > 0
    runner.capture_graphs(eager=True)
    replays = []
    run = runner.verify_graphs.run

    def counted(scheduled, rows=None):
        hidden = run(scheduled, rows)
        replays.append(hidden is not None)
        return hidden

    runner.verify_graphs.run = counted
    mirrored = []
    if method != "ngram":  # the proposer mirrors decode/verify steps through its graphs
        replay = runner.proposer.mirror_graphs.replay

        def mirror(*args):
            hidden = replay(*args)
            mirrored.append(hidden is not None)
            return hidden

        runner.proposer.mirror_graphs.replay = mirror
    assert _generate(llm) == expected  # through the verify-graph buffers
    assert method == "ngram" or any(mirrored)
    assert any(replays)
    sd = llm.llm_engine.get_stats().spec_decoding
    assert sd.num_drafts > 0 and (method == "eagle3" or sd.num_accepted_tokens > 0)
    if method == "eagle3":  # the target's layer states came from the graph buffers
        assert runner.verify_graphs.last_extra(1) is not None
    if method == "draft_model":
        assert runner.proposer.graphs is not None
        assert sd.num_accepted_tokens == sd.num_draft_tokens
    assert llm.llm_engine.num_used_blocks == 0
