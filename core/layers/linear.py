"""Linear layers, plain and fused (QKV, gate/up), with loaders for the checkpoint's separate
tensors. Fused layers copy each checkpoint tensor straight into its slice of the fused weight."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.registry import Kernels
from engine.layers.weight_utils import check_shape, new_parameter, set_weight_loader


def linear_op(kernels: Kernels | None):
    """The platform's ``linear`` kernel (e.g. engine-llm-triton's skinny GEMM for decode batches on
    GPUs), or ``F.linear`` when the layer is built without a kernel registry."""
    return F.linear if kernels is None else kernels.linear


class Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` [output_size, input_size], as ``nn.Linear`` stores it.

    The product goes through ``kernels.linear`` when ``kernels`` is given (models pass
    ``ctx.kernels``), else ``F.linear``. On the CPU the model runner replaces ``forward`` with a
    oneDNN-prepacked product (``engine.layers.cpu_packed_linear``)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        *,
        kernels: Kernels | None = None,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = new_parameter((output_size, input_size), dtype)
        self.bias = new_parameter((output_size,), dtype) if bias else None
        self._linear = linear_op(kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class MergedLinear(Linear):
    """Several projections of the same input fused along the output dim (e.g. gate and up).

    Shard ``i`` of ``output_sizes`` receives the checkpoint tensor loaded with ``shard_id=i``.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        dtype: torch.dtype | None = None,
        *,
        kernels: Kernels | None = None,
    ) -> None:
        super().__init__(input_size, sum(output_sizes), bias, dtype, kernels=kernels)
        self.output_sizes = list(output_sizes)
        self.offsets = [sum(self.output_sizes[:i]) for i in range(len(self.output_sizes))]
        for p in self.parameters():
            set_weight_loader(p, self.weight_loader)

    def shard_range(self, shard_id: object) -> tuple[int, int]:
        """(offset, size) of a shard along the output dim."""
        i = int(shard_id)  # type: ignore[call-overload]
        return self.offsets[i], self.output_sizes[i]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object) -> None:
        offset, size = self.shard_range(shard_id)
        dst = param.data.narrow(0, offset, size)
        check_shape(f"shard {shard_id!r}", dst.shape, loaded.shape)
        dst.copy_(loaded)


class QKVLinear(MergedLinear):
    """The query, key and value projections fused: output is ``[q | k | v]`` with
    ``num_heads * head_size`` then twice ``num_kv_heads * head_size`` features. Shards are
    loaded with ``shard_id`` ``"q"``, ``"k"``, ``"v"``."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        *,
        kernels: Kernels | None = None,
    ) -> None:
        self.q_size = num_heads * head_size
        self.kv_size = num_kv_heads * head_size
        super().__init__(
            hidden_size,
            [self.q_size, self.kv_size, self.kv_size],
            bias,
            dtype,
            kernels=kernels,
        )

    def shard_range(self, shard_id: object) -> tuple[int, int]:
        return super().shard_range({"q": 0, "k": 1, "v": 2}[shard_id])  # type: ignore[index]

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split a fused output [T, q+2kv] into (q, k, v) views."""
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
