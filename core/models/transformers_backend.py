"""The transformers modeling backend: any ``AutoModelForCausalLM`` architecture on our engine.

``TransformersForCausalLM`` builds the Hugging Face model itself (``AutoModelForCausalLM.
from_config``) and runs it inside the engine: our scheduler, paged KV cache, sampler and weight
loaders, with transformers' code for everything between the embedding and the logits. It is
what ``--model-impl transformers`` picks, and what ``auto`` picks for an architecture with no
native class (see ``engine.models.selection``).

How a step runs (the flat token batch of ``ModelRunner`` is one sequence to transformers):

* ``forward(input_ids [T], positions [T], attn_metadata)`` calls the base model with batch 1,
  ``input_ids[None]`` and ``position_ids=positions[None]``, so rotary / learned position
  embeddings see each token's own position whichever request it belongs to;
* the HF config's ``_attn_implementation`` is ``"engine_paged"``, a function registered in
  transformers' ``AttentionInterface``: every attention layer hands it its rotated q/k/v
  (``[1, heads, T, head_dim]``) and the engine's ``Attention`` layer of that ``layer_idx``
  writes k/v into the paged cache and attends with the step's ``AttentionMetadata`` (which
  travels down as the keyword argument ``engine_attention``, as transformers passes any
  ``**kwargs`` of the model's forward to its attention functions). Since the function is not
  a mask function, transformers builds no attention mask: causality, request boundaries and
  sliding windows come from the metadata;
* ``compute_logits(hidden)`` runs the model's own ``ForCausalLM.forward`` head code (LM head,
  then whatever the architecture does to the logits: Gemma 2's final soft-cap, Cohere's
  ``logit_scale``, Granite's ``logits_scaling``, ...) on the rows the runner asks for, with the
  base model's output replaced by those rows.

What each layer's attention needs (head counts, ``scaling``, sliding window, soft-cap) is read
from the model's own code, not guessed from the config: at build time one probe forward of two
tokens runs with a recording attention function, and the engine's ``Attention`` layers are
built from what each layer passed. The same probe refuses, with the reason, layers that do not
call the registry, non-causal attention, value heads of another size, masks the model builds
itself, and attention sinks. Each step checks the per-call arguments against the layer again.

Modules are swapped for ours where it pays: every ``nn.Linear`` becomes a linear of the
linear-layer family (``ReplicatedLinear`` on one device, so the CPU prepacks it and quantization
methods apply by prefix; under tensor parallelism the style the model's ``base_model_tp_plan``
names), the input embedding a ``VocabParallelEmbedding`` and the LM head a ``ParallelLMHead``
(tied to the embedding when transformers ties them). Everything else (norms, rotary, MLP
activations, MoE routing) is transformers' code. Weights stream in through our loaders by their
checkpoint names, which are the HF module tree's.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from engine.attention_backends.interface import AttentionMetadata, AttentionSpec
from engine.layers import (
    Attention,
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    ReplicatedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from engine.layers.weight_utils import ModelLoadError, default_weight_loader
from engine.models.base import CausalLM
from engine.models.context import ModelContext

logger = logging.getLogger(__name__)

#: the name registered in transformers' ``AttentionInterface`` (``config._attn_implementation``)
ATTENTION_IMPLEMENTATION = "engine_paged"
#: the keyword argument that carries the step's context down to the attention function
CONTEXT_KWARG = "engine_attention"

# Per-call keyword arguments of attention functions that carry nothing the paged backend needs.
_IGNORED_KWARGS = frozenset(
    {
        CONTEXT_KWARG,
        "dropout",
        "position_ids",
        "use_cache",
        "cache_position",
        "output_attentions",
        "is_causal",
        "layer_idx",
    }
)

# tensor-parallel styles of ``base_model_tp_plan`` -> how the linear family builds that layer.
_TP_STYLES = {
    "colwise": (ColumnParallelLinear, {}),
    "colwise_gather_output": (ColumnParallelLinear, {"gather_output": True}),
    "packed_colwise": (MergedColumnParallelLinear, {}),
    "rowwise": (RowParallelLinear, {}),
    "rowwise_split_input": (RowParallelLinear, {"input_is_parallel": False}),
}


# ---- the attention function ------------------------------------------------------------------
def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature, served by the engine's paged attention.

    ``query`` [1, heads, T, head_dim], ``key``/``value`` [1, kv_heads, T, head_dim] (already
    rotated); returns ``([1, T, heads, head_dim], None)``. The step's ``_StepContext`` (or the
    build-time ``_Probe``) arrives as the ``engine_attention`` keyword argument.
    """
    context = kwargs.get(CONTEXT_KWARG)
    if context is None:
        raise RuntimeError(
            f"{type(module).__name__} called the {ATTENTION_IMPLEMENTATION!r} attention function "
            "without the engine's step context: this model does not pass its forward's keyword "
            "arguments down to its attention layers, so the transformers backend cannot serve it"
        )
    call = _AttentionCall(
        module=module,
        query=query,
        key=key,
        value=value,
        attention_mask=attention_mask,
        scaling=scaling,
        sliding_window=sliding_window,
        softcap=softcap,
        kwargs=kwargs,
    )
    return context.attend(call)


def _register_attention_function() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_IMPLEMENTATION, paged_attention_forward)


_register_attention_function()


@dataclass
class _AttentionCall:
    """One layer's call of the attention function, as transformers made it."""

    module: nn.Module
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attention_mask: Any
    scaling: float | None
    sliding_window: int | None
    softcap: float | None
    kwargs: dict[str, Any]

    @property
    def layer_idx(self) -> int:
        idx = getattr(self.module, "layer_idx", None)
        if not isinstance(idx, int):
            raise RuntimeError(
                f"{type(self.module).__name__} has no integer `layer_idx`, so the transformers "
                "backend cannot tell which paged-attention layer (KV cache) it uses"
            )
        return idx

    def scale(self) -> float:
        """The softmax scale the model asked for (``head_dim ** -0.5`` when it passed None, as
        transformers' own attention functions default)."""
        return float(self.scaling) if self.scaling is not None else self.query.shape[-1] ** -0.5


@dataclass
class _LayerSpec:
    """What one layer's attention calls looked like at build time (per rank)."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None
    logit_softcap: float | None


@dataclass
class _Probe:
    """The build-time recording attention: collects each layer's ``_LayerSpec`` and the
    reasons the paged backend cannot stand in for a layer; returns zeros."""

    specs: dict[int, _LayerSpec] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def attend(self, call: _AttentionCall) -> tuple[torch.Tensor, None]:
        name = type(call.module).__name__
        q, k, v = call.query, call.key, call.value
        idx = call.layer_idx
        if getattr(call.module, "is_causal", True) is False:
            self._problem(f"{name} (layer {idx}) is not causal (bidirectional attention)")
        if call.attention_mask is not None:
            self._problem(
                f"{name} (layer {idx}) receives an attention mask the model builds itself "
                "(paged attention applies only causal and sliding-window masks)"
            )
        if v.shape[-1] != q.shape[-1] or k.shape[-1] != q.shape[-1]:
            self._problem(
                f"{name} (layer {idx}) has query/key/value head sizes {q.shape[-1]}/"
                f"{k.shape[-1]}/{v.shape[-1]} (paged attention needs one head size)"
            )
        if q.shape[0] != 1 or k.shape[1] != v.shape[1] or q.shape[1] % k.shape[1]:
            self._problem(
                f"{name} (layer {idx}) has {q.shape[1]} query and {k.shape[1]}/{v.shape[1]} "
                "key/value heads"
            )
        extra = sorted(
            key
            for key, value in call.kwargs.items()
            if key not in _IGNORED_KWARGS and isinstance(value, torch.Tensor)
        )
        if extra:
            self._problem(
                f"{name} (layer {idx}) passes {', '.join(extra)} to its attention function "
                "(e.g. attention sinks), which paged attention does not implement"
            )
        self.specs[idx] = _LayerSpec(
            num_heads=q.shape[1],
            num_kv_heads=k.shape[1],
            head_size=q.shape[-1],
            scale=call.scale(),
            sliding_window=call.sliding_window or None,
            logit_softcap=call.softcap or None,
        )
        b, h, t, d = q.shape
        return q.new_zeros((b, t, h, d)), None

    def _problem(self, text: str) -> None:
        if text not in self.problems:
            self.problems.append(text)


@dataclass
class _StepContext:
    """One step: the engine's ``Attention`` layer of each ``layer_idx`` and the step's
    per-KV-group metadata."""

    layers: dict[int, Attention]
    metadata: list[AttentionMetadata]

    def attend(self, call: _AttentionCall) -> tuple[torch.Tensor, None]:
        idx = call.layer_idx
        layer = self.layers.get(idx)
        if layer is None:
            raise RuntimeError(f"attention layer {idx} did not run in the build-time probe")
        q, k, v = call.query, call.key, call.value
        _, h, t, d = q.shape
        hk = k.shape[1]
        if (h, hk, d) != (layer.num_heads, layer.num_kv_heads, layer.head_size):
            raise RuntimeError(
                f"attention layer {idx}: got {h} query / {hk} key-value heads of size {d}, the "
                f"KV cache was built for {layer.num_heads} / {layer.num_kv_heads} of size "
                f"{layer.head_size}"
            )
        window, softcap = call.sliding_window or None, call.softcap or None
        if (
            window != layer.sliding_window
            or softcap != layer.logit_softcap
            or not math.isclose(call.scale(), layer.scale, rel_tol=1e-6)
        ):
            raise RuntimeError(
                f"attention layer {idx}: the model now asks for scale {call.scale()}, sliding "
                f"window {window}, soft-cap {softcap}; the layer was built with "
                f"{layer.scale}, {layer.sliding_window}, {layer.logit_softcap}"
            )
        dtype = layer.kv_cache.dtype if layer.kv_cache is not None else q.dtype
        flat_q = q.transpose(1, 2).reshape(t, h * d).to(dtype)
        flat_k = k.transpose(1, 2).reshape(t, hk * d).to(dtype)
        flat_v = v.transpose(1, 2).reshape(t, hk * d).to(dtype)
        out = layer(flat_q, flat_k, flat_v, self.metadata)
        return out.view(1, t, h, d).to(q.dtype), None


# ---- can the backend serve this config? --------------------------------------------------------
def hf_causal_lm_class(hf_config: Any, trust_remote_code: bool = False) -> type:
    """The transformers class ``AutoModelForCausalLM`` builds for ``hf_config``.

    Raises ``ModelLoadError`` when transformers has none (or it is custom code that
    ``trust_remote_code`` does not allow)."""
    import transformers

    auto_map = getattr(hf_config, "auto_map", None) or {}
    if "AutoModelForCausalLM" in auto_map:
        if not trust_remote_code:
            raise ModelLoadError(
                f"the model's AutoModelForCausalLM is custom code ({auto_map['AutoModelForCausalLM']}); "
                "pass --trust-remote-code (LLM(trust_remote_code=True)) to run it"
            )
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        ref = auto_map["AutoModelForCausalLM"]
        repo = hf_config.name_or_path
        if "--" in ref:
            repo, ref = ref.split("--")
        return get_class_from_dynamic_module(ref, repo)
    names = list(getattr(hf_config, "architectures", None) or [])
    if names and not any(hasattr(transformers, n) for n in names):
        # A class transformers does not know: the checkpoint is not what model_type's class
        # would build, so it is not served as that class.
        raise ModelLoadError(
            f"transformers has no class {', '.join(names)} (config.json's architectures), and "
            "the config has no auto_map naming custom code for it"
        )
    mapping = transformers.MODEL_FOR_CAUSAL_LM_MAPPING
    if type(hf_config) not in mapping:
        raise ModelLoadError(
            f"transformers has no AutoModelForCausalLM class for model_type "
            f"{getattr(hf_config, 'model_type', '?')!r}"
        )
    found = mapping[type(hf_config)]
    if isinstance(found, (list, tuple)):
        archs = set(getattr(hf_config, "architectures", None) or [])
        found = next((c for c in found if c.__name__ in archs), found[0])
    return found


# Layer kinds in a config's `layer_types` that carry a recurrent state instead of a KV cache.
_RECURRENT_LAYER_TYPES = frozenset(
    {"linear_attention", "mamba", "mamba2", "ssm", "recurrent", "conv", "short_conv"}
)


def transformers_backend_problems(hf_config: Any, trust_remote_code: bool = False) -> list[str]:
    """Reasons the transformers backend cannot serve ``hf_config`` (empty when it can, as far
    as the config and the class tell; the build-time probe checks each layer's attention)."""
    try:
        model_cls = hf_causal_lm_class(hf_config, trust_remote_code)
    except ModelLoadError as e:
        return [str(e)]
    name = model_cls.__name__
    problems = []
    if getattr(hf_config, "is_encoder_decoder", False):
        problems.append(f"{name} is an encoder-decoder model (only decoder-only models run)")
    if any(getattr(hf_config, key, None) is not None for key in ("vision_config", "audio_config")):
        problems.append(f"{name} is multimodal (the transformers backend serves text models)")
    layer_types = getattr(hf_config, "layer_types", None) or []
    # transformers < 5.2x marks such classes `_is_stateful`; later releases name the layers'
    # kind in `layer_types` instead (Mamba: "linear_attention").
    if getattr(model_cls, "_is_stateful", False) or _RECURRENT_LAYER_TYPES & set(layer_types):
        problems.append(
            f"{name} has recurrent / state-space layers, whose state the paged KV cache does "
            "not hold"
        )
    odd = sorted(
        {t for t in layer_types if t not in ("full_attention", "sliding_attention")}
        - _RECURRENT_LAYER_TYPES
    )
    if odd:
        problems.append(
            f"{name} has layers of type {', '.join(map(str, odd))} (paged attention serves "
            "full_attention and sliding_attention layers)"
        )
    if getattr(hf_config, "attention_chunk_size", None):
        problems.append(f"{name} uses chunked attention (attention_chunk_size)")
    if not getattr(model_cls, "_supports_attention_backend", False):
        problems.append(
            f"{name}'s attention cannot be replaced: the class does not declare "
            "_supports_attention_backend (its attention layers do not take the attention "
            "function and keyword arguments from transformers' AttentionInterface)"
        )
    converters = _checkpoint_converters(hf_config, model_cls)
    if converters:
        problems.append(
            f"{name} checkpoints need transformers' weight conversion ({converters}), which "
            "the engine's loaders do not apply"
        )
    return problems


def transformers_backend_parallel_problems(
    hf_config: Any, tensor_parallel_size: int, pipeline_parallel_size: int, model_impl: str
) -> list[str]:
    """Reasons the transformers backend cannot run ``hf_config`` in this parallel layout, each
    saying what to use instead (empty when it can). Checked at start, before workers spawn.

    Tensor parallelism splits the linears as the config's ``base_model_tp_plan`` says (see
    ``TransformersForCausalLM._swap_modules``), so a model without a plan cannot be split.
    Pipeline parallelism is refused for every model: the backend runs transformers' whole
    module tree, whose forward has no entry point for a previous stage's hidden states (nor
    placeholders for the layers another stage holds)."""
    name = (getattr(hf_config, "architectures", None) or [hf_config.model_type])[0]
    instead = (
        "--model-impl auto runs the native implementation where the architecture has one"
        if model_impl == "transformers"
        else f"{name} has no native implementation in the engine"
    )
    problems = []
    if pipeline_parallel_size > 1:
        problems.append(
            f"pipeline_parallel_size={pipeline_parallel_size}: the transformers modeling "
            f"backend ({name}) does not run under pipeline parallelism, since it runs "
            "transformers' whole model in every process and cannot hand hidden states from "
            "one stage to the next; use tensor_parallel_size alone (the backend splits the "
            f"model by its base_model_tp_plan), or pipeline_parallel_size=1 ({instead})"
        )
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    if tensor_parallel_size > 1 and not getattr(text, "base_model_tp_plan", None):
        problems.append(
            f"tensor_parallel_size={tensor_parallel_size}: {name} declares no "
            "base_model_tp_plan, so the transformers modeling backend does not know which "
            f"linears to split over the ranks; use tensor_parallel_size=1 ({instead})"
        )
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if tensor_parallel_size > 1 and kv_heads and kv_heads % tensor_parallel_size:
        problems.append(
            f"tensor_parallel_size={tensor_parallel_size} is more ranks than {name}'s "
            f"{kv_heads} key/value heads: the transformers modeling backend splits the k/v "
            "projections by the tp plan and does not replicate key/value heads over ranks; "
            f"use a tensor_parallel_size that divides {kv_heads} ({instead})"
        )
    return problems


def _checkpoint_converters(hf_config: Any, model_cls: type) -> str:
    """The checkpoint conversions transformers registers for this class or model type that
    are more than renames (merging per-expert tensors, ...), as text; empty when none."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # transformers 4: no conversions
        return ""
    mapping = get_checkpoint_conversion_mapping(model_cls.__name__)
    if mapping is None:
        mapping = get_checkpoint_conversion_mapping(getattr(hf_config, "model_type", ""))
    ops = [m for m in mapping or [] if "Renam" not in type(m).__name__]
    return "; ".join(
        f"{' + '.join(getattr(m, 'source_patterns', []))} -> "
        f"{' + '.join(getattr(m, 'target_patterns', []))}"
        for m in ops
    )


def _checkpoint_renamings(hf_model: nn.Module) -> list[Any]:
    """transformers' key renamings for this model (``WeightRenaming``: e.g. GPT-NeoX's
    ``embed_out.`` -> ``lm_head.``, legacy ``LayerNorm.gamma`` -> ``.weight``), in order."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:  # transformers 4: checkpoint names are module names
        return []
    return [t for t in get_model_conversion_mapping(hf_model) if isinstance(t, WeightRenaming)]


# ---- building the model ----------------------------------------------------------------------
@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Create every ``nn.Parameter`` registered inside on the meta device while buffers stay
    where they are made (rotary ``inv_freq`` tables and the like keep the values the model's
    constructor computes); the loader fills the parameters afterwards."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=False)
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _plan_style(plan: dict[str, str], name: str) -> str | None:
    """The tensor-parallel style ``plan`` (keys relative to the base model, ``*`` for a layer
    index) gives module ``name``."""
    for pattern, style in plan.items():
        regex = re.escape(pattern).replace(r"\*", r"\d+")
        if re.fullmatch(regex, name):
            return style
    return None


class _HiddenOnly(dict):
    """Stands in for the base model's output inside ``compute_logits``: ``[0]`` and
    ``.last_hidden_state`` are the given rows, any other output is None."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__(last_hidden_state=hidden)
        self.last_hidden_state = hidden

    def __getitem__(self, key: Any) -> Any:
        if key == 0:
            return self.last_hidden_state
        return super().__getitem__(key)

    def __getattr__(self, name: str) -> Any:
        return None

    def to_tuple(self) -> tuple[torch.Tensor]:
        return (self.last_hidden_state,)


class TransformersForCausalLM(CausalLM):
    """A transformers ``ForCausalLM`` model run by the engine (see the module docstring).

    The HF model's top-level children (``model`` and ``lm_head``; ``transformer``,
    ``gpt_neox``, ...) are this module's children, so parameter names are the HF model's
    ``state_dict`` names, i.e. the checkpoint's.
    """

    def __init__(self, ctx: ModelContext) -> None:
        nn.Module.__init__(self)
        from transformers import AutoModelForCausalLM

        config = copy.deepcopy(ctx.hf_config)
        with _parameters_on_meta():
            hf = AutoModelForCausalLM.from_config(
                config,
                dtype=ctx.dtype,
                attn_implementation=ATTENTION_IMPLEMENTATION,
                # Custom code only gets here when the user allowed it: engine.models.selection
                # refuses an ``auto_map`` model without trust_remote_code.
                trust_remote_code=True,
            )
        hf.eval()
        hf.requires_grad_(False)
        self.config = hf.config
        # Not a registered child: its children become ours (checkpoint names), see the class
        # docstring.
        object.__setattr__(self, "hf", hf)
        self._head_takes_logits_to_keep = (
            "logits_to_keep" in inspect.signature(type(hf).forward).parameters
        )
        self._swap_modules(ctx)
        for name, child in hf.named_children():
            self.add_module(name, child)
        self._materialize(ctx.device)
        self._renamings = _checkpoint_renamings(hf)
        self.paged_attention = nn.ModuleList()
        self._layers: dict[int, Attention] = {}
        if ctx.device.type != "meta":  # the loader's dry run needs no attention layers
            self._build_attention(ctx)

    # -- module swaps ----------------------------------------------------------------------------
    def _swap_modules(self, ctx: ModelContext) -> None:
        hf = self.hf
        parallel = ctx.parallel
        base_prefix = hf.base_model_prefix
        plan = dict(getattr(hf.config, "base_model_tp_plan", None) or {})
        if parallel.tp_size > 1 and not plan:
            raise ModelLoadError(
                f"{type(hf).__name__} declares no base_model_tp_plan, so the transformers "
                "backend does not know how to split it over tensor-parallel ranks"
            )
        embedding = hf.get_input_embeddings()
        head = hf.get_output_embeddings()
        tied = head is not None and embedding is not None and head.weight is embedding.weight
        new_embedding = embedding
        if type(embedding) is nn.Embedding and embedding.max_norm is None:
            new_embedding = VocabParallelEmbedding(
                embedding.num_embeddings, embedding.embedding_dim, ctx.dtype, parallel=parallel
            )
            hf.set_input_embeddings(new_embedding)
        elif parallel.tp_size > 1:
            raise ModelLoadError(
                f"tensor parallelism: the input embedding is a {type(embedding).__name__}, "
                "which the transformers backend cannot split"
            )
        head_name = None
        if head is not None:
            head_name = next(n for n, m in hf.named_modules() if m is head)
        if type(head) is nn.Linear and head.bias is None:
            new_head = ParallelLMHead(
                head.out_features,
                head.in_features,
                ctx.dtype,
                kernels=ctx.kernels,
                parallel=parallel,
            )
            if tied:
                new_head.tie(new_embedding)
            hf.set_output_embeddings(new_head)
        elif tied:
            raise ModelLoadError(
                f"the tied LM head {head_name} is a {type(head).__name__} with a bias, which the "
                "transformers backend does not build"
            )
        for name, module in list(hf.named_modules()):
            for child_name, child in list(module.named_children()):
                if type(child) is not nn.Linear:
                    continue
                full = f"{name}.{child_name}" if name else child_name
                if full == head_name:  # an LM head with a bias: gathered over the ranks
                    cls, options = ColumnParallelLinear, {"gather_output": True}
                elif parallel.tp_size == 1:
                    cls, options = ReplicatedLinear, {}
                else:
                    relative = full.removeprefix(f"{base_prefix}.")
                    style = _plan_style(plan, relative)
                    if style is None:
                        cls, options = ReplicatedLinear, {}
                    elif style in _TP_STYLES:
                        cls, options = _TP_STYLES[style]
                    else:
                        raise ModelLoadError(
                            f"tensor parallelism: {type(hf).__name__}'s tp plan splits {full} "
                            f"as {style!r}; the transformers backend maps only "
                            f"{', '.join(sorted(_TP_STYLES))}"
                        )
                sizes = child.out_features
                if cls is MergedColumnParallelLinear:
                    sizes = [child.out_features // 2] * 2
                bias = child.bias is not None
                new = cls(child.in_features, sizes, bias, ctx=ctx, prefix=full, **options)
                setattr(module, child_name, new)

    def _materialize(self, device: torch.device) -> None:
        """Give the HF parameters still on the meta device real (uninitialised) storage; tied
        parameters stay one tensor."""
        if device.type == "meta":
            return
        made: dict[int, nn.Parameter] = {}
        for module in self.modules():
            for name, param in list(module._parameters.items()):
                if param is None or not param.is_meta:
                    continue
                new = made.get(id(param))
                if new is None:
                    new = nn.Parameter(torch.empty_like(param, device=device), requires_grad=False)
                    made[id(param)] = new
                module._parameters[name] = new

    def _build_attention(self, ctx: ModelContext) -> None:
        """Probe the model's attention calls (two tokens, uninitialised weights) and build one
        paged ``Attention`` layer per ``layer_idx`` from what each call passed."""
        probe = _Probe()
        ids = torch.zeros((1, 2), dtype=torch.long, device=ctx.device)
        with torch.inference_mode():
            self.hf.base_model(
                input_ids=ids,
                position_ids=torch.arange(2, device=ctx.device)[None],
                use_cache=False,
                **{CONTEXT_KWARG: probe},
            )
        name = type(self.hf).__name__
        expected = getattr(self.config.get_text_config(), "num_hidden_layers", None)
        if not probe.specs:
            probe.problems.append(
                f"{name}'s layers never called the attention-function registry "
                "(config._attn_implementation)"
            )
        elif expected is not None and sorted(probe.specs) != list(range(expected)):
            probe.problems.append(
                f"{name}: attention ran for layer indices {sorted(probe.specs)}, expected "
                f"0..{expected - 1} (num_hidden_layers={expected})"
            )
        backend = ctx.attn_backend_cls
        for idx, spec in sorted(probe.specs.items()):
            reasons = backend.supports(
                AttentionSpec(
                    head_size=spec.head_size,
                    num_heads=spec.num_heads,
                    num_kv_heads=spec.num_kv_heads,
                    sliding_window=spec.sliding_window is not None,
                    logit_softcap=spec.logit_softcap is not None,
                )
            )
            if reasons:
                probe.problems.append(
                    f"attention backend {backend.name} cannot serve layer {idx}: "
                    + ", ".join(reasons)
                )
                break
        if probe.problems:
            raise ModelLoadError(
                f"the transformers backend cannot serve {name}: " + "; ".join(probe.problems)
            )
        for idx in sorted(probe.specs):
            spec = probe.specs[idx]
            layer = Attention(
                spec.num_heads,
                spec.head_size,
                spec.num_kv_heads,
                spec.scale,
                ctx.attn_backend_cls,
                sliding_window=spec.sliding_window,
                logit_softcap=spec.logit_softcap,
            )
            self.paged_attention.append(layer)
            self._layers[idx] = layer
        windows = sorted({s.sliding_window for s in probe.specs.values()}, key=str)
        caps = sorted({s.logit_softcap for s in probe.specs.values()}, key=str)
        logger.info(
            "transformers backend: %s with %d paged attention layers (sliding windows %s, "
            "logit soft-caps %s)",
            name,
            len(self._layers),
            windows,
            caps,
        )

    # -- the model interface -----------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: list[AttentionMetadata],
    ) -> torch.Tensor:
        """input_ids, positions: int64 [T] -> the base model's last hidden states [T, H]."""
        out = self.hf.base_model(
            input_ids=input_ids[None],
            position_ids=positions[None],
            use_cache=False,
            **{CONTEXT_KWARG: _StepContext(self._layers, attn_metadata)},
        )
        return out[0][0]

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """hidden [N, H] -> float32 logits [N, V], through the model's own head code (the LM
        head and any scaling or soft-capping of the logits the architecture applies)."""
        base = self.hf.base_model
        stand_in = _HiddenOnly(hidden[None])
        kwargs: dict[str, Any] = {"use_cache": False}
        if self._head_takes_logits_to_keep:
            kwargs["logits_to_keep"] = 0
        base.forward = lambda *args, **kw: stand_in  # type: ignore[method-assign]
        try:
            out = self.hf(input_ids=None, **kwargs)
        finally:
            del base.forward
        logits = out.logits if hasattr(out, "logits") else out[0]
        return logits[0].float()

    def attention_layers(self) -> list[Attention]:
        """The paged-attention layers, in ``layer_idx`` order."""
        return list(self.paged_attention)

    # -- loading -------------------------------------------------------------------------------------
    def checkpoint_name(self, name: str, params: dict[str, Any]) -> str:
        """The parameter a checkpoint tensor name refers to: transformers' renamings of this
        model applied, and the base-model prefix added for checkpoints saved without it (a
        ``GPT2Model`` checkpoint in a ``GPT2LMHeadModel``)."""
        for renaming in self._renamings:
            name, _ = renaming.rename_source_key(name)
        prefix = self.hf.base_model_prefix
        if name not in params and f"{prefix}.{name}" in params:
            name = f"{prefix}.{name}"
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named checkpoint tensors into the module tree; returns the parameter names
        loaded. Tensors of non-persistent buffers (old checkpoints' ``rotary_emb.inv_freq``),
        of a tied LM head, and those the class lists in ``_keys_to_ignore_on_load_unexpected``
        are skipped; any other unknown name is an error."""
        params = dict(self.named_parameters())
        buffers = dict(self.named_buffers())
        persistent = set(self.state_dict().keys())
        ignore = [re.compile(p) for p in (self.hf._keys_to_ignore_on_load_unexpected or [])]
        head = self.hf.get_output_embeddings()
        head_name = next((n for n, m in self.named_modules() if m is head), None)
        tied = isinstance(head, ParallelLMHead) and head.weight is getattr(
            self.hf.get_input_embeddings(), "weight", None
        )
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = self.checkpoint_name(hf_name, params)
            if tied and name == f"{head_name}.weight":
                continue
            param = params.get(name)
            if param is None:
                if name in buffers:
                    if name in persistent:
                        default_weight_loader(buffers[name], tensor)
                    continue
                if any(p.search(hf_name) for p in ignore):
                    continue
                raise ModelLoadError(
                    f"checkpoint tensor {hf_name!r} does not belong to this model "
                    f"({type(self.hf).__name__} through the transformers backend)"
                )
            loader = getattr(param, "weight_loader", None)
            try:
                if loader is not None:
                    loader(param, tensor)
                else:
                    default_weight_loader(param, tensor)
            except ModelLoadError as e:
                raise ModelLoadError(f"checkpoint tensor {hf_name!r}: {e}") from None
            loaded.add(name)
        return loaded
