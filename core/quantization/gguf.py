"""GGUF files served with their linear weights kept quantized (``--quantization gguf``, the
default for a ``.gguf`` model).

A GGUF file has no ``quantization_config``; the model loader gives its config one,
``{"quant_method": "gguf", "tensor_types": {module: GGML type name}}``, read from the file's
tensor directory (``engine.loader.gguf_loader.quantization_config``). ``--quantization none``
dequantizes every tensor at load instead (the behaviour before this method existed).

Per linear layer:

* every checkpoint part of the layer (q, k and v of ``qkv_proj``) in a type ``gguf_linear``
  multiplies (``engine.kernels.gguf.GGUF_TYPES``: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
  Q6_K): the layer keeps the raw blocks, one tensor per part, since a Q4_K_M file mixes types
  inside one fused layer (its v projection is often Q6_K or Q8_0 while q and k are Q4_K). After
  loading, consecutive parts of the same type are joined and handed to the kernel's
  ``prepack`` (the CPU plugin repacks 4-bit types for its int4 kernel and dequantizes the
  others at load into oneDNN-packed dense weights, the torch reference keeps the blocks);
  ``apply`` multiplies each run and concatenates the outputs;
* a part in any other type (F16, BF16, F32, Q2_K, IQ*, ...): the whole layer is dequantized at
  load into the model dtype, as before, and the log says which layers and why.

Embeddings and the LM head stay dequantized in the model dtype (the loader dequantizes them as
before; a tied head shares the embedding's matrix): lookups and the vocabulary-sized product run
at the dense kernels' speed, at the cost of their memory (for Gemma 3 270M, the 262k x 640 Q8_0
embedding is 178 MB in the file and 335 MB in bf16). docs/quantization.md has the figures.
The exception: where the platform's ``gguf_linear`` says it keeps a vocabulary matrix of that
type and dtype quantized (an optional ``keeps_vocabulary(qtype, dtype)``; the CPU plugin's does
for every kept type where its AVX2 or AMX kernels run, else for Q8_0 in bf16), a vocabulary
matrix on one process keeps the file's blocks instead (``GGUFVocabMethod``: ``prepack(...,
vocabulary=True)``, lookups through the kernel's ``embedding``, the head through its
product): a tied embedding and LM head as one matrix, an untied embedding and head each in its
own type. No other platform changes.

A MoE layer's expert stacks stay quantized too (``engine.quantization.gguf_moe``, chosen by
``get_moe_method``): on the CPU as ``gguf_linear`` packings, on a GPU converted for the
platform's fused expert kernel ``fused_moe_wna16`` (with float offsets); they are dequantized
at load only where that kernel is the torch reference (no plugin provides it), said in the
log.

Tensor parallelism shards a layer by whole GGUF blocks: a column-parallel layer by rows (each
row is its own run of blocks, any split works), a row-parallel layer by columns, which needs
every rank's input features to start and end on a block boundary (32 values, 256 for the
K-quants); a split that does not is refused at build time with the sizes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from engine.kernels.gguf import GGUF_TYPE_NAMES, GGUFType
from engine.layers.embedding import round_to_dtype
from engine.layers.linear import LinearMethod, ShardLayout
from engine.layers.weight_utils import ModelLoadError, materialize
from engine.quantization.base import QuantizationConfig, QuantizationError, QuantizationSpec
from engine.quantization.gguf_moe import GGUFMoEMethod
from engine.quantization.utils import add_param, kernel, replace_param

if TYPE_CHECKING:
    from engine.layers.linear import LinearBase

logger = logging.getLogger(__name__)

KEPT_TYPES = tuple(GGUF_TYPE_NAMES)


class GGUFLinearMethod(LinearMethod):
    """One linear layer of GGUF blocks, one GGML type per fused output slice (see the module
    docstring). The checkpoint tensor is ``<module>.qweight``: uint8 ``[rows, K / block_size,
    type_size]`` (the loader yields the raw blocks under that name)."""

    def __init__(self, types: list[GGUFType]) -> None:
        self.types = types
        names = sorted({t.name for t in types})
        self.name = f"gguf {'/'.join(names)}"
        self.runs: list[tuple[GGUFType, int]] = []  # (type, number of output rows), in order

    # -- building ------------------------------------------------------------------------------
    def create_weights(self, layer: LinearBase) -> None:
        k = layer.input_size_per_partition
        sharded_input = k != layer.input_size
        for t in self.types:
            if k % t.block_size or (sharded_input and (layer.tp_rank * k) % t.block_size):
                raise QuantizationError(
                    f"{layer.prefix}: {t.name} blocks hold {t.block_size} input features, but "
                    f"this rank's {k} of {layer.input_size} input features (tensor-parallel "
                    f"rank {layer.tp_rank} of {layer.tp_size}) do not start and end on a block "
                    "boundary; GGUF weights shard by whole blocks (choose a "
                    "tensor_parallel_size that divides the blocks of a row)"
                )
        # The loader's name: filled slice by slice into the per-slice tensors below. It holds no
        # data itself; it marks the layer as loaded once every slice arrived.
        add_param(layer, "qweight", (0,), torch.uint8, ShardLayout(None, None), self._loader(layer))
        for s, (t, rows) in enumerate(zip(self.types, layer.output_partition_sizes, strict=True)):
            param = add_param(
                layer,
                f"qweight_{s}",
                (rows, k // t.block_size, t.type_size),
                torch.uint8,
                ShardLayout(output_dim=0, input_dim=1, input_pack=t.block_size),
            )
            param.optional = True  # filled through ``qweight``

    def _loader(self, layer: LinearBase) -> Any:
        def load(param: torch.nn.Parameter, loaded: Any, shard_id: object | None = None) -> None:
            fused = len(layer.output_full_sizes) > 1
            if shard_id is None and fused:
                raise ModelLoadError(
                    f"{layer.prefix}: a GGUF fused layer loads one checkpoint part at a time"
                )
            s = layer._slice_index(shard_id) if fused else 0  # type: ignore[attr-defined]
            t = self.types[s]
            dst = getattr(layer, f"qweight_{s}")
            full_rows = layer.output_full_sizes[s]
            expected = (full_rows, layer.input_size // t.block_size, t.type_size)
            if tuple(loaded.shape) != expected:
                raise ModelLoadError(
                    f"{layer.prefix}: {t.name} blocks of shape {tuple(loaded.shape)}, expected "
                    f"{expected} ({full_rows} rows of {layer.input_size} features)"
                )
            value = materialize(loaded)
            rows = layer.output_partition_sizes[s]
            if rows != full_rows:  # column parallel: this rank's rows
                rank = layer._shard_rank(s)  # type: ignore[attr-defined]
                value = value.narrow(0, rank * rows, rows)
            k = layer.input_size_per_partition
            if k != layer.input_size:  # row parallel: this rank's whole blocks
                value = value.narrow(1, layer.tp_rank * k // t.block_size, k // t.block_size)
            dst.data.copy_(value)

        return load

    def init_dummy_weights(self, layer: LinearBase, generator: torch.Generator) -> None:
        raise ModelLoadError(
            f"{layer.prefix}: --load-format dummy cannot build GGUF blocks; load the .gguf file"
        )

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        op = kernel(layer, "gguf_linear")
        tensors = [getattr(layer, f"qweight_{s}").data for s in range(len(self.types))]
        runs: list[tuple[GGUFType, list[torch.Tensor]]] = []
        for t, blocks in zip(self.types, tensors, strict=True):
            if runs and runs[-1][0] is t:
                runs[-1][1].append(blocks)
            else:
                runs.append((t, [blocks]))
        replace_param(layer, "qweight", None)
        for s in range(len(self.types)):
            replace_param(layer, f"qweight_{s}", None)
        self.runs, self.packed_names = [], []
        for r, (t, parts) in enumerate(runs):
            blocks = parts[0] if len(parts) == 1 else torch.cat(parts)
            packed = op.prepack(blocks.contiguous(), qtype=t.ggml_type, dtype=layer.params_dtype)
            del blocks
            names = []
            for key, tensor in packed.items():
                replace_param(layer, f"gguf{r}_{key}", tensor)
                names.append(key)
            self.packed_names.append(names)
            self.runs.append((t, sum(p.shape[0] for p in parts)))

    # -- compute -------------------------------------------------------------------------------
    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        op = kernel(layer, "gguf_linear")
        runs = [
            (t, rows, {key: getattr(layer, f"gguf{r}_{key}") for key in self.packed_names[r]})
            for r, (t, rows) in enumerate(self.runs)
        ]
        if len(runs) == 1:
            y = op(x, runs[0][2], qtype=runs[0][0].ggml_type)
        elif getattr(op, "writes_out", False):
            # Each run's product straight into its columns of one output (no concatenation).
            y = x.new_empty(*x.shape[:-1], sum(rows for _t, rows, _p in runs))
            col = 0
            for t, rows, packed in runs:
                op(x, packed, qtype=t.ggml_type, out=y[..., col : col + rows])
                col += rows
        else:
            y = torch.cat([op(x, packed, qtype=t.ggml_type) for t, _rows, packed in runs], dim=-1)
        return y if bias is None else y + bias.to(y.dtype)


class GGUFVocabMethod:
    """A vocabulary matrix whose GGUF blocks stay quantized (see the module docstring): a tied
    embedding and LM head, or an untied embedding or head alone.

    Owned by the embedding or the untied head (``module``); a tied head holds its embedding's. The loader yields
    the raw blocks as ``<embedding>.qweight``; ``weight`` keeps no data (its dtype and device
    still say the model's)."""

    def __init__(self, module: torch.nn.Module, t: GGUFType, op: Any, dtype: torch.dtype) -> None:
        self.module, self.type, self.op, self.dtype = module, t, op, dtype
        self.name = f"gguf {t.name} (vocabulary kept quantized)"
        self.packed: dict[str, torch.Tensor] = {}
        rows, hidden = module.weight.shape
        param = torch.nn.Parameter(
            torch.empty(
                rows,
                hidden // t.block_size,
                t.type_size,
                dtype=torch.uint8,
                device=module.weight.device,
            ),
            requires_grad=False,
        )
        param.weight_loader = self._load  # type: ignore[attr-defined]
        module.register_parameter("qweight", param)
        # The dense matrix is neither loaded nor kept (the tied head shares this parameter).
        module.weight.data = torch.empty(0, dtype=module.weight.dtype, device=module.weight.device)
        module.weight.optional = True  # type: ignore[attr-defined]

    def _load(self, param: torch.nn.Parameter, loaded: Any) -> None:
        if tuple(loaded.shape) != tuple(param.shape):
            raise ModelLoadError(
                f"{self.type.name} vocabulary blocks of shape {tuple(loaded.shape)}, expected "
                f"{tuple(param.shape)}"
            )
        param.data.copy_(materialize(loaded))

    def process_weights_after_loading(self, module: torch.nn.Module) -> None:
        # No reference kept here: the kernel may free the raw blocks once it has split them.
        packed = self.op.prepack(
            self._take(module), qtype=self.type.ggml_type, dtype=self.dtype, vocabulary=True
        )
        for key, tensor in packed.items():
            replace_param(module, f"gguf_{key}", tensor)
        self.packed = {key: getattr(module, f"gguf_{key}") for key in packed}

    @staticmethod
    def _take(module: torch.nn.Module) -> torch.Tensor:
        blocks = module.qweight.data
        replace_param(module, "qweight", None)
        return blocks

    def embedding(self, ids: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """The rows ``ids`` dequantized, ``[*ids.shape, hidden]`` in the model dtype, times
        ``scale`` rounded to that dtype (Gemma's embedding scale) when given. A kernel whose
        ``embedding`` takes the scale (``scales_embedding = True``) applies it in the lookup;
        otherwise it is one more multiply here, with the same result."""
        op, qtype = self.op, self.type.ggml_type
        if scale is None:
            return op.embedding(ids, self.packed, qtype=qtype, dtype=self.dtype)
        s = round_to_dtype(scale, self.dtype)
        if getattr(op, "scales_embedding", False):
            return op.embedding(ids, self.packed, qtype=qtype, dtype=self.dtype, scale=s)
        return op.embedding(ids, self.packed, qtype=qtype, dtype=self.dtype) * s

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden @ matrix^T`` (the raw logits of the tied head), in ``hidden``'s dtype."""
        return self.op(hidden, self.packed, qtype=self.type.ggml_type)


class GGUFConfig(QuantizationConfig):
    """GGUF files with Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K linear weights kept quantized."""

    name: ClassVar[str] = "gguf"
    checkpoint_formats: ClassVar[tuple[str, ...]] = ("gguf",)
    description: ClassVar[str] = (
        "GGUF files: Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K linear weights kept quantized "
        "(gguf_linear), MoE expert stacks too (gguf_linear on the CPU, fused_moe_wna16 on a "
        "GPU); other types, embeddings and the LM head dequantized at load"
    )
    kernel_names: ClassVar[tuple[str, ...]] = ("gguf_linear",)

    def __init__(self, tensor_types: Mapping[str, str]) -> None:
        super().__init__()
        self.tensor_types = dict(tensor_types)
        #: checkpoint module names whose blocks the loader must yield raw (``<name>.qweight``)
        self.kept_modules: set[str] = set()
        self._dequantized: list[str] = []
        self._moe_logged = False
        # Whether MoE experts run on the host as ``gguf_linear`` packings (the CPU, set by
        # ``bind``) rather than through the fused expert kernel.
        self.experts_on_host = False

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> GGUFConfig:
        types = config.get("tensor_types")
        if not isinstance(types, Mapping):
            raise QuantizationError(
                "a gguf quantization_config needs tensor_types (module name -> GGML type); "
                "the GGUF loader writes it from the file, so load a .gguf file"
            )
        return cls(types)

    @classmethod
    def from_flag(cls) -> GGUFConfig:
        raise QuantizationError(
            "--quantization gguf needs a .gguf model file (its weights are already quantized); "
            "this model is not one. Online quantization of an unquantized checkpoint: "
            "--quantization fp8."
        )

    def describe(self) -> str:
        counts: dict[str, int] = {}
        for t in self.tensor_types.values():
            counts[t] = counts.get(t, 0) + 1
        shown = ", ".join(f"{n} x{c}" for n, c in sorted(counts.items()))
        return f"gguf kept quantized ({shown})"

    def bind(self, spec: QuantizationSpec) -> None:
        """MoE experts run as ``gguf_linear`` packings where a step may loop over them on the
        host: the CPU. A GPU's decode steps are CUDA graphs, which that loop would break, so
        there they go through the fused expert kernel (``get_moe_method``)."""
        self.experts_on_host = spec.is_cpu

    def get_moe_method(self, layer: Any, prefix: str) -> Any:
        """``GGUFMoEMethod`` for stacks of kept types (``engine.quantization.gguf_moe``): on
        the CPU as ``gguf_linear`` packings, elsewhere converted for the platform's
        ``fused_moe_wna16`` where a plugin provides it. Otherwise ``None``: the unquantized
        expert method, the stacks dequantized at load, as every GGUF tensor was before this
        method existed, with a log line."""
        names = {proj: f"{prefix}.{proj}_proj" for proj in ("gate", "up", "down")}
        types = {proj: self.tensor_types.get(name) for proj, name in names.items()}
        missing = [names[p] for p, t in types.items() if t is None]
        if missing:
            raise QuantizationError(
                f"{prefix}: the GGUF file has no expert stack for {', '.join(missing)}"
            )
        others = sorted({t for t in types.values() if t not in GGUF_TYPE_NAMES})
        kernels = getattr(layer, "kernels", None)
        fused = kernels is not None and not kernels.is_reference("fused_moe_wna16")
        if not others and (self.experts_on_host or fused):
            self.kept_modules.update(names.values())
            kept = {p: GGUF_TYPE_NAMES[t] for p, t in types.items()}
            if not self.experts_on_host and not self._moe_logged:
                self._moe_logged = True
                logger.info(
                    "gguf: MoE experts kept quantized, multiplied by %s's fused_moe_wna16 "
                    "(values in int32 words, float32 scales and offsets per group)",
                    kernels.provider("fused_moe_wna16"),
                )
            return GGUFMoEMethod(kept, integer=not self.experts_on_host)
        if prefix not in self._dequantized:
            platform = getattr(kernels, "platform", "this platform")
            why = (
                f"GGML type {'/'.join(map(str, others))} is not kept quantized (kept: "
                f"{', '.join(KEPT_TYPES)})"
                if others
                else f"no plugin provides fused_moe_wna16 on {platform}, only the torch "
                "reference, and a per-expert loop on the host would break the CUDA graphs"
            )
            logger.info("%s: GGUF experts are dequantized at load: %s", prefix, why)
            self._dequantized.append(prefix)
        return None

    def keep_vocabulary(self, model: torch.nn.Module, kernels: Any, dtype: torch.dtype) -> int:
        """Before loading: give each vocabulary matrix a ``GGUFVocabMethod`` where the bound
        ``gguf_linear`` keeps its type quantized in ``dtype`` (one process only: no tensor or
        pipeline split), so that the loader yields its raw blocks: a tied embedding and LM
        head share one; an untied embedding and an untied head each get their own (their
        types differ: a Q4_K_M file has a Q4_K embedding and a Q6_K head). Returns how many."""
        from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding

        op = getattr(kernels, "gguf_linear", None)
        keeps = getattr(op, "keeps_vocabulary", None)
        if keeps is None:
            return 0
        modules = dict(model.named_modules())
        heads = [m for m in modules.values() if isinstance(m, ParallelLMHead)]
        embeddings = [m for m in modules.values() if isinstance(m, VocabParallelEmbedding)]
        count = 0
        for name, module in modules.items():
            if isinstance(module, VocabParallelEmbedding):
                tied = [h for h in heads if h.weight is module.weight]
                what = "embedding and tied LM head" if tied else "embedding"
            elif isinstance(module, ParallelLMHead):
                if any(module.weight is e.weight for e in embeddings):
                    continue  # tied: its embedding decides
                tied, what = [], "LM head"
            else:
                continue
            if module.parallel.world_size > 1:
                continue
            t = GGUF_TYPE_NAMES.get(self.tensor_types.get(name, ""))
            if t is None or not keeps(t.ggml_type, dtype):
                continue
            method = GGUFVocabMethod(module, t, op, dtype)
            module.vocab_method = method
            for head in tied:
                head.vocab_method = method
            self.kept_modules.add(name)
            logger.info("%s: the %s vocabulary matrix (%s) stays quantized", name, t.name, what)
            count += 1
        return count

    def get_linear_method(self, layer: LinearBase, prefix: str) -> LinearMethod | None:
        names = self.checkpoint_names(prefix)
        types = [self.tensor_types.get(n) for n in names]
        if any(t is None for t in types):
            missing = [n for n, t in zip(names, types, strict=True) if t is None]
            raise QuantizationError(
                f"{prefix}: the GGUF file has no tensor for {', '.join(missing)}"
            )
        if not all(t in GGUF_TYPE_NAMES for t in types):
            # Dequantized at load, as for every type before this method existed.
            others = sorted({t for t in types if t not in GGUF_TYPE_NAMES})
            logger.info(
                "%s: GGML type %s is not kept quantized (kept: %s); dequantized at load",
                prefix,
                "/".join(map(str, others)),
                ", ".join(KEPT_TYPES),
            )
            self._dequantized.append(prefix)
            return None
        self.kept_modules.update(names)
        return GGUFLinearMethod([GGUF_TYPE_NAMES[t] for t in types])
