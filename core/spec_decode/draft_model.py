"""``method="draft_model"``: a smaller model of the same tokenizer drafts the next tokens.

The draft model is any causal LM the model registry serves, loaded in the target's dtype on
the target's device. Its KV cache comes from the same block pool (see
``engine.spec_decode.model_proposer``): each of its attention layers gets its own cache
tensor per block id, sized into the same memory budget, and reads the target's block
tables. It mirrors every target step over the same positions and tokens; a request that
proposes also feeds it the token the target just sampled, whose logits give draft 1, and
``k - 1`` decode steps give the rest.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.config import ConfigError, ModelConfig
from engine.spec_decode.model_proposer import ModelProposer


def _text(hf_config: Any) -> Any:
    return getattr(hf_config, "text_config", None) or hf_config


def draft_model_config(config: Any) -> ModelConfig:
    """The ``ModelConfig`` of the draft: the target's dtype, load format and seed."""
    return ModelConfig(
        model=config.speculative.model,
        download_dir=config.model.download_dir,
        dtype=config.model.dtype,
        load_format=config.model.load_format,
        model_loader_extra_config=dict(config.model.model_loader_extra_config),
        seed=config.model.seed,
        max_model_len=config.model.max_model_len,
    )


class DraftModelProposer(ModelProposer):
    """A draft model proposer; see the module docstring."""

    name = "draft_model"

    @classmethod
    def supports(cls, config: Any, hf_config: Any) -> list[str]:
        """Reasons the draft model cannot serve with this target (empty: it can)."""
        from engine.loader import load_hf_config
        from engine.models.registry import ModelRegistry

        reasons: list[str] = []
        try:
            draft_cfg = load_hf_config(draft_model_config(config), ModelRegistry())
        except Exception as e:  # ModelLoadError, or transformers' own
            return [f"the draft model {config.speculative.model!r} cannot be read: {e}"]
        target, draft = _text(hf_config), _text(draft_cfg)
        if int(draft.vocab_size) != int(target.vocab_size):
            reasons.append(
                f"the draft model's vocabulary has {draft.vocab_size} tokens, the target's "
                f"{target.vocab_size}: a draft model must share the target's tokenizer"
            )
        max_len = config.model.max_model_len
        draft_len = getattr(draft, "max_position_embeddings", None)
        if max_len is not None and draft_len is not None and draft_len < max_len:
            reasons.append(
                f"the draft model's context ({draft_len} positions) is shorter than "
                f"max_model_len={max_len}; lower --max-model-len"
            )
        return reasons

    @classmethod
    def create(cls, config: Any, runner: Any) -> DraftModelProposer:
        return cls(config, runner)

    def __init__(self, config: Any, runner: Any) -> None:
        super().__init__(config, runner)
        from engine.layers.cpu_packed_linear import pack_linears
        from engine.layers.embedding import VocabParallelEmbedding
        from engine.loader import load_model
        from engine.models.registry import ModelRegistry

        model_config = draft_model_config(config)
        registry = runner.model_registry or ModelRegistry.with_plugins(runner.plugins)
        self.model = load_model(
            model_config, runner.kernels, runner.attn_backend_cls, self.device, registry
        )
        vocab = int(_text(model_config.hf_config).vocab_size)
        if vocab != runner.vocab_size:
            raise ConfigError(
                f"the draft model's vocabulary has {vocab} tokens, the target's "
                f"{runner.vocab_size}: a draft model must share the target's tokenizer"
            )
        embeddings = tuple(
            m.weight for m in self.model.modules() if isinstance(m, VocabParallelEmbedding)
        )
        pack_linears(self.model, shared_weights=embeddings)

    # ---- hooks -------------------------------------------------------------------------------
    def _mirror_len(self, valid: int, proposing: bool) -> int:
        # The validated positions, then the token just sampled (its logits give draft 1).
        return valid + (1 if proposing else 0)

    def _mirror_inputs(self, scheduled, batch, hidden, sampling, new_tokens, plan):
        starts, lens, tables, valid, proposing = plan
        target_ids = batch.input_ids
        pool = target_ids if new_tokens is None else torch.cat([target_ids, new_tokens])
        base = target_ids.shape[0]
        sample_of = {i: j for i, j, _ in proposing}
        index: list[int] = []
        for i in range(len(scheduled)):
            row = batch.query_start_loc[i]
            index.extend(range(row, row + valid[i]))
            if i in sample_of:
                index.append(base + sample_of[i])
        ids = pool.index_select(0, torch.tensor(index, dtype=torch.long, device=self.device))
        return ids, None

    def _forward(self, ids, positions, metadata, hidden):
        return self.model(ids, positions, metadata), None

    def _mirror_query_len(self) -> int:
        return self.k + 2  # the verified tokens, then the one just sampled

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)
