"""4/8-bit integer mixture-of-experts models on the CPU (``WNA16MoEMethod`` and the
``fused_moe_wna16`` reference) against the *dequantized reference*: the same model with every
quantized weight replaced by its exact dequantized value, saved and run unquantized.

Checkpoints of tiny random Qwen3-MoE, Mixtral and Qwen2-MoE (a shared expert) models, every
decoder projection quantized, the routed experts' included:

* GPTQ (4/8-bit, groups of 32/64/128 and one per row, sym and asym, the v1 zero points and
  ``gptq_v2``) and AWQ (GEMM packing) written by ``engine.testing.quantized_models``' own
  packers (plain integer arithmetic on NumPy words, independent of the engine's unpacking);
* compressed-tensors ``pack-quantized`` (w4a16 sym/asym, w8a16), packed and unpacked by the
  compressed-tensors library itself (``write_compressed_tensors_moe``).

The runs are float32 and the reference dequantizes exactly as the format does, so the stated
tolerance is float32 rounding: 1e-3 on logits of magnitude ~1-10 (as tests/test_fp8_moe.py),
the greedy token equal wherever the reference's top two logits are well separated; the
quantized logits must also differ from the unquantized model's by more than that (the
experts really are quantized). End to end through ``LLM`` (chunked prefill, batched decode):
greedy tokens equal; at TP=2 and with expert parallelism over gloo: equal to one process.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from quant_helpers import PROMPT, build, compare, prefill_logits

from engine import LLM, SamplingParams
from engine.layers.fused_moe import FusedMoE, MoEParallel
from engine.quantization import QuantizationError
from engine.testing import quantized_models as qm
from engine.testing.tiny_models import build_tokenizer, save_tiny_model

ATOL = 1e-3


def _source(tmp_path_factory, kind: str, **overrides):
    path = save_tiny_model(kind, tmp_path_factory.mktemp(kind), **overrides)
    build_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Hidden 64 (Mixtral's experts 160 wide, Qwen2-MoE's 64 with a 96-wide shared expert),
    and a 128-wide Qwen3-MoE for groups of 128."""
    return {
        "qwen3_moe": _source(
            tmp_path_factory, "qwen3_moe", num_hidden_layers=2, num_experts=16,
            moe_intermediate_size=64,
        ),
        "mixtral": _source(tmp_path_factory, "mixtral", num_hidden_layers=2),
        "qwen2_moe": _source(
            tmp_path_factory, "qwen2_moe", num_hidden_layers=2, moe_intermediate_size=64
        ),
        "qwen3_moe_128": _source(
            tmp_path_factory, "qwen3_moe", num_hidden_layers=2, num_experts=8,
            hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
        ),
    }  # fmt: skip


def experts_of(model) -> list[FusedMoE]:
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def _write(fmt: str, src, out, ref, **kw):
    if fmt == "gptq":
        return qm.write_gptq(src, out, ref, **kw)
    if fmt == "awq":
        return qm.write_awq(src, out, ref, **kw)
    return qm.write_compressed_tensors_moe(src, out, ref, **kw)


CASES = [
    # (model, format, writer arguments)
    ("qwen3_moe", "gptq", dict(bits=4, group_size=32, sym=True)),
    ("mixtral", "gptq", dict(bits=4, group_size=32, sym=True)),
    ("qwen2_moe", "gptq", dict(bits=4, group_size=32, sym=False)),
    ("qwen3_moe", "gptq", dict(bits=4, group_size=64, sym=False, checkpoint_format="gptq_v2")),
    ("qwen3_moe_128", "gptq", dict(bits=4, group_size=128, sym=False)),
    ("qwen3_moe", "gptq", dict(bits=4, group_size=-1, sym=True)),
    ("qwen3_moe", "gptq", dict(bits=8, group_size=32, sym=False)),
    ("mixtral", "gptq", dict(bits=8, group_size=-1, sym=True)),
    # Act-order: every expert's own order of its inputs (gate and up share it).
    ("qwen3_moe", "gptq", dict(bits=4, group_size=32, sym=False, desc_act=True)),
    ("mixtral", "gptq", dict(bits=8, group_size=32, sym=True, desc_act=True)),
    ("qwen2_moe", "gptq", dict(bits=4, group_size=32, sym=True, desc_act=True)),
    ("qwen3_moe", "awq", dict(group_size=32)),
    ("mixtral", "awq", dict(group_size=32)),
    ("qwen2_moe", "awq", dict(group_size=32)),
    ("qwen3_moe_128", "awq", dict(group_size=128)),
    ("qwen3_moe", "awq", dict(group_size=-1)),
    ("qwen3_moe", "ct", dict(kind="w4a16")),
    ("qwen3_moe", "ct", dict(kind="w4a16_asym", group_size=64)),
    ("qwen3_moe", "ct", dict(kind="w8a16")),
    ("mixtral", "ct", dict(kind="w4a16_asym")),
    ("qwen2_moe", "ct", dict(kind="w4a16")),
]


def _case_id(case) -> str:
    kind, fmt, kw = case
    return "-".join([kind, fmt, *(f"{k}{v}" for k, v in kw.items())])


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_integer_experts_match_the_dequantized_reference(case, sources, tmp_path):
    kind, fmt, kw = case
    src = sources[kind]
    quantized, reference = _write(fmt, src, tmp_path / "q", tmp_path / "ref", **kw)
    model, quant = build(quantized)
    layers = experts_of(model)
    assert layers
    bits = kw.get("bits", 8 if kw.get("kind") == "w8a16" else 4)
    qname = "weight_packed" if fmt == "ct" else "qweight"
    for layer in layers:
        method = layer.quant_method
        assert type(method).__name__ == "WNA16MoEMethod"
        e, i, h = layer.num_local_experts, layer.intermediate_size, layer.hidden_size
        group = kw.get("group_size", 32)
        q13, q2 = getattr(layer, f"w13_{qname}"), getattr(layer, f"w2_{qname}")
        assert q13.dtype == torch.int32 and q13.shape == (e, 2 * i, h * bits // 32)
        assert q2.shape == (e, h, i * bits // 32)
        s2 = method.tensors(layer, "w2")[1]
        assert s2.shape == (e, h, 1 if group == -1 else i // group)
        if kw.get("desc_act"):  # the input permutation of every expert, g_idx dropped
            assert layer.w13_perm.shape == (e, h) and layer.w2_perm.shape == (e, i)
            assert not hasattr(layer, "w13_g_idx")
        # No bf16 copy of the experts is kept.
        assert not any(p.dtype.is_floating_point and p.numel() >= q13.numel() for p in
                       layer.parameters(recurse=False))  # fmt: skip
    ref, _ = build(reference)
    got, want = prefill_logits(model), prefill_logits(ref)
    compare(got, want, ATOL)
    unquantized, _ = build(src)
    assert float((got - prefill_logits(unquantized)).abs().max()) > 10 * ATOL


@pytest.mark.parametrize(
    "kind,fmt,kw",
    [
        ("qwen3_moe", "gptq", dict(bits=4, group_size=32, sym=False)),
        ("mixtral", "awq", dict(group_size=32)),
        ("qwen2_moe", "ct", dict(kind="w4a16_asym")),
    ],
)
def test_greedy_tokens_through_llm(kind, fmt, kw, sources, tmp_path):
    """End to end: chunked prefill and batched decodes, greedy tokens equal to the engine run
    on the dequantized weights, every KV block back in the pool."""
    quantized, reference = _write(fmt, sources[kind], tmp_path / "q", tmp_path / "ref", **kw)
    opts = dict(dtype="float32", block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    prompts = [PROMPT, PROMPT[:5], PROMPT[3:20], [7, 8, 9]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def run(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.llm_engine.num_used_blocks == 0
        return [o.outputs[0].token_ids for o in outs]

    llm = LLM(str(quantized), **opts)
    layer = experts_of(llm.llm_engine.runner.model)[0]
    assert type(layer.quant_method).__name__ == "WNA16MoEMethod"
    got = run(llm)
    assert got == run(LLM(str(reference), **opts)), kind


def test_dummy_weights_for_a_gptq_moe_config(sources, tmp_path):
    """``--load-format dummy`` with a GPTQ MoE config (benchmarks of real shapes): random
    packed values, mid-range zero points, positive scales, and the model runs."""
    quantized, _ = qm.write_gptq(sources["qwen3_moe"], tmp_path / "q", None, group_size=32)
    model, _ = build(quantized, load_format="dummy")
    layer = experts_of(model)[0]
    w13 = layer.quant_method.dequantized(layer, "w13")
    assert 0.005 < float(w13.std()) < 0.05
    assert torch.isfinite(prefill_logits(model)).all()


def test_missing_expert_tensors_are_named(sources, tmp_path):
    from safetensors.torch import load_file, save_file

    from engine.layers.weight_utils import ModelLoadError

    quantized, _ = qm.write_awq(sources["qwen3_moe"], tmp_path / "q", None, group_size=32)
    state = load_file(str(quantized / "model.safetensors"))
    del state["model.layers.1.mlp.experts.5.down_proj.qzeros"]
    save_file(state, str(quantized / "model.safetensors"))
    with pytest.raises(
        ModelLoadError, match=r"model\.layers\.1\.mlp\.experts\.5\.down_proj\.qzeros"
    ):
        build(quantized)


def test_a_wrong_expert_shape_is_named(sources, tmp_path):
    from safetensors.torch import load_file, save_file

    from engine.layers.weight_utils import ModelLoadError

    quantized, _ = qm.write_gptq(sources["qwen3_moe"], tmp_path / "q", None, group_size=32)
    state = load_file(str(quantized / "model.safetensors"))
    name = "model.layers.0.mlp.experts.2.up_proj.scales"
    state[name] = state[name][:1].contiguous()
    save_file(state, str(quantized / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"experts\.2\.up_proj\.scales'.*expected \(64, 2\)"):
        build(quantized)


def test_act_order_gate_and_up_with_different_orders_are_refused(sources, tmp_path):
    from safetensors.torch import load_file, save_file

    from engine.layers.weight_utils import ModelLoadError

    quantized, _ = qm.write_gptq(
        sources["qwen3_moe"], tmp_path / "q", None, group_size=32, desc_act=True
    )
    state = load_file(str(quantized / "model.safetensors"))
    name = "model.layers.1.mlp.experts.2.up_proj.g_idx"
    state[name] = state[name].flip(0).contiguous()
    save_file(state, str(quantized / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"expert 2's gate and up projections have different"):
        build(quantized)


# ---- what is refused ------------------------------------------------------------------------
def _experts_only(src, quantized) -> None:
    """Turn a GPTQ checkpoint of ``src`` into one whose attention stays in float (the
    originals back, a GPTQModel ``dynamic`` rule excluding them)."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(quantized / "model.safetensors"))
    original = qm._load_state(src)
    for key in list(state):
        module, _, leaf = key.rpartition(".")
        if ".self_attn." in key and leaf in ("qweight", "qzeros", "scales", "g_idx"):
            del state[key]
            state[f"{module}.weight"] = original[f"{module}.weight"]
    save_file(state, str(quantized / "model.safetensors"))
    _set_config(quantized, dynamic={"-:.*self_attn.*": {}})


def _set_config(path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(bits=3), r"GPTQ checkpoint has bits 3, which is not supported \(supported: 4, 8\)"),
        (
            dict(group_size=16),
            r"group_size 16, which is not supported \(supported: 32, 64, 128, -1\)",
        ),
    ],
)
def test_unsupported_gptq_experts_are_refused_at_start(changes, message, sources, tmp_path):
    quantized, _ = qm.write_gptq(sources["qwen3_moe"], tmp_path / "q", None, group_size=32)
    _set_config(quantized, **changes)
    with pytest.raises(QuantizationError, match=message):
        LLM(str(quantized), dtype="float32")


def test_unsupported_awq_and_compressed_tensors_experts_are_refused_at_start(sources, tmp_path):
    """AWQ 8-bit and a compressed-tensors 3-bit group over the experts: refused before any
    weight is read, listing what the format supports."""
    awq, _ = qm.write_awq(sources["qwen3_moe"], tmp_path / "awq", None, group_size=32)
    _set_config(awq, bits=8)
    with pytest.raises(QuantizationError, match=r"AWQ checkpoint has bits 8.*\(supported: 4\)"):
        LLM(str(awq), dtype="float32")
    ct, _ = qm.write_compressed_tensors_moe(sources["qwen3_moe"], tmp_path / "ct", None)
    groups = json.loads((ct / "config.json").read_text())["quantization_config"]["config_groups"]
    groups["group_0"]["weights"]["num_bits"] = 3
    _set_config(ct, config_groups=groups)
    with pytest.raises(
        QuantizationError, match=r"3-bit int weights.*Supported schemes: .*W4A16/W8A16"
    ):
        LLM(str(ct), dtype="float32")


def test_compressed_tensors_act_order_experts_read_their_g_idx():
    """compressed-tensors act-order groups (``actorder: group``) take the integer method with
    its ``weight_g_idx`` per expert projection (the GPTQ act-order tests run the loading);
    ``static`` act-order is the plain order (no g_idx)."""
    from engine.quantization.compressed_tensors import CompressedTensorsConfig

    def method(actorder):
        weights = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 32,
                   "actorder": actorder}  # fmt: skip
        config = {"format": "pack-quantized",
                  "config_groups": {"g": {"targets": ["Linear"], "weights": weights}}}  # fmt: skip
        layer = _gptq_layer(64, tp_size=1)  # a meta layer to build the parameters on
        m = CompressedTensorsConfig.from_config(config).get_moe_method(None, layer.prefix)
        with torch.device("meta"):
            m.create_weights(layer, 8, 256, 64, torch.bfloat16)
        return m, layer

    m, layer = method("group")
    assert m.act_order and layer.w13_weight_g_idx.shape == (8, 256)
    assert layer.w2_weight_g_idx.shape == (8, 64)
    assert "weight_g_idx" not in m.ignored_checkpoint_suffixes
    m, layer = method("static")
    assert not m.act_order and "weight_g_idx" in m.ignored_checkpoint_suffixes


def _gptq_layer(
    intermediate: int, tp_size: int, group: int = 32, ep: bool = False, act_order: bool = False
):
    from engine.quantization.gptq import GPTQConfig

    config = GPTQConfig(4, group, desc_act=act_order, sym=True, v1_zeros=True)
    parallel = (
        MoEParallel(ep_rank=0, ep_size=tp_size) if ep else MoEParallel(tp_rank=0, tp_size=tp_size)
    )
    with torch.device("meta"):
        return FusedMoE(
            8, 2, 256, intermediate, renormalize=True, kernels=None, dtype=torch.bfloat16,
            parallel=parallel, communicator=object(), quant_config=config,
            prefix="model.layers.0.mlp.experts",
        )  # fmt: skip


def test_a_scale_group_split_across_ranks_is_refused():
    _gptq_layer(256, tp_size=2, group=128)  # 128 per rank: whole groups
    _gptq_layer(192, tp_size=2, group=-1)  # one group per row: every rank keeps its scale
    _gptq_layer(256, tp_size=4, group=128, ep=True)  # whole experts per rank
    with pytest.raises(
        QuantizationError,
        match=r"each rank's 64 of the experts' 128 intermediate features \(tensor-parallel "
        r"size 2\) would split a 128-feature scale group.*\(none above 1\), or expert "
        r"parallelism",
    ):
        _gptq_layer(128, tp_size=2, group=128)
    with pytest.raises(QuantizationError, match=r"keeps whole groups \(2\)"):
        _gptq_layer(256, tp_size=4, group=128)
    with pytest.raises(QuantizationError, match=r"intermediate size 192 is not a multiple of"):
        _gptq_layer(192, tp_size=1, group=128)


def test_act_order_experts_with_one_group_per_row_split_over_ranks():
    """Act-order without groups (``desc_act`` with ``group_size -1``) splits anywhere: each
    rank reads its share of the down projection's ``g_idx`` (all group 0: no permutation)."""
    from engine.quantization.gptq import GPTQConfig

    layer = FusedMoE(
        4, 2, 64, 64, renormalize=True, kernels=None, dtype=torch.float32,
        parallel=MoEParallel(tp_rank=1, tp_size=2), communicator=object(),
        quant_config=GPTQConfig(4, -1, desc_act=True, sym=True, v1_zeros=True),
        prefix="model.layers.0.mlp.experts",
    )  # fmt: skip
    for e in range(4):
        layer.w2_g_idx.weight_loader(layer.w2_g_idx, torch.zeros(64, dtype=torch.int32), "w2", e)
        for shard in ("w1", "w3"):
            layer.w13_g_idx.weight_loader(layer.w13_g_idx, torch.zeros(64), shard, e)
    assert layer.w2_g_idx.shape == (4, 32) and not bool(layer.w2_g_idx.any())
    with pytest.raises(Exception, match=r"expected shape \(64,\), got \(32,\)"):
        layer.w2_g_idx.weight_loader(layer.w2_g_idx, torch.zeros(32), "w2", 0)


def test_act_order_experts_split_over_ranks_are_refused():
    """A rank's share of an act-order down projection's inputs falls in any group: refused
    under tensor parallelism (with the reason and expert parallelism as the way), served with
    expert parallelism and on one rank."""
    _gptq_layer(256, tp_size=1, act_order=True)
    _gptq_layer(256, tp_size=2, act_order=True, ep=True)
    _gptq_layer(256, tp_size=2, group=-1, act_order=True)  # one group per row: any split
    with pytest.raises(
        QuantizationError,
        match=r"act-order experts \(gptq 4-bit g32 act-order\) split over 2 tensor-parallel "
        r"ranks: a rank's share of the down projection's input features falls in any scale "
        r"group.*use expert parallelism \(--enable-expert-parallel\)",
    ):
        _gptq_layer(256, tp_size=2, act_order=True)


def test_a_gpu_platform_with_only_the_reference_is_refused():
    from engine.kernels.registry import KernelRegistry
    from engine.quantization.gptq import GPTQConfig

    def layer(platform: str) -> FusedMoE:
        with torch.device("meta"):
            return FusedMoE(
                8, 2, 256, 256, renormalize=True, kernels=KernelRegistry().resolve(platform),
                dtype=torch.bfloat16, quant_config=GPTQConfig(4, 32, False, True, True),
                prefix="model.layers.0.mlp.experts",
            )  # fmt: skip

    with pytest.raises(QuantizationError, match="no plugin provides fused_moe_wna16 on cuda"):
        layer("cuda")  # no plugin: the torch reference only
    layer("cpu")  # the CPU: the reference


def test_ignored_experts_stay_unquantized():
    from engine.quantization.awq import AWQConfig
    from engine.quantization.gptq import GPTQConfig

    gptq = GPTQConfig(4, 32, False, True, True, dynamic={"-:.*mlp\\.experts.*": {}})
    assert gptq.get_moe_method(None, "model.layers.0.mlp.experts") is None
    awq = AWQConfig(32, modules_to_not_convert=["experts"])
    assert awq.get_moe_method(None, "model.layers.0.mlp.experts") is None
    per_module = GPTQConfig(4, 32, False, True, True, dynamic={".*experts.*": {"bits": 8}})
    assert per_module.get_moe_method(None, "model.layers.0.mlp.experts").bits == 8


def test_experts_quantized_in_part_are_refused():
    """One method serves all three projections: settings that differ between them (a GPTQ
    ``dynamic`` rule for the down projections, AWQ's substring rule catching ``gate_proj``, a
    compressed-tensors ignore entry) are refused, naming the projections."""
    from engine.quantization.awq import AWQConfig
    from engine.quantization.compressed_tensors import CompressedTensorsConfig
    from engine.quantization.gptq import GPTQConfig

    prefix = "model.layers.0.mlp.experts"
    down8 = GPTQConfig(4, 32, False, True, True, dynamic={".*down_proj": {"bits": 8}})
    with pytest.raises(QuantizationError, match=r"'dynamic' settings differ between the experts'"):
        down8.get_moe_method(None, prefix)
    awq = AWQConfig(32, modules_to_not_convert=["gate"])  # meant for the router, catches gate_proj
    with pytest.raises(QuantizationError, match=r"unquantized but not up_proj, down_proj"):
        awq.get_moe_method(None, prefix)
    # Mixtral's experts (w1/w3/w2, which the model tells its layers) do not contain "gate".
    mixtral = SimpleNamespace(proj_names=("w1", "w3", "w2"))
    assert awq.get_moe_method(mixtral, "model.layers.0.block_sparse_moe.experts") is not None
    weights = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 32}
    ct = CompressedTensorsConfig.from_config({
        "format": "pack-quantized",
        "config_groups": {"g": {"targets": ["Linear"], "weights": weights}},
        "ignore": ["re:.*down_proj"],
    })  # fmt: skip
    with pytest.raises(QuantizationError, match=r"fall under different schemes"):
        ct.get_moe_method(None, prefix)


def test_the_qwen3_30b_gptq_shape_builds_and_splits_as_the_real_checkpoint(tmp_path):
    """The built-in Qwen3-30B-A3B-GPTQ-Int4 shape (what ``--model qwen3-30b-a3b-gptq-int4
    --load-format dummy`` benchmarks): built on the meta device as a rank would, its experts
    (768 wide, groups of 128) split at TP=2 (384: three groups per rank), are refused at TP=4
    (192 per rank), and are placed whole at TP=4 with expert parallelism."""
    from engine.attention_backends.torch_ref import TorchReferenceBackend
    from engine.benchmarks.workload import write_builtin_model
    from engine.config import ModelConfig
    from engine.kernels.registry import KernelRegistry
    from engine.loader import load_hf_config
    from engine.loader.model_loader import check_quantized_layout
    from engine.models.registry import ModelRegistry
    from engine.quantization.gptq import GPTQConfig

    path = write_builtin_model("qwen3-30b-gptq", str(tmp_path))
    config = json.loads((tmp_path / "qwen3-30b-a3b-gptq-int4" / "config.json").read_text())
    quant = GPTQConfig.from_config(config["quantization_config"])
    assert (quant.bits, quant.group_size, quant.desc_act) == (4, 128, False)
    model_config = ModelConfig(model=path, load_format="dummy")
    load_hf_config(model_config)
    kernels = KernelRegistry().resolve("cpu")
    args = (model_config, kernels, TorchReferenceBackend, ModelRegistry(), quant)
    check_quantized_layout(*args, 1)
    check_quantized_layout(*args, 2)
    check_quantized_layout(*args, 4, True)
    with pytest.raises(
        QuantizationError,
        match=r"each rank's 192 of the experts' 768 intermediate features \(tensor-parallel "
        r"size 4\) would split a 128-feature scale group.*\(2, 3\)",
    ):
        check_quantized_layout(*args, 4)


# ---- split over ranks -----------------------------------------------------------------------
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_experts_split_and_placed_over_two_ranks_match_one_process(tmp_path, act_order):
    """A GPTQ checkpoint (4-bit, groups of 32, asym) of a Qwen3-MoE whose experts are 64
    wide, at TP=2 (each rank's 32 intermediate features one whole group of the down
    projection) and with expert parallelism (whole experts per rank) on two gloo worker
    processes: greedy tokens equal one process's, logprobs within 1e-4, no KV block left in
    use. Act-order: expert parallelism only (TP is refused, tests above), attention and
    the dense layers unquantized (a row-parallel act-order layer is refused too)."""
    from engine.testing.moe_parallel import assert_moe_layouts_match_one_process
    from engine.testing.tiny_models import build_tiny_model

    src = build_tiny_model(tmp_path / "src", "qwen3_moe", seed=2, moe_intermediate_size=64)
    gptq, _ = qm.write_gptq(
        src, tmp_path / "gptq", None, bits=4, group_size=32, sym=False, desc_act=act_order
    )
    if act_order:  # experts only: the attention layers read their float weights back
        _experts_only(src, gptq)
    # 64 experts, hidden 64, intermediate 64: split (32 features = 4 words per rank) or placed
    # (32 whole experts, 8 words).
    shapes = {False: [(64, 64, 4)] * 2, True: [(32, 64, 8)] * 2}
    if act_order:
        del shapes[False]
    assert_moe_layouts_match_one_process(str(gptq), "model.layers.0.mlp.experts.w2_qweight", shapes)


# ---- the quantizer for tests and benchmarks ---------------------------------------------------
@pytest.mark.parametrize("bits,group,sym", [(4, 32, True), (4, 128, False), (8, -1, True)])
def test_expert_quantizer_writes_the_kernels_layout(bits, group, sym):
    """``quantize_wna16_experts`` against the spec's dequantizer: the dequantized experts are
    the originals to within a quantization step of each group (half a step but where the
    symmetric range clips its largest positive value)."""
    from engine.kernels.quantized import dequantize_wna16_experts
    from engine.quantization.wna16_moe import quantize_wna16_experts

    w = torch.randn(3, 24, 256)
    q, s, z = quantize_wna16_experts(w, bits, group, sym)
    groups = 1 if group == -1 else 256 // group
    assert q.shape == (3, 24, 256 * bits // 32) and q.dtype == torch.int32
    assert s.shape == (3, 24, groups) and (z is None) == sym
    back = dequantize_wna16_experts(q, s, z, bits)
    step = s.repeat_interleave(256 // groups, dim=-1)
    assert bool(((back - w).abs() <= step + 1e-6).all())
