"""Every quantization method on a tiny random Llama, on the CPU, against references.

* Against the *dequantized reference*: the same model with every quantized weight replaced by
  its exact dequantized value, run unquantized. Weight-only paths (W4A16/W8A16, FP8 on the CPU)
  must match it to float32 rounding (stated tolerance 1e-3 on logits of magnitude ~10), with
  the greedy token equal wherever the reference's top two logits are well separated.
* Against transformers on the same compressed-tensors checkpoint (the library decompresses the
  weights and fake-quantizes the activations): the W8A8 paths (FP8, INT8), forced on, agree to
  2e-3.
* GPTQ and AWQ checkpoints come from packers written from the formats' descriptions
  (``engine.testing.quantized_models``), checked on hand-made values in test_quantization.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from quant_helpers import PROMPT, build, compare, prefill_logits

from engine.testing import quantized_models as qm
from engine.testing.tiny_models import build_tokenizer, save_tiny_model

WEIGHT_ONLY_ATOL = 1e-3
W8A8_VS_HF_ATOL = 2e-3
W8A8_MODEL_ATOL = 0.1


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = save_tiny_model(
        "llama",
        tmp_path_factory.mktemp("src"),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        initializer_range=0.1,
    )
    build_tokenizer(path)
    return path


WRITERS = {
    "gptq-4bit-g32-sym": lambda s, q, r: qm.write_gptq(s, q, r, bits=4, group_size=32),
    "gptq-4bit-g32-asym-act-order": lambda s, q, r: qm.write_gptq(
        s, q, r, bits=4, group_size=32, sym=False, desc_act=True
    ),
    "gptq-4bit-channel-asym-v2": lambda s, q, r: qm.write_gptq(
        s, q, r, bits=4, group_size=-1, sym=False, checkpoint_format="gptq_v2"
    ),
    "gptq-8bit-g64-sym": lambda s, q, r: qm.write_gptq(s, q, r, bits=8, group_size=64),
    "awq-g32": lambda s, q, r: qm.write_awq(s, q, r, group_size=32),
    "awq-g64": lambda s, q, r: qm.write_awq(s, q, r, group_size=64),
    "fp8-per-tensor-dynamic": lambda s, q, r: qm.write_fp8(s, q, r),
    "fp8-per-tensor-static": lambda s, q, r: qm.write_fp8(s, q, r, activation_scheme="static"),
    "fp8-block-32x32": lambda s, q, r: qm.write_fp8(s, q, r, block=(32, 32)),
}


@pytest.mark.parametrize("kind", list(WRITERS))
def test_weight_only_paths_match_the_dequantized_reference(kind, source, tmp_path):
    quantized, reference = WRITERS[kind](source, tmp_path / "q", tmp_path / "ref")
    model, quant = build(quantized)
    assert quant is not None and quant.name == kind.split("-")[0]
    ref, _ = build(reference)
    compare(prefill_logits(model), prefill_logits(ref), WEIGHT_ONLY_ATOL)


def test_online_fp8_quantizes_a_float_checkpoint_per_channel(source):
    model, quant = build(source, quantization="fp8")
    assert "online" in quant.describe() and "weight-only" in quant.describe()
    layer = model.model.layers[0].mlp.down_proj
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (64,)
    # The reference: the same per-channel e4m3 rounding, done here independently.
    ref, _ = build(source)
    with torch.no_grad():
        for module in ref.modules():
            w = getattr(module, "weight", None)
            if hasattr(module, "quant_method") and w is not None:
                scale = w.abs().amax(dim=1, keepdim=True) / 448.0
                w.copy_((w / scale).to(torch.float8_e4m3fn).float() * scale)
    compare(prefill_logits(model), prefill_logits(ref), WEIGHT_ONLY_ATOL)


CT_KINDS = ["fp8_dynamic", "fp8_static", "fp8_weight_only", "fp8_block", "w4a16", "w4a16_asym"]
CT_KINDS += ["w8a16"]


@pytest.fixture(scope="module")
def ct_checkpoints(source, tmp_path_factory):
    """compressed-tensors checkpoints written by the library, with their dequantized
    references (decompressed by the library)."""
    made = {}

    def get(kind: str):
        if kind not in made:
            root = tmp_path_factory.mktemp(kind)
            ckpt = qm.write_compressed_tensors(source, root / "ct", kind, dtype=torch.float32)
            made[kind] = (ckpt, qm.write_dequantized_compressed_tensors(ckpt, root / "ref"))
        return made[kind]

    return get


@pytest.mark.parametrize("kind", CT_KINDS)
def test_compressed_tensors_weight_paths_match_the_library_decompression(kind, ct_checkpoints):
    ckpt, reference = ct_checkpoints(kind)
    model, quant = build(ckpt)
    assert quant.name == "compressed-tensors"
    ref, _ = build(reference)
    compare(prefill_logits(model), prefill_logits(ref), WEIGHT_ONLY_ATOL)


@pytest.mark.parametrize("kind", ["fp8_dynamic", "fp8_static", "fp8_block", "int8_static"])
def test_w8a8_matches_transformers_on_the_compressed_tensors_checkpoint(kind, ct_checkpoints):
    """transformers runs the checkpoint with compressed-tensors' fake quantization of the
    activations (per token dynamic, or the static scale and zero point), so with W8A8 forced on
    the engine computes the same function. (Dynamic INT8 differs by convention: the library
    scales a token by amax / 127.5, vLLM and the engine by amax / 127; see the next test.)"""
    from transformers import AutoModelForCausalLM

    ckpt, _ = ct_checkpoints(kind)
    model, _ = build(ckpt, activation_quant=True)
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0].float()
    compare(prefill_logits(model), want, W8A8_VS_HF_ATOL)


@pytest.mark.parametrize("kind", ["w4a16", "w8a16", "fp8_weight_only"])
def test_weight_only_compressed_tensors_match_transformers(kind, ct_checkpoints):
    """transformers 5.24 loads symmetric pack-quantized and FP8 weight-only checkpoints on the
    CPU and decompresses them (its asymmetric pack-quantized loading fails on the packed zero
    points' shape, so those are checked against the library's decompression above)."""
    from transformers import AutoModelForCausalLM

    ckpt, _ = ct_checkpoints(kind)
    model, _ = build(ckpt)
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0].float()
    compare(prefill_logits(model), want, WEIGHT_ONLY_ATOL)


def test_int8_dynamic_w8a8_matches_the_reference_with_quantized_activations(ct_checkpoints):
    """Dynamic INT8 W8A8 against the dequantized reference whose every linear layer first
    rounds its input per token to int8 at scale amax / 127 (vLLM's convention)."""
    ckpt, reference = ct_checkpoints("int8_dynamic")
    model, quant = build(ckpt)
    ref, _ = build(reference)

    def fake_quant(module, args):
        (x,) = args
        scale = (x.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=1e-10)
        return (torch.round(x / scale).clamp(-128, 127) * scale,)

    seen = {}

    def record(name):
        def hook(module, args, out):
            seen[name] = (args[0].clone(), out.clone())

        return hook

    for name, module in ref.named_modules():
        if hasattr(module, "quant_method"):
            module.register_forward_pre_hook(fake_quant)
            module.register_forward_hook(record(name))
    # Layer by layer, on the reference's own inputs: the same function to float rounding.
    want = prefill_logits(ref)
    with torch.inference_mode():
        for name, (x, y) in seen.items():
            torch.testing.assert_close(model.get_submodule(name)(x), y, rtol=1e-5, atol=1e-5)
    # End to end, a rounding difference of 1e-6 can move an activation across an int8 step in
    # a later layer, so the logits agree only to about one quantization step.
    compare(prefill_logits(model), want, W8A8_MODEL_ATOL)


@pytest.mark.parametrize(
    "kind", ["awq-g32", "gptq-4bit-g32-asym-act-order", "fp8-block-32x32", "fp8-online"]
)
def test_dummy_weights_for_quantized_configs(kind, source, tmp_path):
    """--load-format dummy builds random packed weights with positive scales from config.json
    alone (how the vLLM comparison kit runs quantized shapes), and the model generates."""
    from engine import LLM, SamplingParams

    if kind == "fp8-online":
        model_dir, quantization = source, "fp8"
    else:
        quantized, _ = WRITERS[kind](source, tmp_path / "q", None)
        model_dir, quantization = tmp_path / "cfg", None
        model_dir.mkdir()
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            if (quantized / name).exists():
                (model_dir / name).write_text((quantized / name).read_text())
    llm = LLM(
        model=str(model_dir),
        load_format="dummy",
        quantization=quantization,
        dtype="float32",
        num_gpu_blocks_override=32,
        block_size=4,
    )
    params_dtypes = {p.dtype for p in llm.llm_engine.runner.model.parameters()}
    assert params_dtypes & {torch.float8_e4m3fn, torch.int32, torch.uint8}, params_dtypes
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)
    out = llm.generate([{"prompt_token_ids": [5, 9, 11]}], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4
    assert all(
        torch.isfinite(torch.tensor(lp[t].logprob))
        for lp, t in zip(out.logprobs, out.token_ids, strict=True)
    )


def test_awq_end_to_end_greedy_matches_the_dequantized_reference(source, tmp_path):
    """Through the engine (batched prefill and decode, paged KV cache): the AWQ checkpoint and
    its dequantized reference generate the same greedy tokens, and no KV block leaks."""
    from engine import LLM, SamplingParams

    quantized, reference = qm.write_awq(source, tmp_path / "q", tmp_path / "r", group_size=32)
    prompts = [{"prompt_token_ids": p} for p in ([5, 9, 11, 40, 3], [100, 3], list(range(10, 40)))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    results = []
    for path in (quantized, reference):
        llm = LLM(model=str(path), dtype="float32", num_gpu_blocks_override=64, block_size=4)
        results.append(
            [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        )
        assert llm.llm_engine.num_used_blocks == 0
    assert results[0] == results[1]


def test_quantized_weights_stay_packed_in_memory(source, tmp_path):
    """4-bit weights take about a quarter of the float16 bytes of the projections (plus
    scales), FP8 half; nothing dequantized stays behind."""

    def linear_bytes(model):
        total = 0
        for module in model.modules():
            if hasattr(module, "quant_method"):
                total += sum(p.numel() * p.element_size() for p in module.parameters())
        return total

    float16 = linear_bytes(build(source, dtype="float16")[0])
    awq, _ = qm.write_awq(source, tmp_path / "awq", None, group_size=32)
    fp8, _ = qm.write_fp8(source, tmp_path / "fp8", None, block=(32, 32))
    assert linear_bytes(build(awq, dtype="float16")[0]) < 0.35 * float16
    assert linear_bytes(build(fp8, dtype="float16")[0]) < 0.55 * float16


def test_unsupported_settings_fail_at_load_with_what_is_supported(source, tmp_path):
    from engine import LLM
    from engine.quantization import QuantizationError

    quantized, _ = qm.write_gptq(source, tmp_path / "q", None, bits=4, group_size=32)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"]["group_size"] = 16
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantizationError, match=r"group_size 16.*supported: 32, 64, 128, -1"):
        LLM(model=str(quantized), dtype="float32", num_gpu_blocks_override=16)
    config["quantization_config"].update(group_size=32, bits=3)
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantizationError, match=r"bits 3.*supported: 4, 8"):
        LLM(model=str(quantized), dtype="float32", num_gpu_blocks_override=16)
