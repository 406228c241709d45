"""Lazy checkpoint tensors: a shape, narrowing, and data read only when materialised.

The loaders yield these instead of tensors so that a tensor-parallel rank reads only its shard:
a layer's weight loader narrows the tensor to the rank's rows or columns
(``engine.layers.weight_utils.narrow``) and copies ``materialize(...)`` into its parameter; the
rest of the checkpoint tensor is never touched. ``ReadStats`` counts what was materialised
(logged per rank by the model loader, and checked by the tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass
class ReadStats:
    """Bytes of checkpoint data offered to the model (``offered``: every tensor's full size)
    and actually materialised (``read``)."""

    offered: int = 0
    read: int = 0

    def describe(self) -> str:
        share = self.read / self.offered if self.offered else 0.0
        return f"{self.read / 2**20:.1f} MiB of {self.offered / 2**20:.1f} MiB ({share:.0%})"


class LazyTensor:
    """A rectangular window ``[start, stop)`` per dimension of a checkpoint tensor, read on
    ``materialize()``. Subclasses implement ``_read(bounds)``: the window's data as a tensor
    (a view is fine; the caller copies it) and the number of checkpoint bytes it read."""

    def __init__(
        self,
        shape: tuple[int, ...],
        bounds: tuple[tuple[int, int], ...] | None = None,
        stats: ReadStats | None = None,
    ) -> None:
        self._full_shape = tuple(int(n) for n in shape)
        self._bounds = bounds if bounds is not None else tuple((0, n) for n in self._full_shape)
        self._stats = stats

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self._bounds)

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return len(self._bounds)

    @property
    def ndim(self) -> int:
        return len(self._bounds)

    # ---- reading it like a tensor ---------------------------------------------------------
    # Weight loaders written for plain tensors keep working: any other tensor attribute, an
    # index, or a torch function given a lazy tensor (``param.data.copy_(lazy)``,
    # ``torch.cat``) reads the window first. Each such use reads it again: loaders that use
    # the data several times should ``materialize()`` once.
    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*_materialized(args), **_materialized(kwargs or {}))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.materialize(), name)

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.materialize()[index]

    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        """The window narrowed along ``dim`` to ``[start, start + length)`` of its own extent
        (``torch.Tensor.narrow`` semantics); nothing is read."""
        dim = dim % len(self._bounds)
        lo, hi = self._bounds[dim]
        if start < 0 or length < 0 or lo + start + length > hi:
            raise IndexError(
                f"narrow({dim}, {start}, {length}) is outside a dimension of size {hi - lo}"
            )
        bounds = list(self._bounds)
        bounds[dim] = (lo + start, lo + start + length)
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone._bounds = tuple(bounds)
        return clone

    def materialize(self) -> torch.Tensor:
        """Read the window now (counted in the ``ReadStats``)."""
        tensor, num_bytes = self._read(self._bounds)
        if self._stats is not None:
            self._stats.read += num_bytes
        return tensor

    def _read(self, bounds: tuple[tuple[int, int], ...]) -> tuple[torch.Tensor, int]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={self.shape}, of {self._full_shape})"


# Bytes per element of safetensors' dtype names.
_SAFETENSORS_ITEMSIZE = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
    "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip
_SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "U16": "uint16", "U32": "uint32",
    "U64": "uint64",
}  # fmt: skip


def _materialized(value: Any) -> Any:
    """``value`` with every lazy tensor in it (also inside lists, tuples and dicts) read."""
    if isinstance(value, LazyTensor):
        return value.materialize()
    if isinstance(value, (list, tuple)):
        return type(value)(_materialized(v) for v in value)
    if isinstance(value, dict):
        return {k: _materialized(v) for k, v in value.items()}
    return value


class LazySafetensor(LazyTensor):
    """A tensor of an open safetensors file, read through ``safe_open(...).get_slice(name)``:
    only the window's elements are copied out of the memory-mapped file. Materialise it while
    the file is open (the loaders consume each tensor before yielding the next)."""

    def __init__(self, file_slice: Any, stats: ReadStats | None = None) -> None:
        super().__init__(tuple(file_slice.get_shape()), stats=stats)
        self._slice = file_slice
        self._dtype_name = str(file_slice.get_dtype())
        if stats is not None:
            stats.offered += self.numel() * _SAFETENSORS_ITEMSIZE.get(self._dtype_name, 0)

    @property
    def dtype(self) -> torch.dtype:
        import torch

        name = _SAFETENSORS_DTYPES.get(self._dtype_name)
        if name is None or not hasattr(torch, name):
            return self.materialize().dtype
        return getattr(torch, name)

    def _read(self, bounds: tuple[tuple[int, int], ...]) -> tuple[torch.Tensor, int]:
        if not bounds:  # a 0-d tensor
            tensor = self._slice[...]
        else:
            tensor = self._slice[tuple(slice(start, stop) for start, stop in bounds)]
        return tensor, tensor.numel() * tensor.element_size()
