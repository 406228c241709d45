"""What a draft model and an EAGLE head share: a small model with its own paged KV cache that
follows every target step, then drafts token by token.

**KV cache.** The proposer's attention layers keep their own cache tensors, sized into the
same block budget (``ModelRunner.bytes_per_block`` counts them), and use the *target's* block
tables: position ``p`` of a request lives in the same slot in both caches, so the scheduler's
allocation, preemption, prefix caching and trimming need nothing new. The invariant is simple:
**whenever the target validates positions, the proposer computes its own KV for the same
positions in the same step** (``_mirror``) -- a prefill chunk, a decode, or the accepted
prefix of a verification. A block the target hashes into the prefix cache therefore holds the
proposer's KV too, and a later prefix hit reuses both. Drafting writes past the validated
positions, into look-ahead slots the scheduler reserved (``num_to_propose``); those are
rewritten before anything reads them.

**Steps.** After the target's step is sampled (and verified), ``run``:

1. mirrors the step: one varlen forward over the newly validated positions of every
   scheduled request (plus, for a draft model, the token just sampled, for requests that
   propose), giving the first draft token of each proposing request;
2. runs ``k - 1`` single-token decode steps over the proposing requests (replayed from the
   proposer's own CUDA graphs where the platform has them).

A draft token is chosen from the proposer's logits after the same processing the target's
sampling applies (penalties counting the drafts before it, ``logit_bias``, ``min_tokens``,
temperature, top-k/top-p/min-p): greedy rows take the argmax, random rows (without structured
outputs) sample it and keep the distribution ``q`` for the rejection sampler, which then
preserves the target distribution exactly (``engine.spec_decode.rejection``). Structured rows
draft greedily (a point mass): the grammar's masks for future states are not known here, and
the drafts are checked against the grammar afterwards.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import numpy as np
import torch

from engine.config import ConfigError
from engine.sampler import SamplingRow, apply_logits_processors, exponential_noise
from engine.spec_decode.rejection import target_probs

logger = logging.getLogger(__name__)


class ModelProposer:
    """Base of the device-side proposers (``uses_model = True``); see the module docstring.

    Subclasses build ``self.model`` (with ``attention_layers()``) in ``__init__`` and
    implement ``_mirror_inputs``, ``_forward`` and ``_logits``.
    """

    uses_model = True
    name = "model"

    def __init__(self, config: Any, runner: Any) -> None:
        spec = config.speculative
        self.config = config
        self.runner = runner
        self.k = int(spec.num_speculative_tokens)
        self.device = runner.device
        self.model: Any = None
        self.graphs: Any = None  # DecodeGraphs over ``_step_module`` once captured
        self.mirror_graphs: Any = None  # the mirror of decode/verification steps, padded
        # Per request: the draft distribution of each proposed token (random rows only).
        self._probs: weakref.WeakKeyDictionary[Any, torch.Tensor] = weakref.WeakKeyDictionary()
        max_seqs = config.scheduler.max_num_seqs
        # The previous draft token of each proposing row: the decode steps' input.
        self._draft_buf = torch.zeros(max_seqs, dtype=torch.int64, device=self.device)

    # ---- what the runner asks --------------------------------------------------------------
    def attention_layers(self) -> list[Any]:
        """The proposer's paged-attention layers (their caches are allocated by the runner)."""
        return list(self.model.attention_layers())

    def weights_bytes(self) -> int:
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        return sum(t.numel() * t.element_size() for t in tensors)

    def take_draft_probs(self, request: Any, num: int) -> torch.Tensor | None:
        """The draft distributions ``[num, V]`` of the drafts a request verifies now (None:
        they were drafted greedily, a point mass)."""
        q = self._probs.pop(request, None)
        if q is None or q.shape[0] < num:
            return None
        return q[:num]

    def capture_graphs(self, eager: bool = False) -> float:
        """Capture the draft decode steps' graphs and the mirror of steps made of decodes
        and verifications (every request padded to ``_mirror_query_len`` tokens, as the
        target's verify graphs), for batches up to the largest that speculates."""
        from engine.cuda_graphs import DecodeGraphs

        runner = self.runner
        spec = self.config.speculative
        max_seqs = min(self.config.scheduler.max_num_seqs, int(spec.disable_by_batch_size))
        groups = runner._groups if runner._groups is not None else runner.kv_cache_groups()
        args = (len(groups), runner.block_size, runner.max_model_len, max_seqs, self.device)
        self.graphs = DecodeGraphs(self._step_module(), *args, self._draft_buf, eager=eager)
        seconds = self.graphs.capture()
        q = self._mirror_query_len()
        self._mirror_pool = torch.zeros(max_seqs * q, dtype=torch.int64, device=self.device)
        self.mirror_graphs = DecodeGraphs(
            self._mirror_module(max_seqs * q), *args, self._mirror_pool, query_len=q, eager=eager
        )
        return seconds + self.mirror_graphs.capture()

    def release_graphs(self) -> None:
        self.graphs = self.mirror_graphs = None

    def _mirror_query_len(self) -> int:
        """The most tokens one request's mirror holds in a decode or verification step."""
        return self.k + 1

    def _mirror_module(self, rows: int) -> torch.nn.Module:
        """What the mirror graphs run: the step module, fed ``rows`` hidden states."""
        return self._step_module()

    def _mirror_forward(self, starts, lens, tables, ids, hidden, decodes: bool):
        """The mirror forward: replayed from the mirror graphs when every request decodes or
        verifies (``decodes``) and the batch fits, else eager. Returns the output hidden
        states, the next-step ones, and the row of each request's last token."""
        graphs = self.mirror_graphs
        n = len(starts)
        q = graphs.query_len if graphs is not None else 0
        if decodes and q and graphs.padded_size(n) is not None and max(lens) <= q:
            dest = [i * q + t for i in range(n) for t in range(lens[i])]
            index = torch.tensor(dest, dtype=torch.long, device=self.device)
            self._mirror_pool.index_copy_(0, index, ids)
            self._set_mirror_hidden(index, hidden)
            sources = np.full((n, q), -1, dtype=np.int64)
            for i, c in enumerate(lens):
                sources[i, :c] = np.arange(i * q, i * q + c)
            out = graphs.replay(starts, lens, tables, np.zeros((n, q), dtype=np.int64), sources)
            out_hidden, next_hidden = self._split_step_output(out)
            return out_hidden, next_hidden, [i * q + c - 1 for i, c in enumerate(lens)]
        positions, metadata, qsl = self.runner.layout(starts, lens, tables)
        out_hidden, next_hidden = self._forward(ids, positions, metadata, hidden)
        return out_hidden, next_hidden, [int(qsl[i + 1]) - 1 for i in range(n)]

    def _set_mirror_hidden(self, index: torch.Tensor, hidden: torch.Tensor | None) -> None:
        return None

    wants_aux = False  # EAGLE-3 reads inner target layers' hidden states

    def profile(self, ids, positions, metadata, hidden, aux) -> None:
        """The proposer's forward over a profiling batch (``ModelRunner._profile_run``
        sizes the KV cache from the peak memory of target and proposer together)."""
        out, _ = self._forward(ids, positions, metadata, self._profile_hidden(hidden, aux))
        self._logits(out[: min(out.shape[0], self.config.scheduler.max_num_seqs)])

    def _profile_hidden(self, hidden, aux):
        return None

    # ---- the step --------------------------------------------------------------------------
    def run(
        self,
        scheduled: list[Any],
        batch: Any,
        hidden: torch.Tensor,
        sampling: list[tuple[int, Any]],
        rows: dict[str, Any],
        new_tokens: torch.Tensor | None,
        accepted: list[list[int]] | None,
    ) -> tuple[list[Any], torch.Tensor] | None:
        """Mirror the target step and draft. ``sampling`` are the (index, entry) pairs that
        sampled, ``new_tokens`` their newest token on the device (in that order),
        ``accepted`` the tokens each kept (host; None when each sampled one). Returns the
        proposing entries and their drafts ``[n, max(num_to_propose)]`` on the device (a
        row's tail past its own ``num_to_propose`` is padding), or None when none
        proposes."""
        plan = self._plan(scheduled, sampling, accepted)
        starts, lens, tables, valid, proposing = plan
        ids, hid = self._mirror_inputs(scheduled, batch, hidden, sampling, new_tokens, plan)
        decodes = all(s.num_known_tokens == 1 for s in scheduled)  # no prompt chunk
        out_hidden, next_hidden, last_rows = self._mirror_forward(
            starts, lens, tables, ids, hid, decodes
        )
        if not proposing:
            return None
        # Each proposing request's last mirrored row gives its first draft.
        last = torch.tensor(
            [last_rows[i] for i, _, _ in proposing], dtype=torch.long, device=self.device
        )
        h = out_hidden.index_select(0, last)
        nh = next_hidden.index_select(0, last) if next_hidden is not None else None
        entries = [scheduled[i] for i, _, _ in proposing]
        counts = [c for _, _, c in proposing]
        srows = [rows[e.request.request_id] for e in entries]
        n, width = len(entries), max(counts)
        gained = self._gained(entries, sampling, new_tokens, accepted, srows)
        # Host copies of the drafts so far, only where penalties or min_tokens read them.
        prev: list[list[int]] | None = [[] for _ in entries] if gained is not None else None
        drafts = torch.zeros((n, width), dtype=torch.int64, device=self.device)
        probs: list[list[torch.Tensor | None]] = [[None] * width for _ in entries]
        live = list(range(n))
        last_pos = [starts[i] + lens[i] - 1 for i, _, _ in proposing]
        for j in range(width):
            if j:
                live = [r for r in live if counts[r] > j]
                if not live:
                    break
                index = torch.tensor(live, dtype=torch.long, device=self.device)
                self._draft_buf[: len(live)].copy_(drafts[index, j - 1])
                if prev is not None:
                    column = drafts[:, j - 1].tolist()
                    for r in live:
                        prev[r].append(column[r])
                h, nh_live = self._decode_step(
                    [last_pos[r] + j for r in live],
                    [entries[r].block_ids for r in live],
                    nh.index_select(0, index) if nh is not None else None,
                )
                if nh is not None:
                    nh = nh.index_copy(0, index, nh_live)
            else:
                index = None
            chosen, q = self._choose(
                h,
                [srows[r] for r in live],
                [gained[r] for r in live] if gained is not None else None,
                [prev[r] for r in live] if prev is not None else None,
            )
            if index is None:
                drafts[:, 0] = chosen
            else:
                drafts[index, j] = chosen
            if q is not None:
                for k, r in enumerate(live):
                    probs[r][j] = q[k]
        self._keep_probs(entries, counts, srows, probs)
        return entries, drafts

    # ---- helpers ---------------------------------------------------------------------------
    def _plan(self, scheduled, sampling, accepted):
        """The mirror batch: per scheduled request its start, token count and tables, the
        positions the target validated, and the proposing requests as (index, sampling
        index, how many drafts)."""
        sample_of = {i: j for j, (i, _) in enumerate(sampling)}
        starts, lens, tables, valid_of, proposing = [], [], [], [], []
        for i, s in enumerate(scheduled):
            j = sample_of.get(i)
            valid = s.num_new_tokens
            if s.spec_token_ids and j is not None and accepted is not None:
                valid = s.num_known_tokens + len(accepted[j]) - 1
            propose = s.num_to_propose if j is not None else 0
            starts.append(s.start)
            lens.append(self._mirror_len(valid, propose > 0))
            tables.append(s.block_ids)
            valid_of.append(valid)
            if propose:
                proposing.append((i, j, propose))
        return starts, lens, tables, valid_of, proposing

    def _mirror_len(self, valid: int, proposing: bool) -> int:
        raise NotImplementedError

    def _gained(self, entries, sampling, new_tokens, accepted, rows) -> list[list[int]] | None:
        """The tokens each proposing request gained this step (host lists), which the draft
        steps' penalties and ``min_tokens`` count as outputs; None when no row reads them."""
        if not any(r.params.reads_output_tokens for r in rows):
            return None
        if accepted is not None:
            by_id = {s.request.request_id: t for (_, s), t in zip(sampling, accepted, strict=True)}
            return [list(by_id[e.request.request_id]) for e in entries]
        host = new_tokens.tolist()
        by_id = {s.request.request_id: host[j] for j, (_, s) in enumerate(sampling)}
        return [[by_id[e.request.request_id]] for e in entries]

    def _choose(self, hidden, rows, gained, prev):
        """Draft tokens ``[n]`` (target ids) from the proposer's hidden states, and for
        random rows the distributions they were drawn from, over the target vocabulary
        (None when every row is greedy)."""
        logits = self._logits(hidden)
        drows = [
            SamplingRow(
                params=r.params,
                prompt_token_ids=r.prompt_token_ids,
                output_token_ids=(
                    list(r.output_token_ids) + gained[k] + prev[k]
                    if gained is not None and r.params.reads_output_tokens
                    else r.output_token_ids
                ),
                generators=r.generators[:1],
                eos_token_ids=r.eos_token_ids,
            )
            for k, r in enumerate(rows)
        ]
        random_rows = [
            i
            for i, r in enumerate(drows)
            if not r.params.is_greedy and r.params.structured_outputs is None
        ]
        if not random_rows:
            apply_logits_processors(logits, drows)
            return logits.argmax(dim=-1), None
        out = torch.empty(len(drows), dtype=torch.int64, device=self.device)
        chosen = set(random_rows)
        greedy = [i for i in range(len(drows)) if i not in chosen]
        if greedy:
            g = torch.tensor(greedy, dtype=torch.long, device=self.device)
            x = logits[g]
            apply_logits_processors(x, [drows[i] for i in greedy])
            out[g] = x.argmax(dim=-1)
        r_idx = torch.tensor(random_rows, dtype=torch.long, device=self.device)
        rrows = [drows[i] for i in random_rows]
        q = target_probs(logits[r_idx], rrows)
        noise = exponential_noise(tuple(q.shape), [r.generators[0] for r in rrows], self.device)
        out[r_idx] = (q / noise).argmax(dim=-1)
        probs: list[torch.Tensor | None] = [None] * len(drows)
        for k, i in enumerate(random_rows):
            probs[i] = q[k]
        return out, probs

    def _keep_probs(self, entries, counts, rows, probs) -> None:
        """Keep each random row's draft distributions for its verification."""
        for r, (e, c) in enumerate(zip(entries, counts, strict=True)):
            qs = probs[r][:c]
            if all(q is not None for q in qs):
                self._probs[e.request] = torch.stack(qs)
            else:
                self._probs.pop(e.request, None)

    def _decode_step(self, positions, tables, hidden_in):
        """One single-token forward of the proposer over the proposing rows, whose input
        ids are ``_draft_buf[:n]``. Returns the hidden states for the logits and (EAGLE) the
        hidden states the next step is fed."""
        n = len(positions)
        self._set_step_hidden(hidden_in)
        out = None
        if self.graphs is not None:
            out = self.graphs.replay(
                positions,
                [1] * n,
                tables,
                np.zeros((n, 1), dtype=np.int64),
                np.arange(n, dtype=np.int64)[:, None],
            )
        if out is None:
            pos, metadata, _ = self.runner.layout(positions, [1] * n, tables)
            out = self._step_module()(self._draft_buf[:n], pos, metadata)
        return self._split_step_output(out)

    # Hooks, with the defaults of a plain draft model.
    def _set_step_hidden(self, hidden_in: torch.Tensor | None) -> None:
        return None

    def _split_step_output(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return out, None

    def _step_module(self) -> torch.nn.Module:
        return self.model

    def _mirror_inputs(self, scheduled, batch, hidden, sampling, new_tokens, plan):
        raise NotImplementedError

    def _forward(self, ids, positions, metadata, hidden):
        raise NotImplementedError

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def check_windows(layers: list[Any], groups: list[int | None], what: str) -> None:
    """A proposer layer's sliding window must be one of the target's KV-cache groups."""
    for layer in layers:
        if layer.sliding_window not in groups:
            raise ConfigError(
                f"the {what} has a layer with sliding window {layer.sliding_window}, which "
                "no target layer has; its layers must use the target's KV-cache groups"
            )
