"""INT8 W8A8 linear layers (compressed-tensors ``int-quantized``, SmoothQuant-style).

``weight`` int8 ``[N, K]`` with a per-channel (``[N, 1]``) or per-tensor (per fused slice)
scale, expanded to a float32 ``weight_scale`` ``[N]`` after loading. Activations are quantized
to int8 per token with a dynamic symmetric scale, or with the checkpoint's static
``input_scale`` (and ``input_zero_point`` for asymmetric activations). Fused slices share
their input, so their static scales are merged into one range covering all of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.layers.linear import LinearMethod, ShardLayout
from engine.layers.weight_utils import ModelLoadError, init_dummy_parameter
from engine.quantization.fp8 import expand_slice_scales
from engine.quantization.utils import (
    add_param,
    fill_uniform_int,
    kernel,
    per_slice_scale,
    replace_param,
)

if TYPE_CHECKING:
    from engine.layers.linear import LinearBase

# Uniform int8 values in [-127, 127] have a std of ~73: dummy weights of std ~0.02.
_DUMMY_SCALE = 0.02 / 73.0
_DUMMY_INPUT_SCALE = 8.0 / 127.0


class Int8LinearMethod(LinearMethod):
    """INT8 W8A8 (see the module docstring). ``weight_scheme``: ``"channel"`` or ``"tensor"``;
    ``static_input``: static activation scales; ``asymmetric``: static zero points too."""

    def __init__(self, *, weight_scheme: str, static_input: bool, asymmetric: bool = False) -> None:
        self.weight_scheme = weight_scheme
        self.static_input = static_input
        self.asymmetric = asymmetric
        acts = "static" if static_input else "dynamic per-token"
        self.name = f"int8 w8a8 ({weight_scheme} weights, {acts} activations)"

    def create_weights(self, layer: LinearBase) -> None:
        out, inp = layer.output_size_per_partition, layer.input_size_per_partition
        add_param(layer, "weight", (out, inp), torch.int8, ShardLayout(0, 1))
        if self.weight_scheme == "channel":
            add_param(layer, "weight_scale", (out, 1), torch.float32, ShardLayout(0, None))
        else:
            per_slice_scale(layer, "weight_scale")
        if self.static_input:
            per_slice_scale(layer, "input_scale")
            if self.asymmetric:
                per_slice_scale(layer, "input_zero_point", torch.int32)

    def init_dummy_weights(self, layer: LinearBase, generator: torch.Generator) -> None:
        for name, param in layer.named_parameters(recurse=False):
            if name == "weight":
                fill_uniform_int(param, -127, 128, generator)
            elif name == "weight_scale":
                param.data.fill_(_DUMMY_SCALE)
            elif name == "input_scale":
                param.data.fill_(_DUMMY_INPUT_SCALE)
            elif name == "input_zero_point":
                param.data.zero_()
            else:
                init_dummy_parameter(name, param, generator)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        scale = layer.weight_scale.data.float()
        scale = (
            scale.reshape(-1)
            if self.weight_scheme == "channel"
            else expand_slice_scales(layer, scale)
        )
        if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
            raise ModelLoadError(f"{layer.prefix}: int8 weight scales must be finite and > 0")
        replace_param(layer, "weight_scale", scale.contiguous())
        if not self.static_input:
            layer.input_scale = None
            layer.input_zero_point = None
            return
        s = layer.input_scale.data.float()
        if self.asymmetric:
            # One range covering every slice's [s * (-128 - z), s * (127 - z)].
            z = layer.input_zero_point.data.float()
            lo = (s * (-128.0 - z)).min()
            hi = (s * (127.0 - z)).max()
            merged = (hi - lo) / 255.0
            zp = torch.round(-128.0 - lo / merged).clamp(-128, 127)
            replace_param(layer, "input_scale", merged.reshape(1))
            replace_param(layer, "input_zero_point", zp.to(torch.int32).reshape(1))
        else:
            replace_param(layer, "input_scale", s.amax().reshape(1))
            layer.input_zero_point = None

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return kernel(layer, "int8_linear")(
            x, layer.weight, layer.weight_scale, layer.input_scale, layer.input_zero_point, bias
        )
