"""Model implementations and the registry mapping HF architecture names to them.

A model is an ``nn.Module`` built as ``Model(ctx: ModelContext)`` with ``forward(input_ids,
positions, attn_metadata) -> hidden``, ``compute_logits(hidden) -> float32 logits``,
``load_weights(weights) -> set of loaded parameter names`` and ``attention_layers()``.
"""

from engine.models.context import ModelContext
from engine.models.registry import ModelRegistry

__all__ = ["ModelContext", "ModelRegistry"]
