"""Find a model, read its config, build it and stream its weights into it.

``load_hf_config`` resolves ``ModelConfig.model`` (a local directory, a Hugging Face Hub id,
cached or downloaded by ``engine.loader.hub``, or a ``.gguf`` file), reads the config and checks
the architecture;
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
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.layers.fused_moe import FusedMoE
from engine.layers.linear import UNQUANTIZED, LinearBase, process_weights_after_loading
from engine.layers.weight_utils import ModelLoadError
from engine.loader.lazy_tensor import LazySafetensor, ReadStats
from engine.models.context import ModelContext
from engine.models.registry import ModelRegistry
from engine.parallel import SINGLE_PROCESS, ParallelContext
from engine.quantization.base import checkpoint_prefixes_in

if TYPE_CHECKING:
    from engine.attention_backends.interface import AttentionBackend
    from engine.config import ModelConfig
    from engine.kernels.registry import Kernels
    from engine.layers.linear import QuantizationConfig

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---- locating the model -------------------------------------------------------------------
def resolve_model_path(
    model: str,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    weights: bool = True,
    code: bool = False,
) -> Path:
    """A local model directory (with config.json) or ``.gguf`` file for ``model``.

    ``model`` may be a path, or a Hugging Face Hub id: its snapshot in the local cache, at
    ``revision``, downloaded first where the cache lacks it (``engine.loader.hub``; ``weights``
    False skips the safetensors files, ``code`` adds the repository's Python files).
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
    from engine.loader.hub import hub_snapshot, is_hub_id

    if not is_hub_id(model):
        raise ModelLoadError(
            f"model path {path} does not exist; pass a Hugging Face model directory (with "
            "config.json), a Hugging Face Hub id (org/name), or a .gguf file"
        )
    return hub_snapshot(
        model, revision=revision, download_dir=download_dir, weights=weights, code=code
    )


def apply_hf_overrides(hf_config: Any, overrides: dict[str, Any], where: str = "") -> None:
    """Set ``overrides`` (vLLM's ``--hf-overrides``) on a transformers config: a nested object
    updates the sub-config of that name (``text_config``...), anything else replaces the
    field. Logged, and a field the config did not have is named as new."""
    if not isinstance(overrides, dict):
        raise ModelLoadError(f"hf_overrides must be a JSON object, got {type(overrides).__name__}")
    for key, value in overrides.items():
        name = f"{where}{key}"
        current = getattr(hf_config, key, None)
        if isinstance(value, dict) and hasattr(current, "to_dict"):
            apply_hf_overrides(current, value, f"{name}.")
            continue
        if not hasattr(hf_config, key):
            logger.warning("hf_overrides: %s is not in the model's config; added", name)
        setattr(hf_config, key, value)
        logger.info("hf_overrides: %s = %r (was %r)", name, value, current)


def locate_model(model_config: ModelConfig) -> Path:
    """``resolve_model_path`` with the model config's revision, download directory, load
    format (dummy weights need no weight files) and ``trust_remote_code``."""
    if model_config.model is None:
        raise ModelLoadError("no model given")
    return resolve_model_path(
        model_config.model,
        revision=model_config.revision,
        download_dir=model_config.download_dir,
        weights=model_config.load_format != "dummy",
        code=model_config.trust_remote_code,
    )


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
    path = locate_model(model_config)
    if _is_gguf(path, model_config):
        from engine.loader import gguf_loader

        hf_config = gguf_loader.load_config(path)
        if (model_config.quantization or "").lower() != "none":
            # Kept quantized by engine.quantization.gguf unless --quantization none.
            hf_config.quantization_config = gguf_loader.quantization_config(path)
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
    if model_config.hf_overrides:
        apply_hf_overrides(hf_config, model_config.hf_overrides)
    registry = registry or ModelRegistry.with_plugins(plugins)
    _resolve_runner(model_config, hf_config, path)
    choice = _select(model_config, hf_config, registry, log=True)
    if model_config.max_model_len is None:
        # The engine (runtime.resolve_max_model_len) validates a user-given value.
        text = getattr(hf_config, "text_config", None) or hf_config
        model_config.max_model_len = getattr(text, "max_position_embeddings", None)
    model_config.hf_config = hf_config
    model_config.architecture = choice.architecture
    model_config.implementation = choice.implementation
    return hf_config


def _resolve_runner(model_config: ModelConfig, hf_config: Any, path: Path) -> None:
    """Fill ``model_config.runner_type`` (``--runner``; auto: pooling for an embedding-only
    architecture or a sentence-transformers checkpoint) and, for pooling, its pooler."""
    from engine import pooling

    model_dir = path if path.is_dir() else None
    names = list(getattr(hf_config, "architectures", None) or [])
    runner, why = pooling.resolve_runner(getattr(model_config, "runner", "auto"), names, model_dir)
    model_config.runner_type = runner
    if runner != "pooling":
        return
    from_lm_head = bool(getattr(hf_config, "classifier_from_token", None))
    if from_lm_head:
        _resolve_classifier_tokens(model_config, model_dir, hf_config)  # sets num_labels
    cfg = pooling.resolve_pooler_config(model_dir, hf_config, names)
    model_config.pooler_config = cfg
    if (
        cfg.task == "classify"
        and getattr(hf_config, "sep_token_id", None) is None
        and not from_lm_head
    ):
        hf_config.sep_token_id = _sep_token_id(model_config, model_dir)
    if model_config.max_model_len is None:
        st_len = pooling.sentence_transformers_max_len(model_dir)
        if st_len is not None:
            model_config.max_model_len = st_len
        elif getattr(hf_config, "model_type", "") in ("roberta", "xlm-roberta"):
            # RoBERTa's positions start after the padding id: 514 table rows hold 512 tokens.
            model_config.max_model_len = hf_config.max_position_embeddings - (
                (hf_config.pad_token_id or 0) + 1
            )
    logger.info(
        "pooling runner (%s): %s pooling (%s), normalize=%s%s",
        why,
        cfg.pooling_type,
        cfg.source,
        cfg.normalize,
        f", matryoshka dimensions {cfg.matryoshka_dimensions or 'any'}"
        if cfg.is_matryoshka
        else "",
    )


def _resolve_classifier_tokens(
    model_config: ModelConfig, model_dir: Path | None, hf_config: Any
) -> None:
    """A classifier made from a causal LM's head (vLLM's ``--hf-overrides`` keys, as for
    Qwen3-Reranker: ``{"architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}``): the listed
    tokens' ids go into ``hf_config.classifier_from_token_ids`` and ``num_labels`` follows the
    method. ``from_2_way_softmax`` (what ``is_original_qwen3_reranker`` means) scores
    ``sigmoid(logit[second] - logit[first])``, the second token's probability in a softmax over
    the two, as one label; otherwise each token's logit is a label."""
    tokens = list(hf_config.classifier_from_token)
    method = getattr(hf_config, "method", None)
    if getattr(hf_config, "is_original_qwen3_reranker", False):
        method = "from_2_way_softmax"
    if method not in (None, "from_2_way_softmax", "no_post_processing"):
        raise ModelLoadError(
            f"hf_overrides method {method!r} is not supported; use 'from_2_way_softmax' "
            "or 'no_post_processing'"
        )
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ModelLoadError(
            f"from_2_way_softmax needs two classifier_from_token entries (the negative, then "
            f"the positive token), got {tokens}"
        )
    tok = _pooling_tokenizer(model_config, model_dir, "the model's")
    if tok is None:
        raise ModelLoadError("classifier_from_token needs the model's tokenizer")
    vocab = tok.get_vocab()
    missing = [t for t in tokens if t not in vocab]
    if missing:
        raise ModelLoadError(
            f"classifier_from_token names {missing}, which are not tokens of the model's "
            "vocabulary (each entry must be one token)"
        )
    hf_config.classifier_from_token_ids = [vocab[t] for t in tokens]
    hf_config.classifier_method = method or "no_post_processing"
    hf_config.num_labels = 1 if method == "from_2_way_softmax" else len(tokens)
    if hf_config.num_labels > 1:
        hf_config.id2label = dict(enumerate(tokens))
        hf_config.label2id = {t: i for i, t in enumerate(tokens)}


def _pooling_tokenizer(model_config: ModelConfig, model_dir: Path | None, whose: str) -> Any:
    """The model's tokenizer (``--tokenizer``, else the model directory), read while the config
    is resolved for what the config does not say; None without either. ``whose`` names the
    reader in the error."""
    source = getattr(model_config, "tokenizer", None) or model_dir
    if source is None:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(source))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {whose} tokenizer at {source}: {e}") from e


def _sep_token_id(model_config: ModelConfig, model_dir: Path | None) -> int | None:
    """A cross-encoder's separator token id, from its tokenizer (BERT's config.json does not
    name it; the model needs it to tell a pair's two texts apart)."""
    tok = _pooling_tokenizer(model_config, model_dir, "the cross-encoder's")
    return None if tok is None else tok.sep_token_id


def _select(model_config: ModelConfig, hf_config: Any, registry: ModelRegistry, log: bool) -> Any:
    """The ``engine.models.selection.ModelChoice`` for ``model_config.model_impl``."""
    from engine.models.selection import select_model

    return select_model(
        hf_config,
        getattr(model_config, "model_impl", "auto"),
        registry,
        trust_remote_code=model_config.trust_remote_code,
        log=log,
        runner=getattr(model_config, "runner_type", "generate"),
    )


def resolve_dtype(model_config: ModelConfig, hf_config: Any) -> torch.dtype:
    """``model_config.dtype`` as a torch dtype; ``auto`` takes the checkpoint's dtype
    (``declared_dtype``), float32 when it has none. (The engine resolves ``auto`` before it
    loads, asking the platform where the checkpoint declares nothing: core/runtime.py.)"""
    if model_config.dtype != "auto":
        return _DTYPES[model_config.dtype]
    return declared_dtype(hf_config) or torch.float32


def declared_dtype(hf_config: Any) -> torch.dtype | None:
    """The dtype a checkpoint declares (``dtype``/``torch_dtype`` in config.json; a multimodal
    config declares it at the top level or in its ``text_config``); None when it declares
    none (a GGUF file)."""
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
    return None


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
    missing = _required_parameters(meta_model) - loaded
    if missing:
        raise ModelLoadError(_missing_message(meta_model, missing, set(shapes)))


def _required_parameters(model: nn.Module) -> set[str]:
    """The parameters a checkpoint must fill: all but those a quantization method marks
    ``optional`` (e.g. GPTQ's ``g_idx`` without act-order, which it then ignores)."""
    return {name for name, p in model.named_parameters() if not getattr(p, "optional", False)}


def _drop_skipped(
    model_cls: type, shapes: dict[str, tuple], ctx: ModelContext | None = None
) -> dict[str, tuple]:
    """``shapes`` without the tensors ``model_cls.skip_checkpoint_prefixes`` names (parts of the
    checkpoint the model does not run; a class whose choice depends on the context, e.g. a
    multimodal model served text-only, answers ``checkpoint_prefixes_to_skip(ctx) -> (prefixes,
    reason)`` instead); logs what was skipped and why."""
    prefixes = tuple(getattr(model_cls, "skip_checkpoint_prefixes", ()))
    reason = getattr(model_cls, "skip_checkpoint_reason", "")
    if ctx is not None and hasattr(model_cls, "checkpoint_prefixes_to_skip"):
        prefixes, reason = model_cls.checkpoint_prefixes_to_skip(ctx)
        prefixes = tuple(prefixes)
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
            reason or "not used by this model",
        )
    return kept


# Checkpoint names of FP8 KV-cache scales (compressed-tensors' kv_cache_scheme, fp8 exports):
# suffix -> (how many module levels up the attention block is, which scales it sets).
_KV_SCALE_SUFFIXES = {
    ".k_scale": (1, "k"),
    ".v_scale": (1, "v"),
    ".kv_scale": (1, "kv"),
    ".k_proj.output_scale": (2, "k"),
    ".v_proj.output_scale": (2, "v"),
}


def _kv_scale_target(name: str) -> tuple[str, str] | None:
    """(module holding the layer's attention, "k"/"v"/"kv") for a KV-cache scale tensor name
    (``model.layers.3.self_attn.k_scale``, ``...self_attn.k_proj.k_scale``), else None."""
    for suffix, (_, which) in _KV_SCALE_SUFFIXES.items():
        if name.endswith(suffix):
            head = name[: -len(suffix)]
            if head.endswith((".k_proj", ".v_proj")) and suffix in (".k_scale", ".v_scale"):
                head = head.rsplit(".", 1)[0]
            return head, which
    return None


def _load_kv_scales(model: nn.Module, files: list[Path], names: set[str]) -> None:
    """Set each attention layer's FP8 KV-cache scales from the checkpoint (they are used when
    the cache is FP8, ``--kv-cache-dtype fp8``; 1.0 where a checkpoint has none)."""
    from engine.layers.attention import Attention

    for name, tensor in iter_safetensors(files, names=names):
        head, which = _kv_scale_target(name)  # type: ignore[misc]
        try:
            block = model.get_submodule(head)
        except AttributeError:
            block = None
        layers = [m for m in block.modules() if isinstance(m, Attention)] if block else []
        if len(layers) != 1 or tensor.numel() != 1:
            raise ModelLoadError(
                f"checkpoint tensor {name!r}: a KV-cache scale needs one element and one "
                f"attention layer under {head!r}"
            )
        value = float(tensor.float().reshape(()))
        if not value > 0:
            raise ModelLoadError(f"checkpoint tensor {name!r}: KV-cache scale {value} is not > 0")
        for part in which:
            setattr(layers[0].impl, f"{part}_scale", value)
    if names:
        logger.info("FP8 KV-cache scales from the checkpoint for %d tensors", len(names))


def init_dummy_weights(model: nn.Module, seed: int, init: str = "normal") -> None:
    """Random weights for ``load_format="dummy"`` (also a draft head's, for benchmarks);
    ``init`` is one of ``engine.config.DUMMY_INITS``."""
    _init_dummy(model, seed, init=init)


def _param_seed(seed: int, name: str) -> int:
    """A generator seed for one parameter: the same on every rank and in every layout."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63)


def _init_dummy(
    model: nn.Module,
    seed: int,
    full_shapes: dict[str, tuple[int, ...]] | None = None,
    init: str = "normal",
) -> None:
    """Seeded random weights: normal(0, 0.02) matrices (``init="uniform"``: vLLM's
    uniform(-1e-3, 1e-3)), zero biases, unit norm scales.

    Each matrix is drawn whole, from a generator seeded by ``seed`` and its name, so every
    parameter has the same values in every layout: under tensor or pipeline parallelism
    (``full_shapes``: the unsharded shape of each parameter) a rank draws the whole matrix and
    keeps its shard through the parameter's weight loader, exactly as from a checkpoint, so
    TP=2 runs the model TP=1 runs."""
    device = next(model.parameters()).device
    quantized = _quantized_linear_params(model)
    for name, param in model.named_parameters():
        if name in quantized:
            continue  # filled by the layer's quantization method (below)
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
        full = torch.empty(shape, dtype=param.dtype, device=device)
        if init == "uniform":
            full.uniform_(-1e-3, 1e-3, generator=gen)
        else:
            full.normal_(0.0, 0.02, generator=gen)
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
    for name, module in {id(m): (n, m) for n, m in quantized.values()}.values():
        # A quantization method fills its own packed values and scales (random, positive),
        # from a generator seeded by the seed and the layer's name. Under tensor parallelism
        # each rank fills its shard, so dummy quantized values differ between layouts (dummy
        # weights only serve benchmarks of big shapes).
        gen = torch.Generator(device=device).manual_seed(_param_seed(seed, name))
        module.quant_method.init_dummy_weights(module, gen)


def _quantized_linear_params(model: nn.Module) -> dict[str, tuple[str, LinearBase]]:
    """Parameter name -> (layer name, layer) for the parameters of the linear layers whose
    method is a quantization method (one entry per layer is enough to visit each once)."""
    out: dict[str, tuple[str, LinearBase]] = {}
    for layer_name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        # FusedMoE experts whose method stores quantized values (FP8 checkpoints) fill them
        # the same way; online methods quantize the normal dummy weights after loading.
        experts = isinstance(module, FusedMoE) and getattr(method, "serialized", False)
        if experts or isinstance(module, LinearBase) and method is not UNQUANTIZED:
            for pname, _ in module.named_parameters(recurse=False):
                out[f"{layer_name}.{pname}" if layer_name else pname] = (layer_name, module)
    return out


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
    multimodal_config: Any = None,
    stats: ReadStats | None = None,
) -> nn.Module:
    """Build the model for ``model_config`` on ``device`` and load its weights.

    Reads the config first when ``model_config.hf_config`` is unset. ``parallel`` says which
    tensor-parallel shard and pipeline stage this process builds (default: all of it); each
    checkpoint tensor is read only in the part this process holds. ``quant_config`` picks the
    linear layers' quantization methods; ``multimodal_config`` (``MultiModalConfig``) tells a
    multimodal model whether to build its vision tower. Every linear layer's method gets its
    post-loading pass (``process_weights_after_loading``), then norms and activations that
    feed an FP8 W8A8 linear are linked to write its FP8 input (``link_fp8_inputs``).
    ``stats`` counts the checkpoint bytes offered and read. Returns the model in eval mode
    with frozen parameters.
    """
    from tqdm.auto import tqdm

    from engine.layers.fp8_input import link_fp8_inputs

    registry = registry or ModelRegistry()
    if model_config.hf_config is None:
        load_hf_config(model_config, registry)
    hf_config = model_config.hf_config
    choice = _select(model_config, hf_config, registry, log=False)
    model_cls = choice.model_cls
    model_config.implementation = choice.implementation
    device = torch.device(device)
    dtype = resolve_dtype(model_config, hf_config)
    if quant_config is not None and hasattr(model_cls, "packed_modules_mapping"):
        # Which checkpoint modules each fused layer stands for (ignore lists name those).
        quant_config.packed_modules_mapping = dict(model_cls.packed_modules_mapping)
    ctx = ModelContext(
        hf_config,
        dtype,
        kernels,
        attn_backend_cls,
        device,
        parallel=parallel or SINGLE_PROCESS,
        quant_config=quant_config,
        multimodal_config=multimodal_config,
    )
    path = locate_model(model_config)
    fmt = model_config.load_format
    if fmt == "safetensors" and path.is_file():
        raise ModelLoadError(f"load_format=safetensors needs a model directory, got file {path}")

    if fmt == "dummy":
        full_shapes = None
        if ctx.parallel.world_size > 1:
            full_shapes = _full_shapes(model_cls, ctx)
        with torch.device(device):
            model = model_cls(ctx)
        _init_dummy(
            model,
            model_config.seed,
            full_shapes,
            init=model_config.dummy_init,
        )
        process_weights_after_loading(model)
        link_fp8_inputs(model)
        return model.eval()

    kv_scales: set[str] = set()
    keep_vocabulary = None
    if _is_gguf(path, model_config):
        from engine.loader import gguf_loader

        kept = getattr(quant_config, "kept_modules", None)  # GGUFConfig: raw blocks
        keep = kept.__contains__ if kept is not None and quant_config.name == "gguf" else None
        if keep is not None:  # GGUFConfig: a tied vocabulary matrix may stay quantized too
            keep_vocabulary = quant_config.keep_vocabulary
        weights = gguf_loader.iter_weights(path, hf_config, dtype, stats=stats, keep_quantized=keep)
        present: set[str] | None = None
        progress = tqdm(
            total=gguf_loader.num_tensors(path), desc="Loading GGUF weights", unit="tensor"
        )
        weights = _counting(weights, progress)
    else:
        files = safetensors_files(path)
        all_shapes = safetensors_shapes(files)
        if quant_config is not None:
            # Ignore lists name the checkpoint's modules, which may sit under other prefixes.
            quant_config.checkpoint_prefixes = checkpoint_prefixes_in(
                getattr(model_cls, "checkpoint_module_prefixes", ()), all_shapes
            )
        shapes = _drop_skipped(model_cls, all_shapes, ctx)
        kv_scales = {name for name in shapes if _kv_scale_target(name) is not None}
        shapes = {name: shape for name, shape in shapes.items() if name not in kv_scales}
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
        if keep_vocabulary is not None:  # before the first tensor is read
            keep_vocabulary(model, kernels, dtype)
    try:
        loaded = model.load_weights(weights)
    finally:
        progress.close()
    missing = _required_parameters(model) - loaded
    if missing:
        raise ModelLoadError(_missing_message(model, missing, present or set()))
    if kv_scales:
        _load_kv_scales(model, files, kv_scales)
    process_weights_after_loading(model)
    link_fp8_inputs(model)
    return model.eval()


def _counting(weights: Any, progress: Any) -> Iterator[tuple[str, torch.Tensor]]:
    for item in weights:
        yield item
        progress.update(1)


def check_quantized_layout(
    model_config: ModelConfig,
    kernels: Kernels,
    attn_backend_cls: type[AttentionBackend],
    registry: ModelRegistry,
    quant_config: QuantizationConfig,
    tensor_parallel_size: int = 1,
    enable_expert_parallel: bool = False,
) -> None:
    """Refuse, before any weight is read or worker started, a quantized model that cannot be
    built or sharded: the model is built on the meta device as a tensor-parallel rank builds
    it (each quantization method checks its per-rank sizes: a group size that does not divide
    a row-parallel layer's input features on a rank, a packing that splits), and every rank's
    shard of every packed or grouped parameter must start on a packed element (an int32 of
    eight 4-bit values, a quantization group, an FP8 scale block). Mixture-of-experts layers
    need a quantization method for their experts. Raises ``QuantizationError`` (a
    ``ConfigError``) naming the layer, the sizes and ``tensor_parallel_size``."""
    from engine.layers.linear import ColumnParallelLinear, RowParallelLinear
    from engine.quantization import QuantizationError

    hf_config = model_config.hf_config
    _, model_cls = registry.resolve(getattr(hf_config, "architectures", None) or [])
    if hasattr(model_cls, "packed_modules_mapping"):
        quant_config.packed_modules_mapping = dict(model_cls.packed_modules_mapping)
    tp = tensor_parallel_size
    parallel = ParallelContext(tp_rank=0, tp_size=tp, enable_expert_parallel=enable_expert_parallel)
    ctx = ModelContext(
        hf_config,
        resolve_dtype(model_config, hf_config),
        kernels,
        attn_backend_cls,
        torch.device("meta"),
        parallel=parallel,
        quant_config=quant_config,
    )
    method = getattr(quant_config, "name", type(quant_config).__name__)
    where = f" at tensor_parallel_size={tp}" if tp > 1 else ""
    try:
        with torch.device("meta"):
            model = model_cls(ctx)
    except NotImplementedError as exc:  # e.g. FusedMoE without a method for its experts
        raise QuantizationError(f"quantization {method!r} cannot run this model: {exc}") from None
    except QuantizationError as exc:
        raise QuantizationError(f"quantization {method!r}{where}: {exc}") from None
    if tp == 1:
        return
    for name, layer in model.named_modules():
        if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
            act_order = getattr(layer.quant_method, "act_order", False)
            group = getattr(layer.quant_method, "group_size", -1)
            if isinstance(layer, RowParallelLinear) and act_order and group != -1:
                raise QuantizationError(
                    f"quantization {method!r}{where}: {name} is row-parallel and the "
                    f"checkpoint is act-order (desc_act) with group_size {group}: a rank's "
                    "share of the input features falls in any group, which the wna16_linear "
                    "kernels cannot run; use tensor_parallel_size=1, or a checkpoint without "
                    "act-order (or with group_size -1)"
                )
            for pname, param in layer.named_parameters(recurse=False):
                try:
                    _check_shard_alignment(layer, param, tp)
                except ModelLoadError as exc:
                    raise QuantizationError(
                        f"quantization {method!r}{where}: {name}.{pname}: {exc}"
                    ) from None


def _check_shard_alignment(layer: Any, param: torch.Tensor, tp: int) -> None:
    """Every rank's shard of ``param`` starts on a packed element (``_packed_extent``)."""
    from engine.layers.linear import (
        ColumnParallelLinear,
        QKVParallelLinear,
        _packed_extent,
        shard_layout,
    )

    layout = shard_layout(param)
    if isinstance(layer, ColumnParallelLinear):
        if layout.output_dim is None or layout.per_slice or layout.output_pack == 1:
            return
        for s, (full, part) in enumerate(
            zip(layer.output_full_sizes, layer.output_partition_sizes, strict=True)
        ):
            for rank in range(tp):
                shard = rank
                if isinstance(layer, QKVParallelLinear) and s > 0:
                    shard = rank // layer.kv_replicas
                what = (
                    f"output slice {s} ({full} features, {part} per rank) in "
                    f"{layout.output_pack}-wide packed elements"
                )
                _packed_extent(shard * part, part, layout.output_pack, full, what)
            offset = sum(layer.output_partition_sizes[:s])
            _packed_extent(
                offset, part, layout.output_pack, layer.output_size_per_partition, "fused slices"
            )
    elif layout.input_dim is not None and layout.input_pack > 1:
        part = layer.input_size_per_partition
        for rank in range(tp):
            what = (
                f"{layer.input_size} input features, {part} per rank, in "
                f"{layout.input_pack}-wide groups or packed elements"
            )
            _packed_extent(rank * part, part, layout.input_pack, layer.input_size, what)
