"""EAGLE and EAGLE-3 draft heads, in the layout of their published checkpoints.

**EAGLE** (e.g. ``yuhuili/EAGLE-LLaMA3-Instruct-8B``): a Llama config with one (or a few)
decoder layers; tensors ``fc.weight`` ``[H, 2H]`` (``fc.bias`` in some checkpoints),
``layers.N.*`` as in Llama except that layer 0 has no ``input_layernorm``. For position
``p`` the head takes the embedding of token ``p + 1`` and the target's final (normed) hidden
state at ``p``: ``x = fc([embed; hidden])``, then the layers; its output, ``hidden +
residual`` without a final norm, goes through the *target's* LM head, and is also the hidden
state of its next step. Embedding and LM head are the target's.

**EAGLE-3** (e.g. ``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``, architecture
``LlamaForCausalLMEagle3``): ``fc.weight`` ``[H, 3 * target_hidden]`` projects the residual
stream entering three target layers (``eagle_config.eagle_aux_hidden_state_layer_ids``, else
vLLM's default 2, L/2, L-3 of L layers) concatenated; one decoder layer ``midlayer.*`` whose
attention takes ``[input_layernorm(embed); hidden_norm(hidden)]`` (``2H`` features) with the
un-normed hidden as residual; a final ``norm``; its own ``lm_head`` over ``draft_vocab_size``
tokens, ``d2t`` mapping draft id ``d`` to target id ``d + d2t[d]`` (``t2d`` is the reverse
mask, unused here). The next step is fed the pre-norm hidden state, not ``fc`` of target
states. The embedding is the target's unless the checkpoint has ``embed_tokens``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.layers import (
    Attention,
    ModelLoadError,
    ParallelLMHead,
    QKVParallelLinear,
    ReplicatedLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    load_named_weights,
    rope_parameters,
)
from engine.models.context import ModelContext
from engine.models.llama import FUSED_WEIGHTS, LlamaDecoderLayer, LlamaMLP, layer_sliding_window


def checkpoint_tensors(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a head checkpoint (safetensors headers, or a PyTorch
    ``pytorch_model.bin`` as the original EAGLE releases ship)."""
    from engine.loader.model_loader import safetensors_files, safetensors_shapes

    if any(path.glob("*.safetensors")):
        return safetensors_shapes(safetensors_files(path))
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        raise ModelLoadError(f"no *.safetensors or pytorch_model.bin weights in {path}")
    shapes: dict[str, tuple[int, ...]] = {}
    for file in bins:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        shapes.update({k: tuple(v.shape) for k, v in state.items()})
    return shapes


def iter_checkpoint(path: Path):
    """``(name, tensor)`` of a head checkpoint, safetensors or PyTorch."""
    from engine.loader.model_loader import iter_safetensors, safetensors_files

    if any(path.glob("*.safetensors")):
        yield from iter_safetensors(safetensors_files(path))
        return
    for file in sorted(path.glob("pytorch_model*.bin")):
        yield from torch.load(file, map_location="cpu", weights_only=True, mmap=True).items()


class _FirstLayerInput(nn.Module):
    """EAGLE's layer 0 has no input norm: the fused input becomes the residual as is."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        if residual is None:
            return x
        x = x + residual
        return x, x


class EagleHead(nn.Module):
    """EAGLE (1): ``forward(ids, positions, metadata, hidden) -> (out, out)``."""

    def __init__(self, ctx: ModelContext, target: Any, fc_bias: bool) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.config = cfg
        h = cfg.hidden_size
        self.fc = ReplicatedLinear(2 * h, h, fc_bias, ctx=ctx, prefix="fc")
        head_dim = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
        rotary = RotaryEmbedding(
            head_dim, cfg.max_position_embeddings, rope_parameters(cfg), ctx.kernels
        )
        options = {"qkv_bias": False, "o_bias": False, "qk_norm": False}
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(ctx, i, rotary, options) for i in range(cfg.num_hidden_layers)
        )
        self.layers[0].input_layernorm = _FirstLayerInput()
        # The target's embedding and LM head, shared (not parameters of the head).
        self._shared = (target.model.embed_tokens, target.lm_head)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]

    def forward(self, ids, positions, metadata, hidden) -> tuple[torch.Tensor, torch.Tensor]:
        embed = self._shared[0](ids)
        x = self.fc(torch.cat([embed, hidden.to(embed.dtype)], dim=-1))
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, metadata)
        out = x + residual
        return out, out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._shared[1](hidden)

    def load_weights(self, weights) -> set[str]:
        def ignore(name: str) -> bool:
            # Shared with the target; rotary tables are recomputed.
            return name.startswith(("embed_tokens.", "lm_head.")) or "rotary_emb" in name

        return load_named_weights(self, weights, FUSED_WEIGHTS, ignore)


class _Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention over ``[norm(embed); norm(hidden)]``."""

    def __init__(self, ctx: ModelContext, rotary: RotaryEmbedding) -> None:
        super().__init__()
        cfg = ctx.hf_config
        h = cfg.hidden_size
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        self.head_dim = getattr(cfg, "head_dim", None) or h // heads
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, ctx.kernels, ctx.dtype)
        self.hidden_norm = RMSNorm(h, eps, ctx.kernels, ctx.dtype)
        self.post_attention_layernorm = RMSNorm(h, eps, ctx.kernels, ctx.dtype)
        bias = bool(getattr(cfg, "attention_bias", False))
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = QKVParallelLinear(
            2 * h,
            self.head_dim,
            heads,
            kv_heads,
            bias,
            ctx=ctx,
            prefix="midlayer.self_attn.qkv_proj",
        )
        self.self_attn.o_proj = RowParallelLinear(
            heads * self.head_dim, h, bias, ctx=ctx, prefix="midlayer.self_attn.o_proj"
        )
        self.self_attn.attn = Attention(
            self.self_attn.qkv_proj.num_heads,
            self.head_dim,
            self.self_attn.qkv_proj.num_kv_heads,
            self.head_dim**-0.5,
            ctx.attn_backend_cls,
            sliding_window=layer_sliding_window(cfg, 0),
        )
        self.rotary = rotary
        self.mlp = LlamaMLP(
            h, cfg.intermediate_size, cfg.hidden_act, ctx, bias=getattr(cfg, "mlp_bias", False)
        )
        self.norm_before_residual = bool(getattr(cfg, "norm_before_residual", False))

    def forward(self, positions, embeds, hidden, metadata):
        embeds = self.input_layernorm(embeds)
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        attn = self.self_attn
        q, k, v = attn.qkv_proj.split(attn.qkv_proj(torch.cat([embeds, normed], dim=-1)))
        q, k = self.rotary(positions, q, k, None, None)
        x = attn.o_proj(attn.attn(q, k, v, metadata))
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Eagle3Head(nn.Module):
    """EAGLE-3: ``forward(ids, positions, metadata, hidden) -> (normed, prenorm)``;
    ``combine(aux)`` is ``fc`` over the target's three hidden states."""

    def __init__(self, ctx: ModelContext, target: Any, own_embedding: bool) -> None:
        super().__init__()
        cfg = ctx.hf_config
        if cfg.num_hidden_layers != 1:
            raise ModelLoadError(
                f"EAGLE-3 heads have one decoder layer; this one has {cfg.num_hidden_layers}"
            )
        self.config = cfg
        h = cfg.hidden_size
        target_h = int(getattr(cfg, "target_hidden_size", None) or h)
        self.vocab_size = int(cfg.vocab_size)
        self.draft_vocab_size = int(getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size)
        self.fc = ReplicatedLinear(3 * target_h, h, False, ctx=ctx, prefix="fc")
        head_dim = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
        rotary = RotaryEmbedding(
            head_dim, cfg.max_position_embeddings, rope_parameters(cfg), ctx.kernels
        )
        self.layers = nn.ModuleList([_Eagle3Layer(ctx, rotary)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps, ctx.kernels, ctx.dtype)
        self.lm_head = ParallelLMHead(
            self.draft_vocab_size, h, ctx.dtype, kernels=ctx.kernels, parallel=ctx.parallel
        )
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        self.embed_tokens = (
            VocabParallelEmbedding(cfg.vocab_size, h, ctx.dtype, parallel=ctx.parallel)
            if own_embedding
            else None
        )
        self._target_embed = (target.model.embed_tokens,)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's concatenated hidden states ``[T, 3 * target_hidden]`` -> ``[T, H]``."""
        return self.fc(aux.to(self.fc.weight.dtype))

    def forward(self, ids, positions, metadata, hidden) -> tuple[torch.Tensor, torch.Tensor]:
        embed = (self.embed_tokens or self._target_embed[0])(ids)
        x, residual = self.layers[0](positions, embed, hidden.to(embed.dtype), metadata)
        return self.norm(x, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the *target* vocabulary (tokens outside the draft vocab: -inf)."""
        draft = self.lm_head(hidden)
        if self._targets is None:
            return draft
        out = draft.new_full((draft.shape[0], self.vocab_size), float("-inf"))
        out[:, self._targets] = draft
        return out

    _targets: torch.Tensor | None = None

    def use_first_tokens(self) -> None:
        """Map draft id ``d`` to target id ``d`` (random-weight heads for benchmarks, whose
        checkpoint has no ``d2t``)."""
        self.d2t.zero_()
        small = self.draft_vocab_size != self.vocab_size
        self._targets = (
            torch.arange(self.draft_vocab_size, device=self.d2t.device) if small else None
        )

    def load_weights(self, weights) -> set[str]:
        """Load a checkpoint (``midlayer.`` names as published); ``d2t`` fills the vocab
        mapping, ``t2d`` is skipped."""
        d2t: list[torch.Tensor] = []

        def renamed():
            for name, tensor in weights:
                if name == "t2d":
                    continue
                if name == "d2t":
                    d2t.append(tensor)
                    continue
                yield name.replace("midlayer.", "layers.0."), tensor

        loaded = load_named_weights(self, renamed(), FUSED_WEIGHTS, lambda n: "rotary" in n)
        if d2t:
            if tuple(d2t[0].shape) != (self.draft_vocab_size,):
                raise ModelLoadError(
                    f"EAGLE-3 d2t has shape {tuple(d2t[0].shape)}, expected "
                    f"({self.draft_vocab_size},) (draft_vocab_size)"
                )
            self.d2t.copy_(d2t[0].to(torch.long))
        elif self.draft_vocab_size != self.vocab_size:
            raise ModelLoadError(
                f"the EAGLE-3 head drafts over {self.draft_vocab_size} tokens of "
                f"{self.vocab_size} but its checkpoint has no d2t mapping"
            )
        targets = torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t
        if int(targets.max()) >= self.vocab_size or int(targets.min()) < 0:
            raise ModelLoadError("EAGLE-3 d2t maps draft tokens outside the target vocabulary")
        identity = self.draft_vocab_size == self.vocab_size and not bool(self.d2t.any())
        self._targets = None if identity else targets
        return loaded


def aux_layer_ids(head_config: Any, num_target_layers: int) -> list[int]:
    """Which target layers feed EAGLE-3: the checkpoint's ``eagle_config`` choice, else
    vLLM's default (2, L/2, L-3). Index ``i`` is the residual stream entering layer ``i``."""
    eagle = getattr(head_config, "eagle_config", None) or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    if ids:
        return [int(i) for i in ids]
    n = num_target_layers
    return [2, n // 2, n - 3]


class AuxHiddenStates:
    """Forward hooks on a target's decoder that keep the residual stream entering the chosen
    layers (the output ``hidden + residual`` of the layer before; the embedding for layer 0),
    overwritten at each forward; ``take()`` concatenates them. Under CUDA-graph capture the
    kept tensors are the graph's own outputs."""

    def __init__(self, decoder: nn.Module, layer_ids: list[int]) -> None:
        self.layer_ids = list(layer_ids)
        self._states: list[torch.Tensor | None] = [None] * len(layer_ids)
        self._handles = []
        for slot, i in enumerate(self.layer_ids):
            if i == 0:
                module = decoder.embed_tokens
                hook = self._keep_embedding(slot)
            else:
                module = decoder.layers[i - 1]
                hook = self._keep_layer(slot)
            self._handles.append(module.register_forward_hook(hook))

    def _keep_embedding(self, slot: int):
        def hook(module, args, output):
            self._states[slot] = output

        return hook

    def _keep_layer(self, slot: int):
        def hook(module, args, output):
            hidden, residual = output
            self._states[slot] = hidden + residual

        return hook

    def take(self) -> torch.Tensor:
        if any(s is None for s in self._states):
            raise RuntimeError("the target has not run since the EAGLE-3 hooks were set")
        return torch.cat(self._states, dim=-1)  # type: ignore[arg-type]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
