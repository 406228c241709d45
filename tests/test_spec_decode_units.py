"""Speculative decoding's parts without a model: the n-gram lookup and the verification
(greedy acceptance, rejection sampling checked by chi-square tests against the exact target
distribution, penalties and grammar masks per verified position)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.sampler import Sampler, SamplingRow
from engine.sampling_params import SamplingParams
from engine.spec_decode.ngram import NgramProposer, find_draft
from engine.spec_decode.rejection import verify


def draft(tokens, lo=1, hi=3, k=4) -> list[int]:
    return find_draft(np.asarray(tokens, dtype=np.int64), lo, hi, k).tolist()


def test_ngram_lookup():
    # The longest suffix (3 tokens: 1 2 3) matches at the start; what followed it is drafted.
    assert draft([1, 2, 3, 4, 5, 6, 9, 2, 3, 1, 2, 3], k=3) == [4, 5, 6]
    # A longer match wins over a later shorter one; among equal lengths the latest wins.
    assert draft([7, 2, 3, 8, 1, 2, 3, 9, 5, 2, 3], hi=2, k=2) == [9, 5]
    assert draft([1, 2, 3, 4, 5, 6, 9, 2, 3, 1, 2, 3], hi=1, k=2) == [1, 2]
    # Too few tokens after the match: the repeating pattern is continued.
    assert draft([5, 6, 7, 5, 6, 7, 5], k=5) == [6, 7, 5, 6, 7]
    assert draft([3, 3, 3], k=3) == [3, 3, 3]
    # No match, or a match shorter than prompt_lookup_min: no draft.
    assert draft([1, 2, 3, 4], k=3) == []
    assert draft([1, 2, 9, 8, 2], lo=2, hi=3) == []
    assert draft([4], k=2) == []


def test_ngram_proposer_keeps_a_buffer_per_request():
    from engine.request import Request

    proposer = NgramProposer(3, 1, 2)
    r = Request("r", [1, 2, 3, 1, 2], 10)
    assert proposer.propose(r, [3], 3) == [1, 2, 3]  # context 1 2 3 1 2 3
    r.output_token_ids += [3, 7]
    # 1 2 3 1 2 3 7 1 2: the latest earlier "1 2" (positions 3-4) was followed by 3 7.
    assert proposer.propose(r, [1, 2], 2) == [3, 7]
    assert proposer.propose(r, [1, 2], 5) == [3, 7, 1]  # at most num_speculative_tokens
    del r
    assert len(proposer._buffers) == 0  # a finished request's buffer goes with it


def _rows(params: SamplingParams, n: int, outputs=None) -> list[SamplingRow]:
    return [SamplingRow(params, [0], list(outputs or []), [None]) for _ in range(n)]


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's chi-square test of ``counts`` against ``probs``; bins expected below 5 are
    pooled. Returns the p-value (survival function of the chi-square distribution)."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
        if expected[-1] == 0:
            counts, expected = counts[:-1], expected[:-1]
    stat = float(((counts - expected) ** 2 / expected).sum())
    df = len(counts) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


# Threshold of every chi-square test here. The samples come from fixed seeds, so a test
# gives the same verdict on every run; a correct sampler would fail on a given seed with
# probability 1e-4. With these sample sizes, a bias as small as the one of the broken
# variant below (whose p-value is checked to be < 1e-12) is far beyond the threshold.
ALPHA = 1e-4
N = 20_000


def _target(logits: torch.Tensor, temperature: float, top_k: int = 0) -> np.ndarray:
    x = logits / temperature
    if top_k:
        x = x.masked_fill(x < x.topk(top_k).values[-1], float("-inf"))
    return torch.softmax(x, -1).numpy().astype(np.float64)


@pytest.mark.parametrize("with_q", [False, True], ids=["point-mass", "draft-distribution"])
def test_rejection_sampling_preserves_the_target_distribution(with_q):
    """N requests verify k = 2 drafts against the same target rows: the first emitted token
    is distributed as p_0, the second (after an accepted first draft) as p_1, the bonus
    token (both accepted) as p_2 -- whatever the drafts, as long as a draft with a
    distribution is drawn from it."""
    torch.manual_seed(0)
    vocab, k = 6, 2
    sampler = Sampler(vocab, "cpu")
    target = torch.randn(k + 1, vocab) * 1.5
    params = SamplingParams(temperature=0.8, top_k=5)
    p = [_target(target[j], 0.8, 5) for j in range(k + 1)]
    q = torch.softmax(torch.randn(k, vocab), -1)
    if with_q:
        drafts = torch.multinomial(q, N, replacement=True).T.tolist()  # d_j ~ q_j
        draft_probs = [q] * N
    else:
        drafts = [[i % vocab, (i // vocab) % vocab] for i in range(N)]  # any rule at all
        draft_probs = None
    logits = target.repeat(N, 1)
    result = verify(sampler, logits, _rows(params, N), drafts, draft_probs)
    out = result.token_ids
    assert all(1 <= len(t) <= k + 1 for t in out)
    first = np.bincount([t[0] for t in out], minlength=vocab)
    second = np.bincount(
        [t[1] for t, d in zip(out, drafts, strict=True) if t[0] == d[0]], minlength=vocab
    )
    bonus = np.bincount([t[2] for t in out if len(t) == 3], minlength=vocab)
    assert chi2_pvalue(first, p[0]) > ALPHA
    assert chi2_pvalue(second, p[1]) > ALPHA
    assert chi2_pvalue(bonus, p[2]) > ALPHA
    assert 0 < sum(len(t) - 1 for t in out) < k * N  # both paths taken
    # The token top_k masked out never appears.
    assert first[np.argmin(p[0])] == 0


def test_the_chi_square_test_detects_a_biased_sampler():
    """Power check: claiming a draft distribution the drafts were not drawn from biases the
    output, and the test above would catch it by a wide margin."""
    torch.manual_seed(1)
    vocab = 6
    sampler = Sampler(vocab, "cpu")
    target = torch.randn(2, vocab) * 1.5
    q = torch.softmax(torch.randn(1, vocab), -1)
    drafts = [[int(q.argmax())]] * N  # always the same token, but q claimed
    out = verify(
        sampler, target.repeat(N, 1), _rows(SamplingParams(temperature=1.0), N), drafts, [q] * N
    ).token_ids
    first = np.bincount([t[0] for t in out], minlength=vocab)
    assert chi2_pvalue(first, _target(target[0], 1.0)) < 1e-12


def test_greedy_verification_and_penalties_per_position():
    """Greedy: drafts are kept while they equal the argmax of their position, where the
    penalties count the drafts before it as outputs."""
    vocab = 5
    sampler = Sampler(vocab, "cpu")
    rows = torch.tensor(
        [
            [0.0, 3.0, 1.0, 0.0, 0.0],  # argmax 1
            [0.0, 3.0, 2.9, 0.0, 0.0],  # argmax 1, but 2 once 1 is penalized
            [4.0, 0.0, 0.0, 0.0, 0.0],  # argmax 0
        ]
    )
    plain = SamplingParams(temperature=0.0)
    got = verify(sampler, rows.clone(), _rows(plain, 1), [[1, 1]]).token_ids
    assert got == [[1, 1, 0]]  # both drafts match: bonus 0
    penalized = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    got = verify(sampler, rows.clone(), _rows(penalized, 1, outputs=[3]), [[1, 1]]).token_ids
    # Position 1 sees the first draft (1) as an output: 3.0 / 1.2 < 2.9, so 2 wins there.
    assert got == [[1, 2]]
    expect = sampler.sample(
        rows[1:2].clone(), [SamplingRow(penalized, [0], [3, 1], [None])]
    ).token_ids
    assert expect == [[2]]
    # No drafts: one token, like plain sampling.
    assert verify(sampler, rows[:1].clone(), _rows(plain, 1), [[]]).token_ids == [[1]]


def test_logprobs_per_accepted_token():
    vocab = 5
    sampler = Sampler(vocab, "cpu")
    rows = torch.randn(3, vocab)
    choice = rows.argmax(-1).tolist()
    params = SamplingParams(temperature=0.0, logprobs=2)
    result = verify(sampler, rows.clone(), _rows(params, 1), [[choice[0], (choice[1] + 1) % 5]])
    assert result.token_ids == [[choice[0], choice[1]]]
    lps = result.logprobs[0]
    assert len(lps) == 2
    raw = torch.log_softmax(rows, -1)
    for j, entry in enumerate(lps):
        token = result.token_ids[0][j]
        assert entry[token].rank == 1
        assert abs(entry[token].logprob - float(raw[j, token])) < 1e-6
        assert len(entry) == 2  # the chosen token is the top one; + the runner-up


def test_seeded_verification_does_not_depend_on_the_batch():
    vocab = 7
    sampler = Sampler(vocab, "cpu")
    torch.manual_seed(5)
    target = torch.randn(3, vocab)
    params = SamplingParams(temperature=1.0, seed=1)

    def run(batch_before: int) -> list[int]:
        rows = _rows(SamplingParams(temperature=1.0), batch_before)
        rows.append(SamplingRow(params, [0], [], [sampler.make_generator(11)]))
        drafts = [[1, 2]] * (batch_before + 1)
        logits = target.repeat(batch_before + 1, 1)
        return verify(sampler, logits, rows, drafts).token_ids[-1]

    assert run(0) == run(3) == run(9)
