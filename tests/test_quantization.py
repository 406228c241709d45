"""The quantization-method registry, its errors and plugin hook, the packed formats on
hand-made values, and quantized layers under tensor parallelism (model-level correctness is in
test_quantized_models.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from plugin_helpers import install_fixtures

from engine.kernels import KernelRegistry
from engine.layers import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.models.context import ModelContext
from engine.parallel import ParallelContext
from engine.quantization import (
    QuantizationConfig,
    QuantizationError,
    QuantizationRegistry,
    QuantizationSpec,
)
from engine.quantization.awq import AWQConfig
from engine.quantization.compressed_tensors import CompressedTensorsConfig
from engine.quantization.fp8 import Fp8Config
from engine.quantization.gptq import GPTQConfig
from engine.quantization.utils import unpack_awq, unpack_int32
from engine.testing import quantized_models as qm

CPU = QuantizationSpec(platform="cpu", device_type="cpu", dtype="bfloat16")


# ---- the registry ------------------------------------------------------------------------------
def test_builtin_methods_use_vllm_names():
    registry = QuantizationRegistry()
    assert registry.names() == ["fp8", "compressed-tensors", "gptq", "awq", "gguf", "mxfp4"]
    assert [e.name for e in registry.readers("awq")] == ["awq"]
    assert "compressed_tensors" in registry  # vLLM's alternative spelling


def test_resolution_from_the_checkpoint_and_the_flag():
    registry = QuantizationRegistry()
    assert registry.resolve(None, None, CPU) is None
    online = registry.resolve("fp8", None, CPU)
    assert isinstance(online, Fp8Config) and not online.serialized
    assert not online.activation_quant  # the CPU has no FP8 arithmetic: weight-only
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}
    assert isinstance(registry.resolve(None, awq, CPU), AWQConfig)
    assert isinstance(registry.resolve("awq", awq, CPU), AWQConfig)
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True}
    config = registry.resolve(None, gptq, CPU)
    assert isinstance(config, GPTQConfig) and config.desc_act
    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert registry.resolve(None, fp8, CPU).weight_block_size == (128, 128)


@pytest.mark.parametrize(
    ("requested", "checkpoint", "message"),
    [
        ("int3", None, r"Unknown quantization method 'int3'. Valid names: fp8, compressed-tensors"),
        (None, {"quant_method": "bitsandbytes"}, r"'bitsandbytes' format, which no quantization"),
        ("fp8", {"quant_method": "awq"}, r"--quantization fp8 does not read this checkpoint"),
        ("awq", None, r"--quantization awq needs a checkpoint quantized in the awq format"),
        (None, {"quant_method": "gptq", "bits": 3}, r"bits 3.*supported: 4, 8"),
        (None, {"quant_method": "gptq", "group_size": 256}, r"group_size 256.*32, 64, 128, -1"),
        (None, {"quant_method": "gptq", "lm_head": True}, r"quantizes the LM head"),
        (None, {"quant_method": "awq", "bits": 8}, r"AWQ checkpoint has bits 8"),
        (None, {"quant_method": "awq", "version": "gemv"}, r"version 'gemv'.*supported: gemm"),
        (
            None,
            {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [1, 1]},
            r"block-wise weight scales with activation_scheme 'static'",
        ),
        (
            None,
            {
                "quant_method": "compressed-tensors",
                "config_groups": {
                    "g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float"}}
                },
            },
            r"4-bit float weights.*Supported schemes: FP8 W8A8",
        ),
        (None, {"bits": 4}, r"quantization_config has no quant_method"),
    ],
)
def test_unsupported_requests_are_refused_with_what_is_supported(requested, checkpoint, message):
    with pytest.raises(QuantizationError, match=message):
        QuantizationRegistry().resolve(requested, checkpoint, CPU)


def test_an_accelerator_without_real_kernels_is_refused_never_dequantized():
    """On a GPU platform where only the torch references serve the quantized ops (no plugin
    provides them), every method refuses: the reference would dequantize on every call."""
    kernels = KernelRegistry().resolve("cuda")
    spec = QuantizationSpec(
        platform="cuda", device_type="cuda", capability=(9, 0), dtype="bfloat16", kernels=kernels
    )
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128}
    with pytest.raises(QuantizationError, match=r"no plugin provides wna16_linear on cuda"):
        QuantizationRegistry().resolve(None, awq, spec)
    assert any("dequantizes the weights" in r for r in Fp8Config.supports(spec))
    # The CPU may run the references.
    cpu = QuantizationSpec(
        platform="cpu", device_type="cpu", kernels=KernelRegistry().resolve("cpu")
    )
    assert AWQConfig.supports(cpu) == []


def test_fp8_is_w8a8_from_sm89_weight_only_on_the_cpu_and_refused_on_older_gpus(caplog):
    for capability in ((9, 0), (8, 9)):
        spec = QuantizationSpec(platform="cuda", device_type="cuda", capability=capability)
        assert QuantizationRegistry().resolve("fp8", None, spec).activation_quant
    assert "weight-only" not in caplog.text
    assert not QuantizationRegistry().resolve("fp8", None, CPU).activation_quant
    assert "the CPU has no FP8 arithmetic, so FP8 weights are multiplied weight-only" in caplog.text
    old_gpu = QuantizationSpec(platform="cuda", device_type="cuda", capability=(8, 0))
    with pytest.raises(QuantizationError, match=r"FP8 kernels need CUDA sm_89 or newer.*sm_80"):
        QuantizationRegistry().resolve("fp8", None, old_gpu)
    rocm = QuantizationSpec(platform="rocm", device_type="cuda", capability=(9, 4))
    assert any("not rocm" in r for r in Fp8Config.supports(rocm))
    # An INT8 compressed-tensors checkpoint still runs on the older GPU.
    int8 = {
        "quant_method": "compressed-tensors",
        "config_groups": {
            "g": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
                "input_activations": {
                    "num_bits": 8, "type": "int", "strategy": "token", "dynamic": True
                },
            }
        },
    }  # fmt: skip
    assert QuantizationRegistry().resolve(None, int8, old_gpu) is not None


def test_a_name_registered_twice_is_an_error():
    registry = QuantizationRegistry()
    with pytest.raises(QuantizationError, match="registered by both engine-llm and someone"):
        registry.register("awq", AWQConfig, provider="someone")


def test_a_class_whose_name_differs_from_its_registration_is_refused():
    registry = QuantizationRegistry(with_builtins=False)
    registry.register("other", AWQConfig, provider="vendor")
    with pytest.raises(QuantizationError, match="its class says name = 'awq'"):
        registry.entry("other").load()


def test_a_method_that_does_not_import_names_its_provider():
    registry = QuantizationRegistry(with_builtins=False)
    registry.register("ghost", "engine_no_such_module:GhostConfig", provider="engine-ghost")
    with pytest.raises(
        QuantizationError,
        match=r"Could not import quantization method 'ghost' "
        r"\(engine_no_such_module:GhostConfig, from engine-ghost\).*reinstall engine-ghost",
    ):
        registry.entry("ghost").load()


def test_checkpoint_names_carry_the_checkpoints_prefix():
    """Ignore lists name the checkpoint's modules: ours under the checkpoint's prefix, fused
    layers as their parts."""
    from engine.quantization.fp8 import Fp8Config

    config = Fp8Config(
        serialized=True, ignored_layers=["language_model.model.layers.0.mlp.down_proj"]
    )
    assert config.get_linear_method(None, "model.layers.0.mlp.down_proj") is not None  # no map
    config.checkpoint_prefixes = [("language_model.model.", "model.")]
    assert config.checkpoint_names("model.layers.1.self_attn.qkv_proj") == [
        f"language_model.model.layers.1.self_attn.{p}_proj" for p in "qkv"
    ]
    assert config.checkpoint_names("lm_head") == ["lm_head"]
    assert config.get_linear_method(None, "model.layers.0.mlp.down_proj") is None
    assert config.get_linear_method(None, "model.layers.1.mlp.down_proj") is not None


@pytest.mark.parametrize(
    "tensor, expected",
    [
        # released checkpoints / transformers 5, transformers 4.52-4.57, a text-only checkpoint
        ("language_model.model.layers.0.mlp.up_proj.weight", [("language_model.model.", "model.")]),
        ("model.language_model.layers.0.mlp.up_proj.weight", [("model.language_model.", "model.")]),
        ("model.layers.0.mlp.up_proj.weight", []),
    ],
)
def test_the_loader_picks_the_prefixes_the_checkpoint_uses(tensor, expected):
    from engine.models.gemma3_mm import Gemma3ForConditionalGeneration
    from engine.quantization.base import checkpoint_prefixes_in

    candidates = Gemma3ForConditionalGeneration.checkpoint_module_prefixes
    assert checkpoint_prefixes_in(candidates, [tensor]) == expected
    vision = {
        "vision_tower.vision_model.encoder.x.weight": "vision_tower.vision_model.",
        "model.vision_tower.vision_model.encoder.x.weight": "model.vision_tower.vision_model.",
        "vision_tower.encoder.x.weight": "vision_tower.",
    }
    for name, theirs in vision.items():
        assert checkpoint_prefixes_in(candidates, [tensor, name]) == [
            (theirs, "vision_tower.vision_model."),
            *expected,
        ]


def test_a_plugin_registers_a_method_and_its_own_kernel(plugin_env, tmp_path):
    """A vendor's method becomes ``--quantization vendor-awq`` and reads its own checkpoint
    format; its wna16_linear override serves every W4A16 layer on its platform."""
    from quant_helpers import build, prefill_logits

    from engine.plugins import PluginManager
    from engine.testing.tiny_models import save_tiny_model

    install_fixtures(plugin_env, "engine-quant-method")
    pm = PluginManager.from_env()
    entry = pm.quantization_methods().entry("vendor-awq")
    assert entry.provider == "engine-quant-method"
    assert pm.kernel_registry().resolve("cpu").provider("wna16_linear") == "engine-quant-method"

    from engine.cli.plugins import collect_report

    rows = {r["name"]: r for r in collect_report(pm, "cpu")["quantization_methods"]}
    assert rows["vendor-awq"]["checkpoint_formats"] == ["vendor-awq"]
    assert rows["vendor-awq"]["usable"] and rows["vendor-awq"]["provider"] == "engine-quant-method"

    src = save_tiny_model(
        "llama", tmp_path / "src", hidden_size=64, intermediate_size=128, num_hidden_layers=2
    )
    ckpt, ref = qm.write_awq(src, tmp_path / "q", tmp_path / "r", group_size=32)
    config = (ckpt / "config.json").read_text().replace('"awq"', '"vendor-awq"')
    (ckpt / "config.json").write_text(config)
    import engine_quant_method

    model, quant = build(ckpt)
    assert quant.name == "vendor-awq"
    assert engine_quant_method.CALLS["prepack"] == 2 * 4  # two layers of four projections
    torch.testing.assert_close(
        prefill_logits(model), prefill_logits(build(ref)[0]), rtol=1e-4, atol=1e-4
    )
    assert engine_quant_method.CALLS["linear"] == 2 * 4


def test_engine_plugins_lists_the_methods_and_why(plugin_env, capsys, monkeypatch):
    from engine.cli.main import main

    monkeypatch.setenv("ENGINE_PLUGINS", "cpu")
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "Quantization methods on cpu:" in out
    for name in ("fp8", "compressed-tensors", "gptq", "awq"):
        assert f"  {name} " in out


def test_cli_flags_reach_the_engine_config():
    import argparse

    from engine.cli.args import add_engine_args, add_model_arg, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_model_arg(parser)
    add_engine_args(parser)
    config = engine_config_from_args(
        parser.parse_args(["m", "--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3"])
    )
    assert config.model.quantization == "fp8" and config.cache.cache_dtype == "fp8"


# ---- the packed formats on hand-made values ------------------------------------------------------
def test_gptq_packing_of_hand_made_values():
    # Input features 0..7 of output column 0 hold 1..8: one int32, lowest bits first.
    values = np.zeros((8, 2), dtype=np.int64)
    values[:, 0] = np.arange(1, 9)
    values[:, 1] = [15, 0, 0, 0, 0, 0, 0, 0]
    packed = qm.gptq_pack_rows(values, 4)
    assert packed.view(np.uint32)[0, 0] == 0x87654321 and packed.view(np.uint32)[0, 1] == 0xF
    got = unpack_int32(torch.from_numpy(packed), 4, dim=0)
    assert got[:, 0].tolist() == list(range(1, 9)) and got[:, 1].tolist() == [15] + [0] * 7
    # 8-bit: four per int32.
    packed8 = qm.gptq_pack_rows(np.array([[1], [2], [3], [255]]), 8)
    assert packed8.view(np.uint32)[0, 0] == 0xFF030201
    assert unpack_int32(torch.from_numpy(packed8), 8, dim=0)[:, 0].tolist() == [1, 2, 3, 255]


def test_awq_packing_of_hand_made_values():
    # Output features 0..7 of one input row hold 1..8; AWQ's nibbles hold features
    # 0, 2, 4, 6, 1, 3, 5, 7: values 1, 3, 5, 7, 2, 4, 6, 8 from the lowest bits up.
    packed = qm.awq_pack(np.arange(1, 9)[None, :])
    assert packed.view(np.uint32)[0, 0] == 0x86427531
    assert unpack_awq(torch.from_numpy(packed))[0].tolist() == list(range(1, 9))


def test_compressed_tensors_packing_of_hand_made_values():
    """The library's own packer: int4 values -8..-1 stored offset by 8 (0..7)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    packed = pack_to_int32(torch.arange(-8, 0, dtype=torch.int8)[None, :], 4)
    assert packed.view(torch.int32)[0, 0].item() == 0x76543210
    assert unpack_int32(packed, 4, dim=1)[0].tolist() == list(range(8))


# ---- quantized layers under tensor parallelism -------------------------------------------------------
def _ctx(rank: int, size: int, quant: QuantizationConfig) -> ModelContext:
    return ModelContext(
        hf_config=None,
        dtype=torch.float32,
        kernels=None,
        attn_backend_cls=None,
        device=torch.device("cpu"),
        parallel=ParallelContext(tp_rank=rank, tp_size=size),
        quant_config=quant,
    )


def _gptq_tensors(w: torch.Tensor, group: int) -> tuple[dict, torch.Tensor]:
    q, scales, zeros = qm.rtn_groups(w, 4, group, sym=False)
    g_idx = torch.arange(w.shape[1]) // group
    tensors = {
        "qweight": torch.from_numpy(qm.gptq_pack_rows(q.T.numpy(), 4)),
        "qzeros": torch.from_numpy(qm.gptq_pack_columns((zeros - 1).T.numpy(), 4)),
        "scales": scales.T.contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }
    return tensors, qm.dequantize_groups(q, scales, zeros, g_idx)


def _awq_tensors(w: torch.Tensor, group: int) -> tuple[dict, torch.Tensor]:
    q, scales, zeros = qm.rtn_groups(w, 4, group, sym=False)
    tensors = {
        "qweight": torch.from_numpy(qm.awq_pack(q.T.numpy())),
        "qzeros": torch.from_numpy(qm.awq_pack(zeros.T.numpy())),
        "scales": scales.T.contiguous(),
    }
    return tensors, qm.dequantize_groups(q, scales, zeros, torch.arange(w.shape[1]) // group)


def _fp8_block_tensors(w: torch.Tensor, block: tuple[int, int]) -> tuple[dict, torch.Tensor]:
    n, k = w.shape
    bn, bk = block
    tiles = w.unflatten(0, (-1, bn)).unflatten(-1, (-1, bk))
    scale = tiles.abs().amax((1, 3)) / 448.0
    full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    q = (w / full).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale_inv": scale}, q.float() * full


FORMATS = {
    "gptq": (GPTQConfig(4, 16, desc_act=False, sym=False, v1_zeros=True), _gptq_tensors, 16),
    "awq": (AWQConfig(16), _awq_tensors, 16),
    "fp8-block": (
        Fp8Config(serialized=True, weight_block_size=(8, 16)),
        _fp8_block_tensors,
        (8, 16),
    ),
}


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("tp", [2, 4])
def test_quantized_shards_combine_to_the_single_process_product(fmt, tp):
    """Each rank loads its shard of the packed checkpoint tensors through the same loader;
    column-parallel outputs concatenate and row-parallel partial sums add up to the product of
    the whole dequantized weight (GPTQ's input-packed qweight, AWQ's output-packed one, FP8
    128x128-style block scales)."""
    quant, make, group = FORMATS[fmt]
    quant.activation_quant = False
    torch.manual_seed(0)
    x = torch.randn(3, 64)
    # Column-parallel (fused q/k/v: each slice split by heads).
    heads, kv_heads, head = 4, 4, 16
    slices = {s: torch.randn(heads * head, 64) * 0.1 for s in "qkv"}
    packed = {s: make(w, group) for s, w in slices.items()}
    outs = []
    for rank in range(tp):
        layer = QKVParallelLinear(
            64,
            head,
            heads,
            kv_heads,
            ctx=_ctx(rank, tp, quant),
            prefix="m.layers.0.self_attn.qkv_proj",
        )
        for s, (tensors, _) in packed.items():
            for name, tensor in tensors.items():
                param = getattr(layer, name)
                param.weight_loader(param, tensor, s)
        layer.process_weights_after_loading()
        outs.append(layer(x).split(layer.output_slices, dim=-1))
    for i, s in enumerate("qkv"):
        want = x @ packed[s][1].T
        torch.testing.assert_close(torch.cat([o[i] for o in outs], -1), want, rtol=1e-4, atol=1e-4)
    # Row-parallel: input features split, partial products summed.
    w = torch.randn(32, 64) * 0.1
    tensors, deq = make(w, group)
    total = torch.zeros(3, 32)
    for rank in range(tp):
        layer = RowParallelLinear(
            64, 32, reduce_results=False, ctx=_ctx(rank, tp, quant), prefix="m.layers.0.o_proj"
        )
        for name, tensor in tensors.items():
            param = getattr(layer, name)
            param.weight_loader(param, tensor)
        layer.process_weights_after_loading()
        total += layer(x.chunk(tp, dim=-1)[rank])
    torch.testing.assert_close(total, x @ deq.T, rtol=1e-4, atol=1e-4)


def test_a_shard_that_splits_a_packed_element_is_refused():
    """A GPTQ group of 32 input features cannot be split over ranks holding 16 each."""
    quant = GPTQConfig(4, 32, desc_act=False, sym=True, v1_zeros=True)
    with pytest.raises(QuantizationError, match="not a multiple of the group size 32"):
        RowParallelLinear(64, 32, ctx=_ctx(0, 4, quant), prefix="m.o_proj")


def test_fused_modules_must_be_quantized_alike():
    config = CompressedTensorsConfig.from_config(
        {
            "quant_method": "compressed-tensors",
            "config_groups": {
                "g": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                }
            },
            "ignore": ["model.layers.0.self_attn.k_proj"],
        }
    )
    with pytest.raises(QuantizationError, match="quantizes only some of them"):
        ColumnParallelLinear(
            64, [64, 64, 64], ctx=_ctx(0, 1, config), prefix="model.layers.0.self_attn.qkv_proj"
        )


# ---- benchmark inputs -----------------------------------------------------------------------------
def test_the_mixed_workload_is_fixed_by_its_seed():
    """Both engines are measured on the same 512 requests (tests/gpu/vllm_peer_mixed.py feeds
    them to the vLLM kit): lengths and token ids depend on the seed alone."""
    from engine.benchmarks.workload import MIXED_SYSTEM_PROMPT_LEN, mixed_workload

    a, b = mixed_workload(512, 128256, 0), mixed_workload(512, 128256, 0)
    assert a.prompts == b.prompts and a.output_lens == b.output_lens
    assert (a.input_tokens, a.output_tokens) == (446457, 189280)
    from collections import Counter

    prefixes = Counter(tuple(p[:MIXED_SYSTEM_PROMPT_LEN]) for p in a.prompts)
    shared = [n for _, n in prefixes.most_common(4)]
    assert len(shared) == 4 and min(shared) > 50  # four system prompts, each often reused
    assert mixed_workload(512, 128256, 1).prompts != a.prompts


def test_the_random_workload_draws_in_nano_vllms_order():
    """Per request: prompt length, token ids, output length, from random.Random(seed), so
    ``--seed 0`` reproduces nano-vllm's benchmark (the vLLM peer numbers were drawn the same
    way). Pinned, so that a refactor of the draws shows here."""
    from engine.benchmarks.workload import random_workload

    w = random_workload(3, (100, 1024), (100, 1024), 151936, seed=0)
    assert [len(p) for p in w.prompts] == [964, 232, 469]
    assert [p[:3] for p in w.prompts] == [
        [100999, 110260, 10622],
        [103709, 40706, 46347],
        [121679, 9543, 147229],
    ]
    assert w.output_lens == [931, 493, 679]


def test_the_awq_shape_writes_its_quantization_config(tmp_path):
    import json

    from engine.benchmarks.workload import write_builtin_model

    path = write_builtin_model("llama3-8b-awq", str(tmp_path))
    config = json.loads((tmp_path / "llama-3.1-8b-awq" / "config.json").read_text())
    assert path.endswith("llama-3.1-8b-awq")
    assert config["quantization_config"]["quant_method"] == "awq"
    assert isinstance(
        QuantizationRegistry().resolve(None, config["quantization_config"], CPU), AWQConfig
    )
