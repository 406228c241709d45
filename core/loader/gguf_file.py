"""Reading a GGUF file: its metadata, its tensor directory, and tensors dequantized into torch.

Why not ``gguf.GGUFReader``: the reader builds a numpy view for every element of every metadata
array, which for a 262k-entry vocabulary takes ~11 s and a few hundred MB before a single
weight is touched. ``GGUFFile`` walks the same header layout once (the format is small: see
https://github.com/ggml-org/ggml/blob/master/docs/gguf.md), keeps scalars and short arrays,
skips long arrays (the tokenizer vocabulary, which ``transformers`` converts on its own), and
memory-maps the tensor data. Value and tensor types, block sizes and the dequantizers all come
from the ``gguf`` library (``gguf.quants.dequantize``).

Every malformed input raises ``GGUFLoadError`` naming the file and what is wrong with it.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
)
from gguf.quants import dequantize

if TYPE_CHECKING:
    import torch

SUPPORTED_VERSIONS = (2, 3)
# Arrays longer than this are not decoded when the header is read (tokenizer vocabularies,
# merges, scores); ``GGUFFile.metadata`` holds a ``SkippedArray`` marker for them instead.
MAX_DECODED_ARRAY = 4096
# Tensors are dequantized this many elements at a time, so a large quantized tensor never
# exists as a whole float32 copy next to its load-dtype copy.
DEQUANT_CHUNK_ELEMENTS = 1 << 22
GGML_MAX_DIMS = 4


class GGUFLoadError(ValueError):
    """A GGUF file cannot be loaded: truncated, corrupted, of an unsupported architecture or
    tensor type. The message names the file and what is wrong."""


_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}
_SCALAR_NUMPY: dict[GGUFValueType, str] = {
    t: "<" + ("u1" if f == "?" else np.dtype(f).str[1:]) for t, f in _SCALAR_FORMATS.items()
}


@dataclass(frozen=True)
class SkippedArray:
    """A metadata array too long to decode with the header (e.g. the token list)."""

    item_type: GGUFValueType
    length: int
    offset: int  # of the first item in the file


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor directory. ``shape`` is in torch order (GGUF stores dims
    fastest-first, so it is the reverse of the file's ``ne``)."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int  # absolute offset of the first byte in the file
    n_bytes: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


@lru_cache(maxsize=1)
def supported_types() -> tuple[GGMLQuantizationType, ...]:
    """The GGML tensor types this installation of ``gguf`` can dequantize (probed once)."""
    ok = []
    for qtype, (_block, type_size) in GGML_QUANT_SIZES.items():
        try:
            dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
        except NotImplementedError:
            continue
        except Exception:  # a dequantizer that cannot even run on zeros is not usable
            continue
        ok.append(qtype)
    return tuple(ok)


def _supported_names() -> str:
    return ", ".join(t.name for t in supported_types())


class _Cursor:
    """Bounds-checked little-endian reads over the mapped header."""

    def __init__(self, buf: mmap.mmap | bytes, path: Path) -> None:
        self.buf = buf
        self.size = len(buf)
        self.pos = 0
        self.path = path

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GGUFLoadError(
                f"{self.path}: truncated or corrupted GGUF header: {what} at byte {self.pos} "
                f"needs {n} bytes but the file has {self.size}"
            )

    def unpack(self, fmt: str, what: str) -> Any:
        n = struct.calcsize("<" + fmt)
        self.need(n, what)
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += n
        return value

    def string(self, what: str) -> str:
        length = self.unpack("Q", what + " length")
        self.need(length, what)
        raw = bytes(self.buf[self.pos : self.pos + length])
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFLoadError(f"{self.path}: corrupted GGUF header: {what} is not UTF-8") from e

    def skip_strings(self, count: int, what: str) -> None:
        # Walks the length prefixes only: ~50 ms for a 262k vocabulary.
        buf, pos, size = self.buf, self.pos, self.size
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, what)
            pos += 8 + unpack(buf, pos)[0]
        if pos > size:
            self.need(pos - self.pos, what)
        self.pos = pos


class GGUFFile:
    """A parsed GGUF header over a memory-mapped file.

    ``metadata`` maps keys to Python values (scalars, strings, short lists; ``SkippedArray`` for
    long arrays); ``tensors`` maps tensor names to ``GGUFTensorInfo`` in file order. Use as a
    context manager, or call ``close()``, to release the mapping.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    raise GGUFLoadError(f"{self.path}: empty file, not a GGUF model")
                self._mm: mmap.mmap | None = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise GGUFLoadError(f"{self.path}: cannot open GGUF file: {e.strerror or e}") from e
        self.file_size = size
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, GGUFTensorInfo] = {}
        try:
            self._parse()
        except BaseException:
            self.close()
            raise

    # -- header ---------------------------------------------------------------------------

    def _parse(self) -> None:
        assert self._mm is not None
        cur = _Cursor(self._mm, self.path)
        if cur.size < 4 or cur.unpack("I", "magic") != GGUF_MAGIC:
            raise GGUFLoadError(f"{self.path}: not a GGUF file (bad magic bytes)")
        self.version = cur.unpack("I", "version")
        if self.version not in SUPPORTED_VERSIONS:
            hint = " (a big-endian file?)" if self.version & 0xFFFF == 0 else ""
            raise GGUFLoadError(
                f"{self.path}: GGUF version {self.version}{hint} is not supported; supported "
                f"versions: {', '.join(map(str, SUPPORTED_VERSIONS))}"
            )
        n_tensors = cur.unpack("Q", "tensor count")
        n_kv = cur.unpack("Q", "metadata count")
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            vtype = self._value_type(cur.unpack("I", f"type of {key}"), key)
            if key in self.metadata:
                raise GGUFLoadError(f"{self.path}: corrupted GGUF header: duplicate key {key!r}")
            self.metadata[key] = self._read_value(cur, vtype, key)
        infos = []
        for i in range(n_tensors):
            name = cur.string(f"tensor name #{i}")
            n_dims = cur.unpack("I", f"dims of tensor {name}")
            if not 1 <= n_dims <= GGML_MAX_DIMS:
                raise GGUFLoadError(
                    f"{self.path}: corrupted GGUF header: tensor {name!r} has {n_dims} dims"
                )
            ne = [cur.unpack("Q", f"shape of tensor {name}") for _ in range(n_dims)]
            raw_type = cur.unpack("I", f"type of tensor {name}")
            rel_offset = cur.unpack("Q", f"offset of tensor {name}")
            infos.append((name, ne, raw_type, rel_offset))
        alignment = self.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFLoadError(f"{self.path}: invalid general.alignment {alignment!r}")
        data_start = -(-cur.pos // alignment) * alignment
        for name, ne, raw_type, rel_offset in infos:
            self._add_tensor(name, ne, raw_type, rel_offset, data_start, alignment)

    def _value_type(self, raw: int, key: str) -> GGUFValueType:
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise GGUFLoadError(
                f"{self.path}: corrupted GGUF header: unknown value type {raw} for key {key!r}"
            ) from None

    def _read_value(self, cur: _Cursor, vtype: GGUFValueType, key: str) -> Any:
        if vtype == GGUFValueType.STRING:
            return cur.string(key)
        if vtype in _SCALAR_FORMATS:
            return cur.unpack(_SCALAR_FORMATS[vtype], key)
        if vtype != GGUFValueType.ARRAY:
            raise GGUFLoadError(f"{self.path}: unhandled value type {vtype.name} for {key!r}")
        item_type = self._value_type(cur.unpack("I", f"item type of {key}"), key)
        length = cur.unpack("Q", f"length of {key}")
        if item_type in _SCALAR_FORMATS:
            itemsize = struct.calcsize("<" + _SCALAR_FORMATS[item_type])
            cur.need(length * itemsize, key)
            if length > MAX_DECODED_ARRAY:
                skipped = SkippedArray(item_type, length, cur.pos)
                cur.pos += length * itemsize
                return skipped
            arr = np.frombuffer(cur.buf, _SCALAR_NUMPY[item_type], length, cur.pos)
            cur.pos += length * itemsize
            return [bool(x) for x in arr] if item_type == GGUFValueType.BOOL else arr.tolist()
        if item_type == GGUFValueType.STRING:
            if length > MAX_DECODED_ARRAY:
                skipped = SkippedArray(item_type, length, cur.pos)
                cur.skip_strings(length, key)
                return skipped
            return [cur.string(key) for _ in range(length)]
        raise GGUFLoadError(f"{self.path}: nested array in {key!r} is not supported")

    def _add_tensor(
        self, name: str, ne: list[int], raw_type: int, rel_offset: int, start: int, align: int
    ) -> None:
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise GGUFLoadError(
                f"{self.path}: tensor {name!r} has unknown GGML type id {raw_type}; "
                f"supported types: {_supported_names()}"
            ) from None
        if qtype not in GGML_QUANT_SIZES:
            raise GGUFLoadError(f"{self.path}: tensor {name!r} has type {qtype.name} of no size")
        block, type_size = GGML_QUANT_SIZES[qtype]
        if any(d <= 0 for d in ne) or ne[0] % block:
            raise GGUFLoadError(
                f"{self.path}: corrupted tensor {name!r}: shape {ne} does not fit {qtype.name} "
                f"blocks of {block}"
            )
        if rel_offset % align:
            raise GGUFLoadError(
                f"{self.path}: corrupted tensor {name!r}: offset {rel_offset} is not aligned to "
                f"{align}"
            )
        n_bytes = math.prod(ne) // block * type_size
        offset = start + rel_offset
        if offset + n_bytes > self.file_size:
            raise GGUFLoadError(
                f"{self.path}: truncated GGUF file: tensor {name!r} needs bytes "
                f"{offset}..{offset + n_bytes} but the file has {self.file_size} bytes"
            )
        if name in self.tensors:
            raise GGUFLoadError(f"{self.path}: corrupted GGUF header: duplicate tensor {name!r}")
        self.tensors[name] = GGUFTensorInfo(name, qtype, tuple(reversed(ne)), offset, n_bytes)

    # -- access ---------------------------------------------------------------------------

    @property
    def architecture(self) -> str:
        """``general.architecture`` (e.g. ``gemma3``, ``llama``)."""
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFLoadError(f"{self.path}: missing general.architecture in GGUF metadata")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value, or ``default`` when the key is absent."""
        return self.metadata.get(key, default)

    def arch_get(self, key: str, default: Any = None) -> Any:
        """An architecture-scoped value: ``arch_get("block_count")`` reads
        ``<architecture>.block_count``."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def require(self, key: str) -> Any:
        """An architecture-scoped value that must be present."""
        full = f"{self.architecture}.{key}"
        if full not in self.metadata:
            raise GGUFLoadError(f"{self.path}: missing required GGUF metadata key {full!r}")
        return self.metadata[full]

    def strings(self, key: str, stop: int | None = None) -> list[str]:
        """The first ``stop`` items (all when None) of string-array metadata ``key``, decoding
        a skipped array on demand (e.g. the head of the token list)."""
        value = self.metadata[key]
        if isinstance(value, list):
            return value[:stop]
        if not isinstance(value, SkippedArray) or value.item_type != GGUFValueType.STRING:
            raise GGUFLoadError(f"{self.path}: metadata {key!r} is not a string array")
        assert self._mm is not None
        cur = _Cursor(self._mm, self.path)
        cur.pos = value.offset
        n = value.length if stop is None else min(stop, value.length)
        return [cur.string(key) for _ in range(n)]

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a uint8 array of shape [rows, row_bytes] (a view of the map)."""
        info = self.tensors[name]
        if self._mm is None:
            raise GGUFLoadError(f"{self.path}: file already closed")
        rows = math.prod(info.shape[:-1])
        return np.frombuffer(self._mm, np.uint8, info.n_bytes, info.offset).reshape(rows, -1)

    def check_supported(self, name: str) -> None:
        """Raise ``GGUFLoadError`` if tensor ``name``'s type cannot be dequantized."""
        qtype = self.tensors[name].ggml_type
        if qtype not in supported_types():
            raise GGUFLoadError(
                f"{self.path}: tensor {name!r} uses GGML type {qtype.name}, which cannot be "
                f"dequantized; supported types: {_supported_names()}"
            )

    def load(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Tensor ``name`` dequantized to float32 and cast to ``dtype``, in torch order.

        Works a chunk of rows at a time, so peak extra memory is one chunk, not the tensor.
        """
        info = self.tensors[name]
        rows = math.prod(info.shape[:-1])
        out, _ = self.load_window(name, dtype, (0, rows), (0, info.shape[-1]))
        self._release(info)
        return out.view(info.shape)

    def load_window(
        self, name: str, dtype: torch.dtype, rows: tuple[int, int], cols: tuple[int, int]
    ) -> tuple[torch.Tensor, int]:
        """Rows ``[r0, r1)`` and columns ``[c0, c1)`` of tensor ``name`` seen as a matrix
        ``[prod(shape[:-1]), shape[-1]]``, dequantized to ``dtype``; and the number of file
        bytes read. Only those rows are read, and only the quantization blocks of those
        columns when the column range falls on block boundaries (a tensor-parallel shard of
        the input features); otherwise whole rows are dequantized and cut."""
        import torch

        self.check_supported(name)
        info = self.tensors[name]
        raw = self.raw(name)[rows[0] : rows[1]]
        full_cols = info.shape[-1]
        c0, c1 = cols
        block, type_size = GGML_QUANT_SIZES[info.ggml_type]
        cut = None
        if (c0, c1) != (0, full_cols):
            if c0 % block == 0 and (c1 % block == 0 or c1 == full_cols):
                raw = raw[:, c0 // block * type_size : math.ceil(c1 / block) * type_size]
            else:
                cut = (c0, c1)  # dequantize whole rows, keep the columns
        n_rows, n_cols = raw.shape[0], (c1 - c0 if cut is None else full_cols)
        out = torch.empty((n_rows, n_cols), dtype=dtype)
        step = max(1, DEQUANT_CHUNK_ELEMENTS // max(n_cols, 1))
        for start in range(0, n_rows, step):
            stop = min(n_rows, start + step)
            chunk = np.ascontiguousarray(raw[start:stop])  # a column window is strided
            out[start:stop].copy_(_dequantize_rows(chunk, info.ggml_type, n_cols))
        num_bytes = raw.size
        del raw
        if cut is not None:
            out = out[:, cut[0] : cut[1]].contiguous()
        return out, num_bytes

    def release(self, name: str) -> None:
        """Drop tensor ``name``'s file pages from the resident set (after copying it out)."""
        self._release(self.tensors[name])

    def _release(self, info: GGUFTensorInfo) -> None:
        """Drop the tensor's file pages from this process's resident set: the mapped file would
        otherwise count fully in RSS by the end of loading (the data is in ``out`` now)."""
        advice = getattr(mmap, "MADV_DONTNEED", None)
        if advice is None or self._mm is None:
            return
        page = mmap.PAGESIZE
        start = info.offset // page * page
        try:
            self._mm.madvise(advice, start, min(info.offset + info.n_bytes, self.file_size) - start)
        except (OSError, ValueError):
            pass  # advice only

    def iter_tensors(self) -> Iterator[GGUFTensorInfo]:
        """The tensor directory in file order."""
        return iter(self.tensors.values())

    def close(self) -> None:
        """Release the memory map (tensors already loaded stay valid: they are copies)."""
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # views from raw() are still alive; the map closes when they die
            self._mm = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _dequantize_rows(raw: np.ndarray, qtype: GGMLQuantizationType, cols: int) -> torch.Tensor:
    """float32 [rows, cols] from a chunk of raw rows. Plain float types and Q8_0 (the format of
    Gemma's 262k x 640 embedding) are decoded with torch, which is several times faster than
    numpy here and gives bit-identical results (tests/test_gguf_loader.py checks that); every
    other type goes through ``gguf.quants.dequantize``."""
    import torch

    rows = raw.shape[0]
    if qtype == GGMLQuantizationType.F32:
        return torch.from_numpy(raw.copy().view(np.float32))
    if qtype == GGMLQuantizationType.F16:
        return torch.from_numpy(raw.copy()).view(torch.float16).float()
    if qtype == GGMLQuantizationType.BF16:
        return torch.from_numpy(raw.copy()).view(torch.bfloat16).float()
    if qtype == GGMLQuantizationType.Q8_0:
        blocks = torch.from_numpy(raw.copy()).view(-1, 34)  # fp16 scale + 32 int8 quants
        scale = blocks[:, :2].contiguous().view(torch.float16).float()
        quants = blocks[:, 2:].view(torch.int8).float()
        return quants.mul_(scale).view(rows, cols)
    return torch.from_numpy(np.ascontiguousarray(dequantize(raw, qtype)).reshape(rows, cols))
