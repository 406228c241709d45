"""Quantized checkpoints of tiny models, for tests and the quality/memory benchmarks.

Each writer takes an unquantized Hugging Face model directory (``save_tiny_model``), quantizes
its decoder linear layers with round-to-nearest, and writes two directories: the quantized
checkpoint in the format's own layout (config.json with its ``quantization_config``), and a
*dequantized reference* — the same model with every quantized weight replaced by its exact
dequantized value (float32), which an unquantized engine (or transformers) runs as the
reference.

The GPTQ and AWQ packers are written from the formats' published descriptions (AutoGPTQ's
``pack``: values of one int32 along the input features, lowest bits first, zero points stored
minus one; AutoAWQ's GEMM ``pack``: eight output features per int32 in the order
0, 2, 4, 6, 1, 3, 5, 7) with plain integer arithmetic on NumPy ``uint32`` words, independently
of the engine's unpacking code. compressed-tensors checkpoints are written by the
``compressed-tensors`` library itself.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

# The decoder projections the writers quantize (the LM head and embeddings stay unquantized).
LINEAR_SUFFIXES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


# ---- reading and writing checkpoints ---------------------------------------------------------
def _load_state(src: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


def _copy_side_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        if file.suffix != ".safetensors" and file.name != "model.safetensors.index.json":
            if file.is_file():
                shutil.copy(file, dst / file.name)


def _write(
    dst: Path,
    state: dict[str, torch.Tensor],
    src: Path,
    quantization_config: dict[str, Any] | None,
    dtype: str | None = None,
) -> Path:
    from safetensors.torch import save_file

    _copy_side_files(src, dst)
    save_file({k: v.contiguous() for k, v in state.items()}, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    else:
        config.pop("quantization_config", None)
    if dtype is not None:
        config["dtype"] = config["torch_dtype"] = dtype
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


# Mixtral's per-expert projections (``...experts.<e>.w1``): quantized like the others.
MIXTRAL_EXPERT_SUFFIXES = ("w1", "w2", "w3")


def quantized_linears(state: dict[str, torch.Tensor]) -> list[str]:
    """The module names (``model.layers.0.self_attn.q_proj``) of the decoder projections,
    routed experts' included (``...mlp.experts.3.gate_proj``, ``...experts.3.w1``)."""
    names = []
    for key in state:
        if key.endswith(".weight"):
            module = key[: -len(".weight")]
            last = module.rsplit(".", 1)[-1]
            expert = ".experts." in module and last in MIXTRAL_EXPERT_SUFFIXES
            if last in LINEAR_SUFFIXES or expert:
                names.append(module)
    return sorted(names)


def _quantize_checkpoint(
    src: str | Path,
    out: str | Path,
    reference: str | Path | None,
    quantize: Callable[[torch.Tensor, str], tuple[dict[str, torch.Tensor], torch.Tensor]],
    quantization_config: dict[str, Any],
    dtype: str | None = None,
    modules: Iterable[str] | None = None,
) -> tuple[Path, Path | None]:
    """``quantize(weight, module) -> (tensors by suffix, dequantized weight)`` for every
    projection."""
    src = Path(src)
    state = _load_state(src)
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    targets = set(quantized_linears(state) if modules is None else modules)
    for key, tensor in state.items():
        module = key[: -len(".weight")] if key.endswith(".weight") else None
        if module in targets:
            tensors, deq = quantize(tensor.float(), module)
            for suffix, t in tensors.items():
                quantized[f"{module}.{suffix}"] = t
            dequantized[key] = deq.float()
        else:
            quantized[key] = tensor
            dequantized[key] = tensor.float()
    out_path = _write(Path(out), quantized, src, quantization_config, dtype)
    ref_path = None
    if reference is not None:
        ref_path = _write(Path(reference), dequantized, src, None, "float32")
    return out_path, ref_path


def input_ranges(src: str | Path, prompt: list[int]) -> dict[str, tuple[float, float]]:
    """(min, max) of every projection's input over one forward of ``prompt`` through the
    float model in ``src`` (transformers): calibration for static activation scales."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    ranges: dict[str, tuple[float, float]] = {}

    def hook(name: str):
        def record(module, args):
            x = args[0]
            ranges[name] = (float(x.min()), float(x.max()))

        return record

    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in LINEAR_SUFFIXES:
            module.register_forward_pre_hook(hook(name))
    with torch.no_grad():
        model(torch.tensor([prompt]))
    return ranges


# ---- integer round-to-nearest with groups ------------------------------------------------------
def rtn_groups(
    w: torch.Tensor, bits: int, group: int, sym: bool, g_idx: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min-max round-to-nearest of ``w`` ``[N, K]`` in groups along K. Returns
    (q int64 ``[N, K]`` in ``[0, 2**bits)``, scales float32 ``[N, G]``, zeros int64 ``[N, G]``);
    ``g_idx`` ``[K]`` assigns features to groups (act-order), else ``k // group``."""
    n, k = w.shape
    group = k if group == -1 else group
    if g_idx is None:
        g_idx = torch.arange(k) // group
    num_groups = int(g_idx.max()) + 1
    maxq = (1 << bits) - 1
    scales = torch.empty(n, num_groups)
    zeros = torch.empty(n, num_groups, dtype=torch.int64)
    for g in range(num_groups):
        cols = w[:, g_idx == g]
        if sym:
            amax = cols.abs().amax(dim=1).clamp(min=1e-8)
            s = 2 * amax / maxq
            z = torch.full((n,), (maxq + 1) // 2, dtype=torch.int64)
        else:
            lo = cols.amin(dim=1).clamp(max=0)
            hi = cols.amax(dim=1).clamp(min=0)
            s = ((hi - lo) / maxq).clamp(min=1e-8)
            z = torch.round(-lo / s).clamp(0, maxq).to(torch.int64)
        scales[:, g] = s
        zeros[:, g] = z
    s_full, z_full = scales[:, g_idx], zeros[:, g_idx]
    q = torch.clamp(torch.round(w / s_full) + z_full, 0, maxq).to(torch.int64)
    return q, scales, zeros


def dequantize_groups(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor
) -> torch.Tensor:
    return (q - zeros[:, g_idx]).float() * scales[:, g_idx]


# ---- GPTQ -----------------------------------------------------------------------------------
def _input_key(module: str) -> int:
    """A number shared by the projections that read the same input (for act-order seeds):
    q/k/v, gate/up (Mixtral's experts' w1/w3 too)."""
    head, _, last = module.rpartition(".")
    shared = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gu", "up_proj": "gu",
              "w1": "gu", "w3": "gu"}  # fmt: skip
    key = f"{head}.{shared.get(last, last)}"
    return sum((i + 1) * ord(c) for i, c in enumerate(key)) % 100_003


def gptq_pack_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """AutoGPTQ's qweight packing: ``values`` ``[K, N]`` -> int32 ``[K * bits / 32, N]``, row
    ``r`` holding input features ``r*p .. r*p+p-1`` (p = 32 / bits), the first lowest."""
    per = 32 // bits
    v = values.astype(np.uint32)
    out = np.zeros((v.shape[0] // per, v.shape[1]), dtype=np.uint32)
    for row in range(out.shape[0]):
        for j in range(per):
            out[row] |= v[row * per + j] << np.uint32(bits * j)
    return out.view(np.int32)


def gptq_pack_columns(values: np.ndarray, bits: int) -> np.ndarray:
    """AutoGPTQ's qzeros packing: ``values`` ``[G, N]`` -> int32 ``[G, N * bits / 32]``."""
    return gptq_pack_rows(values.T, bits).T.copy()


def write_gptq(
    src: str | Path,
    out: str | Path,
    reference: str | Path | None = None,
    *,
    bits: int = 4,
    group_size: int = 32,
    sym: bool = True,
    desc_act: bool = False,
    checkpoint_format: str = "gptq",
    seed: int = 0,
) -> tuple[Path, Path | None]:
    """A GPTQ checkpoint (and its dequantized reference) of the model in ``src``."""
    maxq = (1 << bits) - 1

    def quantize(w: torch.Tensor, module: str):
        n, k = w.shape
        group = k if group_size == -1 else group_size
        if desc_act:
            # Act-order: groups are formed over a permuted order of the input features, the
            # order of the input's Hessian diagonal, so projections of one input (q/k/v,
            # gate/up) share it.
            gen = torch.Generator().manual_seed(seed + _input_key(module))
            order = torch.randperm(k, generator=gen)
            g_idx = torch.empty(k, dtype=torch.int64)
            g_idx[order] = torch.arange(k) // group
        else:
            g_idx = torch.arange(k) // group
        q, scales, zeros = rtn_groups(w, bits, group, sym, g_idx)
        stored = zeros - 1 if checkpoint_format == "gptq" else zeros
        if checkpoint_format == "gptq" and bool((stored < 0).any()):
            stored = stored.clamp(min=0)  # v1 cannot store a zero point of 0
            zeros = stored + 1
            q = torch.clamp(torch.round(w / scales[:, g_idx]) + zeros[:, g_idx], 0, maxq).long()
        tensors = {
            "qweight": torch.from_numpy(gptq_pack_rows(q.T.numpy(), bits)),
            "qzeros": torch.from_numpy(gptq_pack_columns(stored.T.numpy(), bits)),
            "scales": scales.T.contiguous().to(torch.float16),
            "g_idx": g_idx.to(torch.int32),
        }
        deq = dequantize_groups(q, scales.to(torch.float16).float(), zeros, g_idx)
        return tensors, deq

    config = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": sym,
        "checkpoint_format": checkpoint_format,
        "lm_head": False,
    }
    return _quantize_checkpoint(src, out, reference, quantize, config, dtype="float16")


# ---- AWQ ------------------------------------------------------------------------------------
def awq_pack(values: np.ndarray) -> np.ndarray:
    """AutoAWQ's GEMM packing: ``values`` ``[R, C]`` 4-bit -> int32 ``[R, C / 8]``, nibble
    ``i`` of word ``c`` holding column ``8c + AWQ_PACK_ORDER[i]``."""
    v = values.astype(np.uint32)
    out = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.uint32)
    for col in range(out.shape[1]):
        for i in range(8):
            out[:, col] |= v[:, col * 8 + AWQ_PACK_ORDER[i]] << np.uint32(4 * i)
    return out.view(np.int32)


def write_awq(
    src: str | Path,
    out: str | Path,
    reference: str | Path | None = None,
    *,
    group_size: int = 32,
) -> tuple[Path, Path | None]:
    """An AWQ (GEMM) checkpoint and its dequantized reference (no activation-aware scaling:
    plain round-to-nearest, which is all the format's layout needs)."""

    def quantize(w: torch.Tensor, module: str):
        q, scales, zeros = rtn_groups(w, 4, group_size, sym=False)
        g_idx = torch.arange(w.shape[1]) // (w.shape[1] if group_size == -1 else group_size)
        tensors = {
            "qweight": torch.from_numpy(awq_pack(q.T.numpy())),
            "qzeros": torch.from_numpy(awq_pack(zeros.T.numpy())),
            "scales": scales.T.contiguous().to(torch.float16),
        }
        return tensors, dequantize_groups(q, scales.to(torch.float16).float(), zeros, g_idx)

    config = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    return _quantize_checkpoint(src, out, reference, quantize, config, dtype="float16")


# ---- the fp8 format ---------------------------------------------------------------------------
FP8_MAX = 448.0


def write_fp8(
    src: str | Path,
    out: str | Path,
    reference: str | Path | None = None,
    *,
    block: tuple[int, int] | None = None,
    activation_scheme: str = "dynamic",
    input_scale: float = 0.02,
    calibration: list[int] | None = None,
    ignored_layers: Iterable[str] = (),
) -> tuple[Path, Path | None]:
    """A checkpoint in the ``fp8`` format: per-tensor scales (``weight_scale``, and a static
    ``input_scale`` with ``activation_scheme="static"``: ``input_scale``, or each input's
    largest magnitude over ``calibration`` / 448) or ``block`` scales (``weight_scale_inv``).
    ``ignored_layers`` (checkpoint module names) stay unquantized and are listed in the config."""
    ranges = input_ranges(src, calibration) if calibration else {}

    def quantize(w: torch.Tensor, module: str):
        if block is None:
            scale = w.abs().amax() / FP8_MAX
            q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            tensors = {"weight": q, "weight_scale": scale.float().reshape(())}
            if activation_scheme == "static":
                lo, hi = ranges.get(module, (-input_scale * FP8_MAX, input_scale * FP8_MAX))
                value = max(abs(lo), abs(hi)) / FP8_MAX
                tensors["input_scale"] = torch.tensor(value, dtype=torch.float32)
            return tensors, q.float() * scale
        bn, bk = block
        n, k = w.shape
        rows, cols = -(-n // bn), -(-k // bk)
        scale = torch.empty(rows, cols)
        for i in range(rows):
            for j in range(cols):
                tile = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
                scale[i, j] = tile.abs().amax().clamp(min=1e-12) / FP8_MAX
        full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale_inv": scale}, q.float() * full

    config: dict[str, Any] = {"quant_method": "fp8", "activation_scheme": activation_scheme}
    if block is not None:
        config["weight_block_size"] = list(block)
    modules = None
    if ignored_layers:
        config["ignored_layers"] = list(ignored_layers)
        modules = set(quantized_linears(_load_state(Path(src)))) - set(ignored_layers)
    return _quantize_checkpoint(
        src, out, reference, quantize, config, dtype="bfloat16", modules=modules
    )


# ---- compressed-tensors (written by the library) -----------------------------------------------
def ct_scheme(kind: str, group_size: int = 32, block: tuple[int, int] = (32, 32)) -> Any:
    """A compressed-tensors ``QuantizationScheme`` for the tiny models (small groups/blocks):
    ``fp8_dynamic`` (channel weights, token-dynamic activations), ``fp8_static`` (tensor
    weights and activations), ``fp8_weight_only``, ``fp8_block``, ``int8_dynamic``,
    ``int8_static``, ``w4a16``, ``w4a16_asym``, ``w8a16``."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    def args(**kw: Any) -> QuantizationArgs:
        return QuantizationArgs(**kw)

    fp8_token = args(num_bits=8, type="float", strategy="token", dynamic=True, symmetric=True)
    schemes = {
        "fp8_dynamic": dict(
            weights=args(num_bits=8, type="float", strategy="channel", symmetric=True),
            input_activations=fp8_token,
        ),
        "fp8_static": dict(
            weights=args(num_bits=8, type="float", strategy="tensor", symmetric=True),
            input_activations=args(num_bits=8, type="float", strategy="tensor", symmetric=True),
        ),
        "fp8_weight_only": dict(
            weights=args(num_bits=8, type="float", strategy="channel", symmetric=True)
        ),
        "fp8_block": dict(
            weights=args(
                num_bits=8,
                type="float",
                strategy="block",
                symmetric=True,
                block_structure=list(block),
            ),
            input_activations=args(
                num_bits=8,
                type="float",
                strategy="group",
                group_size=block[1],
                dynamic=True,
                symmetric=True,
            ),
        ),
        "int8_dynamic": dict(
            weights=args(num_bits=8, type="int", strategy="channel", symmetric=True),
            input_activations=args(
                num_bits=8, type="int", strategy="token", dynamic=True, symmetric=True
            ),
        ),
        "int8_static": dict(
            weights=args(num_bits=8, type="int", strategy="channel", symmetric=True),
            input_activations=args(num_bits=8, type="int", strategy="tensor", symmetric=False),
        ),
        "w4a16": dict(
            weights=args(num_bits=4, type="int", strategy="group", group_size=group_size)
        ),
        "w4a16_asym": dict(
            weights=args(
                num_bits=4, type="int", strategy="group", group_size=group_size, symmetric=False
            )
        ),
        "w8a16": dict(
            weights=args(num_bits=8, type="int", strategy="group", group_size=group_size)
        ),
    }
    return QuantizationScheme(targets=["Linear"], **schemes[kind])


CT_FORMATS = {
    "fp8_dynamic": "float-quantized",
    "fp8_static": "float-quantized",
    "fp8_weight_only": "float-quantized",
    "fp8_block": "float-quantized",
    "int8_dynamic": "int-quantized",
    "int8_static": "int-quantized",
    "w4a16": "pack-quantized",
    "w4a16_asym": "pack-quantized",
    "w8a16": "pack-quantized",
}


def write_compressed_tensors(
    src: str | Path,
    out: str | Path,
    kind: str,
    *,
    group_size: int = 32,
    block: tuple[int, int] = (32, 32),
    input_scale: float = 0.02,
    input_zero_point: int = 4,
    dtype: torch.dtype = torch.bfloat16,
    calibration: list[int] | None = None,
) -> Path:
    """A compressed-tensors checkpoint of the model in ``src`` (see ``ct_scheme``), its
    weights' scales from their min/max (``calculate_qparams``), static activation scales set
    to ``input_scale`` (and ``input_zero_point`` for asymmetric ones), compressed and saved by
    the library.

    The zero point is even by default: the library fake-quantizes ``round(x / s + z)``, vLLM and
    the engine ``round(x / s) + z``, which differ at exact ties when ``z`` is odd. With
    ``calibration`` (a prompt) the static scales and zero points come from each input's range
    over one forward of it instead (the zero point then rounded to even)."""
    ranges = input_ranges(src, calibration) if calibration else {}
    from compressed_tensors.compressors.model_compressors.model_compressor import (
        ModelCompressor,
    )
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.apply import apply_quantization_config
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=dtype)
    scheme = ct_scheme(kind, group_size, block)
    config = QuantizationConfig(
        config_groups={"group_0": scheme},
        ignore=["lm_head"],
        quantization_status="initialized",
    )
    apply_quantization_config(model, config)
    with torch.no_grad():
        for name, module in model.named_modules():
            scheme_ = getattr(module, "quantization_scheme", None)
            if scheme_ is None:
                continue
            w_args = scheme_.weights
            w = module.weight.data.float()
            if w_args.strategy == "tensor":
                lo, hi = w.amin(), w.amax()
            elif w_args.strategy == "channel":
                lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
            elif w_args.strategy == "group":
                g = w.unflatten(-1, (-1, w_args.group_size))
                lo, hi = g.amin(-1), g.amax(-1)
            else:  # block
                bn, bk = w_args.block_structure
                g = w.unflatten(0, (-1, bn)).unflatten(-1, (-1, bk))
                lo, hi = g.amin((1, 3)), g.amax((1, 3))
            scale, zero = calculate_qparams(lo, hi, w_args)
            module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(
                module.weight_scale.shape
            )
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype).reshape(
                    module.weight_zero_point.shape
                )
            scale, zp = input_scale, input_zero_point
            if name in ranges and hasattr(module, "input_scale"):
                lo, hi = ranges[name]
                a_args = scheme_.input_activations
                if a_args.type == "float":
                    scale, zp = max(abs(lo), abs(hi)) / FP8_MAX, 0
                elif a_args.symmetric:
                    scale, zp = max(abs(lo), abs(hi)) / 127.0, 0
                else:
                    lo, hi = min(lo, 0.0), max(hi, 0.0)
                    scale = (hi - lo) / 255.0
                    zp = int(round((-128 - lo / scale) / 2)) * 2
            if hasattr(module, "input_scale"):
                module.input_scale.data.fill_(scale)
            if hasattr(module, "input_zero_point"):
                module.input_zero_point.data.fill_(zp)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=CT_FORMATS[kind])
    compressor.compress_model(model)
    out = Path(out)
    model.save_pretrained(str(out))
    compressor.update_config(str(out))
    src = Path(src)
    for file in src.iterdir():
        if "token" in file.name or file.name == "chat_template.jinja":
            shutil.copy(file, out / file.name)
    return out


def write_dequantized_compressed_tensors(ct_dir: str | Path, out: str | Path) -> Path:
    """The dequantized reference of a compressed-tensors checkpoint: every module's tensors
    decompressed by the library's own compressor for the checkpoint's format (in float32),
    the dense model saved plainly."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    ct_dir = Path(ct_dir)
    qconfig = json.loads((ct_dir / "config.json").read_text())["quantization_config"]
    groups = qconfig["config_groups"]
    if len(groups) != 1:
        raise ValueError("expected one config group (the writers here make one)")
    group = next(iter(groups.values()))
    scheme = QuantizationScheme.model_validate(group)
    compressor = BaseCompressor.get_value_from_registry(group.get("format") or qconfig["format"])
    state = _load_state(ct_dir)
    modules: dict[str, dict[str, torch.Tensor]] = {}
    dense: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        module, _, leaf = key.rpartition(".")
        if module.rsplit(".", 1)[-1] in LINEAR_SUFFIXES:
            value = tensor.float() if tensor.dtype in (torch.bfloat16, torch.float16) else tensor
            modules.setdefault(module, {})[leaf] = value
        else:
            dense[key] = tensor.float()
    for module, tensors in modules.items():
        weight = compressor.decompress(tensors, scheme)["weight"]
        dense[f"{module}.weight"] = weight.float()
    return _write(Path(out), dense, ct_dir, None, "float32")


def write_compressed_tensors_moe(
    src: str | Path,
    out: str | Path,
    reference: str | Path | None = None,
    kind: str = "w4a16",
    *,
    group_size: int = 32,
    actorder: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[Path, Path | None]:
    """A compressed-tensors ``pack-quantized`` checkpoint of a mixture-of-experts model in
    ``src`` (``kind``: ``w4a16``, ``w4a16_asym``, ``w8a16``; see ``ct_scheme``) with every
    decoder projection quantized, the routed experts' included, and its dequantized
    reference. transformers 5 keeps a MoE model's experts stacked (not ``nn.Linear``), so
    the library's model pass would skip them: each projection is quantized here module by
    module, its min/max scale and zero point from ``calculate_qparams`` and its tensors
    compressed (``compress``) and, for the reference, decompressed (``decompress``, in
    float32) by the library's own pack-quantized compressor. The routers (``mlp.gate``,
    Qwen2-MoE's ``shared_expert_gate``) stay unquantized and are listed in ``ignore``.
    ``actorder`` is only written into the config (for the refusal tests)."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    scheme = ct_scheme(kind, group_size)
    if actorder is not None:
        scheme.weights.actorder = actorder
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    w_args = scheme.weights

    def quantize(w: torch.Tensor, module: str):
        w = w.to(dtype)
        g = w.float().unflatten(-1, (-1, w_args.group_size))
        scale, zero = calculate_qparams(g.amin(-1), g.amax(-1), w_args)
        state = {"weight": w, "weight_scale": scale.to(dtype)}
        if not w_args.symmetric:
            state["weight_zero_point"] = zero.to(torch.int8)
        tensors = compressor.compress(state, scheme)
        unpacked = {
            k: v.float() if v.dtype in (torch.bfloat16, torch.float16) else v
            for k, v in tensors.items()
        }
        deq = compressor.decompress(unpacked, scheme)["weight"]
        return tensors, deq.float()

    config = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": json.loads(w_args.model_dump_json()),
            }
        },
        "ignore": [
            "lm_head",
            "re:.*mlp\\.gate$",
            "re:.*block_sparse_moe\\.gate$",
            "re:.*shared_expert_gate$",
        ],  # fmt: skip
    }
    return _quantize_checkpoint(src, out, reference, quantize, config, dtype=str(dtype)[6:])
