"""Attention backends: the interface, the registry/selector and the torch reference backend."""

from engine.attention_backends.interface import (
    AttentionBackend,
    AttentionMetadata,
    AttentionSpec,
    BatchLayout,
)

__all__ = ["AttentionBackend", "AttentionMetadata", "AttentionSpec", "BatchLayout"]
