"""Tests for engine.sampler: every stage against hand computations, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampler import Sampler, SamplingRow, _apply_temperature_and_filters
from engine.sampling_params import SamplingParams

NEG = float("-inf")


def _device() -> torch.device:
    return torch.get_default_device()


@pytest.fixture(
    autouse=True,
    params=[
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
            ],
        ),
    ],
)
def device(request):
    """Every test runs on the CPU, and again on a GPU when there is one."""
    previous = torch.get_default_device()
    torch.set_default_device(request.param)
    yield torch.device(request.param)
    torch.set_default_device(previous)


def row(params: SamplingParams, *, prompt=(), output=(), gens=None, n=1, eos=()) -> SamplingRow:
    return SamplingRow(
        params=params,
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        generators=list(gens) if gens is not None else [None] * n,
        num_samples=n,
        eos_token_ids=list(eos),
    )


def gen(seed: int) -> torch.Generator:
    return Sampler(8, _device()).make_generator(seed)


def empirical(logits_row: list[float], params: SamplingParams, draws: int = 20000) -> torch.Tensor:
    """Frequencies of each token over ``draws`` samples of one row (deterministic seed)."""
    torch.manual_seed(1234)
    logits = torch.tensor([logits_row])
    out = Sampler(len(logits_row), _device()).sample(logits, [row(params, n=draws)])
    counts = torch.bincount(torch.tensor(out.token_ids[0]), minlength=len(logits_row))
    return counts.double() / draws


def assert_distribution(freq: torch.Tensor, expected: list[float], draws: int = 20000) -> None:
    expected_t = torch.tensor(expected, dtype=torch.float64)
    expected_t = expected_t / expected_t.sum()
    # Tokens with zero probability must never be drawn; the others within 5 sigma.
    assert torch.equal(freq > 0, expected_t > 0), (freq, expected_t)
    sigma = (expected_t * (1 - expected_t) / draws).sqrt()
    assert torch.all((freq - expected_t).abs() <= 5 * sigma + 1e-12), (freq, expected_t)


PROBS = [0.4, 0.3, 0.2, 0.1]
LOGITS = [math.log(p) for p in PROBS]


# ---------------------------------------------------------------- greedy


def test_greedy_is_argmax_and_reports_rank_one():
    torch.manual_seed(0)
    logits = torch.randn(7, 50)
    expected = logits.argmax(-1).tolist()
    lp = torch.log_softmax(logits, -1)
    rows = [row(SamplingParams(temperature=0.0, logprobs=2)) for _ in range(7)]
    out = Sampler(50, _device()).sample(logits.clone(), rows)
    assert [t[0] for t in out.token_ids] == expected
    for i, (tok,) in enumerate(out.token_ids):
        d = out.logprobs[i][0]
        assert d[tok].rank == 1
        assert d[tok].logprob == pytest.approx(lp[i, tok].item(), abs=1e-6)
        assert len(d) == 2  # the sampled token is also the top-1


def test_greedy_rows_use_the_given_argmax():
    """The platform's ``argmax`` kernel takes greedy tokens (all-greedy and mixed batches),
    on the vocabulary-cut view; the tokens are torch's."""
    seen = []

    def spy(x: torch.Tensor) -> torch.Tensor:
        seen.append((tuple(x.shape), x.stride()))
        return torch.argmax(x, dim=-1)

    torch.manual_seed(0)
    logits = torch.randn(5, 40)
    expected = logits[:, :37].argmax(-1).tolist()
    sampler = Sampler(37, _device(), argmax=spy)
    greedy = [row(SamplingParams(temperature=0.0)) for _ in range(5)]
    out = sampler.sample(logits.clone(), greedy)
    assert [t[0] for t in out.token_ids] == expected
    assert seen == [((5, 37), (40, 1))]  # one call on the strided view

    seen.clear()
    mixed = greedy[:2] + [row(SamplingParams(temperature=1.0))] + greedy[3:]
    tokens = sampler.sample_tokens(logits.clone(), mixed).tolist()
    assert [tokens[i] for i in (0, 1, 3, 4)] == [expected[i] for i in (0, 1, 3, 4)]
    assert [shape for shape, _ in seen] == [(4, 37)]


def test_padded_vocab_is_cut():
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0]])  # column 3 is padding beyond vocab 3
    out = Sampler(3, _device()).sample(logits, [row(SamplingParams(temperature=0.0))])
    assert out.token_ids == [[2]]


# ---------------------------------------------------------------- filters, exact masks


def masked(logits_rows: list[list[float]], params: list[SamplingParams]) -> list[set[int]]:
    x = _apply_temperature_and_filters(torch.tensor(logits_rows), params)
    return [set(torch.nonzero(r > NEG).flatten().tolist()) for r in x]


def test_filter_masks_exact_per_row():
    rows = [LOGITS] * 8
    params = [
        SamplingParams(),  # nothing: all kept
        SamplingParams(top_k=1),
        SamplingParams(top_k=3),
        SamplingParams(top_p=0.6),  # 0.4 + 0.3 reaches 0.6
        SamplingParams(top_p=0.75),  # needs 0.2 too
        SamplingParams(min_p=0.3),  # keep p >= 0.12
        SamplingParams(top_k=2, top_p=0.95),  # top-k binds
        SamplingParams(top_k=3, top_p=0.6, temperature=0.5),  # p^2 over top 3: .55, .31, .14
    ]
    assert masked(rows, params) == [
        {0, 1, 2, 3},
        {0},
        {0, 1, 2},
        {0, 1},
        {0, 1, 2},
        {0, 1, 2},
        {0, 1},
        {0, 1},
    ]


def test_top_k_only_batch_uses_per_row_k():
    # Without top-p the top-k path takes a partial topk; rows without top-k stay whole.
    logits = [[5.0, 4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0, 5.0], [1.0, 3.0, 2.0, 5.0, 4.0]]
    params = [SamplingParams(top_k=2), SamplingParams(), SamplingParams(top_k=3)]
    assert masked(logits, params) == [{0, 1}, {0, 1, 2, 3, 4}, {1, 3, 4}]


def test_top_p_within_top_k_uses_partial_topk_path():
    # Every top-p row also has a top-k: the sorted prefix comes from topk(max k).
    logits = [LOGITS, LOGITS, [0.0, 3.0, 1.0, 2.0]]
    params = [
        SamplingParams(top_k=3, top_p=0.6),
        SamplingParams(top_k=2),
        SamplingParams(top_k=4, top_p=0.999),
    ]
    assert masked(logits, params) == [{0, 1}, {0, 1}, {0, 1, 2, 3}]
    # top-p applies to the top-k renormalized: .44, .33, .22 -> 0.75 needs only two, 0.8 three
    assert masked([LOGITS], [SamplingParams(top_k=3, top_p=0.75)]) == [{0, 1}]
    assert masked([LOGITS], [SamplingParams(top_k=3, top_p=0.8)]) == [{0, 1, 2}]


def test_top_k_distribution():
    assert_distribution(empirical(LOGITS, SamplingParams(top_k=2)), [0.4, 0.3, 0, 0])


def test_top_p_distribution():
    assert_distribution(empirical(LOGITS, SamplingParams(top_p=0.75)), [0.4, 0.3, 0.2, 0])


def test_min_p_distribution():
    assert_distribution(empirical(LOGITS, SamplingParams(min_p=0.6)), [0.4, 0.3, 0, 0])


def test_unfiltered_distribution():
    assert_distribution(empirical(LOGITS, SamplingParams()), PROBS)


def test_temperature_distribution():
    # temperature t scales logits by 1/t: probabilities become p^(1/t), renormalized.
    assert_distribution(empirical(LOGITS, SamplingParams(temperature=0.5)), [p**2 for p in PROBS])
    assert_distribution(empirical(LOGITS, SamplingParams(temperature=2.0)), [p**0.5 for p in PROBS])


# ---------------------------------------------------------------- processors


def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 1.0]])
    params = SamplingParams(
        temperature=0.0,
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    r = row(params, prompt=[0, 1], output=[2, 2, 3, 4, 2])
    expected = logits.clone()[0].tolist()
    # repetition: tokens 0..4 were seen (prompt or output); 5 was not
    expected[0] = 2.0 / 2
    expected[1] = -1.0 * 2
    expected[2] = 0.5 / 2
    expected[3] = -0.5 * 2
    expected[4] = 3.0 / 2
    # frequency and presence: output counts {2: 3, 3: 1, 4: 1}
    expected[2] -= 0.5 * 3 + 0.25
    expected[3] -= 0.5 * 1 + 0.25
    expected[4] -= 0.5 * 1 + 0.25
    x = logits.clone()
    out = Sampler(6, _device()).sample(x, [r])
    assert x[0].tolist() == pytest.approx(expected)
    assert out.token_ids == [[max(range(6), key=lambda t: expected[t])]]


def test_penalties_only_touch_rows_that_set_them():
    torch.manual_seed(3)
    logits = torch.randn(3, 10)
    original = logits.clone()
    rows = [
        row(SamplingParams(temperature=0.0), prompt=[1], output=[2, 2]),
        row(SamplingParams(temperature=0.0, frequency_penalty=1.0), prompt=[1], output=[2, 2]),
        row(SamplingParams(temperature=0.0), prompt=[1], output=[2, 2]),
    ]
    Sampler(10, _device()).sample(logits, rows)
    assert torch.equal(logits[0], original[0]) and torch.equal(logits[2], original[2])
    expected = original[1].clone()
    expected[2] -= 2.0
    assert torch.allclose(logits[1], expected)


def test_logit_bias():
    logits = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    rows = [
        row(SamplingParams(temperature=0.0, logit_bias={0: 5.0, 99: 1.0})),  # 99: out of vocab
        row(SamplingParams(temperature=0.0, logit_bias={2: -100.0})),
    ]
    out = Sampler(3, _device()).sample(logits, rows)
    assert out.token_ids == [[0], [1]]


def test_min_tokens_suppresses_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0, 3.0]] * 4)
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    rows = [
        row(p, output=[1], eos=[2]),  # 1 < 2 outputs: eos 2 and stop 3 banned -> 4
        row(p, output=[1, 1], eos=[2]),  # reached min_tokens: eos allowed again
        row(SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True), eos=[2]),
        row(SamplingParams(temperature=0.0), eos=[2]),
    ]
    out = Sampler(5, _device()).sample(logits, rows)
    assert out.token_ids == [[4], [2], [2], [2]]


# ---------------------------------------------------------------- seeds and batching


def test_seeded_row_same_alone_and_in_any_batch():
    torch.manual_seed(0)
    vocab = 64
    target = torch.randn(vocab)
    others = torch.randn(5, vocab)
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=7)

    def run(position: int, other_params: list[SamplingParams], steps: int = 6) -> list[int]:
        g = gen(7)
        other_gens = [
            gen(100 + k) if p.seed is not None else None for k, p in enumerate(other_params)
        ]
        tokens = []
        for _ in range(steps):
            rows = [row(p, gens=[og]) for p, og in zip(other_params, other_gens, strict=True)]
            rows.insert(position, row(params, gens=[g]))
            logits = others[: len(other_params)]
            logits = torch.cat([logits[:position], target[None], logits[position:]])
            out = Sampler(vocab, _device()).sample(logits, rows)
            tokens.append(out.token_ids[position][0])
        return tokens

    alone = run(0, [])
    assert len(set(alone)) > 1  # it really samples
    mixes = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, seed=3, min_p=0.1),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
    ]
    for position in (0, 2, 5):
        assert run(position, mixes) == alone
    assert run(1, mixes[:2]) == alone
    # A different seed gives a different stream.
    params_other = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=8)
    g8 = gen(8)
    other = [
        Sampler(vocab, _device())
        .sample(target[None].clone(), [row(params_other, gens=[g8])])
        .token_ids[0][0]
        for _ in range(6)
    ]
    assert other != alone


def test_rows_with_different_params_do_not_interfere():
    # Each seeded row of a mixed batch samples exactly what it samples alone.
    torch.manual_seed(1)
    vocab = 32
    logits = torch.randn(6, vocab) * 2
    params = [
        SamplingParams(temperature=0.5, seed=1),
        SamplingParams(temperature=1.0, top_k=3, seed=2),
        SamplingParams(temperature=1.5, top_p=0.5, seed=3),
        SamplingParams(temperature=1.0, min_p=0.2, seed=4),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=10, top_p=0.8, min_p=0.05, seed=6),
    ]
    batch = Sampler(vocab, _device()).sample(
        logits.clone(), [row(p, gens=[gen(p.seed) if p.seed else None]) for p in params]
    )
    for i, p in enumerate(params):
        alone = Sampler(vocab, _device()).sample(
            logits[i : i + 1].clone(), [row(p, gens=[gen(p.seed) if p.seed else None])]
        )
        assert alone.token_ids[0] == batch.token_ids[i]


def test_num_samples_uses_each_generator():
    torch.manual_seed(2)
    vocab = 100
    logits = torch.randn(1, vocab)
    p = SamplingParams(temperature=1.0, seed=5)

    def single(seed: int) -> int:
        return (
            Sampler(vocab, _device())
            .sample(logits.clone(), [row(p, gens=[gen(seed)])])
            .token_ids[0][0]
        )

    greedy_row = row(SamplingParams(temperature=0.0))
    out = Sampler(vocab, _device()).sample(
        torch.cat([logits, logits]), [greedy_row, row(p, gens=[gen(11), None, gen(12)], n=3)]
    )
    assert out.token_ids[0] == [logits.argmax().item()]
    assert len(out.token_ids[1]) == 3
    assert out.token_ids[1][0] == single(11)
    assert out.token_ids[1][2] == single(12)

    # Each sample's logprobs describe its own token.
    with_lp = Sampler(vocab, _device()).sample(
        logits.clone(),
        [row(SamplingParams(temperature=1.0, logprobs=1), gens=[gen(1), gen(2), gen(3)], n=3)],
    )
    lp = torch.log_softmax(logits[0], -1)
    for tok, d in zip(with_lp.token_ids[0], with_lp.logprobs[0], strict=True):
        assert d[tok].logprob == pytest.approx(lp[tok].item(), abs=1e-6)
        assert lp.argmax().item() in d

    greedy_n = Sampler(vocab, _device()).sample(
        logits.clone(), [row(SamplingParams(temperature=0.0, logprobs=1), n=2)]
    )
    assert greedy_n.token_ids == [[logits.argmax().item()] * 2]
    assert len(greedy_n.logprobs[0]) == 2


def test_generator_count_must_match_num_samples():
    with pytest.raises(ValueError, match="generators"):
        Sampler(4, _device()).sample(torch.zeros(1, 4), [row(SamplingParams(), gens=[None], n=2)])


# ---------------------------------------------------------------- logprobs


def test_logprobs_ranks_and_top_n():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, 2.0, -1.0]])
    lp = torch.log_softmax(logits, -1)[0]
    # logit_bias forces the least likely token: it is reported with its raw rank.
    p = SamplingParams(temperature=0.0, logprobs=3, logit_bias={5: 100.0})
    out = Sampler(6, _device()).sample(logits.clone(), [row(p)])
    assert out.token_ids == [[5]]
    d = out.logprobs[0][0]
    assert list(d) == [5, 1, 2, 4]  # sampled first, then the top 3
    assert d[5].rank == 6
    assert d[1].rank == 1 and d[2].rank == 1  # tie: both have no strictly larger token
    assert d[4].rank == 3
    for tok, entry in d.items():
        assert entry.logprob == pytest.approx(lp[tok].item(), abs=1e-6)
        assert entry.decoded_token is None


def test_logprobs_only_for_rows_that_ask_and_zero_means_sampled_only():
    torch.manual_seed(4)
    logits = torch.randn(3, 20)
    lp = torch.log_softmax(logits, -1)
    rows = [
        row(SamplingParams(temperature=0.0)),
        row(SamplingParams(temperature=1.0, logprobs=0), gens=[gen(3)]),
        row(SamplingParams(temperature=0.0, logprobs=5, presence_penalty=2.0), output=[0]),
    ]
    out = Sampler(20, _device()).sample(logits.clone(), rows)
    assert out.logprobs[0] is None
    (tok1,) = out.token_ids[1]
    d1 = out.logprobs[1][0]
    assert list(d1) == [tok1]
    assert d1[tok1].logprob == pytest.approx(lp[1, tok1].item(), abs=1e-6)
    assert d1[tok1].rank == int((lp[1] > lp[1, tok1]).sum()) + 1
    d2 = out.logprobs[2][0]
    top5 = lp[2].topk(5).indices.tolist()
    assert set(top5) <= set(d2)
    assert [d2[t].rank for t in top5] == [1, 2, 3, 4, 5]


def test_prompt_logprobs():
    torch.manual_seed(5)
    logits = torch.randn(4, 30)
    lp = torch.log_softmax(logits, -1)
    targets = [3, 17, lp[2].argmax().item(), 0]
    result = Sampler(30, _device()).compute_prompt_logprobs(logits, targets, 2)
    assert len(result) == 4
    for pos, (d, tgt) in enumerate(zip(result, targets, strict=True)):
        assert d[tgt].logprob == pytest.approx(lp[pos, tgt].item(), abs=1e-6)
        assert d[tgt].rank == int((lp[pos] > lp[pos, tgt]).sum()) + 1
        top = lp[pos].topk(2).indices.tolist()
        assert set(d) == {tgt, *top}
    assert result[2][targets[2]].rank == 1
    assert Sampler(30, _device()).compute_prompt_logprobs(logits[:0], [], 2) == []
