"""Find a model, read its config, build it and stream its weights into it.

``load_hf_config`` resolves ``ModelConfig.model`` (a local directory, a model id in the local
Hugging Face cache, or a ``.gguf`` file), reads the config offline and checks the architecture;
``load_model`` builds the model on the target device and fills it from safetensors shards (tensor
by tensor, straight into the parameters), from GGUF (through ``engine.loader.gguf_loader``) or
with seeded random values (``load_format="dummy"``).

Every problem with the input — missing directory, no config.json, unsupported architecture,
missing or mis-shaped tensors — raises ``ModelLoadError`` before any weight is read.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.layers.linear import process_weights_after_loading
from engine.layers.weight_utils import ModelLoadError
from engine.loader.lazy_tensor import LazySafetensor, ReadStats
from engine.models.context import ModelContext
from engine.models.registry import ModelRegistry
from engine.parallel import SINGLE_PROCESS, ParallelContext

if TYPE_CHECKING:
    from engine.attention_backends.interface import AttentionBackend
    from engine.config import ModelConfig
    from engine.kernels.registry import Kernels
    from engine.layers.linear import QuantizationConfig

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_REPO_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


# ---- locating the model -------------------------------------------------------------------
def resolve_model_path(model: str) -> Path:
    """A local model directory (with config.json) or ``.gguf`` file for ``model``.

    ``model`` may be a path, or a Hugging Face model id already in the local cache (nothing is
    downloaded).
    """
    path = Path(model).expanduser()
    if path.exists():
        if path.is_file():
            if path.suffix == ".gguf":
                return path
            raise ModelLoadError(f"{path} is a file, not a model directory or a .gguf file")
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"no config.json in model directory {path}")
        return path
    if not _REPO_ID.match(model) or model.startswith("."):
        raise ModelLoadError(
            f"model path {path} does not exist; pass a Hugging Face model directory (with "
            "config.json), a model id in the local Hugging Face cache, or a .gguf file"
        )
    from huggingface_hub import snapshot_download

    try:
        snapshot = Path(snapshot_download(model, local_files_only=True))
    except Exception as e:  # huggingface_hub raises several types for "not cached"
        raise ModelLoadError(
            f"model {model!r} is neither a local directory nor a model in the local Hugging "
            f"Face cache (nothing is downloaded; run `huggingface-cli download {model}` first): "
            f"{type(e).__name__}"
        ) from None
    if not (snapshot / "config.json").is_file():
        raise ModelLoadError(f"no config.json in the cached snapshot of {model!r} ({snapshot})")
    return snapshot


def _is_gguf(path: Path, model_config: ModelConfig) -> bool:
    return model_config.load_format == "gguf" or (path.is_file() and path.suffix == ".gguf")


# ---- config and dtype ---------------------------------------------------------------------
def load_hf_config(
    model_config: ModelConfig, registry: ModelRegistry | None = None, plugins: Any = None
) -> Any:
    """Read the model's ``transformers`` config offline and fill ``model_config.hf_config``,
    ``.architecture`` and (when unset) ``.max_model_len``. Returns the config.

    The architecture is checked against ``registry`` (default: the built-ins plus what
    ``plugins``, a ``PluginManager``, registers through ``engine_models``). Raises
    ``ModelLoadError`` for a missing/unreadable model or an unsupported architecture."""
    path = resolve_model_path(model_config.model)
    if _is_gguf(path, model_config):
        from engine.loader import gguf_loader

        hf_config = gguf_loader.load_config(path)
    else:
        from transformers import AutoConfig

        try:
            hf_config = AutoConfig.from_pretrained(
                path,
                trust_remote_code=model_config.trust_remote_code,
                local_files_only=True,
            )
        except Exception as e:
            raise ModelLoadError(f"cannot read {path / 'config.json'}: {e}") from None
    registry = registry or ModelRegistry.with_plugins(plugins)
    arch, _ = registry.resolve(getattr(hf_config, "architectures", None) or [])
    if model_config.max_model_len is None:
        # The engine (runtime.resolve_max_model_len) validates a user-given value.
        text = getattr(hf_config, "text_config", None) or hf_config
        model_config.max_model_len = getattr(text, "max_position_embeddings", None)
    model_config.hf_config = hf_config
    model_config.architecture = arch
    return hf_config


def resolve_dtype(model_config: ModelConfig, hf_config: Any) -> torch.dtype:
    """``model_config.dtype`` as a torch dtype; ``auto`` takes the checkpoint's dtype
    (``dtype``/``torch_dtype`` in config.json; a multimodal config declares it at the top level
    or in its ``text_config``), float32 when it has none."""
    if model_config.dtype != "auto":
        return _DTYPES[model_config.dtype]
    for config in (hf_config, getattr(hf_config, "text_config", None)):
        declared = getattr(config, "dtype", None)
        if declared is None and not isinstance(
            getattr(type(config), "torch_dtype", None), property
        ):
            # transformers < 4.56 has only torch_dtype; later ones alias it to dtype with a
            # deprecation warning on every read, so it is read only where it is the field.
            declared = getattr(config, "torch_dtype", None)
        if isinstance(declared, str):
            declared = getattr(torch, declared.replace("torch.", ""), None)
        if declared in _DTYPES.values():
            return declared
    return torch.float32


# ---- safetensors --------------------------------------------------------------------------
def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's shards: those named in ``model.safetensors.index.json`` when present
    (repos may hold other safetensors files, e.g. Mistral's consolidated copy), else every
    ``*.safetensors`` file."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"cannot read {index}: {e}") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} lists shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(p for p in path.glob("*.safetensors") if not p.name.startswith("consolidated"))
    if not files:
        present = ", ".join(sorted(p.name for p in path.iterdir())) or "nothing"
        raise ModelLoadError(f"no *.safetensors weights in {path} (found: {present})")
    return files


def safetensors_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, from the shard headers only (no tensor data is read)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except Exception as e:
            raise ModelLoadError(f"cannot read safetensors file {file}: {e}") from None
    return shapes


def iter_safetensors(
    files: list[Path],
    progress: Any = None,
    names: set[str] | None = None,
    stats: ReadStats | None = None,
) -> Iterator[tuple[str, LazySafetensor]]:
    """Yield ``(name, lazy tensor)`` one tensor at a time; with ``names``, only those tensors.

    Each ``LazySafetensor`` has a ``shape`` and ``narrow`` and reads its data (from the
    memory-mapped file) only when materialised, so a tensor-parallel rank that narrows to its
    shard reads about ``1 / tp`` of the checkpoint, and a pipeline stage never reads the layers
    it does not hold. Consume each tensor before asking for the next (the file closes after its
    last tensor). ``stats`` counts the bytes offered and read.
    """
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                if names is not None and name not in names:
                    continue
                yield name, LazySafetensor(f.get_slice(name), stats)
                if progress is not None:
                    progress.update(1)


# ---- building and filling the model ---------------------------------------------------------
def _missing_message(model: nn.Module, missing: set[str], present: set[str]) -> str:
    """Name the checkpoint tensors that would have filled ``missing`` parameters."""
    packed = getattr(model, "packed_modules_mapping", {})
    names = []
    for param in sorted(missing):
        expanded = [param]
        for fused, parts in packed.items():
            if f".{fused}." in param:
                expanded = [param.replace(f".{fused}.", f".{p}.") for p in parts]
                break
        names.extend(n for n in expanded if n not in present)
    shown = ", ".join(names[:20]) + (f" (and {len(names) - 20} more)" if len(names) > 20 else "")
    return f"checkpoint is missing {len(names)} tensor(s) the config requires: {shown}"


def _validate_checkpoint(model_cls: type, ctx: ModelContext, shapes: dict[str, tuple]) -> None:
    """Dry-run ``load_weights`` on a meta-device copy of the model with the header shapes, so
    missing, mis-shaped and unknown tensors are reported before any data is read."""
    meta_ctx = dataclasses.replace(ctx, device=torch.device("meta"))
    with torch.device("meta"):
        meta_model = model_cls(meta_ctx)
        loaded = meta_model.load_weights(
            (name, torch.empty(shape, dtype=ctx.dtype)) for name, shape in shapes.items()
        )
    missing = {name for name, _ in meta_model.named_parameters()} - loaded
    if missing:
        raise ModelLoadError(_missing_message(meta_model, missing, set(shapes)))


def _drop_skipped(model_cls: type, shapes: dict[str, tuple]) -> dict[str, tuple]:
    """``shapes`` without the tensors ``model_cls.skip_checkpoint_prefixes`` names (parts of the
    checkpoint the model does not run); logs what was skipped and why."""
    prefixes = tuple(getattr(model_cls, "skip_checkpoint_prefixes", ()))
    if not prefixes:
        return shapes
    kept = {name: shape for name, shape in shapes.items() if not name.startswith(prefixes)}
    skipped = [shape for name, shape in shapes.items() if name not in kept]
    if skipped:
        numel = sum(math.prod(shape) for shape in skipped)
        logger.warning(
            "%s: skipping %d checkpoint tensors (%s parameters under %s) without reading them: %s",
            model_cls.__name__,
            len(skipped),
            f"{numel:,}",
            ", ".join(p for p in prefixes if any(n.startswith(p) for n in shapes)),
            getattr(model_cls, "skip_checkpoint_reason", "") or "not used by this model",
        )
    return kept


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights for ``load_format="dummy"`` (also a draft head's, for benchmarks)."""
    _init_dummy(model, seed)


def _param_seed(seed: int, name: str) -> int:
    """A generator seed for one parameter: the same on every rank and in every layout."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63)


def _init_dummy(
    model: nn.Module, seed: int, full_shapes: dict[str, tuple[int, ...]] | None = None
) -> None:
    """Seeded random weights: normal(0, 0.02) matrices, zero biases, unit norm scales.

    Each matrix is drawn whole, from a generator seeded by ``seed`` and its name, so every
    parameter has the same values in every layout: under tensor or pipeline parallelism
    (``full_shapes``: the unsharded shape of each parameter) a rank draws the whole matrix and
    keeps its shard through the parameter's weight loader, exactly as from a checkpoint, so
    TP=2 runs the model TP=1 runs."""
    device = next(model.parameters()).device
    for name, param in model.named_parameters():
        if param.dim() < 2:
            if name.endswith("bias"):
                param.data.zero_()
            else:
                param.data.fill_(1.0)
            continue
        source = name
        if full_shapes is not None and name not in full_shapes:
            # A tied head on a last pipeline stage: the embedding's values.
            source = "model.embed_tokens.weight" if name == "lm_head.weight" else name
        shape = full_shapes.get(source, tuple(param.shape)) if full_shapes else param.shape
        gen = torch.Generator(device=device).manual_seed(_param_seed(seed, source))
        full = torch.empty(shape, dtype=param.dtype, device=device).normal_(
            0.0, 0.02, generator=gen
        )
        if full_shapes is None:
            param.data.copy_(full)
        else:
            loader = getattr(param, "weight_loader", None)
            kind = getattr(param, "moe_shard_kind", None)
            if loader is None:
                param.data.copy_(full)
            elif kind is not None:
                # Stacked experts: the single-process layout is the checkpoint's stacked form.
                loader(param, full, kind)
            else:
                loader(param, full)


def _full_shapes(model_cls: type, ctx: ModelContext) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of the model on one process (built on the meta device)."""
    single = dataclasses.replace(ctx, parallel=SINGLE_PROCESS, device=torch.device("meta"))
    with torch.device("meta"):
        model = model_cls(single)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def load_model(
    model_config: ModelConfig,
    kernels: Kernels,
    attn_backend_cls: type[AttentionBackend],
    device: torch.device | str = "cpu",
    registry: ModelRegistry | None = None,
    *,
    parallel: ParallelContext | None = None,
    quant_config: QuantizationConfig | None = None,
    stats: ReadStats | None = None,
) -> nn.Module:
    """Build the model for ``model_config`` on ``device`` and load its weights.

    Reads the config first when ``model_config.hf_config`` is unset. ``parallel`` says which
    tensor-parallel shard and pipeline stage this process builds (default: all of it); each
    checkpoint tensor is read only in the part this process holds. ``quant_config`` picks the
    linear layers' quantization methods. Every linear layer's method gets its post-loading pass
    (``process_weights_after_loading``). ``stats`` counts the checkpoint bytes offered and read.
    Returns the model in eval mode with frozen parameters.
    """
    from tqdm.auto import tqdm

    registry = registry or ModelRegistry()
    if model_config.hf_config is None:
        load_hf_config(model_config, registry)
    hf_config = model_config.hf_config
    _, model_cls = registry.resolve(getattr(hf_config, "architectures", None) or [])
    device = torch.device(device)
    dtype = resolve_dtype(model_config, hf_config)
    ctx = ModelContext(
        hf_config,
        dtype,
        kernels,
        attn_backend_cls,
        device,
        parallel=parallel or SINGLE_PROCESS,
        quant_config=quant_config,
    )
    path = resolve_model_path(model_config.model)
    fmt = model_config.load_format
    if fmt == "safetensors" and path.is_file():
        raise ModelLoadError(f"load_format=safetensors needs a model directory, got file {path}")

    if fmt == "dummy":
        full_shapes = None
        if ctx.parallel.world_size > 1:
            full_shapes = _full_shapes(model_cls, ctx)
        with torch.device(device):
            model = model_cls(ctx)
        _init_dummy(model, model_config.seed, full_shapes)
        process_weights_after_loading(model)
        return model.eval()

    if _is_gguf(path, model_config):
        from engine.loader import gguf_loader

        weights = gguf_loader.iter_weights(path, hf_config, dtype, stats=stats)
        present: set[str] | None = None
        progress = tqdm(
            total=gguf_loader.num_tensors(path), desc="Loading GGUF weights", unit="tensor"
        )
        weights = _counting(weights, progress)
    else:
        files = safetensors_files(path)
        shapes = _drop_skipped(model_cls, safetensors_shapes(files))
        _validate_checkpoint(model_cls, ctx, shapes)
        present = set(shapes)
        progress = tqdm(
            total=len(shapes),
            desc=f"Loading {len(files)} safetensors shard(s)",
            unit="tensor",
        )
        weights = iter_safetensors(files, progress, names=set(shapes), stats=stats)
    with torch.device(device):
        model = model_cls(ctx)
    try:
        loaded = model.load_weights(weights)
    finally:
        progress.close()
    missing = {name for name, _ in model.named_parameters()} - loaded
    if missing:
        raise ModelLoadError(_missing_message(model, missing, present or set()))
    process_weights_after_loading(model)
    return model.eval()


def _counting(weights: Any, progress: Any) -> Iterator[tuple[str, torch.Tensor]]:
    for item in weights:
        yield item
        progress.update(1)
