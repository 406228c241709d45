"""Verification of draft tokens: greedy acceptance and rejection sampling.

A request that verifies ``k`` drafts ``d_1..d_k`` has ``k + 1`` rows of target logits: row
``j`` scores the token after the first ``j`` drafts. Each row is processed exactly as the
sampler processes a plain row -- grammar mask for the state after ``d_1..d_j``, ``logit_bias``,
``min_tokens`` and penalties counting ``d_1..d_j`` as outputs, then temperature, top-k, top-p,
min-p -- giving the target distribution ``p_j`` (or, at temperature 0, its argmax).

* Greedy: ``d_j`` is accepted while it equals row ``j - 1``'s argmax; the first mismatch (or
  row ``k``) contributes the argmax itself. The output is exactly what plain greedy decoding
  would produce.
* Random (Leviathan et al. / Chen et al. speculative sampling): ``d_j`` drawn from the draft
  distribution ``q_j`` is accepted with probability ``min(1, p_j(d_j) / q_j(d_j))``; at the
  first rejection the token is drawn from ``max(p_j - q_j, 0)`` normalised, and when all ``k``
  are accepted a bonus token is drawn from ``p_k``. Every output token is then distributed
  exactly as ``p`` (the tests check it with a chi-square test). A proposer with no
  distribution (prompt lookup, greedy drafting) is a point mass: ``q_j(d_j) = 1``, so ``d_j``
  is kept with probability ``p_j(d_j)`` and a rejection resamples ``p_j`` without ``d_j``.

Uniforms and exponential noise come from the request's own generator when it is seeded (a
fresh draw per row, so the result does not depend on the batch), else from one batched draw.
Everything runs on the logits' device; the host reads back one small tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.outputs import Logprob
from engine.sampler import (
    Sampler,
    SamplingRow,
    apply_logits_processors,
    apply_sampling_filters,
    exponential_noise,
    logprob_dicts,
)


@dataclass
class VerifyResult:
    """Per request: the tokens to append (accepted drafts, then the target's own token) and,
    when it asked for logprobs, one entry per token (of the raw target logits)."""

    token_ids: list[list[int]]
    logprobs: list[list[dict[int, Logprob]] | None]


def expand_rows(rows: Sequence[SamplingRow], drafts: Sequence[Sequence[int]]) -> list[SamplingRow]:
    """One ``SamplingRow`` per verified position: position ``j`` of a request counts its
    first ``j`` drafts as outputs (penalties, ``min_tokens``) and takes row ``j`` of its
    grammar masks."""
    out: list[SamplingRow] = []
    for row, d in zip(rows, drafts, strict=True):
        mask = row.token_bitmask
        reads = row.params.reads_output_tokens
        for j in range(len(d) + 1):
            if mask is not None and mask.dim() == 2:
                row_mask = mask[j]
            else:
                row_mask = mask if j == 0 else None
                if mask is not None and d:
                    raise ValueError("a constrained row verifying drafts needs one mask each")
            out.append(
                SamplingRow(
                    params=row.params,
                    prompt_token_ids=row.prompt_token_ids,
                    output_token_ids=(
                        list(row.output_token_ids) + list(d[:j])
                        if reads and j
                        else row.output_token_ids
                    ),
                    generators=row.generators,
                    num_samples=1,
                    eos_token_ids=row.eos_token_ids,
                    token_bitmask=row_mask,
                )
            )
    return out


def target_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The sampling distribution of each (random) row: processors, temperature and filters,
    softmax. ``logits`` (float32) is modified in place."""
    apply_logits_processors(logits, rows)
    x = apply_sampling_filters(logits, [r.params for r in rows])
    return torch.softmax(x, dim=-1)


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    drafts: Sequence[Sequence[int]],
    draft_probs: Sequence[torch.Tensor | None] | None = None,
) -> VerifyResult:
    """Verify each request's drafts against its ``len(drafts[i]) + 1`` rows of ``logits``
    (requests' rows consecutive, in order). ``draft_probs[i]`` is request i's draft
    distribution ``[k_i, V]`` over the target vocabulary, or None for a point mass.
    A request with no drafts just samples one token. May modify ``logits`` in place."""
    counts = [len(d) + 1 for d in drafts]
    num_rows = sum(counts)
    if logits.dim() != 2 or logits.shape[0] != num_rows:
        raise ValueError(f"verify needs {num_rows} logits rows, got {tuple(logits.shape)}")
    if logits.shape[1] > sampler.vocab_size:
        logits = logits[:, : sampler.vocab_size]
    device = logits.device
    firsts = [0]
    for c in counts:
        firsts.append(firsts[-1] + c)
    greedy = [r.params.is_greedy for r in rows]

    lp_reqs = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    raw_lp = None
    if lp_reqs:
        lp_rows = [firsts[i] + j for i in lp_reqs for j in range(counts[i])]
        raw_lp = torch.log_softmax(logits[_index(lp_rows, device)].float(), dim=-1)

    expanded = expand_rows(rows, drafts)
    if sampler.wants_float32_logits(expanded) and logits.dtype != torch.float32:
        logits = logits.float()
    # Row -> token the target chooses there (greedy: its argmax; random: its residual or
    # bonus sample), and for random drafts whether the draft is accepted.
    choice = torch.empty(num_rows, dtype=torch.long, device=device)
    accept = torch.zeros(num_rows, dtype=torch.long, device=device)
    g_reqs = [i for i, g in enumerate(greedy) if g]
    r_reqs = [i for i, g in enumerate(greedy) if not g]
    if g_reqs:
        g_rows = [firsts[i] + j for i in g_reqs for j in range(counts[i])]
        x = logits if len(g_rows) == num_rows else logits[_index(g_rows, device)]
        apply_logits_processors(x, [expanded[r] for r in g_rows])
        choice[_index(g_rows, device)] = sampler.argmax(x)
    if r_reqs:
        _rejection_sample(
            logits, rows, drafts, draft_probs, expanded, firsts, r_reqs, choice, accept
        )

    host = torch.cat([choice, accept]).tolist()
    choice_l, accept_l = host[:num_rows], host[num_rows:]
    token_ids: list[list[int]] = []
    for i, d in enumerate(drafts):
        base = firsts[i]
        a = 0
        if greedy[i]:
            while a < len(d) and choice_l[base + a] == d[a]:
                a += 1
        else:
            while a < len(d) and accept_l[base + a]:
                a += 1
        token_ids.append(list(d[:a]) + [choice_l[base + a]])

    logprobs: list[list[dict[int, Logprob]] | None] = [None] * len(rows)
    if raw_lp is not None:
        positions: list[int] = []
        tokens: list[int] = []
        top_n: list[int] = []
        pos = 0
        for i in lp_reqs:
            n = len(token_ids[i])
            positions += range(pos, pos + n)
            tokens += token_ids[i]
            pos += counts[i]
        top_n = [0] * raw_lp.shape[0]
        pos = 0
        for i in lp_reqs:
            for j in range(counts[i]):
                top_n[pos + j] = rows[i].params.logprobs or 0
            pos += counts[i]
        dicts = logprob_dicts(raw_lp, positions, _index(tokens, device), top_n)
        k = 0
        for i in lp_reqs:
            n = len(token_ids[i])
            logprobs[i] = dicts[k : k + n]
            k += n
    return VerifyResult(token_ids, logprobs)


def _rejection_sample(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    drafts: Sequence[Sequence[int]],
    draft_probs: Sequence[torch.Tensor | None] | None,
    expanded: list[SamplingRow],
    firsts: list[int],
    r_reqs: list[int],
    choice: torch.Tensor,
    accept: torch.Tensor,
) -> None:
    """Fill ``choice`` and ``accept`` for the rows of the random requests ``r_reqs``."""
    device = logits.device
    r_rows = [firsts[i] + j for i in r_reqs for j in range(len(drafts[i]) + 1)]
    x = logits[_index(r_rows, device)]
    if x.dtype != torch.float32:
        x = x.float()
    p = target_probs(x, [expanded[r] for r in r_rows])  # [R, V]
    # The rows that hold a draft: their token, and the draft's distribution when it has one.
    d_local: list[int] = []  # row of p
    d_tokens: list[int] = []
    with_q: list[int] = []  # indices into d_local whose draft has a distribution
    q_rows: list[torch.Tensor] = []
    gens: list[torch.Generator | None] = []
    local = 0
    for i in r_reqs:
        d = drafts[i]
        q = draft_probs[i] if draft_probs is not None else None
        gen = rows[i].generators[0]
        for j in range(len(d) + 1):
            gens.append(gen)
            if j < len(d):
                if q is not None:
                    with_q.append(len(d_local))
                    q_rows.append(q[j])
                d_local.append(local)
                d_tokens.append(d[j])
            local += 1
    residual = p.clone()
    if d_local:
        d_idx = _index(d_local, device)
        tok = _index(d_tokens, device)
        p_d = p[d_idx, tok]
        q_d = torch.ones_like(p_d)
        # A point-mass draft: the residual max(p - q, 0) is p without the draft token.
        residual[d_idx, tok] = 0.0
        if q_rows:
            q = torch.stack(q_rows).to(device=device, dtype=torch.float32)
            wq = _index(with_q, device)
            q_d[wq] = q.gather(1, tok[wq, None]).squeeze(1)
            rows_q = d_idx[wq]
            residual[rows_q] = (p[rows_q] - q).clamp_min_(0.0)
        # Accept with probability min(1, p/q): u < p/q, i.e. u * q < p.
        uniform = _uniforms([gens[r] for r in d_local], device)
        accept[_index([r_rows[r] for r in d_local], device)] = (uniform * q_d < p_d).long()
    noise = exponential_noise(tuple(residual.shape), gens, device)
    choice[_index(r_rows, device)] = residual.div_(noise).argmax(dim=-1)


def _uniforms(generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One Uniform[0, 1) value per entry, seeded entries from their generator."""
    out = torch.empty(len(generators), dtype=torch.float32, device=device)
    unseeded = [k for k, g in enumerate(generators) if g is None]
    if unseeded:
        out[_index(unseeded, device)] = torch.rand(len(unseeded), device=device)
    for k, g in enumerate(generators):
        if g is not None:
            out[k] = torch.rand(1, device=device, generator=g)[0]
    return out


def _index(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.long, device=device)
