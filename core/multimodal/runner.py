"""The model runner's side of image inputs: image embeddings on the device, keyed by content
hash, and what one step needs from them.

For each scheduled chunk that reaches an image's placeholders, ``EncoderRunner`` makes sure the
image's embeddings are in its cache (running the model's vision encoder, all of a step's
missing images in one batch, inside that step), then hands the model the rows of the step's
flat token batch that are placeholders and the embeddings for them: a chunk that covers only
part of an image takes the matching slice, and the rest waits in the cache for the next chunk.
The scheduler's ``EncoderCacheManager`` decides what may be cached; its evictions arrive as
``SchedulerOutput.free_encoder_hashes`` and are dropped here before the step runs, so both sides
hold the same entries. For models whose image tokens attend bidirectionally it also gives each
chunk's image spans to the attention metadata.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from engine.multimodal.inputs import ImageInputSpec


class EncoderRunner:
    """Encodes images and keeps their embeddings (``[tokens_per_image, embed_dim]`` per hash).

    ``num_encoded`` counts images run through the encoder (a cache hit is not counted).
    """

    def __init__(self, model: Any, device: torch.device, spec: ImageInputSpec) -> None:
        self.model = model
        self.device = device
        self.spec = spec
        self.cache: dict[str, torch.Tensor] = {}
        self.num_encoded = 0

    @property
    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.cache.values())

    def free(self, identifiers: list[str]) -> None:
        """Drop evicted entries (the scheduler's ``free_encoder_hashes``)."""
        for identifier in identifiers:
            self.cache.pop(identifier, None)

    @staticmethod
    def _overlapping(scheduled: list[Any]):
        """``(index in step, chunk start, chunk end, feature)`` for every image a chunk
        reaches."""
        for i, s in enumerate(scheduled):
            request = s.request
            features = request.mm_features
            if not features or s.start >= len(request.prompt_token_ids):
                continue
            end = s.start + s.num_new_tokens
            for f in features:
                if f.offset >= end:
                    break
                if f.end > s.start:
                    yield i, s.start, end, f

    def spans_any(self, scheduled: list[Any]) -> bool:
        """Whether any chunk of the step reaches an image (such a step is never replayed
        from a captured decode graph)."""
        return next(iter(self._overlapping(scheduled)), None) is not None

    def spans(self, scheduled: list[Any]) -> list[list[tuple[int, int]]] | None:
        """Per scheduled request, the position spans of its chunk's images, for bidirectional
        attention (None when the model has none or the step reaches no image)."""
        if not self.spec.bidirectional:
            return None
        spans: list[list[tuple[int, int]]] | None = None
        for i, _, _, f in self._overlapping(scheduled):
            if spans is None:
                spans = [[] for _ in scheduled]
            spans[i].append((f.offset, f.end))
        return spans

    def embeddings(
        self, scheduled: list[Any], query_start_loc: list[int] | np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Encode the step's missing images, then ``(rows, embeddings)``: the placeholder rows
        of the flat batch (request ``i``'s tokens start at ``query_start_loc[i]``) and their
        embeddings. None when no chunk reaches an image."""
        hits = list(self._overlapping(scheduled))
        if not hits:
            return None
        missing: dict[str, Any] = {}
        for _, _, _, f in hits:
            if f.identifier not in self.cache:
                missing.setdefault(f.identifier, f)
        if missing:
            self._encode(list(missing.values()))
        rows: list[np.ndarray] = []
        chunks: list[torch.Tensor] = []
        for i, start, end, f in hits:
            lo, hi = max(f.offset, start), min(f.end, end)
            base = int(query_start_loc[i]) - start
            rows.append(np.arange(base + lo, base + hi, dtype=np.int64))
            chunks.append(self.cache[f.identifier][lo - f.offset : hi - f.offset])
        index = torch.from_numpy(np.concatenate(rows)).to(self.device)
        return index, torch.cat(chunks)

    def _encode(self, features: list[Any]) -> None:
        pixels = np.stack([np.asarray(f.pixel_values, dtype=np.float32) for f in features])
        out = self.model.encode_images(torch.from_numpy(pixels).to(self.device))
        for f, embeds in zip(features, out, strict=True):
            self.cache[f.identifier] = embeds.clone()  # not a view that keeps the batch alive
        self.num_encoded += len(features)

    def profile(self, max_tokens_per_step: int) -> None:
        """Run the encoder on as many dummy images as one step may encode (memory profiling)."""
        n = max(1, max_tokens_per_step // self.spec.tokens_per_image)
        shape = self.model.image_input_shape()
        self.model.encode_images(torch.zeros((n, *shape), device=self.device))
