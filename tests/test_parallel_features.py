"""Main's features under tensor parallelism, end to end on the CPU (gloo, one worker process
per rank), against the same model on one process:

* n-gram speculative decoding at TP=2: the drafts travel in the step messages, every rank
  verifies them, the reporting rank proposes the next ones; greedy tokens equal one process's
  (and plain decoding's), and a seeded sampled request's tokens too (rejection sampling draws
  from the same generators on every rank);
* a tiny Qwen3-MoE (64 experts, top-8) with its experts split over two ranks (TP=2) and placed
  on them (``enable_expert_parallel``, 32 whole experts each): greedy tokens equal, logprobs
  close;
* the native Phi-3 (fused checkpoint q/k/v and gate/up split per rank while loading lazily,
  partial rotary, LongRoPE with prompts past the original context) and Gemma 2 (soft-caps,
  alternating window, KV heads replicated over the ranks, tied embeddings) at TP=2, and Gemma 2
  at PP=2 (a last stage loads the tied head from the embedding), give one process's greedy
  tokens with close logprobs;
* the transformers modeling backend at TP=2 (GPT-NeoX: fused q/k/v with biases split by its
  ``base_model_tp_plan``) gives one process's greedy tokens;
* layouts that cannot work are refused at start, before any worker starts, saying why (the
  transformers backend under pipeline parallelism, or under tensor parallelism for a model
  without a tp plan, among them).
"""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.config import ConfigError
from engine.testing.moe_parallel import assert_moe_layouts_match_one_process
from engine.testing.tiny_models import build_tiny_model, build_tokenizer, save_tiny_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}  # fmt: skip
KW = dict(dtype="float32", block_size=4, max_num_batched_tokens=48, max_num_seqs=8,
          num_gpu_blocks_override=120, max_model_len=256)  # fmt: skip


def token_ids(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def spec_llama(tmp_path_factory):
    """A tiny Llama whose greedy output falls into repeating patterns (prompt lookup pays)."""
    path = tmp_path_factory.mktemp("llama_tp_spec")
    tok = build_tokenizer(path)
    return save_tiny_model("llama", path, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                           initializer_range=0.05)  # fmt: skip


def test_ngram_speculation_under_tensor_parallelism_matches_one_process(spec_llama):
    rng = random.Random(3)
    prompts = [[rng.randrange(10, 300) for _ in range(n)] for n in (3, 9, 25)]
    prompts.append((prompts[1] * 4)[:30])  # a repeated phrase: lookup drafts it
    greedy = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * len(prompts)
    seeded = [SamplingParams(temperature=0.8, seed=11, max_tokens=16, ignore_eos=True)]
    single = LLM(str(spec_llama), speculative_config=NGRAM, **KW)
    try:
        want = token_ids(single, prompts, greedy)
        want_seeded = token_ids(single, prompts[3:], seeded)
    finally:
        single.llm_engine.shutdown()
    llm = LLM(str(spec_llama), speculative_config=NGRAM, tensor_parallel_size=2, **KW)
    try:
        engine = llm.llm_engine
        assert engine.runner.name == "mp"
        assert token_ids(llm, prompts, greedy) == want
        stats = engine.get_stats().spec_decoding
        assert stats.num_accepted_tokens > 0  # drafts were proposed by the workers, verified
        assert stats.num_draft_tokens > stats.num_accepted_tokens  # and some rejected
        assert token_ids(llm, prompts[3:], seeded) == want_seeded
        assert engine.num_used_blocks == 0 and not engine.has_unfinished_requests()
    finally:
        llm.llm_engine.shutdown()
    plain = LLM(str(spec_llama), **KW)
    try:
        assert token_ids(plain, prompts, greedy) == want  # speculation changed nothing
    finally:
        plain.llm_engine.shutdown()


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("qwen3_moe_tp"), "qwen3_moe", seed=2))


def test_moe_experts_split_and_placed_over_two_ranks_match_one_process(qwen3_moe):
    # 64 experts of intermediate size 32: split (each rank 16 rows of each expert's gate and
    # up) or placed (32 whole experts per rank).
    assert_moe_layouts_match_one_process(
        qwen3_moe,
        "model.layers.0.mlp.experts.w13_weight",
        {False: [(64, 32, 64)] * 2, True: [(32, 64, 64)] * 2},
        prompt_lens=(2, 7, 19, 40),
        max_tokens=10,
    )


def assert_same_greedy(path: str, layouts: list[dict], num_new: int = 10, **kw) -> None:
    """Greedy tokens (and top-3 logprobs, within 1e-4) of mixed-length prompts, prompts past
    the sliding windows and LongRoPE's original context among them, equal on one process and
    in each of ``layouts`` (mp executor); no KV block is left in use."""
    rng = random.Random(9)
    prompts = [[rng.randrange(10, 300) for _ in range(n)] for n in (1, 6, 19, 47)]
    params = SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True, logprobs=3)
    single = LLM(path, **KW, **kw)
    try:
        want = single.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        single.llm_engine.shutdown()
    for layout in layouts:
        llm = LLM(path, **KW, **kw, **layout)
        try:
            assert llm.llm_engine.runner.name == "mp"
            got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            for out, ref in zip(got, want, strict=True):
                assert out.outputs[0].token_ids == ref.outputs[0].token_ids, (
                    layout,
                    out.request_id,
                )
                for lp, ref_lp in zip(
                    out.outputs[0].logprobs, ref.outputs[0].logprobs, strict=True
                ):
                    assert set(lp) == set(ref_lp)
                    for token, entry in lp.items():
                        assert abs(entry.logprob - ref_lp[token].logprob) < 1e-4
            assert llm.llm_engine.num_used_blocks == 0
        finally:
            llm.llm_engine.shutdown()


# head_dim 16 with partial_rotary_factor 0.75: 12 rotary dims, 6 factors per table.
PHI3_LONGROPE = dict(
    original_max_position_embeddings=32,
    rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.4, 1.7, 2.0],
                  "long_factor": [1.0, 2.0, 4.0, 8.0, 12.0, 16.0]},
)  # fmt: skip


def test_native_phi3_at_tp2_matches_one_process(tmp_path):
    path = build_tiny_model(tmp_path / "phi3", "phi3", seed=3, **PHI3_LONGROPE)
    assert_same_greedy(str(path), [dict(tensor_parallel_size=2)], model_impl="native")


def test_native_gemma2_at_tp2_and_pp2_matches_one_process(tmp_path):
    # 2 attention heads and 1 KV head: the KV head is replicated on both ranks.
    path = build_tiny_model(tmp_path / "gemma2", "gemma2", seed=3, num_heads=2, num_kv_heads=1)
    layouts = [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)]
    assert_same_greedy(str(path), layouts, model_impl="native")


def test_transformers_backend_at_tp2_matches_one_process(tmp_path):
    path = build_tiny_model(tmp_path / "neox", "gpt_neox", seed=3, num_kv_heads=4)
    assert_same_greedy(str(path), [dict(tensor_parallel_size=2)], model_impl="transformers")


def test_layouts_that_cannot_work_are_refused_at_start(spec_llama, qwen3_moe, tmp_path):
    with pytest.raises(ConfigError, match="does not run under pipeline parallelism"):
        LLM(str(spec_llama), speculative_config=NGRAM, pipeline_parallel_size=2, **KW)
    draft = {"method": "draft_model", "model": str(spec_llama), "num_speculative_tokens": 2}
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2: the 'draft_model' proposer"):
        LLM(str(spec_llama), speculative_config=draft, tensor_parallel_size=2, **KW)
    odd = build_tiny_model(tmp_path / "odd_moe", "qwen3_moe", moe_intermediate_size=33)
    with pytest.raises(ConfigError, match=r"experts' intermediate size \(33\).*expert-parallel"):
        LLM(str(odd), tensor_parallel_size=2, **KW)
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size=2: the transformers modeling "
                       r"backend \(LlamaForCausalLM\) does not run under pipeline parallelism.*"
                       r"--model-impl auto runs the native"):  # fmt: skip
        LLM(str(spec_llama), model_impl="transformers", pipeline_parallel_size=2, **KW)
    gpt2 = build_tiny_model(tmp_path / "gpt2", "gpt2", num_kv_heads=4)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2: GPT2LMHeadModel declares no "
                       r"base_model_tp_plan.*use tensor_parallel_size=1 \(GPT2LMHeadModel has "
                       r"no native implementation"):  # fmt: skip
        LLM(str(gpt2), tensor_parallel_size=2, **KW)
    one_kv = build_tiny_model(tmp_path / "one_kv", "llama", num_kv_heads=1)
    with pytest.raises(ConfigError, match=r"more ranks than LlamaForCausalLM's 1 key/value heads"):
        LLM(str(one_kv), model_impl="transformers", tensor_parallel_size=2, **KW)
