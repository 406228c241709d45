"""The SigLIP vision tower (``SiglipVisionModel``), as Gemma 3 and PaliGemma use it.

A plain ViT with no KV cache: a ``patch_size`` x ``patch_size`` convolution turns an image into
``(image_size / patch_size)**2`` patch embeddings, a learned position embedding is added, then
``num_hidden_layers`` pre-norm encoder layers (LayerNorm, bidirectional multi-head attention
through torch SDPA, LayerNorm, a GELU-tanh MLP) and a final LayerNorm. The pooling head of
``vision_use_head`` configs is not run (Gemma 3 reads the last hidden state), so its checkpoint
tensors are skipped.

Projections are the engine's linear layers (q/k/v fused and split by head, the output and second
MLP projection row-parallel), so the tower shards with the text model under tensor parallelism
and a quantization config can pick methods by the layers' checkpoint prefixes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.weight_utils import ModelLoadError, load_named_weights, new_parameter
from engine.models.context import ModelContext

# Checkpoint q/k/v projections -> slices of the fused ``qkv_proj``.
_SIGLIP_STACKED = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
)

_ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


class _LayerNorm(nn.Module):
    """``nn.LayerNorm`` with weight and bias as uninitialised frozen parameters (the loader
    fills them), computed in the input's dtype as transformers does."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_parameter((size,), dtype)
        self.bias = new_parameter((size,), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class SiglipAttention(nn.Module):
    """Bidirectional multi-head self-attention over one image's patches."""

    def __init__(self, ctx: ModelContext, cfg: Any, prefix: str) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        heads = cfg.num_attention_heads
        if hidden % heads:
            raise ModelLoadError(
                f"vision_config.hidden_size {hidden} is not a multiple of num_attention_heads "
                f"{heads}"
            )
        self.head_dim = hidden // heads
        self.scale = self.head_dim**-0.5
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_dim, heads, heads, True, ctx=ctx, prefix=f"{prefix}.qkv_proj"
        )
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.out_proj = RowParallelLinear(
            hidden, hidden, True, ctx=ctx, prefix=f"{prefix}.out_proj"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, N, hidden] -> [B, N, hidden]."""
        b, n, _ = x.shape
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q, k, v = (
            t.reshape(b, n, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v)
        )
        out = F.scaled_dot_product_attention(q, k, v, scale=self.scale)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim))


class SiglipMLP(nn.Module):
    def __init__(self, ctx: ModelContext, cfg: Any, prefix: str) -> None:
        super().__init__()
        act = getattr(cfg, "hidden_act", "gelu_pytorch_tanh")
        if act not in _ACTIVATIONS:
            raise ModelLoadError(
                f"vision_config.hidden_act {act!r} is not supported; supported: "
                f"{', '.join(_ACTIVATIONS)}"
            )
        self.act = _ACTIVATIONS[act]
        self.fc1 = ColumnParallelLinear(
            cfg.hidden_size, cfg.intermediate_size, True, ctx=ctx, prefix=f"{prefix}.fc1"
        )
        self.fc2 = RowParallelLinear(
            cfg.intermediate_size, cfg.hidden_size, True, ctx=ctx, prefix=f"{prefix}.fc2"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    """``x += attn(norm1(x)); x += mlp(norm2(x))``."""

    def __init__(self, ctx: ModelContext, cfg: Any, prefix: str) -> None:
        super().__init__()
        eps = cfg.layer_norm_eps
        self.layer_norm1 = _LayerNorm(cfg.hidden_size, eps, ctx.dtype)
        self.self_attn = SiglipAttention(ctx, cfg, f"{prefix}.self_attn")
        self.layer_norm2 = _LayerNorm(cfg.hidden_size, eps, ctx.dtype)
        self.mlp = SiglipMLP(ctx, cfg, f"{prefix}.mlp")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipVisionModel(nn.Module):
    """``pixel_values [B, C, S, S] -> last hidden state [B, (S / patch)**2, hidden]``.

    ``ctx.hf_config`` is the ``vision_config``; ``prefix`` the tower's checkpoint prefix (for
    the linear layers' names). Parameter names follow the checkpoint's
    ``vision_tower.vision_model.*`` without the ``vision_model.`` part (transformers 5 saves it
    that way); ``load_weights`` takes either.
    """

    def __init__(self, ctx: ModelContext, prefix: str = "vision_tower") -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.config = cfg
        self.image_size = int(cfg.image_size)
        self.patch_size = int(cfg.patch_size)
        self.num_channels = int(getattr(cfg, "num_channels", 3))
        if self.image_size % self.patch_size:
            raise ModelLoadError(
                f"vision_config.image_size {self.image_size} is not a multiple of patch_size "
                f"{self.patch_size}"
            )
        self.patches_per_side = self.image_size // self.patch_size
        self.num_patches = self.patches_per_side**2
        hidden = cfg.hidden_size
        self.dtype = ctx.dtype
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = nn.Module()
        self.embeddings.patch_embedding.weight = new_parameter(
            (hidden, self.num_channels, self.patch_size, self.patch_size), ctx.dtype
        )
        self.embeddings.patch_embedding.bias = new_parameter((hidden,), ctx.dtype)
        self.embeddings.position_embedding = nn.Module()
        self.embeddings.position_embedding.weight = new_parameter(
            (self.num_patches, hidden), ctx.dtype
        )
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(
            SiglipEncoderLayer(ctx, cfg, f"{prefix}.encoder.layers.{i}")
            for i in range(cfg.num_hidden_layers)
        )
        self.post_layernorm = _LayerNorm(hidden, cfg.layer_norm_eps, ctx.dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        shape = tuple(pixel_values.shape[1:])
        expected = (self.num_channels, self.image_size, self.image_size)
        if shape != expected:
            raise ValueError(f"pixel_values of shape {shape}, the vision tower takes {expected}")
        patch = self.embeddings.patch_embedding
        x = F.conv2d(pixel_values.to(self.dtype), patch.weight, patch.bias, stride=self.patch_size)
        x = x.flatten(2).transpose(1, 2)  # [B, patches, hidden], row-major over the grid
        x = x + self.embeddings.position_embedding.weight
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load tensors named relative to the tower (``encoder.layers.0.mlp.fc1.weight``, with
        or without a leading ``vision_model.``); the pooling head's are skipped."""

        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith("vision_model."):
                    name = name[len("vision_model.") :]
                yield name, tensor

        return load_named_weights(
            self, renamed(), _SIGLIP_STACKED, ignore=lambda name: name.startswith("head.")
        )
