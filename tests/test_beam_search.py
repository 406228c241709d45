"""``LLM.beam_search`` against transformers' ``generate(num_beams=W)`` on a tiny random model.

The search (``engine.beam_search``) keeps transformers' bookkeeping, so for each
``early_stopping`` mode (True, False, "never") the returned sequences are ``generate``'s with
the same ``early_stopping``, ``length_penalty``, ``num_beams=num_return_sequences=W`` and
``do_sample=False``; scores and cumulative logprobs agree within float tolerance. A second EOS
id (a token this model picks often) is written to ``generation_config.json`` so that beams do
end early; ``ignore_eos`` runs never end before ``max_tokens``. Beam width 1 is transformers'
greedy decoding, which our width-1 search equals when EOS cannot end a beam or
``early_stopping=True``.
"""

from __future__ import annotations

import json
import random
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from engine import LLM
from engine.beam_search import BeamSearch, BeamSearchParams, BeamSearchParamsError
from engine.testing.tiny_models import build_tiny_model

MAX_TOKENS = 8
REPO = Path(__file__).resolve().parent.parent


def _import_hf_generation() -> None:
    """Import transformers' generation code with the repository root off ``sys.path``.

    ``python -m pytest`` puts the working directory first on ``sys.path``, where this
    repository's ``kernels/`` (``engine.kernels``) shadows the installed ``kernels``
    distribution that ``generate`` imports (transformers' hub kernels): that import fails."""
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO]
    try:
        import transformers.integrations.hub_kernels  # noqa: F401
    finally:
        sys.path[:] = saved


PROMPT_LENGTHS = [1, 5, 13, 30]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    _import_hf_generation()
    path = build_tiny_model(tmp_path_factory.mktemp("beam"), "llama")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(7)
    vocab = hf.config.vocab_size
    prompts = [[rng.randrange(10, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]
    # A forced EOS: the token greedy decoding produces most often over these prompts.
    seen: Counter[int] = Counter()
    for p in prompts:
        out = hf.generate(
            torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        seen.update(out[0, len(p) :].tolist())
    forced = seen.most_common(1)[0][0]
    eos = sorted({int(hf.config.eos_token_id), forced})
    gen = {"eos_token_id": eos, "pad_token_id": 0, "bos_token_id": hf.config.bos_token_id}
    (path / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(
        model=str(path),
        dtype="float32",
        block_size=4,
        num_gpu_blocks_override=256,
        enable_prefix_caching=True,
    )
    assert sorted(set(llm.llm_engine.eos_token_ids)) == eos
    return llm, hf, prompts, eos


def hf_beams(hf, prompt, width, eos, params: BeamSearchParams):
    """``generate``'s W best sequences: (generated tokens, score, cumulative logprob)."""
    out = hf.generate(
        torch.tensor([prompt]),
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        max_new_tokens=params.max_tokens,
        early_stopping=params.early_stopping,
        length_penalty=params.length_penalty,
        eos_token_id=None if params.ignore_eos else eos,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_scores=True,
    )
    n = len(prompt)
    if width == 1:  # greedy: no beam scores; sum the chosen tokens' logprobs
        tokens = out.sequences[0, n:].tolist()
        if not params.ignore_eos:
            for i, t in enumerate(tokens):
                if t in eos:
                    tokens = tokens[: i + 1]
                    break
        logps = [
            torch.log_softmax(s[0], -1)[t].item() for s, t in zip(out.scores, tokens, strict=True)
        ]
        cum = sum(logps)
        return [(tokens, cum / len(tokens) ** params.length_penalty, cum)]
    beams = []
    for row, score, idx in zip(out.sequences, out.sequences_scores, out.beam_indices, strict=True):
        length = int((idx != -1).sum())
        cum = float(score) * length**params.length_penalty
        beams.append((row[n : n + length].tolist(), float(score), cum))
    return beams


CASES = [
    # (early_stopping, ignore_eos, length_penalty)
    (True, False, 1.0),
    (False, False, 1.0),
    ("never", False, 1.0),
    ("never", False, 0.5),
    (False, False, -0.5),
    ("never", True, 1.0),
    (True, True, 2.0),
]


@pytest.mark.parametrize(("early_stopping", "ignore_eos", "length_penalty"), CASES)
def test_matches_transformers(setup, early_stopping, ignore_eos, length_penalty):
    llm, hf, prompts, eos = setup
    engine = llm.llm_engine
    stopped = 0
    for width in (1, 2, 3, 4):
        params = BeamSearchParams(
            beam_width=width,
            max_tokens=MAX_TOKENS,
            ignore_eos=ignore_eos,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
        )
        outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
        assert len(outputs) == len(prompts)
        for prompt, out in zip(prompts, outputs, strict=True):
            ours = out.sequences
            assert len(ours) == width
            assert [s.score for s in ours] == sorted((s.score for s in ours), reverse=True)
            assert all(s.tokens[: len(prompt)] == prompt for s in ours)
            if width == 1 and not (ignore_eos or early_stopping is True):
                continue  # transformers' width 1 is greedy: it never looks past an EOS
            want = hf_beams(hf, prompt, width, eos, params)
            where = f"W={width}, prompt of {len(prompt)}"
            assert [s.output_tokens for s in ours] == [w[0] for w in want], where
            assert [s.cum_logprob for s in ours] == pytest.approx([w[2] for w in want], abs=1e-4)
            assert [s.score for s in ours] == pytest.approx([w[1] for w in want], abs=1e-4)
            for s in ours:
                assert s.cum_logprob == pytest.approx(
                    sum(step[t] for step, t in zip(s.logprobs, s.output_tokens, strict=True)),
                    abs=1e-5,
                )
                if s.finish_reason == "stop":
                    stopped += 1
                    assert s.output_tokens[-1] in eos and not ignore_eos
                else:
                    assert len(s.output_tokens) == MAX_TOKENS
    if not ignore_eos:
        assert stopped > 0, "the forced EOS id should end some beams"
    assert engine.num_used_blocks == 0, "beam search left KV blocks allocated"
    assert not engine.has_unfinished_requests()


def test_beams_share_prefix_blocks(setup):
    llm, _, prompts, _ = setup
    engine = llm.llm_engine
    before = engine.get_stats()
    params = BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = llm.beam_search({"prompt_token_ids": prompts[-1]}, params)[0]
    after = engine.get_stats()
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    # Every step after the first finds the prompt's 7 full blocks (28 of its 30 tokens) and
    # the full blocks of the tokens generated so far: most of what each step queries.
    steps = MAX_TOKENS - 1
    assert hits >= steps * 4 * 28 * 0.9 or hits >= 28 * (1 + 2 * 4), (hits, queries)
    assert hits / queries > 0.8, (hits, queries)
    assert len(out.sequences) == 4
    assert engine.num_used_blocks == 0


def test_text_and_eos_in_output(setup):
    llm, _, prompts, eos = setup
    tok = llm.get_tokenizer()
    for include in (False, True):
        params = BeamSearchParams(
            beam_width=3, max_tokens=MAX_TOKENS, include_stop_str_in_output=include
        )
        for out in llm.beam_search([{"prompt_token_ids": p} for p in prompts], params):
            for s in out.sequences:
                shown = s.output_tokens
                if s.finish_reason == "stop" and not include:
                    shown = shown[:-1]
                assert s.text == tok.decode(shown)


def test_text_prompt(setup):
    llm, _, _, _ = setup
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    [by_text] = llm.beam_search("The quick brown fox", params)
    ids = llm.get_tokenizer()("The quick brown fox").input_ids
    [by_ids] = llm.beam_search([ids], params)
    assert [s.tokens for s in by_text.sequences] == [s.tokens for s in by_ids.sequences]
    assert by_text.prompt_token_ids == ids


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        (dict(beam_width=0, max_tokens=4), "beam_width"),
        (dict(beam_width=2.0, max_tokens=4), "beam_width"),
        (dict(beam_width=2, max_tokens=0), "max_tokens"),
        (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature"),
        (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty"),
        (dict(beam_width=2, max_tokens=4, early_stopping="sometimes"), "early_stopping"),
    ],
)
def test_bad_params(kwargs, param):
    with pytest.raises(BeamSearchParamsError) as e:
        BeamSearchParams(**kwargs).validate()
    assert e.value.param == param and param in str(e.value)


def test_width_over_the_logprobs_limit_is_refused(setup):
    llm, _, prompts, eos = setup
    # Two EOS ids: each step ranks 3 * W candidates per beam, and 20 logprobs at most.
    with pytest.raises(BeamSearchParamsError, match=r"beam_width must be at most 6, got 7"):
        llm.beam_search([prompts[0]], BeamSearchParams(beam_width=7, max_tokens=2))
    # Without EOS only 2 * W: up to 10.
    llm.beam_search([prompts[0]], BeamSearchParams(beam_width=10, max_tokens=1, ignore_eos=True))
    with pytest.raises(BeamSearchParamsError, match="at most 10"):
        llm.beam_search(
            [prompts[0]], BeamSearchParams(beam_width=11, max_tokens=1, ignore_eos=True)
        )
    with pytest.raises(Exception, match="context"):
        llm.beam_search([prompts[0]], BeamSearchParams(beam_width=2, max_tokens=10**6))
    assert llm.llm_engine.num_used_blocks == 0


def test_search_without_an_engine():
    """The bookkeeping alone: two beams, a scripted model, EOS ranked inside and outside the
    top W (only the former becomes a hypothesis, as in transformers)."""
    params = BeamSearchParams(beam_width=2, max_tokens=3, early_stopping=True)
    search = BeamSearch([1, 2], params, eos_token_ids=[0])
    assert search.k == 4 and search.live_sequences() == [[1, 2]]
    search.advance([{5: -0.1, 0: -0.5, 6: -1.0, 7: -3.0}])  # EOS rank 1 < W: a hypothesis
    assert search.live_sequences() == [[1, 2, 5], [1, 2, 6]]
    search.advance([{8: -2.0, 9: -2.5, 0: -5.0, 3: -6.0}, {0: -0.1, 4: -2.0, 7: -3, 2: -4}])
    assert search.done  # two hypotheses with early_stopping=True
    out = search.results()
    assert [s.output_tokens for s in out.sequences] == [[0], [6, 0]]
    assert [s.finish_reason for s in out.sequences] == ["stop", "stop"]
    assert out.sequences[1].cum_logprob == pytest.approx(-1.1)
    assert out.sequences[1].score == pytest.approx(-1.1 / 2)
