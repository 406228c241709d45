"""FP8 (e4m3) linear layers: W8A8 with per-tensor or per-channel weight scales, the block-wise
format with 128x128 weight scales, and ``--quantization fp8`` online quantization.

``Fp8LinearMethod`` holds ``weight`` float8_e4m3fn ``[N, K]`` and a per-channel float32
``weight_scale`` ``[N]`` after loading (a checkpoint's per-tensor scales of fused q/k/v or
gate/up slices are expanded to their slice's channels, which is exact); activations are quantized
per token with a dynamic scale, or with the checkpoint's static ``input_scale`` (the fused
slices' static scales are requantized to their maximum, since the slices share one input).
``Fp8BlockLinearMethod`` keeps the checkpoint's ``[ceil(N / 128), ceil(K / 128)]`` block
scales; its activations are quantized per token and 128-wide group.

W8A8 needs FP8 arithmetic (CUDA compute capability 8.9+, where every FP8 method runs W8A8). On
the CPU the same weights are multiplied weight-only (activations unquantized), and the log says
so (``Fp8Config.bind``). GPUs without e4m3 conversion (CUDA before sm_89, ROCm) are refused
with that reason rather than served by a dequantized copy.

The ``fp8`` checkpoint format (config.json ``quantization_config``)::

    {"quant_method": "fp8", "activation_scheme": "dynamic" | "static",
     "weight_block_size": [128, 128] (optional), "ignored_layers": [...] (optional)}

stores ``weight`` (e4m3) and ``weight_scale`` (scalar, per tensor) + ``input_scale`` (static),
or ``weight`` + ``weight_scale_inv`` (block-wise; the scale to multiply by, despite its name).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from engine.kernels.quantized import FP8_DTYPE, Fp8Activation
from engine.layers.linear import LinearMethod, ShardLayout
from engine.layers.weight_utils import ModelLoadError, init_dummy_parameter
from engine.quantization.base import (
    QuantizationConfig,
    QuantizationError,
    QuantizationSpec,
    config_value,
    matches_module,
    require,
)
from engine.quantization.utils import (
    add_param,
    kernel,
    per_slice_scale,
    quantize_fp8_per_channel,
    quantize_fp8_per_tensor,
    random_fp8,
    replace_param,
)

if TYPE_CHECKING:
    from engine.layers.linear import LinearBase

logger = logging.getLogger(__name__)

# Dequantized dummy weights get the loader's normal(0, 0.02): stored values of std 64 (well
# inside e4m3's +-448) times this scale.
_DUMMY_STD = 64.0
_DUMMY_SCALE = 0.02 / _DUMMY_STD
# A static activation scale for dummy checkpoints: |x| up to ~7 before saturating.
_DUMMY_INPUT_SCALE = 1.0 / 64.0
FP8_W8A8_CAPABILITY = (8, 9)


def fp8_w8a8_reasons(spec: QuantizationSpec) -> list[str]:
    """Why FP8 activations cannot be used on ``spec`` (the weight-only path serves instead)."""
    if spec.device_type == "cpu":
        return ["the CPU has no FP8 arithmetic"]
    if spec.platform != "cuda":
        return [f"FP8 W8A8 kernels are only wired for CUDA, not {spec.platform}"]
    if not spec.has_capability(FP8_W8A8_CAPABILITY):
        return [f"FP8 tensor cores need sm_89 or newer (the device: {spec.capability})"]
    return []


def fp8_device_reasons(spec: QuantizationSpec) -> list[str]:
    """Why FP8 weights cannot run at all on ``spec``: the GPU kernels convert e4m3 with the
    hardware (Triton's fp8e4nv), which CUDA has from sm_89; ROCm's FP8 (e4m3fnuz) is not wired.
    (The CPU always can, weight-only.)"""
    if spec.device_type in (None, "cpu"):
        return []
    if spec.platform != "cuda":
        return [f"FP8 (e4m3fn) kernels are wired for CUDA sm_89+ and the CPU, not {spec.platform}"]
    if spec.capability is not None and not spec.has_capability(FP8_W8A8_CAPABILITY):
        return [
            f"FP8 kernels need CUDA sm_89 or newer (the device is "
            f"sm_{spec.capability[0]}{spec.capability[1]}); a weight-only path for older GPUs "
            "(e4m3 converted by bit shifts, as Marlin does) is not written yet"
        ]
    return []


def expand_slice_scales(layer: LinearBase, scales: torch.Tensor) -> torch.Tensor:
    """Per-slice scales ``[num_slices]`` -> per-channel ``[N]`` (each slice's channels take its
    scale): exact, so fused q/k/v keep their own scales."""
    sizes = torch.tensor(layer.output_slices, device=scales.device)
    return scales.float().repeat_interleave(sizes)


class Fp8LinearMethod(LinearMethod):
    """FP8 weights with per-tensor or per-channel scales (see the module docstring).

    ``serialized``: the checkpoint stores e4m3 weights (else ``weight`` arrives in the model
    dtype and is quantized after loading, per channel or per tensor as ``online_scheme``
    says). ``weight_scheme``: ``"tensor"`` (one scale per tensor, i.e. per fused slice) or
    ``"channel"`` (``weight_scale`` ``[N, 1]``). ``static_input``: the checkpoint has static
    ``input_scale``s. ``activation_quant``: W8A8 (else weight-only; set by the config for the
    device)."""

    def __init__(
        self,
        *,
        serialized: bool,
        weight_scheme: str = "tensor",
        static_input: bool = False,
        activation_quant: bool = True,
        online_scheme: str = "channel",
        name: str = "fp8",
    ) -> None:
        self.serialized = serialized
        self.weight_scheme = weight_scheme
        self.static_input = static_input
        self.activation_quant = activation_quant
        self.online_scheme = online_scheme
        self.name = name

    def create_weights(self, layer: LinearBase) -> None:
        out, inp = layer.output_size_per_partition, layer.input_size_per_partition
        dtype = FP8_DTYPE if self.serialized else layer.params_dtype
        add_param(layer, "weight", (out, inp), dtype, ShardLayout(0, 1))
        if not self.serialized:
            return
        if self.weight_scheme == "channel":
            layout = ShardLayout(output_dim=0, input_dim=None)
            add_param(layer, "weight_scale", (out, 1), torch.float32, layout)
        else:
            per_slice_scale(layer, "weight_scale")
        if self.static_input:
            per_slice_scale(layer, "input_scale")

    def init_dummy_weights(self, layer: LinearBase, generator: torch.Generator) -> None:
        for name, param in layer.named_parameters(recurse=False):
            if name == "weight" and param.dtype == FP8_DTYPE:
                param.data.copy_(random_fp8(param.shape, _DUMMY_STD, generator, param.device))
            elif name == "weight_scale":
                param.data.fill_(_DUMMY_SCALE)
            elif name == "input_scale":
                param.data.fill_(_DUMMY_INPUT_SCALE)
            else:
                init_dummy_parameter(name, param, generator)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        if not self.serialized:
            quantize = (
                quantize_fp8_per_channel
                if self.online_scheme == "channel"
                else quantize_fp8_per_tensor
            )
            q, scale = quantize(layer.weight.data)
            replace_param(layer, "weight", q)
            scale = scale.expand(q.shape[0]).contiguous()
        else:
            scale = layer.weight_scale.data.float()
            scale = (
                scale.reshape(-1)
                if self.weight_scheme == "channel"
                else expand_slice_scales(layer, scale)
            )
        if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
            raise ModelLoadError(f"{layer.prefix}: FP8 weight scales must be finite and > 0")
        replace_param(layer, "weight_scale", scale.contiguous())
        if self.static_input:
            # The slices share one input: one scale for all of them, their largest.
            replace_param(layer, "input_scale", layer.input_scale.data.float().amax().reshape(1))
        else:
            layer.input_scale = None

    def apply(
        self, layer: LinearBase, x: torch.Tensor | Fp8Activation, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x W^T + bias``; ``x`` may come quantized from its producer (``Fp8Activation``,
        see ``fp8_input_min_rows``)."""
        return kernel(layer, "fp8_linear")(
            x, layer.weight, layer.weight_scale, layer.input_scale, bias, self.activation_quant
        )

    def fp8_input_min_rows(self, layer: LinearBase) -> int | None:
        """W8A8 with dynamic per-token activation scales takes its input pre-quantized from
        as many rows as the bound ``fp8_linear`` says (``fp8_activation_min_rows``; an
        implementation without it never does). Static scales and weight-only: never."""
        if not self.activation_quant or self.static_input:
            return None
        return getattr(kernel(layer, "fp8_linear"), "fp8_activation_min_rows", None)


class Fp8BlockLinearMethod(LinearMethod):
    """FP8 weights with one scale per ``block_size`` block (``scale_name``: the checkpoint's
    name for it, ``weight_scale_inv`` in the fp8 format, ``weight_scale`` in
    compressed-tensors); activations quantized per token and ``block_size[1]``-wide group."""

    def __init__(
        self,
        block_size: tuple[int, int],
        *,
        scale_name: str = "weight_scale_inv",
        activation_quant: bool = True,
        name: str = "fp8 (block)",
    ) -> None:
        self.block_size = (int(block_size[0]), int(block_size[1]))
        self.scale_name = scale_name
        self.activation_quant = activation_quant
        self.name = name

    def create_weights(self, layer: LinearBase) -> None:
        bn, bk = self.block_size
        out, inp = layer.output_size_per_partition, layer.input_size_per_partition
        if inp % bk:
            raise QuantizationError(
                f"{layer.prefix}: {inp} input features are not a multiple of the {bk}-wide "
                "FP8 weight blocks (block-wise FP8 needs whole blocks along the input)"
            )
        for size in layer.output_slices:
            if size % bn and len(layer.output_slices) > 1:
                raise QuantizationError(
                    f"{layer.prefix}: a fused output slice of {size} features is not a "
                    f"multiple of the {bn}-row FP8 weight blocks"
                )
        add_param(layer, "weight", (out, inp), FP8_DTYPE, ShardLayout(0, 1))
        layout = ShardLayout(output_dim=0, input_dim=1, output_pack=bn, input_pack=bk)
        add_param(layer, self.scale_name, (-(-out // bn), inp // bk), torch.float32, layout)

    def init_dummy_weights(self, layer: LinearBase, generator: torch.Generator) -> None:
        for name, param in layer.named_parameters(recurse=False):
            if name == "weight":
                param.data.copy_(random_fp8(param.shape, _DUMMY_STD, generator, param.device))
            elif name == self.scale_name:
                param.data.fill_(_DUMMY_SCALE)
            else:
                init_dummy_parameter(name, param, generator)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        scale = getattr(layer, self.scale_name).data
        if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
            raise ModelLoadError(f"{layer.prefix}: FP8 block scales must be finite and > 0")

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return kernel(layer, "fp8_block_linear")(
            x,
            layer.weight,
            getattr(layer, self.scale_name),
            self.block_size,
            bias,
            self.activation_quant,
        )


class Fp8Config(QuantizationConfig):
    """``--quantization fp8``: online FP8 W8A8 of a bf16/fp16 checkpoint, or a checkpoint in
    the ``fp8`` format (per-tensor scales, static or dynamic activations; or 128x128 blocks)."""

    name: ClassVar[str] = "fp8"
    checkpoint_formats: ClassVar[tuple[str, ...]] = ("fp8",)
    description: ClassVar[str] = (
        "FP8 e4m3 W8A8 (per-channel/per-tensor or 128x128 block scales; online from bf16 "
        "with --quantization fp8); weight-only where there is no FP8 arithmetic"
    )
    supported_dtypes: ClassVar[tuple[str, ...]] = ("bfloat16", "float16", "float32")
    kernel_names: ClassVar[tuple[str, ...]] = ("fp8_linear", "fp8_block_linear")

    def __init__(
        self,
        *,
        serialized: bool,
        activation_scheme: str = "dynamic",
        weight_block_size: tuple[int, int] | None = None,
        ignored_layers: list[str] | None = None,
    ) -> None:
        super().__init__()
        self.serialized = serialized
        self.activation_scheme = activation_scheme
        self.weight_block_size = weight_block_size
        self.ignored_layers = list(ignored_layers or [])
        self.activation_quant = True  # set for the device by bind()

    @classmethod
    def from_flag(cls) -> Fp8Config:
        return cls(serialized=False)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Fp8Config:
        fmt = config.get("fmt", "e4m3")
        require(fmt, ("e4m3",), "fmt", "fp8")
        scheme = config.get("activation_scheme", "dynamic")
        require(scheme, ("dynamic", "static"), "activation_scheme", "fp8")
        block = config.get("weight_block_size")
        if block is not None:
            if len(block) != 2 or min(block) < 1:
                raise QuantizationError(
                    f"fp8 checkpoint has weight_block_size {block!r}; expected [rows, columns]"
                )
            block = (int(block[0]), int(block[1]))
            if scheme != "dynamic":
                raise QuantizationError(
                    "fp8 checkpoint has block-wise weight scales with activation_scheme "
                    "'static', which is not supported (supported: 'dynamic' with blocks)"
                )
        ignored = config_value(config, "ignored_layers", "modules_to_not_convert", default=[])
        return cls(
            serialized=True,
            activation_scheme=scheme,
            weight_block_size=block,
            ignored_layers=ignored,
        )

    @classmethod
    def supports(cls, spec: QuantizationSpec, kernel_names=None) -> list[str]:
        return super().supports(spec, kernel_names) + fp8_device_reasons(spec)

    def used_kernels(self) -> tuple[str, ...]:
        return ("fp8_block_linear",) if self.weight_block_size else ("fp8_linear",)

    def bind(self, spec: QuantizationSpec) -> None:
        """Choose W8A8 or weight-only for the device (logged when weight-only)."""
        why = fp8_w8a8_reasons(spec)
        self.activation_quant = not why
        if why:
            logger.warning(
                "fp8: %s, so FP8 weights are multiplied weight-only (activations stay %s)",
                why[0],
                spec.dtype or "in the model dtype",
            )

    def describe(self) -> str:
        if not self.serialized:
            how = "online from the checkpoint's weights, per-channel scales"
        elif self.weight_block_size:
            how = f"{self.weight_block_size[0]}x{self.weight_block_size[1]} block scales"
        else:
            how = f"per-tensor scales, {self.activation_scheme} activations"
        mode = "W8A8" if self.activation_quant else "weight-only"
        return f"fp8 ({how}; {mode})"

    def get_linear_method(self, layer: LinearBase, prefix: str) -> LinearMethod | None:
        names = self.checkpoint_names(prefix)
        if self.all_or_none(prefix, (matches_module(n, self.ignored_layers) for n in names)):
            return None
        if self.weight_block_size is not None:
            return Fp8BlockLinearMethod(
                self.weight_block_size,
                scale_name="weight_scale_inv",
                activation_quant=self.activation_quant,
            )
        return Fp8LinearMethod(
            serialized=self.serialized,
            weight_scheme="tensor",
            static_input=self.serialized and self.activation_scheme == "static",
            activation_quant=self.activation_quant,
        )

    def get_moe_method(self, layer: Any, prefix: str) -> Any:
        """FP8 experts for a ``FusedMoE`` (``engine.quantization.fp8_moe``), weight-only; None
        (unquantized experts) when the checkpoint's ignore list names them."""
        from engine.quantization.fp8_moe import fp8_moe_method

        if matches_module(self.checkpoint_names(prefix)[0], self.ignored_layers):
            return None
        return fp8_moe_method(
            self, layer, prefix, serialized=self.serialized, block_size=self.weight_block_size
        )
