"""The linear-layer family: one set of classes for replication, tensor parallelism, quantization
and LoRA.

A linear layer ``y = x W^T + b`` (``W`` logically ``[output_size, input_size]``, as ``nn.Linear``
stores it) knows three things, each in one place:

* **its parallel style** (the class): ``ReplicatedLinear`` (every rank holds all of it),
  ``ColumnParallelLinear`` (output features split over the tensor-parallel ranks; the fused
  ``MergedColumnParallelLinear`` for gate/up and ``QKVParallelLinear`` for q/k/v split each of
  their *output slices* separately) and ``RowParallelLinear`` (input features split; the partial
  products are summed with an all-reduce through the platform's ``Communicator``);
* **its** ``LinearMethod``: how the weights are created, loaded, post-processed and multiplied.
  ``UnquantizedLinearMethod`` is one method among the quantization methods (FP8, GPTQ, AWQ,
  GGUF, ...), which subclass ``LinearMethod``; the model's quantization config picks one per
  layer (``get_linear_method(layer, prefix)``), so a quantized layer is sharded by the same
  classes as a plain one;
* **its output slices** (``output_partition_sizes``): a LoRA wrapper adds ``x @ A @ B`` per
  slice, and a quantization method with per-slice scales reads them.

Parameters made by a method carry a ``ShardLayout`` (``param.shard_layout``) that tells the
layer's loader how the parameter's dimensions map to the layer's logical input and output
features. That is all the loader needs to cut the rank's shard out of any format, e.g.:

====================================  =========================================================
parameter                             layout
====================================  =========================================================
plain weight ``[out, in]``            ``ShardLayout(output_dim=0, input_dim=1)``
GPTQ qweight ``[in/8, out]`` int32    ``ShardLayout(output_dim=1, input_dim=0, input_pack=8)``
GPTQ scales ``[in/group, out]``       ``ShardLayout(output_dim=1, input_dim=0, input_pack=group)``
AWQ qweight ``[in, out/8]`` int32     ``ShardLayout(output_dim=1, output_pack=8, input_dim=0)``
FP8 block scale ``[out/128, in/128]``  ``ShardLayout(output_dim=0, output_pack=128, input_dim=1,
                                      input_pack=128)`` (sizes rounded up)
per-tensor scale of each fused slice  ``ShardLayout(output_dim=None, input_dim=None,
                                      per_slice=True)`` (shape ``[num_slices]``)
====================================  =========================================================

Checkpoint tensors reach a parameter's ``weight_loader(param, loaded, shard_id=None)``; for a
fused layer ``shard_id`` names the slice (``"q"``/``"k"``/``"v"`` or ``0``/``1``), and ``None``
means the checkpoint stores the fused tensor whole (Phi-3's ``qkv_proj``), which is split here.
``loaded`` may be a lazy tensor (anything with ``shape`` and ``narrow``): only the rank's shard
is materialised (``engine.layers.weight_utils.narrow`` / ``materialize``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.weight_utils import (
    ModelLoadError,
    check_shape,
    init_dummy_parameter,
    materialize,
    narrow,
    new_parameter,
    set_weight_loader,
)
from engine.parallel import SINGLE_PROCESS, ParallelContext, divide

if TYPE_CHECKING:
    from engine.kernels.registry import Kernels
    from engine.models.context import ModelContext


def linear_op(kernels: Kernels | None) -> Callable[..., torch.Tensor]:
    """The platform's ``linear`` kernel (e.g. engine-llm-triton's skinny GEMM for decode batches on
    GPUs), or ``F.linear`` when the layer is built without a kernel registry."""
    return F.linear if kernels is None else kernels.linear


# ---- how parameters map onto the layer's features ---------------------------------------------
@dataclass(frozen=True)
class ShardLayout:
    """How a parameter's dimensions run along the layer's logical features.

    ``output_dim`` / ``input_dim``: the parameter dimension that runs along the output / input
    features (None: the parameter does not vary along them, so every rank keeps it whole).
    ``output_pack`` / ``input_pack``: how many logical features one element along that dimension
    stands for (8 int4 values per int32, a quantization group, a 128-wide scale block); sizes
    that do not divide are rounded up, as block-scale tensors are. ``per_slice``: one element per
    fused output slice (a per-tensor scale of q, k and v), loaded at the slice's index.
    """

    output_dim: int | None = 0
    input_dim: int | None = 1
    output_pack: int = 1
    input_pack: int = 1
    per_slice: bool = False


def set_shard_layout(param: nn.Parameter, layout: ShardLayout) -> nn.Parameter:
    """Attach ``layout`` to ``param`` (read by the linear layers' loaders) and return it."""
    param.shard_layout = layout  # type: ignore[attr-defined]
    return param


def shard_layout(param: torch.Tensor) -> ShardLayout:
    """``param``'s layout; a parameter without one is a plain ``[out, in]`` (or ``[out]``)."""
    layout = getattr(param, "shard_layout", None)
    if layout is not None:
        return layout
    return ShardLayout(output_dim=0, input_dim=1 if param.dim() > 1 else None)


def _packed_extent(start: int, length: int, pack: int, full: int, what: str) -> tuple[int, int]:
    """Element ``(start, length)`` along a dimension packed ``pack`` logical features per
    element, for the logical range ``[start, start + length)`` of a ``full``-wide dimension."""
    if pack == 1:
        return start, length
    if start % pack:
        raise ModelLoadError(
            f"{what}: a shard starting at feature {start} does not fall on a {pack}-wide packed "
            "element boundary; choose a tensor_parallel_size that keeps shards aligned"
        )
    if length % pack and start + length != full:
        raise ModelLoadError(
            f"{what}: a shard of {length} features is not a multiple of the {pack}-wide packing"
        )
    return start // pack, math.ceil(length / pack)


# ---- the method seam ---------------------------------------------------------------------------
class LinearMethod:
    """How a linear layer's weights are created, loaded and multiplied.

    ``create_weights`` registers the parameters on the layer (``layer.register_parameter``), each
    with a ``ShardLayout``, sized from the layer's per-rank sizes (``input_size_per_partition``,
    ``output_partition_sizes``, ``params_dtype``); the layer attaches its sharding loader to
    every parameter that has no ``weight_loader`` of its own. ``process_weights_after_loading``
    runs once after every tensor arrived (repacking for a kernel, requantizing fused slices to a
    common scale, ...). ``apply`` computes ``x W^T + bias`` for this rank's shard.
    """

    #: the name ``engine plugins`` and logs show (a quantization method's registry name)
    name: str = "unquantized"

    def create_weights(self, layer: LinearBase) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """Called once after loading; the default keeps the weights as loaded."""

    def init_dummy_weights(self, layer: LinearBase, generator: torch.Generator) -> None:
        """Seeded random values for ``--load-format dummy`` (benchmarks of big shapes), before
        ``process_weights_after_loading``. The default fills floating-point parameters by the
        loader's rule (normal(0, 0.02) matrices, zero biases, unit vectors); a quantized format
        overrides it with random packed values and sane positive scales."""
        for name, param in layer.named_parameters(recurse=False):
            init_dummy_parameter(name, param, generator)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def fp8_input_min_rows(self, layer: LinearBase) -> int | None:
        """From how many rows ``apply`` takes an ``engine.kernels.quantized.Fp8Activation``
        (the input already quantized to e4m3 per token by the kernel that produced it, see
        ``engine.layers.fp8_input``) in place of ``x`` with the same result; None (the
        default): never. Asked at every call, so a method swapped in later (a LoRA wrapper)
        answers for itself."""
        return None


class UnquantizedLinearMethod(LinearMethod):
    """Weights in the model dtype, ``[output_size_per_partition, input_size_per_partition]``,
    multiplied by the platform's ``linear`` kernel."""

    name = "unquantized"

    def create_weights(self, layer: LinearBase) -> None:
        weight = new_parameter(
            (layer.output_size_per_partition, layer.input_size_per_partition), layer.params_dtype
        )
        layer.register_parameter("weight", set_shard_layout(weight, ShardLayout(0, 1)))

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return layer.linear_op(x, layer.weight, bias)


UNQUANTIZED = UnquantizedLinearMethod()


class QuantizationConfig(Protocol):
    """What a layer asks of the model's quantization config (``ModelContext.quant_config``).

    The quantization registry (``engine.quantization``) builds these from ``--quantization`` or
    the checkpoint's ``quantization_config``."""

    def get_linear_method(self, layer: LinearBase, prefix: str) -> LinearMethod | None:
        """The method for the layer named ``prefix`` (``None``: leave it unquantized)."""


# ---- the layers ----------------------------------------------------------------------------
class LinearBase(nn.Module):
    """What every linear layer shares: sizes, the parallel context, the method and the bias.

    Built with a ``ModelContext`` (its dtype, kernels, parallel context and quantization config
    apply) or, in tests, with explicit ``dtype`` / ``kernels`` (single process, unquantized).
    ``prefix`` is the layer's module name in the checkpoint (``model.layers.0.self_attn.qkv_proj``):
    quantization configs decide per layer by it. Subclasses set the per-rank sizes in
    ``_partition`` and the loader in ``weight_loader``.
    """

    #: parallel style, for logs and ``extra_repr``
    style = "replicated"

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        *,
        ctx: ModelContext | None = None,
        prefix: str = "",
        dtype: torch.dtype | None = None,
        kernels: Kernels | None = None,
        quant_method: LinearMethod | None = None,
    ) -> None:
        super().__init__()
        parallel = ctx.parallel if ctx is not None else SINGLE_PROCESS
        self.parallel: ParallelContext = parallel
        self.prefix = prefix
        self.params_dtype = dtype if dtype is not None else (ctx.dtype if ctx else None)
        # The platform's bound ops (None in tests that build layers alone: references then).
        self.kernels: Kernels | None = kernels if kernels is not None else (ctx and ctx.kernels)
        self.linear_op = linear_op(self.kernels)
        self.input_size = input_size
        self.output_full_sizes = [int(s) for s in output_sizes]
        self.output_size = sum(self.output_full_sizes)
        self.tp_rank, self.tp_size = self._tp_place(parallel)
        self.input_size_per_partition, self.output_partition_sizes = self._partition()
        self.output_size_per_partition = sum(self.output_partition_sizes)
        if quant_method is None:
            quant_config = getattr(ctx, "quant_config", None) if ctx is not None else None
            if quant_config is not None:
                quant_method = quant_config.get_linear_method(self, prefix)
        self.quant_method: LinearMethod = quant_method or UNQUANTIZED
        self.quant_method.create_weights(self)
        self.bias = self._make_bias() if bias else None
        for param in self.parameters(recurse=False):
            if getattr(param, "weight_loader", None) is None:
                set_weight_loader(param, self.weight_loader)

    # -- sizes -------------------------------------------------------------------------------
    def _tp_place(self, parallel: ParallelContext) -> tuple[int, int]:
        """(rank, size) this layer is split over: the tensor-parallel group, or (0, 1)."""
        return 0, 1

    def _partition(self) -> tuple[int, list[int]]:
        """(input size per rank, per-rank size of each output slice)."""
        return self.input_size, list(self.output_full_sizes)

    @property
    def output_slices(self) -> list[int]:
        """This rank's size of each fused output slice, in order (one slice when unfused)."""
        return list(self.output_partition_sizes)

    def _make_bias(self) -> nn.Parameter:
        bias = new_parameter((self.output_size_per_partition,), self.params_dtype)
        return set_shard_layout(bias, ShardLayout(output_dim=0, input_dim=None))

    # -- loading ------------------------------------------------------------------------------
    def weight_loader(
        self, param: nn.Parameter, loaded: Any, shard_id: object | None = None
    ) -> None:
        """Copy a checkpoint tensor whole (replicated layers)."""
        self._copy(param, loaded, f"{self.prefix or type(self).__name__}")

    @staticmethod
    def _copy(param: torch.Tensor, loaded: Any, what: str, dst: torch.Tensor | None = None) -> None:
        dst = param.data if dst is None else dst
        check_shape(what, dst.shape, tuple(loaded.shape))
        dst.copy_(materialize(loaded))

    def process_weights_after_loading(self) -> None:
        """Let the method repack what was loaded (the loader calls this once per layer)."""
        self.quant_method.process_weights_after_loading(self)

    # -- compute ------------------------------------------------------------------------------
    def fp8_input_min_rows(self) -> int | None:
        """From how many rows ``forward`` takes an ``Fp8Activation`` in place of ``x``
        (``LinearMethod.fp8_input_min_rows``; None: never)."""
        return self.quant_method.fp8_input_min_rows(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def extra_repr(self) -> str:
        parts = [
            f"in={self.input_size_per_partition}",
            f"out={self.output_size_per_partition}",
            f"bias={self.bias is not None}",
        ]
        if self.tp_size > 1:
            parts.append(f"{self.style} {self.tp_rank}/{self.tp_size}")
        if self.quant_method is not UNQUANTIZED:
            parts.append(f"method={self.quant_method.name}")
        return ", ".join(parts)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole layer (small projections, routers, single-device models)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, **kw: Any) -> None:
        super().__init__(input_size, [output_size], bias, **kw)


class ColumnParallelLinear(LinearBase):
    """Output features split over the tensor-parallel ranks: rank ``r`` computes its
    ``output_size / tp_size`` features of every output slice from the whole input.

    The result stays split (the next layer is usually row-parallel) unless ``gather_output``,
    which concatenates the ranks' outputs (single-slice layers only).
    """

    style = "column"

    def __init__(
        self,
        input_size: int,
        output_size: int | Sequence[int],
        bias: bool = False,
        *,
        gather_output: bool = False,
        **kw: Any,
    ) -> None:
        sizes = [output_size] if isinstance(output_size, int) else list(output_size)
        self.gather_output = gather_output
        super().__init__(input_size, sizes, bias, **kw)
        if gather_output and len(self.output_full_sizes) > 1:
            raise ValueError("gather_output is only defined for a single output slice")

    def _tp_place(self, parallel: ParallelContext) -> tuple[int, int]:
        return parallel.tp_rank, parallel.tp_size

    def _partition(self) -> tuple[int, list[int]]:
        what = f"output features of {self.prefix or type(self).__name__}"
        return self.input_size, [divide(s, self.tp_size, what) for s in self.output_full_sizes]

    def _slice_index(self, shard_id: object) -> int:
        return 0 if shard_id is None else int(shard_id)  # type: ignore[call-overload]

    def _shard_rank(self, slice_index: int) -> int:
        """Which part of slice ``slice_index`` this rank holds (its tp rank, unless the slice
        is replicated over several ranks, as KV heads are when there are fewer than ranks)."""
        return self.tp_rank

    def weight_loader(
        self, param: nn.Parameter, loaded: Any, shard_id: object | None = None
    ) -> None:
        """Copy this rank's part of checkpoint slice ``shard_id`` (the whole fused tensor when
        ``None`` on a layer with several slices) into its place in ``param``."""
        if shard_id is None and len(self.output_full_sizes) > 1:
            self._load_fused_whole(param, loaded)
            return
        s = self._slice_index(shard_id)
        layout = shard_layout(param)
        what = f"{self.prefix or type(self).__name__} slice {shard_id!r}"
        if layout.per_slice:
            self._copy(param, loaded, what, dst=param.data[s : s + 1].view(tuple(loaded.shape)))
            return
        if layout.output_dim is None:
            self._copy(param, loaded, what)
            return
        d, pack = layout.output_dim, layout.output_pack
        full, part = self.output_full_sizes[s], self.output_partition_sizes[s]
        src_start, length = _packed_extent(self._shard_rank(s) * part, part, pack, full, what)
        offset = sum(self.output_partition_sizes[:s])
        dst_start, _ = _packed_extent(offset, part, pack, self.output_size_per_partition, what)
        expected = list(param.shape)
        expected[d] = math.ceil(full / pack)
        check_shape(what, expected, tuple(loaded.shape))
        self._copy(
            param,
            narrow(loaded, d, src_start, length),
            what,
            dst=param.data.narrow(d, dst_start, length),
        )

    def _load_fused_whole(self, param: nn.Parameter, loaded: Any) -> None:
        """A checkpoint that stores the fused slices as one tensor: load each slice."""
        layout = shard_layout(param)
        if layout.output_dim is None or layout.per_slice:
            raise ModelLoadError(
                f"{self.prefix}: a fused checkpoint tensor cannot fill a per-slice parameter"
            )
        d, pack = layout.output_dim, layout.output_pack
        start = 0
        for s, full in enumerate(self.output_full_sizes):
            n = math.ceil(full / pack)
            self.weight_loader(param, narrow(loaded, d, start, n), self._slice_id(s))
            start += n
        check_shape(f"{self.prefix} fused tensor", (start,), (tuple(loaded.shape)[d],))

    def _slice_id(self, index: int) -> object:
        return index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x, self.bias)
        if self.gather_output and self.tp_size > 1:
            y = self.parallel.tp.all_gather(y, dim=-1)
        return y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused along the output (gate and
    up): each slice is split over the ranks separately, so a rank holds ``[gate_r | up_r]``.
    Checkpoint tensor ``i`` is loaded with ``shard_id=i``."""

    def __init__(
        self, input_size: int, output_sizes: Sequence[int], bias: bool = False, **kw: Any
    ) -> None:
        super().__init__(input_size, list(output_sizes), bias, **kw)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Split a fused output into this rank's slices (views)."""
        return y.split(self.output_partition_sizes, dim=-1)


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections fused, split by head: rank ``r`` holds
    ``num_heads / tp`` query heads and ``num_kv_heads / tp`` key/value heads; with fewer KV heads
    than ranks each KV head is replicated on ``tp / num_kv_heads`` consecutive ranks. Slices are
    loaded with ``shard_id`` ``"q"``, ``"k"``, ``"v"``. ``num_heads`` / ``num_kv_heads`` are this
    rank's counts (what its attention layer uses)."""

    _SLICES = {"q": 0, "k": 1, "v": 2}

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = False,
        **kw: Any,
    ) -> None:
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads or total_num_heads
        super().__init__(
            hidden_size,
            [
                total_num_heads * head_size,
                self.total_num_kv_heads * head_size,
                self.total_num_kv_heads * head_size,
            ],
            bias,
            **kw,
        )

    def _partition(self) -> tuple[int, list[int]]:
        tp = self.tp_size
        self.num_heads = divide(self.total_num_heads, tp, "attention heads")
        if self.total_num_kv_heads >= tp:
            self.num_kv_heads = divide(self.total_num_kv_heads, tp, "key/value heads")
            self.kv_replicas = 1
        else:
            if tp % self.total_num_kv_heads:
                raise ValueError(
                    f"tensor_parallel_size {tp} must be a multiple of the number of key/value "
                    f"heads ({self.total_num_kv_heads}) when it is larger than it"
                )
            self.num_kv_heads = 1
            self.kv_replicas = tp // self.total_num_kv_heads
        self.q_size = self.num_heads * self.head_size
        self.kv_size = self.num_kv_heads * self.head_size
        return self.input_size, [self.q_size, self.kv_size, self.kv_size]

    def _slice_index(self, shard_id: object) -> int:
        if shard_id not in self._SLICES:
            raise ModelLoadError(f"{self.prefix}: unknown q/k/v shard {shard_id!r}")
        return self._SLICES[shard_id]  # type: ignore[index]

    def _slice_id(self, index: int) -> object:
        return "qkv"[index]

    def _shard_rank(self, slice_index: int) -> int:
        return self.tp_rank if slice_index == 0 else self.tp_rank // self.kv_replicas

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split a fused output ``[T, q+2kv]`` into this rank's (q, k, v) views."""
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(LinearBase):
    """Input features split over the tensor-parallel ranks: rank ``r`` multiplies its part of
    the (already split, ``input_is_parallel``) input by its columns of ``W``, and the partial
    products are summed with an all-reduce (``reduce_results``). The bias is added once, on
    rank 0, before the sum."""

    style = "row"

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        input_is_parallel: bool = True,
        reduce_results: bool = True,
        **kw: Any,
    ) -> None:
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        super().__init__(input_size, [output_size], bias, **kw)

    def _tp_place(self, parallel: ParallelContext) -> tuple[int, int]:
        return parallel.tp_rank, parallel.tp_size

    def _partition(self) -> tuple[int, list[int]]:
        what = f"input features of {self.prefix or type(self).__name__}"
        return divide(self.input_size, self.tp_size, what), list(self.output_full_sizes)

    def _make_bias(self) -> nn.Parameter:
        bias = new_parameter((self.output_size_per_partition,), self.params_dtype)
        return set_shard_layout(bias, ShardLayout(output_dim=None, input_dim=None))

    def weight_loader(
        self, param: nn.Parameter, loaded: Any, shard_id: object | None = None
    ) -> None:
        """Copy this rank's input columns of a checkpoint tensor (whole when the parameter does
        not run along the input, e.g. the bias)."""
        layout = shard_layout(param)
        what = self.prefix or type(self).__name__
        if layout.input_dim is None or self.tp_size == 1:
            self._copy(param, loaded, what)
            return
        d, pack = layout.input_dim, layout.input_pack
        part = self.input_size_per_partition
        start, length = _packed_extent(self.tp_rank * part, part, pack, self.input_size, what)
        self._copy(param, narrow(loaded, d, start, length), what)

    def fp8_input_min_rows(self) -> int | None:
        # A layer that cuts its rank's columns out of the whole input needs it unquantized.
        if not self.input_is_parallel and self.tp_size > 1:
            return None
        return super().fp8_input_min_rows()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel and self.tp_size > 1:
            x = x.narrow(
                -1, self.tp_rank * self.input_size_per_partition, self.input_size_per_partition
            )
        bias = self.bias if self.tp_rank == 0 else None
        y = self.quant_method.apply(self, x, bias)
        if self.reduce_results and self.tp_size > 1:
            y = self.parallel.tp.all_reduce(y)
        return y


def process_weights_after_loading(model: nn.Module) -> None:
    """Give every layer with a weight method its post-loading pass (repacking, requantizing):
    the linears, and any other layer family that defines ``process_weights_after_loading()``
    (``FusedMoE``)."""
    for module in model.modules():
        hook = getattr(module, "process_weights_after_loading", None)
        if module is not model and callable(hook):
            hook()
