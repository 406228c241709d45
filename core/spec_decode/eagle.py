"""``method="eagle"`` / ``"eagle3"``: an EAGLE head drafts from the target's hidden states.

The head (``engine.spec_decode.eagle_heads``) has one decoder layer with its own paged KV
cache from the shared block pool (see ``engine.spec_decode.model_proposer``). Its position
``p`` combines token ``p + 1`` with the target's hidden state at ``p`` -- the final hidden state
(EAGLE) or ``fc`` over three layers' residual streams (EAGLE-3, captured with forward hooks,
also inside the target's CUDA graphs). Each target step is mirrored over the positions it
validated: the inputs are the step's tokens shifted by one, ending with the token just
sampled (or, for a prompt chunk, the next prompt token). The last position's output gives
draft 1; each decode step then feeds the head its own previous hidden state with the
previous draft.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.config import ConfigError
from engine.spec_decode.model_proposer import ModelProposer

_EAGLE3_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator")


def _text(hf_config: Any) -> Any:
    return getattr(hf_config, "text_config", None) or hf_config


def _head_config(path: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def _fc_shape(shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...] | None:
    return shapes.get("fc.weight")


class _StepModule(nn.Module):
    """One head step with the hidden-state input in a static buffer, so that the proposer's
    decode steps can be captured like a model: ``forward(ids, positions, metadata)`` returns
    ``[logits hidden | next hidden]``."""

    def __init__(self, head: nn.Module, hidden: torch.Tensor) -> None:
        super().__init__()
        self.head = head
        self.hidden_in = hidden

    def forward(self, ids, positions, metadata):
        out, nxt = self.head(ids, positions, metadata, self.hidden_in[: ids.shape[0]])
        return torch.cat([out, nxt], dim=-1)


class EagleProposer(ModelProposer):
    """EAGLE and EAGLE-3 heads; see the module docstring."""

    name = "eagle"

    @classmethod
    def supports(cls, config: Any, hf_config: Any) -> list[str]:
        """Reasons the head cannot serve this target (empty: it can)."""
        from engine.loader import resolve_model_path
        from engine.spec_decode.eagle_heads import aux_layer_ids, checkpoint_tensors

        method = config.speculative.method
        dummy = config.model.load_format == "dummy"
        try:
            path = resolve_model_path(
                config.speculative.model, download_dir=config.model.download_dir, weights=not dummy
            )
            head = _head_config(str(path))
            shapes = {} if dummy else checkpoint_tensors(Path(path))
        except Exception as e:
            return [f"the EAGLE head {config.speculative.model!r} cannot be read: {e}"]
        target = _text(hf_config)
        reasons: list[str] = []
        archs = set(getattr(head, "architectures", None) or [])
        h = int(head.hidden_size)
        target_h = int(target.hidden_size)
        fc = _fc_shape(shapes)
        if dummy:  # random weights: the architecture says which head it is
            fc = (h, 3 * target_h if archs & set(_EAGLE3_ARCHS) else 2 * h)
        if fc is None:
            reasons.append("the checkpoint has no fc.weight: not an EAGLE head")
        elif method == "eagle" and (archs & set(_EAGLE3_ARCHS) or fc[1] != 2 * h):
            reasons.append(
                f"method 'eagle' needs an EAGLE head (fc over 2 x {h} features); this "
                f"checkpoint's fc takes {fc[1]} ({', '.join(sorted(archs)) or 'no architecture'})"
                ": use method 'eagle3' for an EAGLE-3 head"
            )
        elif method == "eagle3" and fc[1] == 2 * h and not archs & set(_EAGLE3_ARCHS):
            reasons.append(
                "method 'eagle3' needs an EAGLE-3 head (fc over 3 target hidden states); this "
                "checkpoint is an EAGLE head: use method 'eagle'"
            )
        if method == "eagle" and h != target_h:
            reasons.append(f"the EAGLE head's hidden size {h} differs from the target's {target_h}")
        if method == "eagle3":
            head_target_h = int(getattr(head, "target_hidden_size", None) or h)
            if head_target_h != target_h:
                reasons.append(
                    f"the EAGLE-3 head reads {head_target_h}-wide target hidden states, the "
                    f"target's are {target_h}"
                )
            if getattr(config.model, "implementation", None) == "transformers":
                # AuxHiddenStates hooks the native decoder layers, which return (hidden,
                # residual); transformers' layers return the residual stream itself.
                reasons.append(
                    "EAGLE-3 reads the target's inner layer hidden states through the native "
                    "decoder layers, and this target runs through the transformers modeling "
                    "backend; use --model-impl auto (or native) where the architecture has a "
                    "native implementation, or method 'eagle'"
                )
            n = int(target.num_hidden_layers)
            ids = aux_layer_ids(head, n)
            if len(ids) != 3 or any(not 0 <= i < n for i in ids):
                reasons.append(
                    f"EAGLE-3 reads target layers {ids}; the target has {n} layers (each id "
                    f"must be in 0..{n - 1}, three of them)"
                )
        if int(head.vocab_size) != int(target.vocab_size):
            reasons.append(
                f"the head's vocabulary has {head.vocab_size} tokens, the target's "
                f"{target.vocab_size}: it must be trained for this target"
            )
        max_len = config.model.max_model_len
        head_len = getattr(head, "max_position_embeddings", None)
        if max_len is not None and head_len is not None and head_len < max_len:
            reasons.append(
                f"the head's context ({head_len} positions) is shorter than "
                f"max_model_len={max_len}; lower --max-model-len"
            )
        return reasons

    @classmethod
    def create(cls, config: Any, runner: Any) -> EagleProposer:
        return cls(config, runner)

    def __init__(self, config: Any, runner: Any) -> None:
        super().__init__(config, runner)
        from engine.layers.cpu_packed_linear import pack_linears
        from engine.loader import resolve_model_path
        from engine.loader.model_loader import resolve_dtype
        from engine.models.context import ModelContext
        from engine.spec_decode.eagle_heads import (
            AuxHiddenStates,
            Eagle3Head,
            EagleHead,
            aux_layer_ids,
            checkpoint_tensors,
            iter_checkpoint,
        )

        self.eagle3 = config.speculative.method == "eagle3"
        path = Path(
            resolve_model_path(
                config.speculative.model,
                download_dir=config.model.download_dir,
                weights=config.model.load_format != "dummy",
            )
        )
        head_cfg = _head_config(str(path))
        dtype = resolve_dtype(config.model, _text(config.model.hf_config))
        ctx = ModelContext(head_cfg, dtype, runner.kernels, runner.attn_backend_cls, self.device)
        target = runner.model
        dummy = config.model.load_format == "dummy"
        shapes = {} if dummy else checkpoint_tensors(path)
        with torch.device(self.device):
            if self.eagle3:
                self.model = Eagle3Head(ctx, target, own_embedding="embed_tokens.weight" in shapes)
            else:
                self.model = EagleHead(ctx, target, fc_bias="fc.bias" in shapes)
        if dummy:  # random weights, as the target's (benchmarks of the mechanism)
            from engine.loader.model_loader import init_dummy_weights

            init_dummy_weights(self.model, config.model.seed, config.model.dummy_init)
            if self.eagle3:
                self.model.use_first_tokens()
        else:
            loaded = self.model.load_weights(iter_checkpoint(path))
            missing = {n for n, _ in self.model.named_parameters()} - loaded
            if missing:
                raise ConfigError(
                    f"the EAGLE head checkpoint {path} lacks {', '.join(sorted(missing))}"
                )
        self.model.eval()
        pack_linears(self.model)
        self.hidden_size = int(head_cfg.hidden_size)
        self._aux = None
        if self.eagle3:
            decoder = target.model
            if not hasattr(decoder, "layers") or not hasattr(decoder, "embed_tokens"):
                raise ConfigError(
                    f"EAGLE-3 needs the target's layer hidden states; {type(target).__name__} "
                    "has no decoder layers to read them from"
                )
            n = len(decoder.layers)
            self._aux = AuxHiddenStates(decoder, aux_layer_ids(head_cfg, n))
        max_seqs = config.scheduler.max_num_seqs
        self._step_hidden = torch.zeros(
            (max_seqs, self.hidden_size), dtype=dtype, device=self.device
        )
        self._step = _StepModule(self.model, self._step_hidden)

    # ---- the target's hidden states ------------------------------------------------------
    @property
    def wants_aux(self) -> bool:
        """EAGLE-3 reads hidden states of inner target layers (hooks keep them)."""
        return self._aux is not None

    def take_aux(self) -> torch.Tensor:
        return self._aux.take()

    def _profile_hidden(self, hidden, aux):
        return self.model.combine(aux) if self.eagle3 else hidden

    # ---- hooks -------------------------------------------------------------------------------
    def _mirror_len(self, valid: int, proposing: bool) -> int:
        return valid

    def _mirror_inputs(self, scheduled, batch, hidden, sampling, new_tokens, plan):
        starts, lens, tables, valid, proposing = plan
        target_ids = batch.input_ids
        base = target_ids.shape[0]
        sample_of = {i: j for j, (i, _) in enumerate(sampling)}
        extra: list[int] = []  # next prompt tokens of chunks that do not sample
        index: list[int] = []
        rows: list[int] = []
        for i, s in enumerate(scheduled):
            row = batch.query_start_loc[i]
            n = valid[i]
            index.extend(range(row + 1, row + n))
            j = sample_of.get(i)
            if j is not None:
                index.append(base + j)
            else:
                request = s.request
                nxt = s.start + n
                p = len(request.prompt_token_ids)
                extra.append(
                    request.prompt_token_ids[nxt] if nxt < p else request.output_token_ids[nxt - p]
                )
                index.append(base + len(sampling) + len(extra) - 1)
            rows.extend(range(row, row + n))
        parts = [target_ids]
        if new_tokens is not None:
            parts.append(new_tokens)
        if extra:
            parts.append(torch.tensor(extra, dtype=torch.long, device=self.device))
        pool = torch.cat(parts) if len(parts) > 1 else target_ids
        ids = pool.index_select(0, torch.tensor(index, dtype=torch.long, device=self.device))
        sel = torch.tensor(rows, dtype=torch.long, device=self.device)
        if self.eagle3:
            h = self.model.combine(batch.aux_hidden.index_select(0, sel))
        else:
            h = hidden.index_select(0, sel)
        return ids, h

    def _forward(self, ids, positions, metadata, hidden):
        return self.model(ids, positions, metadata, hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden).float()

    def _step_module(self) -> torch.nn.Module:
        return self._step

    def _mirror_module(self, rows: int) -> torch.nn.Module:
        self._mirror_hidden = torch.zeros(
            (rows, self.hidden_size), dtype=self._step_hidden.dtype, device=self.device
        )
        return _StepModule(self.model, self._mirror_hidden)

    def _set_mirror_hidden(self, index: torch.Tensor, hidden: torch.Tensor | None) -> None:
        self._mirror_hidden.index_copy_(0, index, hidden.to(self._mirror_hidden.dtype))

    def _set_step_hidden(self, hidden_in: torch.Tensor | None) -> None:
        self._step_hidden[: hidden_in.shape[0]].copy_(hidden_in)

    def _split_step_output(self, out: torch.Tensor):
        return out[:, : self.hidden_size], out[:, self.hidden_size :]
