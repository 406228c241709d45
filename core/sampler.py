"""The batched sampler: logits of one decode/prefill step -> next tokens (and their logprobs).

Everything runs on the logits' device, vectorized over the batch. Stages run in vLLM's order
and a stage is skipped entirely when no row in the batch needs it (the common all-greedy batch
is one ``argmax``):

0. structured outputs: tokens the row's grammar forbids (``SamplingRow.token_bitmask``, see
   ``engine.structured_output``) are set to -inf, so every later stage, greedy included,
   chooses among allowed tokens only;
1. ``logit_bias``;
2. ``min_tokens``: while a row has fewer than ``min_tokens`` outputs, its EOS ids (unless
   ``ignore_eos``) and ``stop_token_ids`` are set to -inf;
3. penalties: repetition penalty over prompt + output tokens (positive logits divided,
   negative multiplied, as HF/vLLM), then frequency and presence penalties over output tokens;
4. greedy rows (``temperature == 0``) take the argmax of the logits at this point;
5. random rows: temperature, top-k, top-p, min-p, then the exponential race
   ``argmax(probs / q)`` with ``q ~ Exponential(1)`` (equivalent to sampling from ``probs``,
   and free of the host sync and the cumsum of ``torch.multinomial``).

**Logprobs are of the raw model logits** (``log_softmax`` before any stage above, the grammar
mask included), as vLLM's
default ``raw_logprobs`` mode. So a greedy row with no penalties always reports rank 1 for its
token, while a row whose processing changed the winner reports the model's own opinion of it.

**Seeds.** A row whose generators are set draws its noise as a fresh ``[V]`` tensor from its
own generator, so a seeded request yields the same tokens alone or in any batch, in any
position. Unseeded rows share one batched draw from the device's default generator.

**Ties** in top-k/top-p thresholds keep every token tied with the last kept one.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.outputs import Logprob
from engine.sampling_params import SamplingParams

# Chunk of rows processed at once by compute_prompt_logprobs (bounds the log_softmax copy).
_PROMPT_LOGPROBS_CHUNK_ELEMS = 1 << 26


@dataclass
class SamplingRow:
    """One logits row to sample from.

    ``generators`` has ``num_samples`` entries: a ``torch.Generator`` on the logits' device for
    a seeded sample, ``None`` for an unseeded one. ``num_samples > 1`` is used once per ``n > 1``
    request (the parent's first token): ``num_samples`` tokens are drawn from this one row, each
    with its own generator. ``eos_token_ids`` are the ids ``min_tokens`` suppresses (besides
    ``params.stop_token_ids``). ``token_bitmask`` (structured outputs) is xgrammar's packed
    int32 ``[ceil(V / 32)]`` host tensor of the tokens the row may sample (bit ``t % 32`` of
    word ``t // 32``); ``None`` leaves the row unconstrained. A request that verifies ``k``
    draft tokens (speculative decoding) has one mask per verified position: ``[k + 1,
    ceil(V / 32)]``, row ``j`` for the grammar state after the first ``j`` drafts.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generators: list[torch.Generator | None]
    num_samples: int = 1
    eos_token_ids: list[int] = field(default_factory=list)
    token_bitmask: torch.Tensor | None = None


@dataclass
class SamplerOutput:
    """Sampled tokens per row (inner list: one per sample) and, for rows that asked, logprobs.

    ``logprobs[i]`` is ``None`` when row i did not ask for logprobs, else one dict per sample:
    ``{token_id: Logprob}`` holding the sampled token plus the top ``params.logprobs``.
    """

    token_ids: list[list[int]]
    logprobs: list[list[dict[int, Logprob]] | None]


class Sampler:
    """Batched sampler for a model with ``vocab_size`` tokens.

    Logits wider than ``vocab_size`` (padded vocabularies) are cut to it. ``sample`` may modify
    the logits tensor in place. ``argmax`` ([N, V] logits -> int64 [N], ``torch.argmax``
    semantics, rows possibly strided) takes greedy rows' tokens: the platform's ``argmax``
    kernel (see ``engine.kernels``), or torch's by default.
    """

    def __init__(
        self,
        vocab_size: int,
        device: torch.device | str,
        argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._argmax = argmax or (lambda x: x.argmax(dim=-1))

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy tokens of ``[N, V]`` logits (int64 ``[N]``), through the platform's kernel."""
        if logits.shape[1] > self.vocab_size:
            logits = logits[:, : self.vocab_size]
        return self._argmax(logits)

    def make_generator(self, seed: int) -> torch.Generator:
        """A generator on this sampler's device seeded with ``seed`` (for ``SamplingRow``)."""
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        return gen

    # ------------------------------------------------------------------ sampling

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Sample ``row.num_samples`` tokens from each row of ``logits`` ([N, V] float32)."""
        if not rows:
            self._check(logits, rows)
            return SamplerOutput([], [])
        tokens, raw_logprobs, lp_rows = self._sample_on_device(logits, rows, with_logprobs=True)
        token_list = tokens.tolist()
        token_ids: list[list[int]] = []
        pos = 0
        for r in rows:
            token_ids.append(token_list[pos : pos + r.num_samples])
            pos += r.num_samples

        logprobs: list[list[dict[int, Logprob]] | None] = [None] * len(rows)
        if raw_logprobs is not None:
            self._fill_logprobs(logprobs, raw_logprobs, lp_rows, rows, tokens)
        return SamplerOutput(token_ids, logprobs)

    def sample_tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The sampled tokens as a device tensor (one per sample, rows' samples in order),
        without waiting for the device: what asynchronous scheduling needs. Logprobs are not
        computed; use ``sample`` for rows that want them."""
        tokens, _, _ = self._sample_on_device(logits, rows, with_logprobs=False)
        return tokens

    def warm_up(self, logits: torch.Tensor) -> None:
        """Run the greedy argmax once on these logits (one row of the model's dtype, as decode
        produces them), so a JIT-compiled kernel compiles at start-up, not in the first
        request."""
        self._argmax(logits)

    @staticmethod
    def wants_float32_logits(rows: list[SamplingRow]) -> bool:
        """Whether these rows need float32 logits. An all-greedy batch with no logit
        processing or logprobs takes the argmax of the model's own dtype: converting first
        cannot change which entry is largest (nor the first of tied ones)."""
        for r in rows:
            p = r.params
            if not p.is_greedy or p.logprobs is not None or p.logit_bias or p.reads_output_tokens:
                return True
            if r.token_bitmask is not None:
                return True
        return False

    @staticmethod
    def _check(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [num_rows, vocab], got {tuple(logits.shape)} for {len(rows)} rows"
            )
        for row in rows:
            if len(row.generators) != row.num_samples:
                raise ValueError(
                    f"a row with num_samples={row.num_samples} needs as many generators, "
                    f"got {len(row.generators)}"
                )

    def _sample_on_device(
        self, logits: torch.Tensor, rows: list[SamplingRow], with_logprobs: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
        """Tokens [num_samples_total] on the logits' device, plus the raw logprobs of the rows
        that asked (when ``with_logprobs``) and those rows' indices."""
        self._check(logits, rows)
        if logits.shape[1] > self.vocab_size:
            logits = logits[:, : self.vocab_size]
        device = logits.device

        # Raw logprobs first: the later stages modify ``logits`` in place.
        lp_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        raw_logprobs = None
        if lp_rows and with_logprobs:
            src = logits if len(lp_rows) == len(rows) else logits[_index(lp_rows, device)]
            raw_logprobs = torch.log_softmax(src, dim=-1)

        apply_logits_processors(logits, rows)

        # sample_rows[s] = the row of sample s (rows with num_samples > 1 repeat).
        sample_rows = [i for i, r in enumerate(rows) for _ in range(r.num_samples)]
        greedy = [r.params.is_greedy for r in rows]
        if all(greedy):
            tokens = self._argmax(logits)
            if len(sample_rows) != len(rows):
                tokens = tokens[_index(sample_rows, device)]
        else:
            tokens = self._sample_mixed(logits, rows, greedy, sample_rows)
        return tokens, raw_logprobs, lp_rows

    def _sample_mixed(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        greedy: list[bool],
        sample_rows: list[int],
    ) -> torch.Tensor:
        """Tokens [num_samples_total] for a batch with at least one random row."""
        device = logits.device
        out = torch.empty(len(sample_rows), dtype=torch.long, device=device)
        if any(greedy):
            greedy_samples = [s for s, i in enumerate(sample_rows) if greedy[i]]
            greedy_rows = [sample_rows[s] for s in greedy_samples]
            out[_index(greedy_samples, device)] = self._argmax(logits[_index(greedy_rows, device)])

        rand_rows = [i for i, g in enumerate(greedy) if not g]
        x = logits if len(rand_rows) == len(rows) else logits[_index(rand_rows, device)]
        params = [rows[i].params for i in rand_rows]
        x = _apply_temperature_and_filters(x, params)
        # The race only compares probs / q within a row, so the softmax normalizer can be
        # skipped: exp(x - max) is proportional to the probabilities (and has no row-wide sum
        # whose rounding could depend on the kernel chosen for this batch).
        probs = (x - x.max(dim=-1, keepdim=True).values).exp_()

        # One probs row per random sample.
        row_to_rand = {row: k for k, row in enumerate(rand_rows)}
        rand_samples = [s for s, i in enumerate(sample_rows) if not greedy[i]]
        if len(rand_samples) != len(rand_rows):
            probs = probs[_index([row_to_rand[sample_rows[s]] for s in rand_samples], device)]

        noise = self._exponential_noise(probs.shape, rows, sample_rows, rand_samples, device)
        rand_tokens = probs.div_(noise).argmax(dim=-1)
        if len(rand_samples) == len(sample_rows):
            return rand_tokens
        out[_index(rand_samples, device)] = rand_tokens
        return out

    @staticmethod
    def _exponential_noise(
        shape: torch.Size,
        rows: list[SamplingRow],
        sample_rows: list[int],
        rand_samples: list[int],
        device: torch.device,
    ) -> torch.Tensor:
        """Exponential(1) noise, one row per random sample; seeded samples use their generator."""
        # Which generator each random sample uses (k-th sample of its row).
        sample_gens: list[torch.Generator | None] = []
        first_sample = {}
        for s, i in enumerate(sample_rows):
            first_sample.setdefault(i, s)
        for s in rand_samples:
            i = sample_rows[s]
            sample_gens.append(rows[i].generators[s - first_sample[i]])

        vocab = shape[-1]
        noise = torch.empty(shape, dtype=torch.float32, device=device)
        unseeded = [k for k, g in enumerate(sample_gens) if g is None]
        if len(unseeded) == len(sample_gens):
            _exponential_(noise)
        else:
            if unseeded:
                fresh = _exponential_(torch.empty(len(unseeded), vocab, device=device))
                noise[_index(unseeded, device)] = fresh
            for k, gen in enumerate(sample_gens):
                if gen is not None:
                    # A fresh [V] draw: the same values whatever the batch looks like.
                    noise[k] = _exponential_(torch.empty(vocab, device=device), gen)
        return noise

    def _fill_logprobs(
        self,
        out: list[list[dict[int, Logprob]] | None],
        raw_logprobs: torch.Tensor,
        lp_rows: list[int],
        rows: list[SamplingRow],
        tokens: torch.Tensor,
    ) -> None:
        """Fill ``out[i]`` for each row in ``lp_rows`` (``raw_logprobs`` is [len(lp_rows), V]).

        ``tokens`` holds every sample's token, rows' samples in order.
        """
        lp_pos: list[int] = []  # per logprob sample: its row in raw_logprobs
        lp_samples: list[int] = []  # per logprob sample: its index in ``tokens``
        first_sample = 0
        k = 0
        for i, r in enumerate(rows):
            if k < len(lp_rows) and lp_rows[k] == i:
                lp_pos.extend([k] * r.num_samples)
                lp_samples.extend(range(first_sample, first_sample + r.num_samples))
                k += 1
            first_sample += r.num_samples
        if len(lp_samples) != tokens.numel():
            tokens = tokens[_index(lp_samples, tokens.device)]
        top_n = [rows[i].params.logprobs or 0 for i in lp_rows]
        dicts = _logprob_dicts(raw_logprobs, lp_pos, tokens, top_n)
        pos = 0
        for i in lp_rows:
            n = rows[i].num_samples
            out[i] = dicts[pos : pos + n]
            pos += n

    # ------------------------------------------------------------------ prompt logprobs

    def compute_prompt_logprobs(
        self, logits: torch.Tensor, target_ids: list[int], k: int
    ) -> list[dict[int, Logprob]]:
        """See the module-level ``compute_prompt_logprobs``."""
        if logits.shape[-1] > self.vocab_size:
            logits = logits[:, : self.vocab_size]
        return compute_prompt_logprobs(logits, target_ids, k)


def compute_prompt_logprobs(
    logits: torch.Tensor, target_ids: list[int], k: int
) -> list[dict[int, Logprob]]:
    """Logprobs of prompt tokens: position p's logits ([P, V] float32) predict ``target_ids[p]``.

    Returns one dict per position with the target token (logprob, rank) plus the top ``k``
    tokens, from the raw logits' ``log_softmax``. Rows are processed in chunks so a long prompt
    never needs a second full [P, V] copy.
    """
    num = logits.shape[0]
    if len(target_ids) != num:
        raise ValueError(f"{num} logits rows but {len(target_ids)} target ids")
    if num == 0:
        return []
    device = logits.device
    chunk = max(1, _PROMPT_LOGPROBS_CHUNK_ELEMS // max(1, logits.shape[1]))
    result: list[dict[int, Logprob]] = []
    for start in range(0, num, chunk):
        end = min(num, start + chunk)
        lp = torch.log_softmax(logits[start:end], dim=-1)
        targets = _index(target_ids[start:end], device)
        result.extend(_logprob_dicts(lp, list(range(end - start)), targets, [k] * (end - start)))
    return result


# ---------------------------------------------------------------------- stages, shared


def apply_logits_processors(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Stages 0-3 in place, for the rows that need them: grammar masks, ``logit_bias``,
    ``min_tokens`` and penalties (over each row's ``output_token_ids``). Shared with the
    speculative-decoding rejection sampler, which runs them once per verified position."""
    _apply_token_bitmasks(logits, rows)
    _apply_logit_bias(logits, rows)
    _apply_min_tokens(logits, rows)
    _apply_penalties(logits, rows)


def apply_sampling_filters(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Stage 5's temperature, top-k, top-p and min-p (masked logits become -inf) on random
    rows ``x`` (modified in place); see ``_apply_temperature_and_filters``."""
    return _apply_temperature_and_filters(x, params)


def exponential_noise(
    shape: tuple[int, int], generators: list[torch.Generator | None], device: torch.device
) -> torch.Tensor:
    """Exponential(1) noise ``[rows, V]``: row ``i`` from ``generators[i]`` (a fresh draw, so a
    seeded row's values do not depend on the batch) or, unseeded, from one batched draw."""
    noise = torch.empty(shape, dtype=torch.float32, device=device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        return _exponential_(noise)
    if unseeded:
        noise[_index(unseeded, device)] = _exponential_(
            torch.empty(len(unseeded), shape[1], device=device)
        )
    for i, gen in enumerate(generators):
        if gen is not None:
            noise[i] = _exponential_(torch.empty(shape[1], device=device), gen)
    return noise


def logprob_dicts(
    logprobs: torch.Tensor, positions: list[int], token_ids: torch.Tensor, top_n: list[int]
) -> list[dict[int, Logprob]]:
    """One ``{token: Logprob}`` dict per entry of ``token_ids``, from row ``positions[s]`` of
    the ``[R, V]`` log-probabilities, with that row's top ``top_n[row]`` (see
    ``_logprob_dicts``)."""
    return _logprob_dicts(logprobs, positions, token_ids, top_n)


# ---------------------------------------------------------------------- helpers


def _exponential_(t: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Fill ``t`` with Exponential(1) noise as ``-log(U)``, ``U ~ Uniform[0, 1)``.

    Same distribution as ``Tensor.exponential_`` but about 3x faster on CPU. ``U = 0`` gives
    ``q = inf``: that token cannot win, which is the limit of the race, and never divides 0/0.
    """
    return t.uniform_(generator=generator).log_().neg_()


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _logprob_dicts(
    logprobs: torch.Tensor,
    positions: list[int],
    token_ids: torch.Tensor,
    top_n: list[int],
) -> list[dict[int, Logprob]]:
    """One ``{token: Logprob}`` dict per entry of ``token_ids``.

    ``logprobs`` is [R, V]; entry s looks at row ``positions[s]`` and reports ``token_ids[s]``
    plus that row's top ``top_n[row]`` tokens. rank = 1 + number of tokens with a strictly
    greater logprob (so tied tokens share a rank).
    """
    device = logprobs.device
    identity = positions == list(range(logprobs.shape[0]))
    rows = logprobs if identity else logprobs[_index(positions, device)]
    chosen = rows.gather(1, token_ids[:, None])
    chosen_rank = (rows > chosen).sum(dim=-1) + 1
    chosen_lp = chosen.squeeze(1).tolist()
    chosen_rank_l = chosen_rank.tolist()
    token_l = token_ids.tolist()

    max_n = min(max(top_n, default=0), logprobs.shape[-1])
    if max_n > 0:
        top_vals, top_ids = logprobs.topk(max_n, dim=-1)
        # Every token strictly above a top-N value is itself among the top N, so ranks
        # within the top N come from an N x N comparison.
        top_ranks = (top_vals[:, None, :] > top_vals[:, :, None]).sum(dim=-1) + 1
        top_vals_l, top_ids_l, top_ranks_l = (
            top_vals.tolist(),
            top_ids.tolist(),
            top_ranks.tolist(),
        )

    dicts: list[dict[int, Logprob]] = []
    for s, tok in enumerate(token_l):
        d = {tok: Logprob(chosen_lp[s], chosen_rank_l[s])}
        row = positions[s]
        for j in range(min(top_n[row], max_n)):
            tid = top_ids_l[row][j]
            if tid not in d:
                d[tid] = Logprob(top_vals_l[row][j], top_ranks_l[row][j])
        dicts.append(d)
    return dicts


def _apply_token_bitmasks(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Forbid (-inf) the tokens each constrained row's grammar does not allow."""
    constrained = [i for i, r in enumerate(rows) if r.token_bitmask is not None]
    if not constrained:
        return
    from engine.structured_output import apply_token_bitmask

    masks = torch.stack([rows[i].token_bitmask for i in constrained])
    apply_token_bitmask(logits, masks, constrained)


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Add each row's ``logit_bias`` (ids outside the vocabulary are ignored)."""
    vocab = logits.shape[1]
    ri: list[int] = []
    ti: list[int] = []
    bias: list[float] = []
    for i, r in enumerate(rows):
        if r.params.logit_bias:
            for tok, b in r.params.logit_bias.items():
                if 0 <= tok < vocab:
                    ri.append(i)
                    ti.append(tok)
                    bias.append(b)
    if ri:
        device = logits.device
        values = torch.tensor(bias, dtype=logits.dtype, device=device)
        logits.index_put_((_index(ri, device), _index(ti, device)), values, accumulate=True)


def _apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Forbid stop tokens for rows that have not yet produced ``min_tokens`` outputs."""
    vocab = logits.shape[1]
    ri: list[int] = []
    ti: list[int] = []
    for i, r in enumerate(rows):
        p = r.params
        if len(r.output_token_ids) >= p.min_tokens:
            continue
        stops = set(p.stop_token_ids or ())
        if not p.ignore_eos:
            stops.update(r.eos_token_ids)
        for tok in stops:
            if 0 <= tok < vocab:
                ri.append(i)
                ti.append(tok)
    if ri:
        device = logits.device
        logits[_index(ri, device), _index(ti, device)] = float("-inf")


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Repetition, then frequency and presence penalties, for the rows that set any.

    Sparse: only the entries of tokens a row has seen are read and written (through a flat
    view, the fastest gather/scatter on CPU too), so the cost grows with the number of
    tokens, not with rows x vocabulary.
    """
    rep_rows = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    out_rows = [
        i
        for i, r in enumerate(rows)
        if r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0
    ]
    if not rep_rows and not out_rows:
        return
    device, dtype, vocab = logits.device, logits.dtype, logits.shape[1]
    work = logits if logits.is_contiguous() else logits.contiguous()
    flat = work.view(-1)

    def send(row: np.ndarray, tok: np.ndarray, per_row: list[float]) -> tuple:
        """Flat indices and each entry's parameter (per_row[row]) on the device, one copy."""
        table = np.asarray(per_row, dtype=np.float32)
        packed = torch.from_numpy(np.stack([row * vocab + tok, row])).to(device)
        return packed[0], torch.from_numpy(table).to(device=device, dtype=dtype)[packed[1]]

    if rep_rows:
        # Every token seen in the prompt or the output; duplicates read the same value and
        # write the same result, so each entry is penalized once.
        lists = [rows[i].prompt_token_ids for i in rep_rows]
        lists += [rows[i].output_token_ids for i in rep_rows]
        row, tok = _row_token_pairs(lists, rep_rows + rep_rows, vocab)
        idx, rep = send(row, tok, [r.params.repetition_penalty for r in rows])
        vals = flat.index_select(0, idx)
        flat.index_copy_(0, idx, torch.where(vals > 0, vals / rep, vals * rep))

    if out_rows:
        row, tok = _row_token_pairs([rows[i].output_token_ids for i in out_rows], out_rows, vocab)
        freq = [r.params.frequency_penalty for r in rows]
        if any(freq):
            # Once per occurrence: the count-weighted penalty.
            idx, f = send(row, tok, freq)
            flat.scatter_add_(0, idx, -f)
        pres = [r.params.presence_penalty for r in rows]
        if any(pres):
            idx, p = send(row, tok, pres)
            flat.index_copy_(0, idx, flat.index_select(0, idx) - p)

    if work is not logits:
        logits.copy_(work)


def _row_token_pairs(
    token_lists: list[list[int]], row_ids: list[int], vocab: int
) -> tuple[np.ndarray, np.ndarray]:
    """(row, token) arrays for every token of every list (list k belongs to row_ids[k]).

    The lists are joined in C (itertools + numpy: the per-token cost is reading a Python
    int); ids outside the vocabulary are dropped.
    """
    lengths = np.fromiter(map(len, token_lists), dtype=np.int64, count=len(token_lists))
    total = int(lengths.sum())
    tokens = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64, count=total)
    row = np.repeat(np.asarray(row_ids, dtype=np.int64), lengths)
    valid = (tokens >= 0) & (tokens < vocab)
    if not valid.all():
        tokens, row = tokens[valid], row[valid]
    return row, tokens


def _apply_temperature_and_filters(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks (masked logits become -inf).

    ``x`` holds the random rows only and may be modified in place.
    """
    device, vocab = x.device, x.shape[1]
    temps = [p.temperature for p in params]
    if any(t != 1.0 for t in temps):
        x = x.div_(torch.tensor(temps, dtype=x.dtype, device=device)[:, None])

    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    ps = [p.top_p for p in params]
    filtered = [j for j in range(len(params)) if ks[j] < vocab or ps[j] < 1.0]
    if filtered:
        threshold = _top_k_top_p_threshold(
            x if len(filtered) == len(params) else x[_index(filtered, device)],
            [ks[j] for j in filtered],
            [ps[j] for j in filtered],
        )
        if len(filtered) != len(params):
            full = torch.full((len(params), 1), float("-inf"), dtype=x.dtype, device=device)
            full[_index(filtered, device)] = threshold
            threshold = full
        x.masked_fill_(x < threshold, float("-inf"))

    min_ps = [p.min_p for p in params]
    if any(m > 0.0 for m in min_ps):
        # p_i >= min_p * p_max  <=>  x_i >= x_max + log(min_p); no softmax needed.
        log_min_p = torch.tensor(
            [math.log(m) if m > 0 else float("-inf") for m in min_ps],
            dtype=x.dtype,
            device=device,
        )
        threshold = x.max(dim=-1, keepdim=True).values + log_min_p[:, None]
        x.masked_fill_(x < threshold, float("-inf"))
    return x


def _top_k_top_p_threshold(x: torch.Tensor, ks: list[int], ps: list[float]) -> torch.Tensor:
    """Per-row logit threshold [R, 1] of top-k and top-p; tokens below it are masked.

    Every row here has a top-k (``k < V``) or a top-p (``p < 1``). Both keep a prefix of the
    descending order, so one sorted prefix serves both. When every top-p row also has a top-k
    (the usual ``top_k=50, top_p=0.95``), the largest k bounds the prefix and a partial
    ``topk`` replaces the full-vocabulary sort.
    """
    device, vocab = x.device, x.shape[1]
    if all(k < vocab for k in ks):
        sorted_vals = x.topk(max(ks), dim=-1).values
    else:
        sorted_vals = x.sort(dim=-1, descending=True).values
    width = sorted_vals.shape[1]
    k_t = _index([min(k, width) for k in ks], device)
    keep = k_t
    if any(p < 1.0 for p in ps):
        # Unnormalized probabilities; the top-k mass is the cumulative sum at k - 1. Tokens
        # past k need no masking: their mass-before is the whole top-k mass, never < p * it.
        # No row-wide sum is involved, so the result does not depend on the prefix width
        # (which depends on the rest of the batch).
        weights = (sorted_vals - sorted_vals[:, :1]).exp_()
        cum = weights.cumsum(dim=-1)
        top_k_mass = cum.gather(1, (k_t - 1)[:, None])
        # Keep token j when the mass strictly before it is < top_p: the smallest prefix whose
        # mass reaches top_p (the top token is always kept).
        mass_before = cum.sub_(weights)
        p_t = torch.tensor(ps, dtype=x.dtype, device=device)
        keep_p = (mass_before < p_t[:, None] * top_k_mass).sum(dim=-1)
        keep_p = torch.where(p_t >= 1.0, width, keep_p)  # no float drift for rows without top-p
        keep = torch.minimum(keep, keep_p).clamp_min_(1)
    return sorted_vals.gather(1, (keep - 1)[:, None])
