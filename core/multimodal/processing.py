"""Turning a prompt with images into token ids and ``MultiModalFeature``s, with the model's own
Hugging Face processor (``AutoProcessor.from_pretrained(model_dir)``: its
``preprocessor_config.json`` / ``processor_config.json``).

The prompt names each image with the model's image placeholder (Gemma 3: ``<start_of_image>``,
which its chat template writes for an image part). The processor resizes and normalises the
images and expands each placeholder into the model's image token sequence (Gemma 3:
``\\n\\n<start_of_image>`` + 256 ``<image_soft_token>`` + ``<end_of_image>\\n\\n``); each run of
placeholder tokens in the result becomes one feature, paired in order with its pixel values,
its content hash computed from them. This is front-end work (CPU, numpy out): the engine core
gets plain arrays and runs the encoder.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from engine.multimodal.inputs import ImageInputSpec, MultiModalFeature, hash_pixel_values

logger = logging.getLogger(__name__)


class MultiModalProcessor:
    """The model's processor, bound to the engine's tokenizer and image spec.

    ``image_placeholder`` is the text a prompt writes where an image goes.
    """

    def __init__(self, processor: Any, spec: ImageInputSpec) -> None:
        self.processor = processor
        self.spec = spec
        placeholder = getattr(processor, "image_token", None) or getattr(
            processor, "boi_token", None
        )
        if not placeholder:
            raise ValueError(
                f"{type(processor).__name__} names no image placeholder (image_token); "
                "this model's image inputs are not supported"
            )
        self.image_placeholder: str = placeholder

    @classmethod
    def from_model_dir(
        cls, model_dir: str | Path, tokenizer: Any, spec: ImageInputSpec
    ) -> MultiModalProcessor:
        """Load ``AutoProcessor`` from the model directory (offline), with the engine's
        tokenizer. Raises ``ValueError`` saying what is missing."""
        from transformers import AutoProcessor

        kwargs = {"tokenizer": tokenizer} if tokenizer is not None else {}
        try:
            processor = AutoProcessor.from_pretrained(
                str(model_dir), local_files_only=True, **kwargs
            )
        except Exception as e:  # noqa: BLE001 - transformers raises many types here
            raise ValueError(
                f"cannot load the image processor of {model_dir} ({type(e).__name__}: {e}); "
                "it needs preprocessor_config.json / processor_config.json, or serve the model "
                'text-only with limit_mm_per_prompt={"image": 0}'
            ) from None
        if not hasattr(processor, "image_processor"):
            raise ValueError(
                f"{model_dir} has a {type(processor).__name__}, not a processor with an image "
                'processor; serve the model text-only with limit_mm_per_prompt={"image": 0}'
            )
        return cls(processor, spec)

    def process(
        self, prompt: str, images: list[Any], add_special_tokens: bool = True
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """Token ids of ``prompt`` with its images expanded, and one feature per image token
        run. Raises ``ValueError`` when the placeholders and images do not match."""
        placeholder = self.image_placeholder
        found = prompt.count(placeholder)
        if found != len(images):
            raise ValueError(
                f"the prompt names {found} image(s) with {placeholder!r} but {len(images)} "
                f"image(s) were given; put one {placeholder!r} where each image goes"
            )
        if not images:
            out = self.processor.tokenizer(prompt, add_special_tokens=add_special_tokens)
            return list(out["input_ids"]), []
        out = self.processor(
            text=[prompt],
            images=[list(images)],
            add_special_tokens=add_special_tokens,
            return_tensors="np",
        )
        ids = [int(t) for t in out["input_ids"][0]]
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        runs = placeholder_runs(ids, self.spec.placeholder_token_id)
        if len(runs) != len(pixels):
            raise ValueError(
                f"the processor produced {len(runs)} image token runs for {len(pixels)} "
                "processed images; the prompt must not contain the image token itself"
            )
        features = [
            MultiModalFeature(
                identifier=hash_pixel_values(p), offset=start, length=length, pixel_values=p
            )
            for (start, length), p in zip(runs, pixels, strict=True)
        ]
        return ids, features


def placeholder_runs(ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """``(start, length)`` of every maximal run of ``token_id`` in ``ids``."""
    arr = np.asarray(ids, dtype=np.int64) == token_id
    if not arr.any():
        return []
    edges = np.diff(np.concatenate(([0], arr.astype(np.int8), [0])))
    starts = np.flatnonzero(edges == 1)
    ends = np.flatnonzero(edges == -1)
    return [(int(s), int(e - s)) for s, e in zip(starts, ends, strict=True)]
