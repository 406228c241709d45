"""Gemma 3 4B/12B/27B (``Gemma3ForConditionalGeneration``): the Gemma 3 text decoder, a SigLIP
vision tower and the multimodal projector.

An image goes through the tower (``vision_config``: 896 px, 14 px patches, a 64 x 64 patch grid)
and the projector: the patch grid is average-pooled down to ``mm_tokens_per_image`` (256: a
16 x 16 grid), RMS-normed (Gemma's ``1 + w``, the vision ``layer_norm_eps``) and multiplied by
``mm_input_projection_weight`` ``[vision hidden, text hidden]``. Those 256 embeddings replace the
embeddings of the ``<image_soft_token>`` placeholders the processor put between
``<start_of_image>`` and ``<end_of_image>`` (unscaled: only text embeddings are multiplied by
``sqrt(hidden)``).

The placeholders of one image attend to each other in both directions on every layer (the text
is causal; sliding layers keep their window): ``image_input_spec().bidirectional``, which the
attention backends implement as bidirectional spans and the scheduler respects by never
splitting one image over two steps.

Weights load from either layout: the released checkpoints' (and transformers 5's)
``language_model.model.*``, ``vision_tower.vision_model.*`` (5 writes ``vision_tower.*``) and
``multi_modal_projector.*``, and transformers 4.52-4.57's ``model.language_model.*``,
``model.vision_tower.*``, ``model.multi_modal_projector.*`` with a top-level ``lm_head``. With
``limit_mm_per_prompt={"image": 0}`` the model is built text-only and the loader skips the vision
tensors without reading them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention_backends.interface import AttentionMetadata
from engine.layers.weight_utils import ModelLoadError, new_parameter
from engine.models.base import IntermediateTensors
from engine.models.context import ModelContext
from engine.models.gemma3 import Gemma3ForCausalLM, _gemma_norm
from engine.models.siglip import SiglipVisionModel
from engine.multimodal.inputs import ImageInputSpec

# Where the text model's tensors live in a Gemma3ForConditionalGeneration checkpoint, as
# (checkpoint prefix, our prefix).
_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
)
_VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


def _images_enabled(ctx: ModelContext) -> bool:
    mm = ctx.multimodal_config
    return mm is None or mm.limit("image") > 0


class Gemma3MultiModalProjector(nn.Module):
    """Vision tower output ``[B, patches, vision hidden]`` -> ``[B, tokens_per_image, text
    hidden]``: average pooling over the patch grid, RMSNorm, projection."""

    def __init__(self, ctx: ModelContext, vision_cfg: Any, text_hidden: int, tokens: int) -> None:
        super().__init__()
        patches_per_side = int(vision_cfg.image_size) // int(vision_cfg.patch_size)
        tokens_per_side = round(tokens**0.5)
        if tokens_per_side**2 != tokens or patches_per_side % tokens_per_side:
            raise ModelLoadError(
                f"mm_tokens_per_image={tokens} must be a square whose side divides the "
                f"{patches_per_side} x {patches_per_side} patch grid"
            )
        self.patches_per_side = patches_per_side
        self.kernel = patches_per_side // tokens_per_side
        self.mm_input_projection_weight = new_parameter(
            (vision_cfg.hidden_size, text_hidden), ctx.dtype
        )
        self.mm_soft_emb_norm = _gemma_norm(
            vision_cfg.hidden_size, vision_cfg, ctx, eps=vision_cfg.layer_norm_eps
        )

    def forward(self, vision_out: torch.Tensor) -> torch.Tensor:
        b, _, hidden = vision_out.shape
        side = self.patches_per_side
        grid = vision_out.transpose(1, 2).reshape(b, hidden, side, side)
        pooled = F.avg_pool2d(grid, self.kernel, stride=self.kernel).flatten(2).transpose(1, 2)
        normed = self.mm_soft_emb_norm(pooled.contiguous())
        return torch.matmul(normed, self.mm_input_projection_weight).to(vision_out.dtype)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma 3 with image inputs (see the module docstring).

    ``encode_images(pixel_values) -> [N, tokens_per_image, hidden]`` runs the tower and the
    projector; ``forward(..., mm_embeds=(rows, embeddings))`` writes embeddings over the
    placeholder rows of the step's flat token batch before the decoder runs.
    """

    bidirectional_image_attention = True  # read by the engine before the model is built
    # Where checkpoints of each layout hold our modules (checkpoint prefix, ours); a quantized
    # checkpoint's ignore list names them so (QuantizationConfig.checkpoint_names).
    # The first pair per prefix of ours that the checkpoint has is used.
    checkpoint_module_prefixes = (
        *_TEXT_PREFIXES,
        ("vision_tower.vision_model.", "vision_tower.vision_model."),  # released checkpoints
        ("model.vision_tower.vision_model.", "vision_tower.vision_model."),  # transformers 4.5x
        ("vision_tower.", "vision_tower.vision_model."),  # transformers 5
    )

    def __init__(self, ctx: ModelContext) -> None:
        top = ctx.hf_config
        text = getattr(top, "text_config", None)
        if text is None:
            raise ModelLoadError(
                "Gemma3ForConditionalGeneration config has no text_config; a text-only "
                "checkpoint should declare architectures=['Gemma3ForCausalLM']"
            )
        tie = getattr(top, "tie_word_embeddings", None)
        if tie is None:
            tie = getattr(text, "tie_word_embeddings", True)
        super().__init__(dataclasses.replace(ctx, hf_config=text), tie_word_embeddings=bool(tie))
        self.top_config = top
        self.image_token_id = int(top.image_token_index)
        self.tokens_per_image = int(getattr(top, "mm_tokens_per_image", 256))
        self.images_enabled = _images_enabled(ctx)
        if self.images_enabled:
            vision = top.vision_config
            # Online quantization (--quantization fp8 on an unquantized checkpoint) quantizes
            # the decoder only: the tower stays as released, as its authors ran it. A quantized
            # checkpoint decides per layer (its ignore list usually names the tower).
            quant = ctx.quant_config
            if quant is not None and quant.online:
                quant = None
            vision_ctx = dataclasses.replace(ctx, hf_config=vision, quant_config=quant)
            self.vision_tower = SiglipVisionModel(vision_ctx, prefix="vision_tower.vision_model")
            self.multi_modal_projector = Gemma3MultiModalProjector(
                ctx, vision, text.hidden_size, self.tokens_per_image
            )

    # ---- what the engine asks ---------------------------------------------------------------
    @classmethod
    def checkpoint_prefixes_to_skip(cls, ctx: ModelContext) -> tuple[tuple[str, ...], str]:
        """Checkpoint prefixes the loader drops unread, and why: the vision tensors when the
        model is served text-only (``limit_mm_per_prompt={"image": 0}``)."""
        if _images_enabled(ctx):
            return (), ""
        return _VISION_PREFIXES, (
            'served as a text-only model (limit_mm_per_prompt={"image": 0}): the vision tower '
            "and multimodal projector are not loaded, image inputs are not accepted"
        )

    def image_input_spec(self) -> ImageInputSpec | None:
        """How this model takes images (None when served text-only)."""
        if not self.images_enabled:
            return None
        return ImageInputSpec(
            placeholder_token_id=self.image_token_id,
            tokens_per_image=self.tokens_per_image,
            embed_dim=int(self.config.hidden_size),
            bidirectional=True,
            pixel_shape=self.image_input_shape(),
        )

    def image_input_shape(self) -> tuple[int, int, int]:
        """``[C, H, W]`` of one image's pixel values."""
        tower = self.vision_tower
        return (tower.num_channels, tower.image_size, tower.image_size)

    # ---- compute ----------------------------------------------------------------------------
    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, C, H, W]`` pixel values -> ``[N, tokens_per_image, hidden]`` embeddings."""
        if not self.images_enabled:
            raise ValueError("this model is served text-only: it has no vision tower")
        return self.multi_modal_projector(self.vision_tower(pixel_values))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: list[AttentionMetadata],
        intermediate: IntermediateTensors | None = None,
        mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """As ``CausalLM.forward``; ``mm_embeds`` = (int64 rows [M], embeddings [M, hidden])
        replaces the embeddings of those rows of the batch (on a single stage: images are
        refused under pipeline parallelism)."""
        if mm_embeds is None:
            return self.model(input_ids, positions, attn_metadata, intermediate)
        rows, embeds = mm_embeds
        ids = input_ids
        if self.image_token_id >= self.config.vocab_size:  # outside the table: embed id 0
            ids = ids.masked_fill(ids == self.image_token_id, 0)
        hidden = self.model.embed_tokens(ids)
        hidden = hidden.index_copy(0, rows, embeds.to(hidden.dtype))
        return self.model(input_ids, positions, attn_metadata, inputs_embeds=hidden)

    def lora_module_name(self, name: str) -> str:
        """A LoRA adapter's module name (PEFT's, trained on transformers'
        ``Gemma3ForConditionalGeneration``: ``model.language_model.layers.0.self_attn.q_proj``
        or ``language_model.model.*``) as the decoder's (``model.layers.0...``). LoRA on the
        vision tower or the projector is refused (ValueError): only the decoder is wrapped."""
        for theirs, ours in _TEXT_PREFIXES:
            if name.startswith(theirs):
                return ours + name[len(theirs) :]
        if name.startswith(_VISION_PREFIXES):
            raise ValueError(
                f"it adapts {name} of the vision tower or projector; LoRA is served on the "
                "language model's linear layers only (target those, e.g. "
                "target_modules=r'.*language_model.*\\.(q|k|v|o)_proj')"
            )
        return name

    # ---- loading ----------------------------------------------------------------------------
    def load_weights(self, weights: Any) -> set[str]:
        """Rename every checkpoint layout onto our names (text as ``Gemma3ForCausalLM``'s,
        ``vision_tower.*`` without ``vision_model.``, the projector as is) and load; the
        vision tower's unused pooling head is skipped, and every vision tensor when served
        text-only."""
        return super().load_weights(self._renamed(weights))

    def _renamed(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        for name, tensor in weights:
            if name.startswith("model.vision_tower.") or name.startswith(
                "model.multi_modal_projector."
            ):
                name = name[len("model.") :]
            if name.startswith(("vision_tower.", "multi_modal_projector.")):
                if not self.images_enabled:
                    continue
                if name.startswith("vision_tower.vision_model."):
                    name = "vision_tower." + name[len("vision_tower.vision_model.") :]
                if name.startswith("vision_tower.head."):
                    continue  # SigLIP's pooling head: Gemma 3 reads the last hidden state
                yield name, tensor
                continue
            for theirs, ours in _TEXT_PREFIXES:
                if name.startswith(theirs):
                    name = ours + name[len(theirs) :]
                    break
            yield name, tensor
