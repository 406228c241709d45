"""Speculative decoding through the whole engine on a tiny random model (CPU): greedy outputs
identical to plain decoding (batches of 1 to 32, preemption, prefix hits, chunked prefill,
asynchronous scheduling), stops inside accepted drafts, logprobs, penalties, structured
outputs, refused combinations, no leaked KV blocks, and a chi-square test that sampling at
temperature > 0 keeps the target distribution."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from test_spec_decode_units import ALPHA, chi2_pvalue

from engine import LLM, SamplingParams
from engine.sampling_params import SamplingParamsError
from engine.testing.tiny_models import build_tiny_model, build_tokenizer, save_tiny_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}  # fmt: skip


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    """A tiny Llama with small random weights: its greedy output falls into repeating
    patterns that change now and then, so prompt lookup drafts are often right, not always."""
    path = tmp_path_factory.mktemp("llama_spec")
    tok = build_tokenizer(path)
    return save_tiny_model("llama", path, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                           initializer_range=0.05)  # fmt: skip


def make_llm(path, spec=None, **kw) -> LLM:
    settings = dict(
        model=str(path),
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=64,
        max_num_seqs=32,
        num_gpu_blocks_override=200,
        enable_prefix_caching=True,
        speculative_config=spec,
    )
    settings.update(kw)
    return LLM(**settings)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    """A tiny Llama whose logits are decisive (widened weights), for the sampling test."""
    return build_tiny_model(tmp_path_factory.mktemp("llama_sharp"), "llama")


@pytest.fixture(scope="module")
def plain_llm(llama_path):
    return make_llm(llama_path)


@pytest.fixture(scope="module")
def ngram_llm(llama_path):
    return make_llm(llama_path, NGRAM)


def tokens(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def copy_heavy_prompts(plain: LLM, n: int, seed: int = 0) -> list[list[int]]:
    """Mixed-length prompts where lookup pays: random ones, repeated phrases, and prompts
    that end with the model's own greedy continuation of their start."""
    rng = random.Random(seed)
    vocab = plain.llm_engine.runner.vocab_size
    prompts = []
    for i in range(n):
        base = [rng.randrange(10, vocab) for _ in range(rng.randint(2, 30))]
        if i % 3 == 1:
            base = (base * 4)[: rng.randint(4, 70)]
        prompts.append(base)
    cont = tokens(plain, [p for i, p in enumerate(prompts) if i % 3 == 0],
                  SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))  # fmt: skip
    it = iter(cont)
    return [p + next(it) if i % 3 == 0 else p for i, p in enumerate(prompts)]


@pytest.mark.parametrize("batch", [1, 7, 32])
def test_ngram_greedy_equals_plain_decoding(plain_llm, ngram_llm, batch):
    prompts = copy_heavy_prompts(plain_llm, batch, seed=batch)
    params = [
        SamplingParams(temperature=0.0, max_tokens=30 - (i * 7) % 23, ignore_eos=True)
        for i in range(batch)
    ]
    engine = ngram_llm.llm_engine
    before = engine.get_stats().spec_decoding
    assert tokens(ngram_llm, prompts, params) == tokens(plain_llm, prompts, params)
    after = engine.get_stats().spec_decoding
    assert after.num_accepted_tokens > before.num_accepted_tokens
    assert after.num_draft_tokens - before.num_draft_tokens > (
        after.num_accepted_tokens - before.num_accepted_tokens
    )  # rejections too
    assert engine.num_used_blocks == 0 and not engine.has_unfinished_requests()


def test_preemption_many_rejections_and_async_scheduling(llama_path, plain_llm):
    """A cache far too small for the batch (preemption by recompute, resumed from prefix
    hits), drafts that are mostly wrong, with and without asynchronous scheduling: the
    same tokens, and every block back in the pool."""
    prompts = copy_heavy_prompts(plain_llm, 24, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = tokens(plain_llm, prompts, params)
    for async_scheduling in (False, True):
        llm = make_llm(llama_path, NGRAM, num_gpu_blocks_override=48, max_num_batched_tokens=32,
                       async_scheduling=async_scheduling)  # fmt: skip
        engine = llm.llm_engine.core
        assert engine._async is async_scheduling
        assert tokens(llm, prompts, params) == want
        stats = engine.get_stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
        sd = stats.spec_decoding
        assert sd.num_accepted_tokens > 0 and sd.num_draft_tokens - sd.num_accepted_tokens > 100
        assert engine.num_used_blocks == 0


def use_proposer(llm, proposer) -> None:
    """Make ``proposer`` the model runner's (behind the in-process executor: setting it on
    the executor would leave the runner's own proposer in place)."""
    executor = llm.llm_engine.runner
    getattr(executor, "runner", executor).proposer = proposer


class OracleProposer:
    """Drafts the target's own greedy continuation (computed with transformers): a point-mass
    proposer that is right often, but not always, at temperature > 0."""

    uses_model = False

    def __init__(self, hf) -> None:
        self.hf = hf
        self.calls = 0
        self._cache: dict[tuple[int, ...], list[int]] = {}

    def propose(self, request, new_tokens, k):
        self.calls += 1
        ids = request.prompt_token_ids + request.output_token_ids + list(new_tokens)
        key = (*ids, -k)
        if key not in self._cache:
            out = []
            with torch.no_grad():
                for _ in range(k):
                    out.append(int(self.hf(torch.tensor([ids + out])).logits[0, -1].argmax()))
            self._cache[key] = out
        return self._cache[key]


@pytest.fixture(scope="module")
def oracle_llm(llama_path):
    """An engine whose drafts are the target's own greedy continuation: every draft is
    accepted, so stops fall inside verified drafts."""
    from transformers import AutoModelForCausalLM

    llm = make_llm(llama_path, {"method": "ngram", "num_speculative_tokens": 4})
    hf = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()
    use_proposer(llm, OracleProposer(hf))
    return llm


@pytest.mark.parametrize("which", ["ngram", "oracle"])
def test_stops_inside_accepted_drafts(plain_llm, ngram_llm, oracle_llm, which):
    """EOS-like stop tokens, max_tokens and stop strings met in the middle of a verified
    draft end the output exactly where plain decoding ends it."""
    spec_llm = ngram_llm if which == "ngram" else oracle_llm
    prompts = copy_heavy_prompts(plain_llm, 9, seed=5)
    free = tokens(plain_llm, prompts, SamplingParams(temperature=0.0, max_tokens=30,
                                                     ignore_eos=True))  # fmt: skip
    tok = plain_llm.get_tokenizer()
    cases = []
    for prompt, out in zip(prompts, free, strict=True):
        # Stop tokens that first appear at several depths of the output.
        firsts = [i for i in range(3, len(out)) if out[i] not in out[:i]]
        for at in firsts[:4]:
            cases.append((prompt, SamplingParams(temperature=0.0, max_tokens=30,
                                                 stop_token_ids=[out[at]])))  # fmt: skip
        cases.append((prompt, SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)))
        text = tok.decode(out[5:9])
        if text.strip():
            cases.append((prompt, SamplingParams(temperature=0.0, max_tokens=30,
                                                 ignore_eos=True, stop=[text.strip()])))  # fmt: skip
    inputs = [{"prompt_token_ids": p} for p, _ in cases]
    params = [sp for _, sp in cases]
    engine = spec_llm.llm_engine.core
    cut = []
    real = engine._tokens_before_stop

    def spy(state, seq, new):
        keep = real(state, seq, new)
        cut.append(keep < len(new))
        return keep

    engine._tokens_before_stop = spy
    try:
        got = spec_llm.generate(inputs, params, use_tqdm=False)
    finally:
        del engine._tokens_before_stop
    if which == "oracle":
        assert any(cut), "no stop fell inside a verified draft"
    want = plain_llm.generate(inputs, params, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        gc, wc = g.outputs[0], w.outputs[0]
        assert (gc.text, gc.finish_reason, gc.stop_reason) == (wc.text, wc.finish_reason,
                                                               wc.stop_reason)  # fmt: skip
        if not isinstance(wc.stop_reason, str):  # a stop string ends the text, not the ids
            assert gc.token_ids == wc.token_ids
    assert engine.num_used_blocks == 0


def test_logprobs_penalties_and_prompt_logprobs(plain_llm, ngram_llm):
    prompts = copy_heavy_prompts(plain_llm, 6, seed=8)
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.4,
                       frequency_penalty=0.3, presence_penalty=0.2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, min_tokens=10),
        SamplingParams(temperature=0.0, max_tokens=12, prompt_logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, logit_bias={50: 3.0}, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0),
    ]  # fmt: skip
    inputs = [{"prompt_token_ids": p} for p in prompts]
    got = ngram_llm.generate(inputs, params, use_tqdm=False)
    want = plain_llm.generate(inputs, params, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        gc, wc = g.outputs[0], w.outputs[0]
        assert gc.token_ids == wc.token_ids
        if wc.logprobs is not None:
            assert len(gc.logprobs) == len(wc.logprobs) == len(wc.token_ids)
            for a, b in zip(gc.logprobs, wc.logprobs, strict=True):
                assert a.keys() == b.keys()
                for t in a:
                    assert a[t].rank == b[t].rank
                    assert abs(a[t].logprob - b[t].logprob) < 1e-4
            assert abs(gc.cumulative_logprob - wc.cumulative_logprob) < 1e-3
        if w.prompt_logprobs is not None:
            assert len(g.prompt_logprobs) == len(w.prompt_logprobs)
    assert ngram_llm.llm_engine.num_used_blocks == 0


def test_structured_outputs_accept_only_what_the_grammar_allows(plain_llm, ngram_llm):
    """A regex and a choice: drafts the grammar forbids are cut before verification, each
    verified position is masked for its own grammar state; greedy output equals plain."""
    from engine.sampling_params import StructuredOutputsParams

    prompts = copy_heavy_prompts(plain_llm, 4, seed=9)
    params = [
        SamplingParams(temperature=0.0, max_tokens=20,
                       structured_outputs=StructuredOutputsParams(regex="(ab|cd){2,5}x")),
        SamplingParams(temperature=0.0, max_tokens=20,
                       structured_outputs=StructuredOutputsParams(choice=["fox jumps", "dog"])),
        SamplingParams(temperature=0.0, max_tokens=20,
                       structured_outputs=StructuredOutputsParams(regex="[a-z ]{4,30}\\.")),
        SamplingParams(temperature=0.0, max_tokens=24,
                       structured_outputs=StructuredOutputsParams(regex="(fox ){3,9}")),
    ]  # fmt: skip
    inputs = [{"prompt_token_ids": p} for p in prompts]
    before = ngram_llm.llm_engine.get_stats().spec_decoding
    got = ngram_llm.generate(inputs, params, use_tqdm=False)
    after = ngram_llm.llm_engine.get_stats().spec_decoding
    assert after.num_accepted_tokens > before.num_accepted_tokens  # drafts were verified
    want = plain_llm.generate(inputs, params, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].text == w.outputs[0].text
    assert ngram_llm.llm_engine.num_used_blocks == 0


def test_n_above_one_is_refused_with_a_clear_error(ngram_llm):
    with pytest.raises(SamplingParamsError, match="n=2 is not supported with speculative"):
        ngram_llm.generate([[5, 6, 7]], SamplingParams(n=2), use_tqdm=False)
    assert ngram_llm.llm_engine.num_used_blocks == 0


def perturbed_copy(src, dst, scale: float, seed: int = 0):
    """The model at ``src`` with Gaussian noise (``scale`` x each tensor's std) added to its
    weights, saved to ``dst``: a draft model close to its target."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * param.std() * scale)
    model.save_pretrained(dst)
    return dst


@pytest.mark.parametrize("proposer", ["point-mass", "draft-model"])
def test_sampling_keeps_the_target_distribution(tiny_path, tmp_path, proposer):
    """Chi-square over the first three sampled tokens (temperature 0.7, top-k 4, seeded
    requests, 2 drafts verified after the first token): tokens 2 and 3 come from verified
    drafts -- accepted, resampled after a rejection, or the bonus token -- and their joint
    distribution must be the model's own, computed with transformers. The drafts are the
    target's greedy continuation (a point mass, right half of the time), or sampled from a
    different, smaller draft model (its own distribution q)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    temperature, top_k, n = 0.7, 4, 1500
    if proposer == "point-mass":
        llm = make_llm(tiny_path, {"method": "ngram", "num_speculative_tokens": 2},
                       max_num_seqs=64)  # fmt: skip
        use_proposer(llm, OracleProposer(hf))
    else:
        # The target with every weight perturbed: close, but not the same distribution.
        draft = perturbed_copy(tiny_path, tmp_path / "draft", scale=0.08)
        llm = make_llm(tiny_path, {"method": "draft_model", "model": str(draft),
                                   "num_speculative_tokens": 2}, max_num_seqs=64)  # fmt: skip

    def probs(prefixes: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            out = [hf(torch.tensor([p])).logits[0, -1] for p in prefixes]
        x = torch.stack(out) / temperature
        x = x.masked_fill(x < x.topk(top_k, dim=-1).values[:, -1:], float("-inf"))
        return torch.softmax(x, -1)

    prompt = [40, 41, 42, 43, 44, 45, 46]
    # The exact joint distribution of the first three tokens (over the top-k supports).
    p1 = probs([prompt])[0]
    pre1 = [[t] for t in p1.topk(top_k).indices.tolist()]
    pre2, w2 = [], []
    for a, row in zip(pre1, probs([prompt + a for a in pre1]), strict=True):
        for b in row.topk(top_k).indices.tolist():
            pre2.append(a + [b])
            w2.append(float(p1[a[0]] * row[b]))
    joint: dict[tuple[int, ...], float] = {}
    for ab, w, row in zip(pre2, w2, probs([prompt + ab for ab in pre2]), strict=True):
        for c in row.topk(top_k).indices.tolist():
            joint[tuple(ab + [c])] = w * float(row[c])
    keys = sorted(joint)
    params = [SamplingParams(temperature=temperature, top_k=top_k, max_tokens=4, seed=i,
                             ignore_eos=True) for i in range(n)]  # fmt: skip
    samples = tokens(llm, [prompt] * n, params)
    sd = llm.llm_engine.get_stats().spec_decoding
    assert sd.num_drafts >= n
    # Both paths: accepted drafts and rejections resampled from the residual.
    assert sd.num_accepted_tokens > 300 and sd.num_draft_tokens - sd.num_accepted_tokens > 300
    index = {key: i for i, key in enumerate(keys)}
    counts = np.zeros(len(keys))
    for s in samples:
        counts[index[tuple(s[:3])]] += 1  # every sample lies in the top-k supports
    expected = np.array([joint[key] for key in keys])
    assert abs(expected.sum() - 1) < 1e-4
    assert chi2_pvalue(counts, expected / expected.sum()) > ALPHA
    assert llm.llm_engine.num_used_blocks == 0


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory, llama_path):
    """A different tiny Llama with the same tokenizer: a draft model that is mostly wrong."""
    path = tmp_path_factory.mktemp("draft_other")
    tok = build_tokenizer(path)
    return save_tiny_model("llama", path, seed=7, vocab_size=len(tok), num_hidden_layers=1,
                           hidden_size=32, intermediate_size=64, num_attention_heads=2,
                           num_key_value_heads=1, bos_token_id=tok.bos_token_id,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                           initializer_range=0.05)  # fmt: skip


@pytest.mark.parametrize("draft", ["self", "self-async", "other"])
def test_draft_model_greedy_equals_plain_decoding(llama_path, other_draft, plain_llm, draft):
    """A draft model of its own shape and weights (mostly rejected), or the target itself as
    draft (always accepted: its KV, mirrored step by step through preemption and prefix
    hits, matches the target's; also with asynchronous scheduling, where steps without
    speculation overlap and the mirror reads inputs fed back on the device), at batch 24 in
    a cache small enough to preempt."""
    model = str(other_draft if draft == "other" else llama_path)
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 3}
    if draft == "self-async":  # speculation only in steps of at most 8 requests
        spec["disable_by_batch_size"] = 8
    llm = make_llm(llama_path, spec, num_gpu_blocks_override=70, max_num_batched_tokens=48,
                   async_scheduling=draft == "self-async")  # fmt: skip
    prompts = copy_heavy_prompts(plain_llm, 24, seed=21)
    params = [SamplingParams(temperature=0.0, max_tokens=30 - i % 9, ignore_eos=True)
              for i in range(24)]  # fmt: skip
    assert tokens(llm, prompts, params) == tokens(plain_llm, prompts, params)
    stats = llm.llm_engine.get_stats()
    sd = stats.spec_decoding
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    if draft != "other":
        assert sd.num_accepted_tokens == sd.num_draft_tokens > 30
    else:
        assert sd.num_draft_tokens > 100 and sd.num_accepted_tokens < sd.num_draft_tokens
    assert llm.llm_engine.num_used_blocks == 0


def test_draft_model_as_its_own_target_accepts_every_sample(llama_path, plain_llm):
    """Draft = target at temperature 0.8 with top-k, top-p and penalties: the draft
    distribution equals the target's (same processing of the same logits), so the rejection
    sampler accepts every draft."""
    spec = {"method": "draft_model", "model": str(llama_path), "num_speculative_tokens": 3}
    llm = make_llm(llama_path, spec)
    prompts = copy_heavy_prompts(plain_llm, 10, seed=4)
    params = [SamplingParams(temperature=0.8, top_k=30, top_p=0.9, repetition_penalty=1.1,
                             presence_penalty=0.2, max_tokens=16, seed=i, ignore_eos=True)
              for i in range(10)]  # fmt: skip
    out = tokens(llm, prompts, params)
    assert tokens(llm, prompts, params) == out  # seeded: reproducible
    sd = llm.llm_engine.get_stats().spec_decoding
    assert sd.num_accepted_tokens == sd.num_draft_tokens > 50
    assert llm.llm_engine.num_used_blocks == 0


def test_draft_model_that_cannot_serve_is_refused_with_reasons(llama_path, tmp_path):
    from engine.config import ConfigError

    path = tmp_path / "bad_draft"
    save_tiny_model("llama", path, vocab_size=300, max_position_embeddings=64)
    spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 2}
    with pytest.raises(ConfigError) as e:
        make_llm(llama_path, spec, max_model_len=128)
    assert "vocabulary has 300 tokens, the target's 384" in str(e.value)
    assert "context (64 positions) is shorter than max_model_len=128" in str(e.value)
    with pytest.raises(ConfigError, match="cannot be read"):
        make_llm(llama_path, {**spec, "model": str(tmp_path / "missing")})


@pytest.mark.parametrize("kind", ["mistral_sliding", "qwen2_sliding"])
def test_sliding_window_models(tmp_path, kind):
    """Models whose layers slide (all, or all but the first) keep a KV-cache group per
    window: verification and the draft model's mirrored KV work across the groups, and
    sliding groups drop blocks as usual."""
    tok = build_tokenizer(tmp_path)
    path = save_tiny_model(kind, tmp_path, vocab_size=len(tok), initializer_range=0.05,
                           bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id)  # fmt: skip
    plain = make_llm(path)
    prompts = copy_heavy_prompts(plain, 6, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = tokens(plain, prompts, params)
    for spec in (NGRAM, {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}):
        llm = make_llm(path, spec, num_gpu_blocks_override=60, max_num_batched_tokens=32)
        assert tokens(llm, prompts, params) == want
        sd = llm.llm_engine.get_stats().spec_decoding
        assert sd.num_accepted_tokens > 0
        if spec is not NGRAM:
            assert sd.num_accepted_tokens == sd.num_draft_tokens
        assert llm.llm_engine.num_used_blocks == 0
