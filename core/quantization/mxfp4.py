"""MXFP4 checkpoints (``quant_method: "mxfp4"``: GPT-OSS as OpenAI released it).

MXFP4 (the OCP microscaling format) stores a weight as 4-bit E2M1 values, two per byte (the
low nibble first), in blocks of 32 along the input dim, each block with one power-of-two scale
byte (E8M0: ``2 ** (byte - 127)``). GPT-OSS's checkpoints hold only the experts' weights this
way (``mlp.experts.gate_up_proj_blocks`` ``[E, N, K / 32, 16]`` uint8 and ``..._scales``
``[E, N, K / 32]`` uint8); attention, the router, the embeddings and the head are bf16.

Where a plugin provides ``fused_moe_mxfp4`` (engine's registry op for MXFP4 experts with
biases and GPT-OSS's clamped SwiGLU), the experts **stay in MXFP4** in memory
(``Mxfp4MoEMethod``: 4.25 bits a weight, the checkpoint's bytes with the gate/up rows
de-interleaved) and that kernel multiplies them. Elsewhere (the CPU, whose torch reference
would dequantize every routed expert on every call; a GPU without the plugin; a
tensor-parallel split that would cut the blocks of 32) the experts are **dequantized at load**
into the model dtype (``dequantize_mxfp4``, called by the GPT-OSS loader) and run as
unquantized experts, which then take about four times the memory they take in the file
(bf16). ``bind`` and ``get_moe_method`` say which in the log, as a warning on an accelerator.
Every other layer is unquantized in the checkpoint and stays so.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from engine.kernels.quantized import MXFP4_BLOCK, dequantize_mxfp4_experts
from engine.layers.fused_moe import FusedMoEMethodBase, host_loop_problem, register_expert_biases
from engine.layers.weight_utils import ModelLoadError, materialize, narrow, new_parameter
from engine.quantization.base import QuantizationConfig, QuantizationError, QuantizationSpec

if TYPE_CHECKING:
    from engine.layers.fused_moe import FusedMoE

logger = logging.getLogger(__name__)


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """MXFP4 ``blocks`` ``[..., G, 16]`` (uint8, two E2M1 codes a byte, low nibble first) and
    ``scales`` ``[..., G]`` (uint8 E8M0), the checkpoints' layout -> ``[..., G * 32]`` in
    ``dtype``: value ``v`` of block ``g`` is ``E2M1_VALUES[code] * 2 ** (scales[..., g] -
    127)`` (``engine.kernels.quantized.dequantize_mxfp4_experts``, which this runs a chunk of
    rows at a time so that its float32 temporaries stay near 64 MiB)."""
    shape = mxfp4_dequantized_shape(blocks.shape, scales.shape)
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise QuantizationError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
        )
    groups = blocks.shape[-2]
    rows = blocks.reshape(-1, groups * (MXFP4_BLOCK // 2))
    row_scales = scales.reshape(-1, groups)
    out = torch.empty((rows.shape[0], groups * MXFP4_BLOCK), dtype=dtype, device=blocks.device)
    chunk = max(1, (1 << 24) // (groups * MXFP4_BLOCK))
    for start in range(0, rows.shape[0], chunk):
        stop = start + chunk
        out[start:stop] = dequantize_mxfp4_experts(rows[start:stop], row_scales[start:stop], dtype)
    return out.view(shape)


def mxfp4_dequantized_shape(blocks: Sequence[int], scales: Sequence[int]) -> tuple[int, ...]:
    """The shape ``dequantize_mxfp4`` returns for blocks and scales of these shapes; raises
    ``QuantizationError`` when they do not pair (the loader's dry run checks this)."""
    blocks, scales = tuple(blocks), tuple(scales)
    if blocks[:-1] != scales or not blocks or blocks[-1] != MXFP4_BLOCK // 2:
        raise QuantizationError(
            f"MXFP4 blocks {blocks} do not match scales {scales} "
            f"(expected blocks [..., G, {MXFP4_BLOCK // 2}] and scales [..., G])"
        )
    return (*blocks[:-2], blocks[-2] * MXFP4_BLOCK)


class Mxfp4Config(QuantizationConfig):
    """MXFP4 expert weights (GPT-OSS): kept in MXFP4 where a plugin provides
    ``fused_moe_mxfp4``, else dequantized at load; see the module docstring."""

    name: ClassVar[str] = "mxfp4"
    checkpoint_formats: ClassVar[tuple[str, ...]] = ("mxfp4",)
    description: ClassVar[str] = (
        "MXFP4 expert weights (GPT-OSS checkpoints): kept in MXFP4 where a plugin provides "
        "fused_moe_mxfp4, else dequantized at load to the model dtype"
    )
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16", "float16")
    #: Keep the experts in MXFP4 even where only the torch reference multiplies them (it
    #: dequantizes every routed expert on every call: slow). Off; tests turn it on to run the
    #: kept-quantized path on the CPU.
    quantized_on_reference: ClassVar[bool] = False

    def __init__(self, modules_to_not_convert: list[str] | None = None) -> None:
        super().__init__()
        self.modules_to_not_convert = list(modules_to_not_convert or [])
        self.provider: str | None = None  # who multiplies kept MXFP4 experts (set by bind)
        self._logged: set[str] = set()

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Mxfp4Config:
        return cls(config.get("modules_to_not_convert"))

    def bind(self, spec: QuantizationSpec) -> None:
        kernels = spec.kernels
        if kernels is not None and (
            not kernels.is_reference("fused_moe_mxfp4") or self.quantized_on_reference
        ):
            self.provider = kernels.provider("fused_moe_mxfp4")
            logger.info(
                "mxfp4: the experts stay in MXFP4 (4.25 bits a weight), multiplied by %s's "
                "fused_moe_mxfp4",
                self.provider,
            )
            return
        level = logging.INFO if spec.is_cpu else logging.WARNING
        logger.log(
            level,
            "mxfp4: the experts' MXFP4 weights are dequantized at load to %s (about 4x their "
            "size in the file): no plugin provides fused_moe_mxfp4 on %s",
            spec.dtype or "the model dtype",
            spec.platform or "this platform",
        )

    def describe(self) -> str:
        if self.provider is not None:
            return "mxfp4 (experts kept in MXFP4)"
        return "mxfp4 (experts dequantized at load)"

    def get_linear_method(self, layer: Any, prefix: str) -> None:
        """Every linear layer of an MXFP4 checkpoint is unquantized (only experts are MXFP4)."""
        return None

    def get_moe_method(self, layer: Any, prefix: str) -> Mxfp4MoEMethod | None:
        """``Mxfp4MoEMethod`` where the experts stay in MXFP4 (``bind`` found a kernel, and
        this rank's share of the experts holds whole blocks of 32); None otherwise: unquantized
        experts, into which the model's loader dequantizes the MXFP4 blocks."""
        if self.provider is None:
            return None
        problem = Mxfp4MoEMethod.split_problem(layer)
        if problem is not None:
            if problem not in self._logged:
                self._logged.add(problem)
                logger.warning("mxfp4: %s; these experts are dequantized at load", problem)
            return None
        return Mxfp4MoEMethod()


class Mxfp4MoEMethod(FusedMoEMethodBase):
    """Experts kept in MXFP4 (the checkpoint's bytes, de-interleaved and cut to this rank's
    part), computed by ``fused_moe_mxfp4`` with their biases and activation:

    * ``w13_weight`` uint8 ``[E, 2I, H / 2]`` (gate rows, then up rows) and
      ``w13_weight_scale`` uint8 ``[E, 2I, H / 32]``;
    * ``w2_weight`` uint8 ``[E, H, I / 2]`` and ``w2_weight_scale`` uint8 ``[E, H, I / 32]``;
    * ``w13_bias`` / ``w2_bias`` in the model dtype, as the unquantized method's.

    Tensor parallelism splits each expert's intermediate features, which must keep whole
    blocks of 32 on every rank (``split_problem``); expert parallelism places whole experts.
    The loader (``GptOssForCausalLM``) hands each layer's stacked blocks and scales to
    ``load``."""

    activations = ("silu", "swigluoai")
    supports_bias = True
    #: The checkpoint stores the quantized values (the dummy loader asks this method for them).
    serialized = True

    @staticmethod
    def split_problem(layer: Any) -> str | None:
        """Why ``layer``'s experts cannot stay in MXFP4 on this rank (None: they can)."""
        ip = layer.intermediate_size_per_partition
        if layer.hidden_size % MXFP4_BLOCK:
            return (
                f"{layer.prefix}: the hidden size {layer.hidden_size} is not a multiple of "
                f"the MXFP4 block of {MXFP4_BLOCK}"
            )
        if ip % MXFP4_BLOCK:
            tp = layer.parallel.tp_size
            fits = [n for n in range(1, tp + 1) if layer.intermediate_size % (n * MXFP4_BLOCK) == 0]
            return (
                f"{layer.prefix}: each rank's {ip} of the experts' {layer.intermediate_size} "
                f"intermediate features (tensor-parallel size {tp}) would split an MXFP4 block "
                f"of {MXFP4_BLOCK}; sizes that keep whole blocks: "
                f"{', '.join(map(str, fits))}, or --enable-expert-parallel"
            )
        return None

    def create_weights(
        self,
        layer: FusedMoE,
        num_local_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        dtype: torch.dtype | None,
    ) -> None:
        e, h, ip = num_local_experts, hidden_size, intermediate_size_per_partition
        shapes = {
            "w13_weight": (e, 2 * ip, h // 2),
            "w13_weight_scale": (e, 2 * ip, h // MXFP4_BLOCK),
            "w2_weight": (e, h, ip // 2),
            "w2_weight_scale": (e, h, ip // MXFP4_BLOCK),
        }
        for name, shape in shapes.items():
            # No ``moe_shard_kind``: the stacked blocks come through ``load``, not through
            # the per-expert mapping (``ExpertCheckpointMapping``).
            layer.register_parameter(name, new_parameter(shape, torch.uint8))
        register_expert_biases(layer, e, ip, dtype)

    def load(
        self, layer: FusedMoE, kind: str, blocks: torch.Tensor, scales: torch.Tensor
    ) -> list[str]:
        """One layer's stacked MXFP4 experts of ``kind`` (``"w13"``: gate and up, rows
        already de-interleaved, ``[E, 2I, G, 16]`` / ``[E, 2I, G]``; ``"w2"``: ``[E, H, G,
        16]`` / ``[E, H, G]``) into this rank's parameters. Returns the parameters' names."""
        h, i = layer.hidden_size, layer.intermediate_size
        rows, features = (2 * i, h) if kind == "w13" else (h, i)
        groups = features // MXFP4_BLOCK
        want = (layer.num_experts, rows, groups)
        if tuple(scales.shape) != want or tuple(blocks.shape) != (*want, MXFP4_BLOCK // 2):
            raise ModelLoadError(
                f"{layer.prefix}: MXFP4 {kind} blocks {tuple(blocks.shape)} / scales "
                f"{tuple(scales.shape)}, expected {(*want, MXFP4_BLOCK // 2)} / {want}"
            )
        experts = layer.local_experts
        weight = getattr(layer, f"{kind}_weight")
        weight_scale = getattr(layer, f"{kind}_weight_scale")
        if weight.device.type == "meta":  # a shapes-only pass
            return [f"{kind}_weight", f"{kind}_weight_scale"]
        ip, rank = layer.intermediate_size_per_partition, layer.parallel.tp_rank
        for src, dst in ((blocks, weight), (scales, weight_scale)):
            mine = materialize(narrow(src, 0, experts.start, len(experts)))
            if kind == "w13":
                layer.copy_gate_up(dst.data, mine.flatten(2))
            else:
                per = ip // MXFP4_BLOCK  # this rank's blocks of the down projection's inputs
                dst.data.copy_(mine.narrow(2, rank * per, per).flatten(2))
        return [f"{kind}_weight", f"{kind}_weight_scale"]

    def init_dummy_weights(self, layer: FusedMoE, generator: torch.Generator) -> None:
        """``--load-format dummy``: random E2M1 codes with exponents ``2 ** -8`` to ``2 **
        -6`` (weights of magnitude up to about 0.09, std about 0.02), zero biases."""
        for name, param in layer.named_parameters(recurse=False):
            if name.endswith("_bias"):
                param.data.zero_()
            else:  # exponents 119-121, or codes of every byte value
                low, high = (119, 122) if name.endswith("_scale") else (0, 256)
                param.data.copy_(
                    torch.randint(low, high, param.shape, generator=generator,
                                  device=param.device, dtype=torch.uint8)
                )  # fmt: skip

    def dequantized(self, layer: FusedMoE, kind: str, dtype: torch.dtype = torch.float32):
        """This rank's stacked experts of ``kind`` dequantized (``[E, N, K]``): for tests and
        debugging."""
        return dequantize_mxfp4_experts(
            getattr(layer, f"{kind}_weight"), getattr(layer, f"{kind}_weight_scale"), dtype
        )

    def graph_capture_problem(self, layer: FusedMoE) -> str | None:
        return host_loop_problem(layer, "fused_moe_mxfp4")

    def apply(
        self,
        layer: FusedMoE,
        hidden: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        return layer.kernels.fused_moe_mxfp4(
            hidden,
            layer.w13_weight,
            layer.w2_weight,
            topk_weights,
            topk_ids,
            layer.w13_weight_scale,
            layer.w2_weight_scale,
            *layer.epilogue_args(),
        )
