"""The fused mixture-of-experts layer: routing, where the experts live, and their weights.

``FusedMoE`` is the second layer family next to the dense linears, built the same way:

* it knows its **parallel style** (``MoEParallel``): plain tensor parallelism shards every
  expert's intermediate dim (w13 by rows: column parallel; w2 by columns: row parallel), expert
  parallelism places ``num_experts / ep_size`` whole experts on each rank through a
  global-to-local expert map. Either way each rank's output is a partial sum that one
  collective of the group's ``Communicator`` completes: an all-reduce when every rank holds the
  same tokens (the tensor-parallel case), an all-gather of the tokens before and a
  reduce-scatter of the sums after when each rank brings its own (data-parallel attention);
* it **routes** (``select_experts``: softmax top-k with or without renormalisation, through the
  ``moe_topk_softmax`` kernel) and counts, when asked, how many tokens each expert received
  (``enable_expert_load_counting``);
* it delegates its parameters' creation, post-load processing and the expert computation to a
  **method object** (``FusedMoEMethodBase``). ``UnquantizedFusedMoEMethod`` holds the stacked
  weights ``w13_weight [E_local, 2 * I_local, H]`` (each expert's gate rows, then its up rows)
  and ``w2_weight [E_local, H, I_local]`` and calls the ``fused_moe`` kernel; quantized methods
  plug in at the same three calls (FP8: ``engine.quantization.fp8_moe.Fp8MoEMethod``, through
  the ``fused_moe_fp8`` kernel; 4/8-bit GPTQ, AWQ and compressed-tensors experts:
  ``engine.quantization.wna16_moe.WNA16MoEMethod``, through ``fused_moe_wna16``; GGUF expert
  stacks on the CPU: ``engine.quantization.gguf_moe.GGUFMoEMethod``, through ``gguf_linear``).

Checkpoints store experts one tensor per expert and projection (``experts.7.gate_proj.weight``,
Mixtral's ``experts.7.w1.weight``), or already stacked (transformers 5's in-memory
``experts.gate_up_proj``; GGUF's ``ffn_gate_exps``). ``ExpertCheckpointMapping`` routes either
form to ``FusedMoE.weight_loader``, which copies each tensor straight into this rank's slice of
the stacked parameter (experts held by other ranks are skipped), and names the tensors a
checkpoint lacks. A method's other per-expert tensors (FP8's ``experts.7.gate_proj.
weight_scale_inv``) go by suffix to its ``w13_<suffix>`` / ``w2_<suffix>`` parameters.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.kernels.reference import MOE_ACTIVATIONS
from engine.layers.weight_utils import (
    ModelLoadError,
    check_shape,
    materialize,
    narrow,
    new_parameter,
    set_weight_loader,
)

if TYPE_CHECKING:
    from engine.distributed import Communicator
    from engine.kernels.registry import Kernels

# Checkpoint projection names -> the shard of the stacked weights they fill.
QWEN_EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
MIXTRAL_EXPERT_NAMES = {"w1": "w1", "w3": "w3", "w2": "w2"}
# The checkpoint names of an expert's gate, up and down projections, per model family.
EXPERT_PROJECTIONS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
SCORING_FUNCS = ("softmax",)


@dataclass(frozen=True)
class MoEParallel:
    """How a MoE layer's experts are split over the ranks of its process group.

    ``tp_size > 1``: every rank holds every expert, ``intermediate_size / tp_size`` of each
    one's intermediate features (rank ``tp_rank``'s slice). ``ep_size > 1``: rank ``ep_rank``
    holds whole experts, a contiguous run of ``num_experts // ep_size`` (the first
    ``num_experts % ep_size`` ranks one more). ``tokens_partitioned``: each rank brings its own
    tokens (the same number on every rank, padded by the caller), so they are all-gathered
    before the experts and the sums reduce-scattered back; otherwise every rank holds the same
    tokens and the partial sums are all-reduced. One rank (the default) needs no collective.
    """

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    tokens_partitioned: bool = False

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.ep_size < 1:
            raise ValueError(
                f"tp_size and ep_size must be >= 1, got {self.tp_size}, {self.ep_size}"
            )
        if not 0 <= self.tp_rank < self.tp_size or not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(
                f"rank out of range: tp_rank {self.tp_rank} of {self.tp_size}, "
                f"ep_rank {self.ep_rank} of {self.ep_size}"
            )

    @classmethod
    def for_group(
        cls,
        rank: int,
        world_size: int,
        enable_expert_parallel: bool = False,
        tokens_partitioned: bool = False,
    ) -> MoEParallel:
        """The style for rank ``rank`` of a group of ``world_size``: experts placed across the
        ranks with ``enable_expert_parallel`` (vLLM's ``--enable-expert-parallel``), else every
        expert sharded."""
        if enable_expert_parallel:
            return cls(ep_rank=rank, ep_size=world_size, tokens_partitioned=tokens_partitioned)
        return cls(tp_rank=rank, tp_size=world_size, tokens_partitioned=tokens_partitioned)

    @property
    def world_size(self) -> int:
        """Ranks whose partial outputs one collective combines."""
        return self.tp_size * self.ep_size

    def expert_range(self, num_experts: int) -> range:
        """The global ids of the experts this rank holds."""
        base, extra = divmod(num_experts, self.ep_size)
        start = self.ep_rank * base + min(self.ep_rank, extra)
        return range(start, start + base + (1 if self.ep_rank < extra else 0))


def moe_parallel_from_context(ctx: Any) -> tuple[MoEParallel, Communicator | None]:
    """The MoE parallel style and communicator of a model context: its ``ParallelContext``'s
    tensor-parallel group (``ctx.parallel.tp_rank`` / ``tp_size`` / ``tp``), with the experts
    placed across that group when ``enable_expert_parallel`` is set (on the parallel context,
    or on the model context) and sharded otherwise. No parallel context: one device."""
    parallel = getattr(ctx, "parallel", None)
    if parallel is None:
        return MoEParallel(), None
    enable_ep = bool(
        getattr(parallel, "enable_expert_parallel", False)
        or getattr(ctx, "enable_expert_parallel", False)
    )
    style = MoEParallel.for_group(parallel.tp_rank, parallel.tp_size, enable_ep)
    return style, parallel.tp


class FusedMoEMethodBase:
    """How a ``FusedMoE`` stores and runs its experts (unquantized, FP8, W4A16, ...).

    ``create_weights`` registers the parameters on the layer, each with a ``weight_loader``
    (usually ``layer.weight_loader``; called as ``loader(param, tensor, shard_id, expert_id)``)
    and a ``moe_shard_kind`` of ``"w13"`` or ``"w2"`` saying which stacked layout it has. A
    parameter named ``<kind>_<suffix>`` with ``checkpoint_suffix = suffix`` receives the
    checkpoint's per-expert ``...experts.<e>.<proj>.<suffix>`` tensors (``weight`` when unset:
    ``w13_weight``, ``w2_weight``; an FP8 method adds ``w13_weight_scale_inv`` and so on);
    ``optional`` ones may be absent. ``ignored_checkpoint_suffixes`` are per-expert tensors the
    method reads and drops. ``process_weights_after_loading`` runs once every checkpoint tensor
    is in (repacking, scale folding); ``apply`` computes the routed experts' weighted sum for
    this rank's experts (no collective: the layer reduces).
    """

    #: per-expert checkpoint tensors (by suffix) that are accepted and dropped
    ignored_checkpoint_suffixes: tuple[str, ...] = ()
    #: the expert activations (``engine.kernels.reference.MOE_ACTIVATIONS``) the method runs,
    #: and whether it takes per-expert biases (``FusedMoE(bias=True)``, GPT-OSS)
    activations: tuple[str, ...] = ("silu",)
    supports_bias: bool = False

    def create_weights(
        self,
        layer: FusedMoE,
        num_local_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        dtype: torch.dtype | None,
    ) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        """Post-load processing (none by default)."""

    def graph_capture_problem(self, layer: FusedMoE) -> str | None:
        """Why ``apply`` cannot run inside a captured CUDA graph on this platform (None: it
        can). The default trusts the method; a method whose kernel may be the torch reference
        says so with ``host_loop_problem``."""
        return None

    def apply(
        self,
        layer: FusedMoE,
        hidden: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        raise NotImplementedError


def host_loop_problem(layer: FusedMoE, op: str) -> str | None:
    """The reason a graph cannot hold op ``op`` of ``layer``'s kernels when the platform binds
    it to the torch reference: the reference experts run in a host loop over the experts that
    received tokens (``engine.kernels.reference.routed_expert_calls``), which reads the counts
    on the host; None when a plugin provides the op."""
    kernels = layer.kernels
    if not kernels.is_reference(op):
        return None
    return (
        f"no plugin provides {op} on {kernels.platform}: its torch reference runs the experts "
        "in a host loop, which a CUDA graph cannot capture"
    )


def register_expert_biases(
    layer: FusedMoE, num_local_experts: int, intermediate_size_per_partition: int, dtype: Any
) -> None:
    """A biased layer's ``w13_bias [E_local, 2 * I_local]`` and ``w2_bias [E_local, H]`` in
    ``dtype`` (none without ``bias=True``), for any expert method that supports biases; they
    are loaded whole per layer by ``FusedMoE.load_bias`` (no per-expert checkpoint names)."""
    if not layer.has_bias:
        return
    i = intermediate_size_per_partition
    for name, shape, kind in (
        ("w13_bias", (num_local_experts, 2 * i), "w13"),
        ("w2_bias", (num_local_experts, layer.hidden_size), "w2"),
    ):
        param = new_parameter(shape, dtype)
        param.moe_bias_kind = kind  # type: ignore[attr-defined]
        layer.register_parameter(name, param)


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    """Experts in the activation dtype: ``w13_weight`` and ``w2_weight``, computed by the
    platform's ``fused_moe`` kernel; with biases (``w13_bias [E_local, 2 * I_local]``,
    ``w2_bias [E_local, H]``) or another activation than SiLU, by ``fused_moe_biased``."""

    activations = ("silu", "swigluoai")
    supports_bias = True

    def create_weights(
        self,
        layer: FusedMoE,
        num_local_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        dtype: torch.dtype | None,
    ) -> None:
        i = intermediate_size_per_partition
        w13 = new_parameter((num_local_experts, 2 * i, hidden_size), dtype)
        w2 = new_parameter((num_local_experts, hidden_size, i), dtype)
        for name, param, kind in (("w13_weight", w13, "w13"), ("w2_weight", w2, "w2")):
            param.moe_shard_kind = kind  # type: ignore[attr-defined]
            set_weight_loader(param, layer.weight_loader)
            layer.register_parameter(name, param)
        register_expert_biases(layer, num_local_experts, i, dtype)

    @staticmethod
    def kernel_name(layer: FusedMoE) -> str:
        """The op ``apply`` runs for ``layer``."""
        return "fused_moe_biased" if layer.has_bias or layer.activation != "silu" else "fused_moe"

    def graph_capture_problem(self, layer: FusedMoE) -> str | None:
        return host_loop_problem(layer, self.kernel_name(layer))

    def apply(
        self,
        layer: FusedMoE,
        hidden: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        if self.kernel_name(layer) == "fused_moe_biased":
            return layer.kernels.fused_moe_biased(
                hidden, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                *layer.epilogue_args(),
            )  # fmt: skip
        return layer.kernels.fused_moe(
            hidden, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids
        )


class FusedMoE(nn.Module):
    """The routed experts of one MoE block: ``forward(hidden [T, H], router_logits [T, E])``
    routes every token to its ``top_k`` experts and returns their weighted sum ``[T, H]``.

    ``intermediate_size`` is one expert's (global) intermediate size. ``renormalize`` divides
    the chosen softmax weights by their sum (Mixtral; Qwen's ``norm_topk_prob``).
    ``reduce_results=False`` leaves the partial sum unreduced so that the block can add a
    shared expert's partial output first and reduce once (``reduce``). ``activation`` is the
    experts' (``"silu"``: SwiGLU; ``"swigluoai"``: GPT-OSS's clamped SwiGLU with
    ``swiglu_alpha`` and ``swiglu_limit``) and ``bias=True`` gives every expert's gate/up and
    down projections a bias (GPT-OSS), loaded with ``load_bias``.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        renormalize: bool,
        kernels: Kernels,
        dtype: torch.dtype | None = None,
        parallel: MoEParallel | None = None,
        communicator: Communicator | None = None,
        quant_method: FusedMoEMethodBase | None = None,
        quant_config: Any = None,
        prefix: str = "",
        reduce_results: bool = True,
        scoring_func: str = "softmax",
        proj_names: tuple[str, str, str] | None = None,
        activation: str = "silu",
        bias: bool = False,
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
    ) -> None:
        """``quant_config`` (the model's, or None) picks the method by ``prefix`` (the layer's
        checkpoint name) through its ``get_moe_method(layer, prefix)``; ``quant_method``
        forces one. ``proj_names``: the checkpoint's names of an expert's gate, up and down
        projections (``expert_projections``), when the model knows them."""
        super().__init__()
        parallel = parallel or MoEParallel()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        if scoring_func not in SCORING_FUNCS:
            raise ValueError(
                f"MoE scoring function {scoring_func!r} is not supported; supported: "
                f"{', '.join(SCORING_FUNCS)}"
            )
        if intermediate_size % parallel.tp_size:
            raise ValueError(
                f"expert intermediate size {intermediate_size} is not divisible by the "
                f"tensor-parallel size {parallel.tp_size}"
            )
        if parallel.ep_size > num_experts:
            raise ValueError(
                f"expert-parallel size {parallel.ep_size} exceeds the {num_experts} experts"
            )
        if parallel.world_size > 1 and communicator is None:
            raise ValueError(
                f"a MoE layer split over {parallel.world_size} ranks needs a communicator"
            )
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.intermediate_size_per_partition = intermediate_size // parallel.tp_size
        self.renormalize = renormalize
        self.scoring_func = scoring_func
        if activation not in MOE_ACTIVATIONS:
            raise ValueError(
                f"MoE expert activation {activation!r} is not supported; supported: "
                f"{', '.join(MOE_ACTIVATIONS)}"
            )
        self.activation = activation
        self.has_bias = bias
        self.swiglu_alpha = swiglu_alpha
        self.swiglu_limit = swiglu_limit
        self.kernels = kernels
        self.parallel = parallel
        self.communicator = communicator
        self.reduce_results = reduce_results
        self.local_experts = parallel.expert_range(num_experts)
        self.num_local_experts = len(self.local_experts)
        if parallel.ep_size > 1:
            # Global id -> local index, -1 for experts other ranks hold (their choices add
            # nothing here); int32 like the routing kernel's ids.
            expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
            expert_map[self.local_experts.start : self.local_experts.stop] = torch.arange(
                self.num_local_experts, dtype=torch.int32
            )
            self.register_buffer("expert_map", expert_map, persistent=False)
        else:
            self.expert_map = None
        # Tokens routed to each (global) expert since counting was enabled; None: not counted.
        self.expert_load: torch.Tensor | None = None
        self.prefix = prefix
        self.proj_names = proj_names
        if quant_method is None and quant_config is not None:
            getter = getattr(quant_config, "get_moe_method", None)
            if getter is None:
                raise NotImplementedError(
                    f"quantization {getattr(quant_config, 'name', type(quant_config).__name__)!r}"
                    f" has no method for MoE experts ({prefix or 'FusedMoE'}); quantized experts "
                    "are served for fp8 (fp8-format checkpoints, or --quantization fp8 on a "
                    "bf16/fp16 checkpoint), gptq and awq (4/8-bit groups), "
                    "compressed-tensors FP8 and W4A16/W8A16 schemes and gguf (kept quantized "
                    "on the CPU, dequantized at load elsewhere)"
                )
            quant_method = getter(self, prefix)
        self.quant_method = quant_method or UnquantizedFusedMoEMethod()
        method = self.quant_method
        if activation not in method.activations or (bias and not method.supports_bias):
            asked = f"activation {activation!r}" + (" with biases" if bias else "")
            raise NotImplementedError(
                f"{prefix or 'FusedMoE'}: the {type(method).__name__} experts do not run "
                f"{asked} (they run {', '.join(method.activations)}"
                f"{', with biases' if method.supports_bias else ', without biases'}); these "
                "experts are served unquantized (bfloat16/float16/float32 weights)"
            )
        self.quant_method.create_weights(
            self, self.num_local_experts, hidden_size, self.intermediate_size_per_partition, dtype
        )

    # ---- compute ----------------------------------------------------------------------------
    def select_experts(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_weights float32 [T, K], topk_ids int32 [T, K])`` with global expert ids."""
        return self.kernels.moe_topk_softmax(router_logits, self.top_k, self.renormalize)

    def forward(
        self,
        hidden: torch.Tensor,
        router_logits: torch.Tensor,
        token_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden [T, H], router_logits [T, E] -> [T, H] (reduced across the group unless
        ``reduce_results`` is off). ``token_mask`` (bool [T], false for padding rows) only
        matters while expert load is counted."""
        gather = self.parallel.tokens_partitioned and self.parallel.world_size > 1
        if gather:
            assert self.communicator is not None
            hidden = self.communicator.all_gather(hidden, 0)
            router_logits = self.communicator.all_gather(router_logits, 0)
            if token_mask is not None:
                token_mask = self.communicator.all_gather(token_mask.to(torch.int64), 0)
        topk_weights, topk_ids = self.select_experts(router_logits)
        if self.expert_load is not None:
            self._count_load(topk_ids, token_mask)
        if self.expert_map is not None:
            topk_ids = self.expert_map[topk_ids]
        out = self.quant_method.apply(self, hidden, topk_weights, topk_ids)
        return self.reduce(out) if self.reduce_results else out

    def reduce(self, out: torch.Tensor) -> torch.Tensor:
        """Complete a partial output across the group: all-reduce, or reduce-scatter back to
        each rank's own tokens; the identity on one rank."""
        if self.parallel.world_size == 1:
            return out
        assert self.communicator is not None
        if self.parallel.tokens_partitioned:
            return self.communicator.reduce_scatter(out, 0)
        return self.communicator.all_reduce(out)

    def _count_load(self, topk_ids: torch.Tensor, token_mask: torch.Tensor | None) -> None:
        # Device-side only (no host sync), so it can run inside a captured graph.
        assert self.expert_load is not None
        ids = topk_ids.reshape(-1).long()
        if token_mask is None:
            ones = torch.ones_like(ids)
        else:
            ones = token_mask.to(torch.int64)[:, None].expand(topk_ids.shape).reshape(-1)
        self.expert_load.index_add_(0, ids, ones)

    # ---- loading ----------------------------------------------------------------------------
    def weight_loader(
        self,
        param: nn.Parameter,
        loaded: torch.Tensor,
        shard_id: str,
        expert_id: int | None = None,
    ) -> None:
        """Copy a checkpoint tensor into this rank's part of a stacked expert parameter.

        ``shard_id`` is ``"w1"`` (gate), ``"w3"`` (up), ``"w13"`` (gate then up, fused) or
        ``"w2"`` (down); ``expert_id`` the global expert, or None when ``loaded`` stacks all
        ``num_experts`` along its first dim. Experts other ranks hold are skipped."""
        if expert_id is None:
            if loaded.dim() != 3 or loaded.shape[0] != self.num_experts:
                raise ModelLoadError(
                    f"stacked {shard_id}: expected {self.num_experts} experts along dim 0, got "
                    f"shape {tuple(loaded.shape)}"
                )
            # One read of this rank's experts (a lazy checkpoint tensor reads only them).
            experts = self.local_experts
            mine = materialize(narrow(loaded, 0, experts.start, len(experts)))
            for local in range(len(experts)):
                self._load_expert(param, mine[local], shard_id, local)
            return
        if not 0 <= expert_id < self.num_experts:
            raise ModelLoadError(
                f"expert {expert_id} out of range: the layer has {self.num_experts}"
            )
        if expert_id in self.local_experts:
            self._load_expert(param, loaded, shard_id, expert_id - self.local_experts.start)

    def _load_expert(self, param: nn.Parameter, w: torch.Tensor, shard_id: str, local: int) -> None:
        kind = getattr(param, "moe_shard_kind", None)
        h, i = self.hidden_size, self.intermediate_size
        ip, rank = self.intermediate_size_per_partition, self.parallel.tp_rank
        dst = param.data[local]
        if kind == "w13" and shard_id in ("w1", "w3", "w13"):
            if shard_id == "w13":
                check_shape("fused gate/up projection", (2 * i, h), w.shape)
                halves = (("w1", narrow(w, 0, 0, i)), ("w3", narrow(w, 0, i, i)))
            else:
                check_shape(f"{shard_id} projection", (i, h), w.shape)
                halves = ((shard_id, w),)
            for which, half in halves:
                self._copy_rank_half(dst, half, which)
        elif kind == "w2" and shard_id == "w2":
            check_shape("w2 (down) projection", (h, i), w.shape)
            dst.copy_(materialize(narrow(w, 1, rank * ip, ip)))
        else:
            raise ModelLoadError(f"shard {shard_id!r} does not fit a {kind} expert parameter")

    def _copy_rank_half(self, dst: torch.Tensor, half: Any, which: str) -> None:
        """This tensor-parallel rank's rows of one expert's gate (``which`` ``"w1"``) or up
        (``"w3"``) half, ``[I, ...]``, into their place in its ``w13`` rows ``dst``: the gate's
        first, then the up's (a weight ``[2 * I_local, H]`` or a bias ``[2 * I_local]``)."""
        ip, rank = self.intermediate_size_per_partition, self.parallel.tp_rank
        offset = 0 if which == "w1" else ip
        dst.narrow(0, offset, ip).copy_(materialize(narrow(half, 0, rank * ip, ip)))

    def copy_gate_up(self, dst: torch.Tensor, stacked: torch.Tensor) -> None:
        """Every local expert's gate/up rows of ``stacked`` ``[E_local, 2I, ...]`` (gate rows,
        then up rows, all of the intermediate features) into this rank's ``dst`` ``[E_local,
        2 * I_local, ...]`` (``_copy_rank_half`` per half): a bias, or a method's stacked
        tensor of any row layout."""
        i = self.intermediate_size
        for local in range(stacked.shape[0]):
            for which, start in (("w1", 0), ("w3", i)):
                self._copy_rank_half(dst[local], stacked[local].narrow(0, start, i), which)

    def epilogue_args(self) -> tuple:
        """``(w13_bias, w2_bias, activation, alpha, limit)``: what ``fused_moe_biased`` and
        ``fused_moe_mxfp4`` take after their weights (a bias None where the layer has none)."""
        return (
            getattr(self, "w13_bias", None),
            getattr(self, "w2_bias", None),
            self.activation,
            self.swiglu_alpha,
            self.swiglu_limit,
        )

    def load_bias(self, kind: str, loaded: torch.Tensor) -> str:
        """Copy a checkpoint's stacked expert biases into this rank's ``w13_bias`` (``kind``
        ``"w13"``: ``[E, 2I]``, gate then up, split over the tensor-parallel ranks like the
        weights) or ``w2_bias`` (``"w2"``: ``[E, H]``, kept by tensor-parallel rank 0 and zero
        on the others, so the reduced sum adds it once). Returns the parameter's name."""
        if not self.has_bias:
            raise ModelLoadError(f"{self.prefix}: expert biases given to a layer without them")
        name = f"{kind}_bias"
        param = getattr(self, name)
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        expected = (e, 2 * i) if kind == "w13" else (e, h)
        check_shape(f"stacked {name}", expected, loaded.shape)
        experts = self.local_experts
        mine = materialize(narrow(loaded, 0, experts.start, len(experts)))
        if kind == "w13":
            self.copy_gate_up(param.data, mine)
        elif self.parallel.tp_rank == 0:
            param.data.copy_(mine)
        else:
            param.data.zero_()
        return name

    def local_expert(self, what: str, expert_id: int | None) -> int | None:
        """This rank's index of global expert ``expert_id`` (None: another rank holds it), for
        a quantized method's loader of per-expert tensors; ``what`` names the tensor in
        errors."""
        if expert_id is None:
            raise ModelLoadError(
                f"{what}: quantized expert tensors are read one expert at a time "
                "(experts.<e>.<proj>.<name>), not stacked"
            )
        if not 0 <= expert_id < self.num_experts:
            raise ModelLoadError(
                f"expert {expert_id} out of range: the layer has {self.num_experts}"
            )
        if expert_id not in self.local_experts:
            return None
        return expert_id - self.local_experts.start

    def process_weights_after_loading(self) -> None:
        """Let the method repack or fold what it loaded (called once by the loader)."""
        self.quant_method.process_weights_after_loading(self)

    def extra_repr(self) -> str:
        p = self.parallel
        return (
            f"experts={self.num_experts} (local {self.num_local_experts}), top_k={self.top_k}, "
            f"hidden={self.hidden_size}, intermediate={self.intermediate_size} "
            f"(per rank {self.intermediate_size_per_partition}), renormalize={self.renormalize}, "
            f"activation={self.activation}{', bias' if self.has_bias else ''}, "
            f"tp={p.tp_rank}/{p.tp_size}, ep={p.ep_rank}/{p.ep_size}"
        )


# ---- checkpoint names -------------------------------------------------------------------------
_PER_EXPERT = re.compile(r"^(?P<layer>.+)\.(?P<expert>\d+)\.(?P<proj>\w+)\.(?P<suffix>\w+)$")
_STACKED = re.compile(
    r"^(?P<layer>.+)\.(?P<proj>gate_up_proj|gate_proj|up_proj|down_proj)(?:\.(?P<suffix>qweight))?$"
)
_STACKED_SHARDS = {"gate_up_proj": "w13", "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


class ExpertCheckpointMapping:
    """Routes a model's expert tensors from a checkpoint to its ``FusedMoE`` layers.

    ``proj_names`` maps the checkpoint's per-expert projection names to shards (Qwen's
    ``gate_proj/up_proj/down_proj`` or Mixtral's ``w1/w3/w2``). Names understood, for a layer
    at module path ``P`` (e.g. ``model.layers.0.mlp.experts``):

    * ``P.<expert>.<proj>.weight``: one expert's ``[I, H]`` gate/up or ``[H, I]`` down;
    * ``P.<expert>.<proj>.<suffix>``: a quantized method's per-expert tensor (a scale), loaded
      into the layer's ``w13_<suffix>`` / ``w2_<suffix>`` by that parameter's loader, or read
      and dropped when the method ignores the suffix;
    * ``P.gate_up_proj`` ``[E, 2I, H]``, ``P.gate_proj`` / ``P.up_proj`` ``[E, I, H]``,
      ``P.down_proj`` ``[E, H, I]`` (``.weight`` suffix optional): every expert at once;
      ``P.gate_proj.qweight`` and the like: every expert's quantized blocks at once (a GGUF
      file's stacks kept quantized), into the layer's ``w13_qweight`` / ``w2_qweight``.

    ``filter(weights)`` loads those and yields every other tensor; ``loaded()`` then returns
    the complete stacked parameters, or raises ``ModelLoadError`` naming the missing tensors.
    """

    def __init__(self, model: nn.Module, proj_names: Mapping[str, str] = QWEN_EXPERT_NAMES):
        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, FusedMoE)}
        self.proj_names = dict(proj_names)
        # (checkpoint suffix, shard, expert) of every tensor loaded, per layer.
        self._seen: dict[str, set[tuple[str, str, int]]] = {name: set() for name in self.layers}

    def _route(self, name: str) -> tuple[str, str, int | None, str] | None:
        """(layer, shard, expert or None when stacked, checkpoint suffix) of an expert tensor;
        suffix ``""`` for one the layer's method drops."""
        base = name[: -len(".weight")] if name.endswith(".weight") else name
        m = _STACKED.match(base)
        if m and m["layer"] in self.layers:
            return m["layer"], _STACKED_SHARDS[m["proj"]], None, m["suffix"] or "weight"
        m = _PER_EXPERT.match(name)
        if m and m["layer"] in self.layers:
            layer = self.layers[m["layer"]]
            suffix = m["suffix"]
            if suffix in layer.quant_method.ignored_checkpoint_suffixes:
                suffix = ""
            elif suffix not in expert_checkpoint_suffixes(layer):
                return None  # not an expert tensor this layer knows: the caller decides
            shard = self.proj_names.get(m["proj"])
            if shard is None:
                raise ModelLoadError(
                    f"checkpoint tensor {name!r}: unknown expert projection {m['proj']!r} "
                    f"(expected one of {', '.join(self.proj_names)})"
                )
            return m["layer"], shard, int(m["expert"]), suffix
        return None

    def filter(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Load every expert tensor of ``weights``; yield the others unchanged."""
        for name, tensor in weights:
            route = self._route(name)
            if route is None:
                yield name, tensor
                continue
            layer_name, shard, expert, suffix = route
            if not suffix:
                continue  # read and dropped by the layer's method (e.g. unused input scales)
            layer = self.layers[layer_name]
            param = getattr(layer, f"{'w2' if shard == 'w2' else 'w13'}_{suffix}")
            loader = getattr(param, "weight_loader", layer.weight_loader)
            try:
                loader(param, tensor, shard, expert)
            except ModelLoadError as e:
                raise ModelLoadError(f"checkpoint tensor {name!r}: {e}") from None
            experts = range(layer.num_experts) if expert is None else (expert,)
            parts = ("w1", "w3") if shard == "w13" else (shard,)
            self._seen[layer_name].update((suffix, p, e) for p in parts for e in experts)

    def loaded(self) -> set[str]:
        """Names of the stacked parameters every expert tensor arrived for; raises
        ``ModelLoadError`` listing (in the checkpoint's per-expert names) what is missing."""
        shard_names = {v: k for k, v in self.proj_names.items()}
        missing: list[str] = []
        done: set[str] = set()
        for layer_name, layer in self.layers.items():
            seen = self._seen[layer_name]
            for pname, param in layer.named_parameters(recurse=False):
                kind = getattr(param, "moe_shard_kind", None)
                if kind is None:
                    continue
                suffix = getattr(param, "checkpoint_suffix", "weight")
                parts = ("w1", "w3") if kind == "w13" else ("w2",)
                absent = [
                    f"{layer_name}.{e}.{shard_names[p]}.{suffix}"
                    for e in range(layer.num_experts)
                    for p in parts
                    if (suffix, p, e) not in seen
                ]
                if absent and getattr(param, "optional", False):
                    continue
                if absent:
                    missing += absent
                else:
                    done.add(f"{layer_name}.{pname}")
        if missing:
            shown = ", ".join(missing[:12])
            more = f" (and {len(missing) - 12} more)" if len(missing) > 12 else ""
            raise ModelLoadError(
                f"checkpoint is missing {len(missing)} expert tensor(s): {shown}{more}"
            )
        return done


def expert_projections(layer: Any) -> tuple[tuple[str, str, str], ...]:
    """The checkpoint names of an expert's (gate, up, down) projections that a quantization
    config should look up for ``layer``: the model's (``FusedMoE.proj_names``), or every
    family's (Qwen's ``gate_proj/up_proj/down_proj``, Mixtral's ``w1/w3/w2``) when unknown."""
    names = getattr(layer, "proj_names", None)
    return (tuple(names),) if names else EXPERT_PROJECTIONS


def expert_checkpoint_suffixes(layer: FusedMoE) -> set[str]:
    """The per-expert checkpoint suffixes the layer's parameters receive (``weight``, and a
    quantized method's scales)."""
    return {
        getattr(p, "checkpoint_suffix", "weight")
        for p in layer.parameters(recurse=False)
        if getattr(p, "moe_shard_kind", None) is not None
    }


# ---- expert load ------------------------------------------------------------------------------
def graph_capture_problems(model: nn.Module) -> list[str]:
    """The distinct reasons the model's MoE layers give (their methods'
    ``graph_capture_problem``) for why its decode steps cannot be captured in CUDA graphs on
    this platform, one line per kind (layers share them); empty when none."""
    problems: dict[str, None] = {}
    for layer in moe_layers(model):
        problem = layer.quant_method.graph_capture_problem(layer)
        if problem is not None:
            problems.setdefault(problem, None)
    return list(problems)


def moe_layers(model: nn.Module) -> list[FusedMoE]:
    """The model's ``FusedMoE`` layers, in module order."""
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def enable_expert_load_counting(model: nn.Module, enabled: bool = True) -> int:
    """Start (or stop) counting the tokens routed to each expert of every MoE layer; returns
    the number of MoE layers. Counting costs a few small device ops per layer and step (none
    while off, the default); it is recorded into CUDA graphs captured while it is on, and
    padding rows of a captured batch (cache slot -1) are not counted."""
    layers = moe_layers(model)
    for layer in layers:
        if enabled:
            device = next(layer.parameters()).device
            layer.expert_load = torch.zeros(layer.num_experts, dtype=torch.int64, device=device)
        else:
            layer.expert_load = None
    return len(layers)


def read_expert_load(model: nn.Module, reset: bool = False) -> torch.Tensor | None:
    """Tokens routed to each expert per MoE layer since counting started (or the last reset):
    int64 ``[num_moe_layers, num_experts]`` on the CPU, or None when not counting. One device
    synchronisation."""
    layers = [m for m in moe_layers(model) if m.expert_load is not None]
    if not layers:
        return None
    counts = torch.stack([m.expert_load for m in layers]).cpu()  # type: ignore[misc]
    if reset:
        for m in layers:
            m.expert_load.zero_()  # type: ignore[union-attr]
    return counts


def expert_load_summary(counts: torch.Tensor) -> dict[str, Any]:
    """Imbalance figures of ``read_expert_load``'s counts: per layer the tokens per expert,
    the busiest expert's load over the mean (1.0 is perfectly balanced) and the idle experts."""
    per_layer = []
    for row in counts.tolist():
        total = sum(row)
        mean = total / len(row) if row else 0.0
        per_layer.append(
            {
                "tokens_per_expert": row,
                "max_over_mean": round(max(row) / mean, 3) if mean else 0.0,
                "idle_experts": sum(1 for c in row if c == 0),
            }
        )
    ratios = [layer["max_over_mean"] for layer in per_layer]
    worst = max(range(len(ratios)), key=ratios.__getitem__) if ratios else -1
    return {
        "layers": len(per_layer),
        "routed_tokens": int(counts.sum()),
        "mean_max_over_mean": round(sum(ratios) / len(ratios), 3) if ratios else 0.0,
        "worst_layer": worst,
        "worst_max_over_mean": ratios[worst] if ratios else 0.0,
        "per_layer": per_layer,
    }
