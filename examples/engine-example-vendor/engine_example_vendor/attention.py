"""The ``example`` attention backend: the core's torch reference backend behind a vendor name,
with narrower declared limits (to show how ``supports`` reasons surface)."""

from __future__ import annotations

from typing import ClassVar

from engine.attention_backends.interface import AttentionBackend
from engine.attention_backends.torch_ref import TorchReferenceBackend


class ExampleAttentionBackend(AttentionBackend):
    """Delegates to ``TorchReferenceBackend``; a real vendor would call its own kernels."""

    name: ClassVar[str] = "example"
    device_types: ClassVar[tuple[str, ...]] = ("cpu",)
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")
    supported_block_sizes: ClassVar[tuple[int, ...] | None] = (8, 16, 32)
    supports_sliding_window: ClassVar[bool] = TorchReferenceBackend.supports_sliding_window
    supports_logit_softcap: ClassVar[bool] = TorchReferenceBackend.supports_logit_softcap

    kv_cache_shape = TorchReferenceBackend.kv_cache_shape
    build_metadata = TorchReferenceBackend.build_metadata

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._reference = TorchReferenceBackend(*args, **kwargs)

    def forward(self, query, key, value, kv_cache, metadata):
        return self._reference.forward(query, key, value, kv_cache, metadata)
