"""FP8 mixture-of-experts models on the CPU (``Fp8MoEMethod`` and the ``fused_moe_fp8``
reference), against the *dequantized reference*: the same model with every quantized weight
replaced by its exact dequantized value, run unquantized.

* ``--quantization fp8`` online on tiny random Qwen3-MoE, Mixtral and Qwen2-MoE (a shared
  expert, dense layers among sparse ones) checkpoints: the
  reference is the unquantized model with every linear's and expert's rows rounded to e4m3
  per channel here, independently of the engine's code;
* block-wise ``fp8`` checkpoints as Qwen3-30B-A3B-FP8 ships them (128x128 ``weight_scale_inv``
  per expert projection, sizes that leave partial blocks), written tile by tile by
  ``engine.testing.quantized_models.write_fp8``, and per-tensor ones (dynamic and static).

FP8 on the CPU is weight-only and the comparisons run in float32, so the stated tolerance is
float32 rounding: 1e-3 on logits of magnitude ~1-10 (as tests/test_quantized_models.py), with
the greedy token equal wherever the reference's top two logits are well separated; the FP8
logits must also differ from the unquantized model's by more than that (the experts really
are quantized). End to end through ``LLM``: greedy tokens equal, no KV block left in use.
"""

from __future__ import annotations

import json

import pytest
import torch
from quant_helpers import PROMPT, build, compare, prefill_logits

from engine import LLM, SamplingParams
from engine.layers.fused_moe import FusedMoE, MoEParallel
from engine.quantization import QuantizationError
from engine.testing import quantized_models as qm
from engine.testing.tiny_models import build_tokenizer, save_tiny_model

ATOL = 1e-3
FP8 = torch.float8_e4m3fn


def _source(tmp_path_factory, kind: str, **overrides):
    path = save_tiny_model(kind, tmp_path_factory.mktemp(kind), **overrides)
    build_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return _source(tmp_path_factory, "qwen3_moe", num_hidden_layers=3, num_experts=16)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return _source(tmp_path_factory, "mixtral", num_hidden_layers=2)


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    return _source(tmp_path_factory, "qwen2_moe", num_hidden_layers=2)


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "qwen2_moe"])
def source(request):
    return request.param, request.getfixturevalue(request.param)


def _round_rows_to_fp8(w: torch.Tensor) -> None:
    """``w`` ([..., N, K]) in place: each row scaled to +-448, rounded to e4m3 and back."""
    scale = (w.abs().amax(dim=-1, keepdim=True) / 448.0).clamp(min=1e-12)
    w.copy_((w / scale).clamp(-448, 448).to(FP8).float() * scale)


def fake_quantize_online(model: torch.nn.Module, quantized: torch.nn.Module) -> int:
    """The online FP8 reference: in ``model`` (unquantized), the rows of every module whose
    weights are e4m3 in ``quantized`` (linears and experts; routers stay as they are) rounded
    per channel, in place. Returns the number of MoE layers touched."""
    fp8 = {
        name
        for name, m in quantized.named_modules()
        for p in m.parameters(recurse=False)
        if p.dtype == FP8
    }
    modules = dict(model.named_modules())
    layers = 0
    with torch.no_grad():
        for name in fp8:
            module = modules[name]
            if isinstance(module, FusedMoE):
                _round_rows_to_fp8(module.w13_weight)
                _round_rows_to_fp8(module.w2_weight)
                layers += 1
            else:
                _round_rows_to_fp8(module.weight)
    return layers


def experts_of(model) -> list[FusedMoE]:
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def test_online_fp8_experts_match_the_dequantized_reference(source):
    kind, path = source
    model, quant = build(path, quantization="fp8")
    assert "online" in quant.describe()
    for layer in experts_of(model):
        e, i, h = layer.num_local_experts, layer.intermediate_size, layer.hidden_size
        assert layer.w13_weight.dtype == FP8 and layer.w2_weight.dtype == FP8
        assert layer.w13_weight_scale.shape == (e, 2 * i)
        assert layer.w2_weight_scale.shape == (e, h)
        assert type(layer.quant_method).__name__ == "Fp8MoEMethod"
    ref, _ = build(path)
    original = prefill_logits(ref)
    assert fake_quantize_online(ref, model) == len(experts_of(model)) > 0
    got, want = prefill_logits(model), prefill_logits(ref)
    compare(got, want, ATOL)
    # Quantization really happened: far more than the tolerance from the unquantized model.
    assert float((got - original).abs().max()) > 10 * ATOL, kind


def write_online_reference(src, dst) -> None:
    """The online FP8 reference as a checkpoint: every decoder projection's and expert's
    rows rounded to e4m3 per channel (what ``--quantization fp8`` quantizes; routers, norms,
    embeddings and the head stay)."""
    state = qm._load_state(src)
    for module in qm.quantized_linears(state):
        w = state[f"{module}.weight"].float()
        _round_rows_to_fp8(w)
        state[f"{module}.weight"] = w
    qm._write(dst, state, src, None, "float32")


def test_online_fp8_greedy_tokens_through_llm(source, tmp_path):
    """End to end: chunked prefill and batched decodes, greedy tokens equal to the engine run
    on the dequantized weights, every KV block back in the pool."""
    kind, path = source
    kw = dict(dtype="float32", block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    prompts = [PROMPT, PROMPT[:5], PROMPT[3:20], [7, 8, 9]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def run(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.llm_engine.num_used_blocks == 0
        return [o.outputs[0].token_ids for o in outs]

    llm = LLM(str(path), quantization="fp8", **kw)
    assert experts_of(llm.llm_engine.runner.model)[0].w13_weight.dtype == FP8
    got = run(llm)
    write_online_reference(path, tmp_path / "ref")
    assert got == run(LLM(str(tmp_path / "ref"), **kw)), kind


# ---- fp8 checkpoints ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def block_sources(tmp_path_factory):
    """128-wide models (the dense layers need whole 128x128 blocks per fused slice, as real
    FP8 models have: 4 KV heads of 32) whose experts leave partial 128x128 blocks: Qwen3-MoE intermediate 96, Mixtral 160."""
    return {
        "qwen3_moe": _source(
            tmp_path_factory,
            "qwen3_moe",
            hidden_size=128,
            intermediate_size=256,
            num_key_value_heads=4,
            moe_intermediate_size=96,
            num_hidden_layers=3,
            num_experts=16,
        ),  # fmt: skip
        "mixtral": _source(
            tmp_path_factory,
            "mixtral",
            hidden_size=128,
            intermediate_size=160,
            num_key_value_heads=4,
            num_hidden_layers=2,
        ),  # fmt: skip
    }


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_block_fp8_checkpoint_matches_the_dequantized_reference(kind, block_sources, tmp_path):
    src = block_sources[kind]
    quantized, reference = qm.write_fp8(src, tmp_path / "q", tmp_path / "ref", block=(128, 128))
    from safetensors import safe_open

    with safe_open(str(quantized / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    proj = "gate_proj" if kind == "qwen3_moe" else "w1"
    block = "mlp" if kind == "qwen3_moe" else "block_sparse_moe"
    assert f"model.layers.0.{block}.experts.3.{proj}.weight_scale_inv" in names
    model, quant = build(quantized)
    assert quant.weight_block_size == (128, 128)
    layers = experts_of(model)
    assert layers
    for layer in layers:
        e, i, h = layer.num_local_experts, layer.intermediate_size, layer.hidden_size
        assert layer.w13_weight.dtype == FP8
        assert layer.w13_weight_scale_inv.shape == (e, 2 * -(-i // 128), -(-h // 128))
        assert layer.w2_weight_scale_inv.shape == (e, -(-h // 128), -(-i // 128))
    ref, _ = build(reference)
    got, want = prefill_logits(model), prefill_logits(ref)
    compare(got, want, ATOL)
    unquantized, _ = build(src)
    assert float((got - prefill_logits(unquantized)).abs().max()) > 10 * ATOL


@pytest.mark.parametrize("scheme", ["dynamic", "static"])
def test_per_tensor_fp8_checkpoint_matches_the_dequantized_reference(scheme, qwen3_moe, tmp_path):
    """Per-tensor ``weight_scale`` per expert projection (expanded to per channel, exactly);
    a static checkpoint's ``input_scale`` is read and dropped (the experts run weight-only)."""
    quantized, reference = qm.write_fp8(
        qwen3_moe, tmp_path / "q", tmp_path / "ref", activation_scheme=scheme
    )
    model, _ = build(quantized, activation_quant=False)  # weight-only dense layers too
    layer = experts_of(model)[0]
    assert layer.w13_weight_scale.shape == (layer.num_local_experts, 2 * layer.intermediate_size)
    assert not hasattr(layer, "w13_input_scale")
    ref, _ = build(reference)
    compare(prefill_logits(model), prefill_logits(ref), ATOL)


def test_dummy_weights_for_a_block_fp8_moe_config(block_sources, tmp_path):
    """``--load-format dummy`` with a Qwen3-MoE-FP8 config (for benchmarks of real shapes):
    the experts get random e4m3 values and positive block scales, and the model runs."""
    quantized, _ = qm.write_fp8(block_sources["qwen3_moe"], tmp_path / "q", None, block=(128, 128))
    model, _ = build(quantized, load_format="dummy")
    layer = experts_of(model)[0]
    assert layer.w13_weight.dtype == FP8 and bool((layer.w13_weight_scale_inv > 0).all())
    assert layer.w13_weight.float().std() > 1.0  # e4m3 values, not the dequantized ones
    assert torch.isfinite(prefill_logits(model)).all()


def test_missing_expert_scales_are_named(block_sources, tmp_path):
    from safetensors.torch import load_file, save_file

    from engine.layers.weight_utils import ModelLoadError

    quantized, _ = qm.write_fp8(block_sources["qwen3_moe"], tmp_path / "q", None, block=(128, 128))
    state = load_file(str(quantized / "model.safetensors"))
    del state["model.layers.1.mlp.experts.5.down_proj.weight_scale_inv"]
    save_file(state, str(quantized / "model.safetensors"))
    with pytest.raises(
        ModelLoadError, match=r"model\.layers\.1\.mlp\.experts\.5\.down_proj\.weight_scale_inv"
    ):
        build(quantized)


# ---- what is refused ------------------------------------------------------------------------
def _fp8_layer(intermediate: int, tp_size: int, block=(128, 128), kernels=None):
    from engine.quantization.fp8 import Fp8Config

    config = Fp8Config(serialized=True, weight_block_size=block)
    with torch.device("meta"):
        return FusedMoE(
            8, 2, 256, intermediate, renormalize=True, kernels=kernels, dtype=torch.bfloat16,
            parallel=MoEParallel(tp_rank=0, tp_size=tp_size), communicator=object(),
            quant_config=config, prefix="model.layers.0.mlp.experts",
        )  # fmt: skip


def test_block_scales_split_off_block_boundaries_are_refused():
    _fp8_layer(512, tp_size=2)  # 256 per rank: whole blocks
    _fp8_layer(96, tp_size=1)  # a partial block on one rank is fine
    with pytest.raises(
        QuantizationError, match=r"each rank's 192 of the experts' 384 intermediate"
    ):
        _fp8_layer(384, tp_size=2)


def test_a_gpu_platform_with_only_the_reference_is_refused():
    from engine.kernels.registry import KernelRegistry

    kernels = KernelRegistry().resolve("cuda")  # no plugin: the torch reference only
    with pytest.raises(QuantizationError, match="no plugin provides fused_moe_fp8 on cuda"):
        _fp8_layer(256, tp_size=1, kernels=kernels)
    _fp8_layer(256, tp_size=1, kernels=KernelRegistry().resolve("cpu"))  # the CPU: the reference


def test_ignored_experts_stay_unquantized():
    from engine.quantization.fp8 import Fp8Config
    from engine.quantization.fp8_moe import Fp8MoEMethod

    config = Fp8Config(serialized=True, ignored_layers=["re:.*mlp\\.experts"])
    assert config.get_moe_method(None, "model.layers.0.mlp.experts") is None
    assert isinstance(
        Fp8Config(serialized=False).get_moe_method(None, "model.layers.0.mlp.experts"),
        Fp8MoEMethod,
    )


# ---- split over ranks -----------------------------------------------------------------------
def test_block_fp8_experts_split_and_placed_over_two_ranks_match_one_process(tmp_path):
    """An experts-only block-wise fp8 checkpoint (16x16 blocks, so that each rank's 16 of the
    32 intermediate features are whole blocks) at TP=2 (every expert's block scales sharded
    with its rows / columns) and with expert parallelism (whole experts and their scales per
    rank) on two gloo worker processes: greedy tokens equal one process's, logprobs within
    1e-4, no KV block left in use."""
    from engine.testing.moe_parallel import assert_moe_layouts_match_one_process
    from engine.testing.tiny_models import build_tiny_model

    src = build_tiny_model(tmp_path / "src", "qwen3_moe", seed=2)
    dense = [m for m in qm.quantized_linears(qm._load_state(src)) if ".experts." not in m]
    fp8, _ = qm.write_fp8(src, tmp_path / "fp8", None, block=(16, 16), ignored_layers=dense)
    # 64 experts, intermediate 32, hidden 64, 16x16 blocks: split (1 gate + 1 up block row per
    # rank) or placed (32 whole experts, 2 + 2 block rows).
    assert_moe_layouts_match_one_process(
        str(fp8),
        "model.layers.0.mlp.experts.w13_weight_scale_inv",
        {False: [(64, 2, 4)] * 2, True: [(32, 4, 4)] * 2},
    )


# ---- compressed-tensors ---------------------------------------------------------------------
def write_ct_fp8_experts(src, out, ref, strategy: str, block=(16, 32)):
    """A compressed-tensors (``float-quantized``) checkpoint with only the routed experts in
    FP8, written by hand (the library quantizes ``nn.Linear`` modules, and transformers 5
    keeps experts stacked): per-channel ``weight_scale`` ``[N, 1]`` with token-dynamic
    activations, or ``block`` scales with group-dynamic ones, as llm-compressor writes them."""
    weights = {"type": "float", "num_bits": 8, "symmetric": True, "dynamic": False}
    if strategy == "channel":
        weights["strategy"] = "channel"
        inputs = {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True}
    else:
        weights.update(strategy="block", block_structure=list(block))
        inputs = {"type": "float", "num_bits": 8, "strategy": "group", "dynamic": True,
                  "group_size": block[1]}  # fmt: skip
    config = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["re:.*experts\\.\\d+\\..*"],
                "weights": weights,
                "input_activations": inputs,
            }
        },
        "ignore": ["lm_head"],
    }

    def quantize(w: torch.Tensor, module: str):
        if strategy == "channel":
            scale = (w.abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
            q = (w / scale).clamp(-448, 448).to(FP8)
            return {"weight": q, "weight_scale": scale}, q.float() * scale
        bn, bk = block
        n, k = w.shape
        rows, cols = -(-n // bn), -(-k // bk)
        scale = torch.empty(rows, cols)
        for i in range(rows):
            for j in range(cols):
                tile = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
                scale[i, j] = tile.abs().amax().clamp(min=1e-12) / 448.0
        full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        q = (w / full).clamp(-448, 448).to(FP8)
        return {"weight": q, "weight_scale": scale}, q.float() * full

    experts = [m for m in qm.quantized_linears(qm._load_state(src)) if ".experts." in m]
    return qm._quantize_checkpoint(src, out, ref, quantize, config, modules=experts)


@pytest.mark.parametrize(
    "kind,strategy", [("qwen3_moe", "channel"), ("qwen3_moe", "block"), ("mixtral", "channel")]
)
def test_compressed_tensors_fp8_experts_match_the_dequantized_reference(
    kind, strategy, request, tmp_path
):
    src = request.getfixturevalue(kind)
    quantized, reference = write_ct_fp8_experts(src, tmp_path / "q", tmp_path / "ref", strategy)
    model, quant = build(quantized)
    assert quant.name == "compressed-tensors"
    layer = experts_of(model)[0]
    assert layer.w13_weight.dtype == FP8
    e, i, h = layer.num_local_experts, layer.intermediate_size, layer.hidden_size
    if strategy == "channel":
        assert layer.w13_weight_scale.shape == (e, 2 * i)
    else:
        assert layer.w13_weight_scale.shape == (e, 2 * -(-i // 16), -(-h // 32))
    ref, _ = build(reference)
    got = prefill_logits(model)
    compare(got, prefill_logits(ref), ATOL)
    unquantized, _ = build(src)
    assert float((got - prefill_logits(unquantized)).abs().max()) > 10 * ATOL


def test_compressed_tensors_integer_experts_take_the_integer_method(qwen3_moe, tmp_path):
    """A W4A16 group over the experts is not FP8: its experts get the integer method
    (tests/test_wna16_moe.py runs them)."""
    quantized, _ = write_ct_fp8_experts(qwen3_moe, tmp_path / "q", None, "channel")
    from engine.quantization.compressed_tensors import CompressedTensorsConfig
    from engine.quantization.wna16_moe import WNA16MoEMethod

    config = json.loads((quantized / "config.json").read_text())["quantization_config"]
    config["config_groups"]["group_0"]["weights"] = {
        "type": "int", "num_bits": 4, "strategy": "group", "group_size": 32, "symmetric": True
    }  # fmt: skip
    del config["config_groups"]["group_0"]["input_activations"]
    config["format"] = "pack-quantized"
    method = CompressedTensorsConfig.from_config(config).get_moe_method(
        None, "model.layers.0.mlp.experts"
    )
    assert isinstance(method, WNA16MoEMethod) and method.symmetric


def test_the_qwen3_30b_fp8_shape_builds_and_splits_as_the_real_checkpoint(tmp_path):
    """The built-in Qwen3-30B-A3B-FP8 shape (what ``--model qwen3-30b-a3b-fp8 --load-format
    dummy`` benchmarks): its config resolves to block-wise fp8 with FP8 experts; built on the
    meta device as a rank would, it splits at TP=2 (384 = 3 blocks per rank), is refused at
    TP=4 (192 per rank), and places whole experts at TP=4 with expert parallelism."""
    import json

    from engine.attention_backends.torch_ref import TorchReferenceBackend
    from engine.benchmarks.workload import write_builtin_model
    from engine.config import ModelConfig
    from engine.kernels.registry import KernelRegistry
    from engine.loader import load_hf_config
    from engine.loader.model_loader import check_quantized_layout
    from engine.models.registry import ModelRegistry
    from engine.quantization.fp8 import Fp8Config

    path = write_builtin_model("qwen3-30b-fp8", str(tmp_path))
    quant = Fp8Config.from_config(
        json.loads((tmp_path / "qwen3-30b-a3b-fp8" / "config.json").read_text())[
            "quantization_config"
        ]
    )
    assert quant.weight_block_size == (128, 128)
    config = ModelConfig(model=path, load_format="dummy")
    load_hf_config(config)
    args = (config, KernelRegistry().resolve("cpu"), TorchReferenceBackend, ModelRegistry(), quant)
    check_quantized_layout(*args, 1)
    check_quantized_layout(*args, 2)
    check_quantized_layout(*args, 4, True)
    with pytest.raises(
        QuantizationError, match=r"each rank's 192 of the experts' 768 intermediate features"
    ):
        check_quantized_layout(*args, 4)


@pytest.mark.parametrize("block,slices", [((128, 128), 2), ((16, 32), 2), ((16, 32), 1)])
def test_block_quantizer_writes_the_kernels_layout(block, slices):
    """``quantize_fp8_experts_blocks`` (tests, benchmarks) against the spec's dequantizer:
    each block's largest magnitude lands on 448 (exactly the block's amax after scaling), and
    the dequantized experts are the originals to e4m3 precision; gate and up blocks apart."""
    from engine.kernels.quantized import dequantize_fp8_experts
    from engine.quantization.fp8_moe import quantize_fp8_experts_blocks

    w = torch.randn(3, 2 * 40, 72)
    w[:, 40:] *= 10  # the up half 10x the gate's: shared blocks would show
    q, scale = quantize_fp8_experts_blocks(w, block, slices)
    bn, bk = block
    part = w.shape[1] // slices
    assert scale.shape == (3, slices * -(-part // bn), -(-72 // bk))
    back = dequantize_fp8_experts(q, scale, block, slices)
    # e4m3: 3 mantissa bits (relative 2^-4), subnormal steps of 2^-9 times the block scale
    assert torch.allclose(back, w, rtol=2**-4, atol=2**-10 * float(scale.max()))
    assert float(q.float().abs().amax()) == 448.0
