"""GGUF mixture-of-experts layers kept quantized: ``GGUFMoEMethod``.

A GGUF MoE file (``qwen3moe``, ``qwen2moe``, Mixtral as a ``llama`` with experts) stores each
layer's experts as three stacks of GGUF blocks, ``ffn_gate_exps`` / ``ffn_up_exps`` ``[E, I,
H]`` and ``ffn_down_exps`` ``[E, H, I]``, each stack in one GGML type (a Q4_K_M file typically
has Q4_K gate and up stacks and a Q6_K or Q4_K down stack). Dequantized at load, the experts
of Qwen3-30B-A3B take 61 GB in bf16 against 17 GB in the file; this method keeps the blocks.

* **Loading.** The loader yields each stack raw (``<block>.experts.gate_proj.qweight`` ``uint8
  [E, rows, K / block_size, type_size]``), which ``ExpertCheckpointMapping`` routes to this
  layer's ``w13_qweight`` (gate and up) or ``w2_qweight`` (down) loader: it keeps this rank's
  experts (expert parallelism) and, under tensor parallelism, this rank's intermediate
  features: the gate and up stacks by rows, the down stack by whole blocks of its input
  features (refused at build when a rank's share does not start and end on a block).
* **After loading**, each expert's matrices go through the platform's ``gguf_linear.prepack``
  (the gate and up matrices joined into one ``[2I, H]`` product when they share a type, as
  ``GGUFLinearMethod`` joins a fused layer's parts), and the packed tensors of all experts are
  stacked into one parameter per tensor (``w13_<key>`` ``[E, ...]``), each expert's a view;
  packings that cannot be stacked (an opaque oneDNN tensor) stay one parameter per expert.
* **Compute on the CPU** (``integer=False``): where the platform's ``gguf_linear`` has
  ``routed_experts`` (an optional capability: the whole layer in one call over the stacked
  packings; the CPU plugin's AVX2 kernels, ``gguf_avx2_moe``), that; otherwise
  ``engine.kernels.reference.routed_expert_calls`` sorts the (token, choice) pairs by expert
  on the host and runs each expert that received tokens as ``gguf_linear`` (gate and up), the
  platform's ``silu_and_mul`` and ``gguf_linear`` (down). Both keep ``fused_moe``'s rounding
  points. The host loop syncs once per layer and step, which a CPU runs anyway.
* **Compute on a GPU** (``integer=True``): a host loop would break the decode steps' CUDA
  graphs, so the stacks are converted after loading to the operands of ``fused_moe_wna16``
  (``engine.kernels.gguf.integer_planes``: values packed 8 or 4 to an int32 word, a float32
  scale per group and, for the types with a minimum (Q4_1, Q5_1, Q4_K, Q5_K), a float32
  offset: ``W = scale * q + offset``; the symmetric types' values are shifted to the kernels'
  symmetric form instead; both exactly the blocks' weights) and run through the platform's
  fused expert kernels (engine-triton's: no host sync, graph-captured). 4-bit types stay
  4-bit; 5-, 6- and 8-bit types take a byte per value; a gate and an up stack of different
  types share the wider form (with offsets if either needs them). That is 5 bits a weight for
  Q4_0, 6 for Q4_K (4.5 in the file), 9 for Q8_0 and Q5_0, 10 for Q5_K and Q6_K (groups of
  16), against 16 in bf16. ``GGUFConfig`` picks this where the platform's ``fused_moe_wna16`` is a plugin's
  kernel, and dequantizes the stacks at load (said in the log) where it is the torch reference.

Stacks in a type ``gguf_linear`` does not multiply (F16, BF16, Q2_K, IQ*, ...) keep the layer
dequantized at load, as before, with a log line naming the layer and type.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.kernels.gguf import GGUFType
from engine.kernels.reference import routed_expert_calls
from engine.layers.fused_moe import FusedMoEMethodBase, host_loop_problem
from engine.layers.weight_utils import ModelLoadError, materialize, set_weight_loader
from engine.quantization.base import QuantizationError
from engine.quantization.utils import replace_param

if TYPE_CHECKING:
    from engine.layers.fused_moe import FusedMoE

logger = logging.getLogger(__name__)

# The checkpoint shards of the stacked layout and the projection each one is.
PROJECTIONS = {"w1": "gate", "w3": "up", "w2": "down"}


# Values converted per slice of experts: bounds the conversion's transient memory (the int64
# words of ``pack_int32``: 8 bytes a value) to about 1 GiB on the device.
CONVERT_VALUES = 1 << 27


class GGUFMoEMethod(FusedMoEMethodBase):
    """A ``FusedMoE`` whose gate, up and down stacks stay GGUF blocks of ``types["gate"]``,
    ``types["up"]`` and ``types["down"]`` (see the module docstring), packed per expert for
    ``gguf_linear`` or, with ``integer``, converted for ``fused_moe_wna16``."""

    def __init__(self, types: dict[str, GGUFType], integer: bool = False) -> None:
        self.types = types
        self.integer = integer
        #: with ``integer``, the bit width of the gate/up words and of the down words
        self.bits: tuple[int, int] = (0, 0)
        #: after loading, the gate/up products in output order: (type, parameter prefix); the
        #: down product is ``types["down"]`` under prefix ``w2``
        self.gate_up: list[tuple[GGUFType, str]] = []
        self._blocks: dict[str, torch.Tensor] = {}
        self._per_expert: dict[str, list[list[str]]] = {}  # prefix -> keys per expert
        self._stacked_keys: dict[str, list[str]] = {}

    # -- building ------------------------------------------------------------------------------
    def create_weights(
        self,
        layer: FusedMoE,
        num_local_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        dtype: torch.dtype | None,
    ) -> None:
        ip, rank = intermediate_size_per_partition, layer.parallel.tp_rank
        down = self.types["down"]
        for t, k in ((self.types["gate"], hidden_size), (self.types["up"], hidden_size)):
            if k % t.block_size:
                raise QuantizationError(
                    f"{layer.prefix}: {t.name} blocks hold {t.block_size} features, which do "
                    f"not divide the hidden size {hidden_size}"
                )
        if ip % down.block_size or (rank * ip) % down.block_size:
            raise QuantizationError(
                f"{layer.prefix}: the down projection's {down.name} blocks hold "
                f"{down.block_size} input features, but this rank's {ip} of "
                f"{layer.intermediate_size} intermediate features (tensor-parallel rank {rank} "
                f"of {layer.parallel.tp_size}) do not start and end on a block boundary; GGUF "
                "experts shard by whole blocks (choose a tensor_parallel_size that divides "
                "the blocks of a row, or --enable-expert-parallel)"
            )
        self.dtype = dtype or torch.get_default_dtype()
        e = num_local_experts
        shapes = {
            "gate": (e, ip, hidden_size // self.types["gate"].block_size),
            "up": (e, ip, hidden_size // self.types["up"].block_size),
            "down": (e, hidden_size, ip // down.block_size),
        }
        for proj, shape in shapes.items():
            t = self.types[proj]
            self._blocks[proj] = torch.empty(*shape, t.type_size, dtype=torch.uint8)
        # The loader's names: markers holding no data (the blocks live in ``_blocks`` until
        # they are packed), one per stacked layout the checkpoint fills.
        for kind in ("w13", "w2"):
            param = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
            param.moe_shard_kind = kind  # type: ignore[attr-defined]
            param.checkpoint_suffix = "qweight"  # type: ignore[attr-defined]
            set_weight_loader(param, self._loader(layer))
            layer.register_parameter(f"{kind}_qweight", param)

    def _loader(self, layer: FusedMoE) -> Any:
        def load(param: nn.Parameter, loaded: Any, shard_id: str, expert_id: int | None) -> None:
            proj = PROJECTIONS.get(shard_id)
            if proj is None or expert_id is not None:
                raise ModelLoadError(
                    f"{layer.prefix}: GGUF experts load as whole stacks of gate, up or down "
                    f"blocks, got shard {shard_id!r}"
                    + ("" if expert_id is None else f" of expert {expert_id}")
                )
            t = self.types[proj]
            full_rows = layer.hidden_size if proj == "down" else layer.intermediate_size
            full_k = layer.intermediate_size if proj == "down" else layer.hidden_size
            expected = (layer.num_experts, full_rows, full_k // t.block_size, t.type_size)
            if tuple(loaded.shape) != expected:
                raise ModelLoadError(
                    f"{layer.prefix}: {proj} stack of {t.name} blocks of shape "
                    f"{tuple(loaded.shape)}, expected {expected}"
                )
            experts = layer.local_experts
            value = materialize(loaded)[experts.start : experts.stop]
            ip, rank = layer.intermediate_size_per_partition, layer.parallel.tp_rank
            if ip != layer.intermediate_size:  # tensor parallel: this rank's features
                if proj == "down":
                    per = ip // t.block_size
                    value = value[:, :, rank * per : (rank + 1) * per]
                else:
                    value = value[:, rank * ip : (rank + 1) * ip]
            self._blocks[proj].copy_(value)

        return load

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        if self.integer:
            self._convert(layer)
            return
        op = layer.kernels.gguf_linear
        blocks = self._blocks
        gate, up = self.types["gate"], self.types["up"]
        if gate is up:  # one product: each expert's gate rows, then its up rows
            parts = [("w13", gate, torch.cat([blocks["gate"], blocks["up"]], dim=1))]
        else:
            parts = [("w1", gate, blocks["gate"]), ("w3", up, blocks["up"])]
        self._blocks = {}
        dtype = self.dtype
        self.gate_up = []
        for prefix, t, stack in parts:
            self._pack(layer, op, prefix, t, stack, dtype)
            self.gate_up.append((t, prefix))
        self._pack(layer, op, "w2", self.types["down"], blocks["down"], dtype)
        for kind in ("w13", "w2"):
            replace_param(layer, f"{kind}_qweight", None)

    def _pack(
        self,
        layer: FusedMoE,
        op: Any,
        prefix: str,
        t: GGUFType,
        stack: torch.Tensor,
        dtype: torch.dtype,
    ) -> None:
        packed = [
            op.prepack(stack[e].contiguous(), qtype=t.ggml_type, dtype=dtype)
            for e in range(stack.shape[0])
        ]
        keys = list(packed[0])
        stackable = all(
            list(p) == keys
            and all(
                p[k].layout == torch.strided
                and not p[k].is_mkldnn
                and p[k].shape == packed[0][k].shape
                and p[k].dtype == packed[0][k].dtype
                for k in keys
            )
            for p in packed
        )
        if stackable:
            for key in keys:
                replace_param(layer, f"{prefix}_{key}", torch.stack([p[key] for p in packed]))
            self._stacked_keys[prefix] = keys
        else:
            for e, p in enumerate(packed):
                for key, tensor in p.items():
                    replace_param(layer, f"{prefix}_{e}_{key}", tensor)
            self._per_expert[prefix] = [list(p) for p in packed]

    def _convert(self, layer: FusedMoE) -> None:
        """The stacks as ``fused_moe_wna16``'s words, scales and offsets (``w13_*``: each
        expert's gate rows then its up rows; ``w2_*``), a slice of experts at a time."""
        from engine.kernels.gguf import integer_planes

        blocks, self._blocks = self._blocks, {}
        gate, up, down = self.types["gate"], self.types["up"], self.types["down"]
        bits13 = 4 if gate.bits == up.bits == 4 else 8
        group13 = min(gate.group, up.group)
        bits2 = 4 if down.bits == 4 else 8
        offsets13 = not (gate.symmetric and up.symmetric)  # one form for the joined product
        parts = {
            "w13": [
                ("gate", gate, bits13, group13, offsets13),
                ("up", up, bits13, group13, offsets13),
            ],
            "w2": [("down", down, bits2, down.group, None)],
        }
        for prefix, stacks in parts.items():
            held = [blocks.pop(proj) for proj, *_ in stacks]  # freed once converted
            e, rows = held[0].shape[0], sum(b.shape[1] for b in held)
            k = held[0].shape[2] * stacks[0][1].block_size
            step = max(1, CONVERT_VALUES // (rows * k))
            slices = []
            for lo in range(0, e, step):
                planes = [
                    integer_planes(b[lo : lo + step], t.ggml_type, n, g, o)
                    for b, (_, t, n, g, o) in zip(held, stacks, strict=True)
                ]
                slices.append(
                    [
                        None if p[0] is None else torch.cat(p, dim=1)
                        for p in zip(*planes, strict=True)
                    ]
                )
            del held
            for key, tensors in zip(
                ("qweight", "scales", "offsets"), zip(*slices, strict=True), strict=True
            ):
                if tensors[0] is not None:  # no offsets: symmetric types
                    replace_param(layer, f"{prefix}_{key}", torch.cat(tensors))
        self.bits = (bits13, bits2)

    def _packed(self, layer: FusedMoE, prefix: str, expert: int) -> dict[str, torch.Tensor]:
        keys = self._stacked_keys.get(prefix)
        if keys is not None:
            return {key: getattr(layer, f"{prefix}_{key}")[expert] for key in keys}
        names = self._per_expert[prefix][expert]
        return {key: getattr(layer, f"{prefix}_{expert}_{key}") for key in names}

    # -- compute -------------------------------------------------------------------------------
    def graph_capture_problem(self, layer: FusedMoE) -> str | None:
        # The CPU path (gguf_linear) runs where native plans, not CUDA graphs, record steps.
        return host_loop_problem(layer, "fused_moe_wna16") if self.integer else None

    def apply(
        self,
        layer: FusedMoE,
        hidden: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        if self.integer:
            assert self.bits[0], "GGUF experts used before process_weights_after_loading"
            return layer.kernels.fused_moe_wna16(
                hidden, layer.w13_qweight, layer.w2_qweight, topk_weights, topk_ids,
                layer.w13_scales, layer.w2_scales, None, None, self.bits[0], None, None,
                getattr(layer, "w13_offsets", None), getattr(layer, "w2_offsets", None),
                self.bits[1],
            )  # fmt: skip
        op = layer.kernels.gguf_linear
        silu_and_mul = layer.kernels.silu_and_mul
        assert self.gate_up, "GGUF experts used before process_weights_after_loading"
        down_type, down_prefix = self.types["down"], "w2"
        whole_layer = getattr(op, "routed_experts", None)
        prefixes = [prefix for _t, prefix in self.gate_up] + [down_prefix]
        if whole_layer is not None and all(p in self._stacked_keys for p in prefixes):
            stacked = [
                {key: getattr(layer, f"{p}_{key}") for key in self._stacked_keys[p]}
                for p in prefixes
            ]
            out = whole_layer(hidden, topk_weights, topk_ids, stacked[:-1], stacked[-1])
            if out is not None:
                return out

        def expert_mlp(expert: int, x: torch.Tensor) -> torch.Tensor:
            if len(self.gate_up) == 1:
                t, prefix = self.gate_up[0]
                gate_up = op(x, self._packed(layer, prefix, expert), qtype=t.ggml_type)
            else:
                gate_up = torch.cat(
                    [
                        op(x, self._packed(layer, prefix, expert), qtype=t.ggml_type)
                        for t, prefix in self.gate_up
                    ],
                    dim=-1,
                )
            act = silu_and_mul(gate_up)
            packed = self._packed(layer, down_prefix, expert)
            return op(act, packed, qtype=down_type.ggml_type)

        return routed_expert_calls(
            hidden, layer.num_local_experts, expert_mlp, topk_weights, topk_ids
        )
