"""What a request carries for its images, and what a multimodal model declares about them.

Everything here is plain data (ints, strings, numpy arrays), so a request's images cross a
process boundary (the front end preprocesses, the engine core encodes, as in vLLM V1) with any
encoding that carries bytes; nothing holds a live tensor or a device handle.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class ImageInputSpec:
    """What a multimodal model tells the engine about its image inputs.

    ``placeholder_token_id``: the token the processor repeats where an image's embeddings go
    (Gemma 3's ``<image_soft_token>``); ``tokens_per_image``: how many of them (and embeddings)
    one image takes; ``embed_dim``: the width of an embedding (the text model's hidden size);
    ``bidirectional``: the placeholder tokens of one image attend to each other in both
    directions (Gemma 3, PaliGemma: a prefix-LM mask over each image), so one image's tokens
    must be computed in one step; ``pixel_shape``: one image's processed pixel array shape.
    """

    placeholder_token_id: int
    tokens_per_image: int
    embed_dim: int
    bidirectional: bool = False
    pixel_shape: tuple[int, ...] | None = None  # [C, H, W] of one image's pixel values


@dataclass
class MultiModalFeature:
    """One image of a request: its processed pixels and the placeholder tokens they replace.

    ``identifier`` is the content hash of the processed pixels (``hash_pixel_values``): equal
    hashes mean equal embeddings, so it keys the encoder cache and the prefix cache (a block
    holding part of an image hashes with it). ``offset`` is the index in the prompt's token ids
    of the first placeholder token and ``length`` the number of placeholders (embeddings).
    ``pixel_values`` is the processor's float32 ``[C, H, W]`` array.
    """

    identifier: str
    offset: int
    length: int
    pixel_values: np.ndarray
    modality: str = "image"

    @property
    def end(self) -> int:
        """One past the last placeholder token."""
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        """Whether any placeholder lies in token positions ``start .. end - 1``."""
        return self.offset < end and start < self.end


def hash_pixel_values(pixel_values: np.ndarray) -> str:
    """SHA-256 (hex) of a processed image: its dtype, shape and bytes."""
    array = np.ascontiguousarray(pixel_values)
    h = hashlib.sha256(b"engine/image/v1\x00")
    h.update(f"{array.dtype.str}{array.shape}".encode())
    h.update(array.tobytes())
    return h.hexdigest()


def check_features(
    features: Any, prompt_token_ids: list[int], spec: ImageInputSpec | None
) -> list[MultiModalFeature]:
    """Validate a request's features against its prompt and the model: sorted, disjoint,
    inside the prompt, each covering ``tokens_per_image`` placeholder tokens. Raises
    ``ValueError`` naming the problem; returns them sorted by offset."""
    features = sorted(features or (), key=lambda f: f.offset)
    if not features:
        return []
    if spec is None:
        raise ValueError("this model takes no image inputs")
    previous_end = 0
    for i, f in enumerate(features):
        if not isinstance(f, MultiModalFeature):
            raise ValueError(f"image {i} is a {type(f).__name__}, not a MultiModalFeature")
        if f.length != spec.tokens_per_image:
            raise ValueError(
                f"image {i} covers {f.length} placeholder tokens; this model takes "
                f"{spec.tokens_per_image} per image"
            )
        if f.offset < previous_end or f.end > len(prompt_token_ids):
            raise ValueError(
                f"image {i}'s placeholder tokens {f.offset}..{f.end - 1} overlap another image "
                f"or lie outside the prompt of {len(prompt_token_ids)} tokens"
            )
        pixels = getattr(f, "pixel_values", None)
        shape = tuple(getattr(pixels, "shape", ()))
        if spec.pixel_shape is not None and shape != tuple(spec.pixel_shape):
            raise ValueError(
                f"image {i} has pixel values of shape {shape}; this model takes "
                f"{tuple(spec.pixel_shape)} (preprocess it with the model's processor)"
            )
        run = prompt_token_ids[f.offset : f.end]
        if any(t != spec.placeholder_token_id for t in run):
            raise ValueError(
                f"image {i}: prompt tokens {f.offset}..{f.end - 1} are not all the image "
                f"placeholder token {spec.placeholder_token_id}"
            )
        previous_end = f.end
    return features
