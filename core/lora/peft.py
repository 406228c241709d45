"""Reading LoRA adapters in the PEFT format, refusing what cannot be served, with the reason.

An adapter directory holds ``adapter_config.json`` (PEFT's ``LoraConfig``) and
``adapter_model.safetensors``, whose tensors are named
``base_model.model.<module>.lora_A.weight`` (``[r, in_features]``) and ``...lora_B.weight``
(``[out_features, r]``) for every adapted module. The module's output gains
``scaling * x @ A^T @ B^T`` with ``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with
``use_rslora``); ``rank_pattern`` / ``alpha_pattern`` override ``r`` / ``lora_alpha`` per module,
matched as PEFT matches them (a pattern names a module or a suffix of its dotted name).

Served: any linear module of the decoder (q/k/v/o, gate/up/down, ...), any rank up to
``--max-lora-rank`` (each module may have its own), ``lora_alpha``, rsLoRA, the patterns.
Refused, each with its own message: a pickled ``adapter_model.bin``, another PEFT method than
LoRA, DoRA (``use_dora``), ``modules_to_save`` (whole trained copies of base modules),
trained biases (``bias`` other than "none", ``lora_bias``), embedding or LM-head targets,
``fan_in_fan_out`` (GPT-2's Conv1D layout), ``layer_replication``, ``trainable_token_indices``,
``target_parameters`` (LoRA on raw parameters, e.g. MoE experts), activated LoRA
(``alora_invocation_tokens``) and other variants that change the forward pass.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.lora.errors import LoRAAdapterError

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_NAMES = ("adapter_model.bin", "adapter_model.pt")
_PREFIX = "base_model.model."
# <module>.lora_A.weight, or with the adapter's name: <module>.lora_A.default.weight
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")
_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
_EMBEDDING_NAMES = ("embed_tokens", "lm_head", "wte", "word_embeddings", "embed_in", "embed_out")

# Config fields whose truthy value changes what the adapter computes, with the reason it is
# refused.
_REFUSED_FIELDS = {
    "use_dora": "DoRA (use_dora=true) adapters rescale the merged weight per output feature",
    "lora_bias": "lora_bias=true adapters train a bias on lora_B",
    "fan_in_fan_out": "fan_in_fan_out=true stores weights transposed for GPT-2's Conv1D layers",
    "layer_replication": "layer_replication duplicates decoder layers",
    "trainable_token_indices": "trainable_token_indices trains embedding rows",
    "target_parameters": "target_parameters applies LoRA to raw parameters (e.g. MoE experts)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) switches the adapter "
    "on mid-sequence",
    "use_qalora": "QA-LoRA (use_qalora=true) pools the input",
    "use_bdlora": "block-diagonal LoRA (use_bdlora) is a different layout",
    "arrow_config": "Arrow (arrow_config) routes between several adapters",
    "kasa_config": "KaSA (kasa_config) changes the forward pass",
}


@dataclass
class LoRAModuleWeights:
    """One adapted module: ``delta = scaling * x @ lora_a.T @ lora_b.T``.

    ``lora_a`` ``[r, in_features]``, ``lora_b`` ``[out_features, r]``, as stored (CPU)."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return int(self.lora_a.shape[0])


@dataclass
class PeftAdapter:
    """An adapter read from disk: its config and its modules by dotted module name
    (``model.layers.0.self_attn.q_proj``, the base model's name without PEFT's prefix)."""

    path: Path
    config: dict[str, Any]
    modules: dict[str, LoRAModuleWeights]

    @property
    def max_rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)


def resolve_adapter_path(path: str) -> Path:
    """The local directory of an adapter: a path, or a Hugging Face Hub repository id (its
    cached snapshot, downloaded first where the cache lacks it: ``engine.loader.hub``)."""
    local = Path(path).expanduser()
    if local.exists():
        if not local.is_dir():
            raise LoRAAdapterError(
                f"LoRA adapter path {path!r} is a file; pass the adapter's directory (with "
                f"{CONFIG_NAME} and {WEIGHTS_NAME})"
            )
        return local
    if not path or not _REPO_ID.match(path):
        raise LoRAAdapterError(f"LoRA adapter path {path!r} does not exist")
    from engine.layers.weight_utils import ModelLoadError
    from engine.loader.hub import hub_adapter_snapshot

    try:
        return hub_adapter_snapshot(path)
    except ModelLoadError as e:
        raise LoRAAdapterError(str(e)) from None


def read_adapter_config(directory: Path) -> dict[str, Any]:
    """``adapter_config.json`` of an adapter directory, checked for what cannot be served."""
    config_path = directory / CONFIG_NAME
    if not config_path.is_file():
        raise LoRAAdapterError(f"LoRA adapter {str(directory)!r} has no {CONFIG_NAME}")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(
            f"LoRA adapter {str(directory)!r}: unreadable {CONFIG_NAME}: {e}"
        ) from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"LoRA adapter {str(directory)!r}: {CONFIG_NAME} is not an object")
    check_adapter_config(config, str(directory))
    return config


def check_adapter_config(config: dict[str, Any], where: str) -> None:
    """Raise ``LoRAAdapterError`` for a config this engine cannot serve."""
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAAdapterError(
            f"LoRA adapter {where!r} is a PEFT {peft_type} adapter; only LoRA adapters are served"
        )
    for field, reason in _REFUSED_FIELDS.items():
        if config.get(field):
            raise LoRAAdapterError(f"LoRA adapter {where!r}: {reason}, which is not supported")
    if config.get("modules_to_save"):
        raise LoRAAdapterError(
            f"LoRA adapter {where!r} has modules_to_save={config['modules_to_save']!r}: whole "
            "trained copies of base-model modules are not supported (merge them into the base "
            "model, or train the adapter without modules_to_save)"
        )
    bias = config.get("bias", "none")
    if bias not in (None, "none"):
        raise LoRAAdapterError(
            f"LoRA adapter {where!r} has bias={bias!r}: it trains the base model's biases, which "
            "is not supported (only bias='none')"
        )
    targets = config.get("target_modules")
    names = [targets] if isinstance(targets, str) else list(targets or [])
    for name in names:
        leaf = str(name).split(".")[-1]
        if leaf in _EMBEDDING_NAMES:
            raise LoRAAdapterError(
                f"LoRA adapter {where!r} targets {name!r}: LoRA on embeddings and the LM head "
                "is not supported (only linear layers of the decoder)"
            )
    r = config.get("r", 8)
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoRAAdapterError(f"LoRA adapter {where!r} has an invalid rank r={r!r}")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise LoRAAdapterError(f"LoRA adapter {where!r} has an invalid lora_alpha={alpha!r}")


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` lookup: the first pattern that names the
    module or a dotted suffix of it (a regular expression)."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def module_scaling(config: dict[str, Any], module: str, rank: int) -> float:
    """``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA) for one module, after the patterns."""
    alpha = float(_pattern_value(config.get("alpha_pattern") or {}, module, config["lora_alpha"]))
    if config.get("use_rslora"):
        return alpha / math.sqrt(rank)
    return alpha / rank


def load_peft_adapter(path: str, max_rank: int) -> PeftAdapter:
    """Read and check an adapter directory (or cached repository id); tensors stay on the CPU
    in their stored dtype. Raises ``LoRAAdapterError`` with the reason when it cannot be
    served."""
    directory = resolve_adapter_path(path)
    config = read_adapter_config(directory)
    config.setdefault("lora_alpha", 8)
    weights_path = directory / WEIGHTS_NAME
    if not weights_path.is_file():
        pickled = [n for n in PICKLE_NAMES if (directory / n).is_file()]
        if pickled:
            raise LoRAAdapterError(
                f"LoRA adapter {path!r} has only {pickled[0]} (a pickle, which can run code when "
                f"loaded); only {WEIGHTS_NAME} is read: convert it with "
                "safetensors.torch.save_file(torch.load(...), 'adapter_model.safetensors')"
            )
        raise LoRAAdapterError(f"LoRA adapter {path!r} has no {WEIGHTS_NAME}")
    from safetensors import SafetensorError, safe_open

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                name = key[len(_PREFIX) :] if key.startswith(_PREFIX) else key
                match = _LORA_KEY.match(name)
                if match is None:
                    raise LoRAAdapterError(_unexpected_tensor(path, name))
                module = match["module"]
                if module.split(".")[-1] in _EMBEDDING_NAMES:
                    raise LoRAAdapterError(
                        f"LoRA adapter {path!r} adapts {module!r}: LoRA on embeddings and the LM "
                        "head is not supported (only linear layers of the decoder)"
                    )
                pairs.setdefault(module, {})[match["which"]] = f.get_tensor(key)
    except SafetensorError as e:
        raise LoRAAdapterError(f"LoRA adapter {path!r}: unreadable {WEIGHTS_NAME}: {e}") from None
    if not pairs:
        raise LoRAAdapterError(f"LoRA adapter {path!r}: {WEIGHTS_NAME} holds no LoRA weights")
    modules: dict[str, LoRAModuleWeights] = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise LoRAAdapterError(f"LoRA adapter {path!r}: {module} has no {missing} weight")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise LoRAAdapterError(
                f"LoRA adapter {path!r}: {module} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}, which are not [r, in] and [out, r] of one rank"
            )
        rank = int(a.shape[0])
        if rank > max_rank:
            raise LoRAAdapterError(
                f"LoRA adapter {path!r}: {module} has rank {rank}, more than --max-lora-rank "
                f"{max_rank}; start the engine with --max-lora-rank {_next_rank(rank)} or more"
            )
        if not (a.is_floating_point() and b.is_floating_point()):
            raise LoRAAdapterError(
                f"LoRA adapter {path!r}: {module} weights are not floating point"
            )
        modules[module] = LoRAModuleWeights(a, b, module_scaling(config, module, rank))
    return PeftAdapter(directory, config, modules)


def _unexpected_tensor(path: str, name: str) -> str:
    if "lora_magnitude_vector" in name:
        return f"LoRA adapter {path!r} is a DoRA adapter ({name}), which is not supported"
    if "lora_embedding" in name:
        return (
            f"LoRA adapter {path!r} adapts an embedding ({name}): LoRA on embeddings and the LM "
            "head is not supported"
        )
    if re.search(r"\.lora_[AB]\.(?:[^.]+\.)?bias$", name):
        return f"LoRA adapter {path!r} has a LoRA bias ({name}), which is not supported"
    if name.endswith((".weight", ".bias")):
        return (
            f"LoRA adapter {path!r} stores a base-model tensor ({name}), as modules_to_save "
            "does: whole trained copies of base-model modules are not supported"
        )
    return f"LoRA adapter {path!r} has a tensor {name!r} that is not a LoRA A/B weight"


def _next_rank(rank: int) -> int:
    return 1 << (rank - 1).bit_length()
