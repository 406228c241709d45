"""GPT-OSS on the CPU: greedy tokens identical to transformers on tiny random checkpoints
(attention sinks, alternating sliding/full layers, YaRN, biased router and experts, the
clamped SwiGLU), in bf16-layout and MXFP4 checkpoints; the experts' op against transformers'
own expert module; MXFP4 dequantization against transformers'; tensor and expert parallelism
over gloo; and the refusals (a backend without sinks, quantized experts). MXFP4 experts kept
quantized (``Mxfp4MoEMethod``): the ``fused_moe_mxfp4`` reference against ``fused_moe_biased``
on the dequantized weights, the loader's placement of the checkpoint's blocks on every
tensor- and expert-parallel rank, the tiny MXFP4 model kept in MXFP4 against transformers, and
the split that falls back to dequantizing at load."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from greedy_reference import assert_greedy_matches, mixed_prompts

from engine import LLM
from engine.kernels.quantized import E2M1_VALUES, dequantize_mxfp4_experts
from engine.kernels.reference import fused_moe_biased, fused_moe_mxfp4, moe_topk_softmax
from engine.kernels.registry import KernelRegistry
from engine.layers.fused_moe import FusedMoE, MoEParallel
from engine.models.gpt_oss import split_interleaved
from engine.quantization.mxfp4 import Mxfp4Config, Mxfp4MoEMethod, dequantize_mxfp4
from engine.testing.moe_parallel import assert_moe_layouts_match_one_process
from engine.testing.tiny_models import build_tiny_model

NUM_NEW = 12


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss", num_layers=3)


def assert_greedy_matches_hf(path, hf) -> None:
    """Prompts of 1 to 90 tokens (well past the window of 8) and a shared prefix, submitted
    together with chunked prefill, prefix caching and a cache small enough to preempt."""
    llm = LLM(
        model=str(path),
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=32,  # chunked prefill
        max_num_seqs=6,
        num_gpu_blocks_override=48,  # small enough to preempt
        enable_prefix_caching=True,
    )
    try:
        prompts = mixed_prompts(hf.config.vocab_size, (1, 3, 8, 17, 33, 64, 90))
        assert_greedy_matches(llm, hf, prompts, NUM_NEW)
        assert llm.llm_engine.get_stats().num_preemptions > 0
    finally:
        llm.llm_engine.shutdown()


def test_greedy_matches_transformers(gpt_oss):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(gpt_oss, dtype=torch.float32).eval()
    assert hf.config.layer_types[:2] == ["sliding_attention", "full_attention"]
    sinks = torch.cat([layer.self_attn.sinks.detach() for layer in hf.model.layers])
    assert sinks.max() > 1.0  # sinks that take real weight (tiny_models widens them)
    assert_greedy_matches_hf(gpt_oss, hf)


def test_experts_op_matches_transformers_expert_module():
    """``fused_moe_biased`` with the de-interleaved weights against transformers'
    ``GptOssExperts`` and router on the same tensors (float32, routing by our top-k)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter

    cfg = GptOssConfig(hidden_size=32, intermediate_size=24, num_local_experts=8,
                       num_experts_per_tok=3, swiglu_limit=1.0)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    experts, router = GptOssExperts(cfg), GptOssTopKRouter(cfg)
    with torch.no_grad():
        for p in (*experts.parameters(), *router.parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    x = torch.randn(19, 32, generator=gen)
    with torch.no_grad():
        logits, scores, ids = router(x)
        want = experts(x, ids, scores)
    weights, our_ids = moe_topk_softmax(logits, 3, renormalize=True)
    assert torch.equal(our_ids.long().sort(-1).values, ids.sort(-1).values)
    w13 = split_interleaved(experts.gate_up_proj.detach().transpose(1, 2), 1)
    b13 = split_interleaved(experts.gate_up_proj_bias.detach(), 1)
    w2 = experts.down_proj.detach().transpose(1, 2)
    got = fused_moe_biased(x, w13, w2, weights, our_ids, b13, experts.down_proj_bias.detach(),
                           "swigluoai", cfg.swiglu_alpha, cfg.swiglu_limit)  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The clamp bit: some gate/up values were past the limit.
    assert (x @ experts.gate_up_proj[0]).abs().max() > cfg.swiglu_limit


# ---- MXFP4 ----------------------------------------------------------------------------------
def mxfp4_pack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An MXFP4 packer written from the OCP microscaling spec: per block of 32 along the last
    dim, the scale is the power of two that puts the block's largest magnitude in E2M1's
    range (``floor(log2(amax)) - 2``, E2M1's largest exponent being 2), each value rounds to
    the nearest E2M1 value times the scale; codes pack two a byte, low nibble first."""
    *lead, k = w.shape
    blocks = w.float().reshape(*lead, k // 32, 32)
    amax = blocks.abs().amax(-1).clamp(min=2.0**-126)
    exp = torch.floor(torch.log2(amax)) - 2
    scaled = blocks / torch.exp2(exp)[..., None]
    grid = torch.tensor(E2M1_VALUES[:8])
    code = (scaled.abs()[..., None] - grid).abs().argmin(-1)  # the nearest magnitude
    code = code + 8 * (scaled < 0)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exp + 127).to(torch.uint8)


def test_dequantize_mxfp4_hand_made_values():
    # One block: codes 0..15 then 15..0; scale 2**1 (byte 128).
    codes = list(range(16)) + list(range(15, -1, -1))
    packed = torch.tensor([codes[i] | (codes[i + 1] << 4) for i in range(0, 32, 2)],
                          dtype=torch.uint8).reshape(1, 16)  # fmt: skip
    got = dequantize_mxfp4(packed, torch.tensor([128], dtype=torch.uint8), torch.float32)
    want = torch.tensor([2 * E2M1_VALUES[c] for c in codes])
    assert torch.equal(got, want)
    # Scale 2**-3 (byte 124) and bfloat16 (exact).
    got = dequantize_mxfp4(packed, torch.tensor([124], dtype=torch.uint8), torch.bfloat16)
    assert torch.equal(got.float(), want / 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_mxfp4_matches_transformers(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 40, 4), generator=gen, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales, dtype)  # [E, N, K]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, K, N]
    assert torch.equal(ours, theirs.transpose(1, 2))


def test_mxfp4_packer_round_trips_representable_values():
    gen = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (5, 64), generator=gen)
    codes[:, 0] = 7  # every block holds +-6 times its scale
    codes[:, 32] = 15
    exps = torch.randint(-4, 4, (5, 2), generator=gen).float()
    w = torch.tensor(E2M1_VALUES)[codes] * torch.exp2(exps).repeat_interleave(32, 1)
    blocks, scales = mxfp4_pack(w)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32), w)


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(gpt_oss, tmp_path_factory):
    """The tiny model's experts quantized to MXFP4 in the released checkpoints' layout, and a
    float32 copy whose experts hold exactly the dequantized values (what transformers runs)."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    ref = tmp_path_factory.mktemp("gpt_oss_mxfp4_ref")
    tensors = load_file(str(gpt_oss / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4_pack(t.transpose(1, 2))  # [E, out, in] in blocks of 32
            quantized[f"{name}_blocks"] = blocks.reshape(*scales.shape, 16)
            quantized[f"{name}_scales"] = scales
            dq = dequantize_mxfp4(quantized[f"{name}_blocks"], scales, torch.float32)
            dequantized[name] = dq.transpose(1, 2).contiguous()
        else:
            quantized[name] = dequantized[name] = t
    for path, data in ((out, quantized), (ref, dequantized)):
        for f in gpt_oss.iterdir():
            if f.name != "model.safetensors":
                (path / f.name).write_bytes(f.read_bytes())
        save_file(data, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    return out, ref


def test_mxfp4_checkpoint_matches_transformers_on_the_dequantized_weights(gpt_oss_mxfp4, caplog):
    from transformers import AutoModelForCausalLM

    path, ref = gpt_oss_mxfp4
    hf = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    with caplog.at_level("INFO"):
        assert_greedy_matches_hf(path, hf)
    assert "mxfp4: the experts' MXFP4 weights are dequantized at load" in caplog.text


# ---- parallel -------------------------------------------------------------------------------
def test_experts_split_and_placed_over_two_ranks_match_one_process(tmp_path):
    # 16 experts of intermediate size 128: split (64 rows of gate and of up per rank; the
    # down bias on rank 0 only) or placed (8 whole experts per rank); sinks split by head.
    path = build_tiny_model(tmp_path / "gpt_oss", "gpt_oss", num_layers=2, seed=2)
    assert_moe_layouts_match_one_process(
        str(path),
        "model.layers.0.mlp.experts.w13_bias",
        {False: [(16, 128)] * 2, True: [(8, 256)] * 2},
        prompt_lens=(2, 7, 19, 40),
        max_tokens=8,
    )


# ---- refusals -------------------------------------------------------------------------------
def test_a_backend_without_sinks_is_refused_with_the_reason(gpt_oss):
    with pytest.raises(Exception, match="attention sinks") as info:
        LLM(model=str(gpt_oss), dtype="float32", attention_backend="sdpa")
    assert "Traceback" not in str(info.value)


def test_quantized_experts_are_refused_with_what_runs(gpt_oss):
    with pytest.raises(Exception, match="swigluoai") as info:
        LLM(model=str(gpt_oss), dtype="float32", quantization="fp8")
    assert "served unquantized" in str(info.value)


def test_the_gpt_oss_20b_shape_builds_as_the_released_model(tmp_path):
    """``--model gpt-oss-20b --load-format dummy`` (the GPU benchmarks' shape): its config
    parses as transformers' GPT-OSS-20B, and the model built on the meta device has the
    released model's 20.9B parameters (3.6B active per token)."""
    from engine.benchmarks.workload import write_builtin_model
    from engine.config import ModelConfig
    from engine.loader import load_hf_config

    path = write_builtin_model("gpt-oss", str(tmp_path))
    config = ModelConfig(model=path, load_format="dummy")
    hf = load_hf_config(config)
    assert hf.layer_types[:2] == ["sliding_attention", "full_attention"]
    assert hf.rope_parameters["rope_type"] == "yarn"
    from transformers import AutoModelForCausalLM

    from engine.attention_backends.torch_ref import TorchReferenceBackend
    from engine.kernels.registry import KernelRegistry
    from engine.models.context import ModelContext
    from engine.models.gpt_oss import GptOssForCausalLM

    with torch.device("meta"):
        theirs = AutoModelForCausalLM.from_config(hf)
        ctx = ModelContext(hf, torch.bfloat16, KernelRegistry().resolve("cpu"),
                           TorchReferenceBackend, torch.device("meta"))  # fmt: skip
        ours = GptOssForCausalLM(ctx)
    total = sum(p.numel() for p in theirs.parameters())
    assert round(total / 1e9, 1) == 20.9
    assert sum(p.numel() for p in ours.parameters()) == total


# ---- MXFP4 experts kept quantized (Mxfp4MoEMethod, fused_moe_mxfp4) -------------------------
def random_mxfp4(gen, *shape_nk, low=118, high=126):
    """Random MXFP4 experts ``[..., N, K]``: (blocks ``[..., N, K / 2]``, scales ``[..., N, K
    / 32]``), every byte value, exponents 2**-9 .. 2**-2."""
    *lead, n, k = shape_nk
    blocks = torch.randint(0, 256, (*lead, n, k // 2), generator=gen, dtype=torch.uint8)
    scales = torch.randint(low, high, (*lead, n, k // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


def test_dequantize_mxfp4_experts_hand_made_values_and_checkpoint_layout():
    # Codes 0..15 then 15..0 in one row of one block; exponent 2**-1 (byte 126).
    codes = list(range(16)) + list(range(15, -1, -1))
    row = torch.tensor([codes[i] | (codes[i + 1] << 4) for i in range(0, 32, 2)],
                       dtype=torch.uint8)  # fmt: skip
    got = dequantize_mxfp4_experts(row[None], torch.tensor([[126]], dtype=torch.uint8))
    assert torch.equal(got[0], torch.tensor([E2M1_VALUES[c] / 2 for c in codes]))
    # The checkpoint layout [..., G, 16] / [..., G] is the same bytes.
    gen = torch.Generator().manual_seed(0)
    blocks, scales = random_mxfp4(gen, 3, 40, 96)
    for dtype in (torch.float32, torch.bfloat16):
        flat = dequantize_mxfp4_experts(blocks, scales, dtype)
        assert torch.equal(flat, dequantize_mxfp4(blocks.reshape(3, 40, 3, 16), scales, dtype))


def test_dequantize_mxfp4_experts_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="do not match scales"):
        dequantize_mxfp4_experts(torch.zeros(2, 16, dtype=torch.uint8),
                                 torch.zeros(2, 2, dtype=torch.uint8))  # fmt: skip
    with pytest.raises(ValueError, match="must be uint8"):
        dequantize_mxfp4_experts(torch.zeros(2, 16), torch.zeros(2, 1, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["swigluoai", "silu"])
def test_reference_equals_the_biased_experts_on_the_dequantized_weights(dtype, activation):
    # Exact: the dequantized weights are exact in both dtypes, and the two references then
    # compute the same thing in the same order.
    gen = torch.Generator().manual_seed(1)
    t, e, k, h, i = 9, 8, 4, 64, 96
    w13, s13 = random_mxfp4(gen, e, 2 * i, h)
    w2, s2 = random_mxfp4(gen, e, h, i)
    x = torch.randn(t, h, generator=gen).to(dtype)
    b13 = torch.randn(e, 2 * i, generator=gen).to(dtype)
    b2 = torch.randn(e, h, generator=gen).to(dtype)
    weights, ids = moe_topk_softmax(torch.randn(t, e, generator=gen), k, True)
    ids[0, 1] = -1  # a choice another expert-parallel rank holds
    got = fused_moe_mxfp4(x, w13, w2, weights, ids, s13, s2, b13, b2, activation, 1.702, 2.0)
    dq13, dq2 = dequantize_mxfp4_experts(w13, s13, dtype), dequantize_mxfp4_experts(w2, s2, dtype)
    want = fused_moe_biased(x, dq13, dq2, weights, ids, b13, b2, activation, 1.702, 2.0)
    assert torch.equal(got, want)
    gate_up = torch.einsum("th,enh->ten", x.float(), dq13.float())
    if activation == "swigluoai":
        assert gate_up.abs().max() > 2.0  # the clamp bit


def moe_layer(tp_rank=0, tp_size=1, ep_rank=0, ep_size=1, *, e=4, h=64, i=128):
    """A GPT-OSS-like FusedMoE with experts kept in MXFP4 on one rank of a layout (no
    communicator: only the loader runs)."""
    parallel = MoEParallel(tp_rank=tp_rank, tp_size=tp_size, ep_rank=ep_rank, ep_size=ep_size)
    kernels = KernelRegistry().resolve("cpu")
    return FusedMoE(
        e, 2, h, i, renormalize=True, kernels=kernels, dtype=torch.float32, parallel=parallel,
        communicator=object() if parallel.world_size > 1 else None,
        quant_method=Mxfp4MoEMethod(), prefix="mlp.experts", activation="swigluoai", bias=True,
    )  # fmt: skip


@pytest.mark.parametrize(
    "layout", [(1, 1), (2, 1), (4, 1), (1, 2)], ids=lambda x: f"tp{x[0]}ep{x[1]}"
)
def test_each_rank_holds_its_part_of_the_checkpoint_blocks(layout):
    """The loader's placement: every rank's kept bytes, dequantized, are its part of the
    de-interleaved dequantized weights (gate rows then up rows, each cut by tensor-parallel
    rank; the down projection's inputs cut by whole blocks; whole experts per expert-parallel
    rank)."""
    tp, ep = layout
    e, h, i = 4, 64, 128
    gen = torch.Generator().manual_seed(2)
    # The checkpoint's layout: gate/up rows interleaved, [E, N, G, 16] / [E, N, G].
    w13, s13 = random_mxfp4(gen, e, 2 * i, h)
    w2, s2 = random_mxfp4(gen, e, h, i)
    full13 = split_interleaved(dequantize_mxfp4_experts(w13, s13), 1)
    full2 = dequantize_mxfp4_experts(w2, s2)
    gate, up = full13[:, :i], full13[:, i:]
    ip, per = i // tp, e // ep
    for rank in range(tp * ep):
        tp_rank, ep_rank = (rank, 0) if ep == 1 else (0, rank)
        layer = moe_layer(tp_rank, tp, ep_rank, ep, e=e, h=h, i=i)
        method = layer.quant_method
        names = method.load(layer, "w13", split_interleaved(w13.reshape(e, 2 * i, h // 32, 16), 1),
                            split_interleaved(s13, 1))  # fmt: skip
        names += method.load(layer, "w2", w2.reshape(e, h, i // 32, 16), s2)
        assert names == ["w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"]
        experts = slice(ep_rank * per, (ep_rank + 1) * per)
        rows = slice(tp_rank * ip, (tp_rank + 1) * ip)
        want13 = torch.cat((gate[experts, rows], up[experts, rows]), dim=1)
        assert torch.equal(method.dequantized(layer, "w13"), want13)
        assert torch.equal(method.dequantized(layer, "w2"), full2[experts][:, :, rows])
        assert layer.w13_weight.dtype == torch.uint8 and layer.w13_weight.shape[-1] == h // 2


def test_a_split_that_cuts_blocks_falls_back_with_the_reason(caplog):
    # 96 intermediate features over 2 ranks: 48 each, not whole blocks of 32.
    config = Mxfp4Config()
    config.provider = "someone"
    layer = FusedMoE(4, 2, 64, 96, renormalize=True, kernels=KernelRegistry().resolve("cpu"),
                     dtype=torch.float32, parallel=MoEParallel(tp_rank=0, tp_size=2),
                     communicator=object(), prefix="mlp.experts", activation="swigluoai",
                     bias=True)  # fmt: skip
    with caplog.at_level(logging.WARNING):
        assert config.get_moe_method(layer, "mlp.experts") is None
    assert "each rank's 48 of the experts' 96 intermediate features" in caplog.text
    assert "sizes that keep whole blocks: 1, or --enable-expert-parallel" in caplog.text


def test_load_refuses_blocks_of_the_wrong_shape():
    layer = moe_layer()
    blocks = torch.zeros(4, 256, 2, 16, dtype=torch.uint8)
    with pytest.raises(Exception, match=r"MXFP4 w13 blocks \(4, 256, 2, 16\) / scales"):
        layer.quant_method.load(layer, "w13", blocks, torch.zeros(4, 256, 3, dtype=torch.uint8))


def test_tiny_gpt_oss_kept_in_mxfp4_matches_transformers(gpt_oss_mxfp4, monkeypatch, caplog):
    """The released layout kept in MXFP4 (the CPU's reference multiplies it, forced on here)
    gives transformers' tokens on the dequantized weights; the experts hold uint8 bytes."""
    from transformers import AutoModelForCausalLM

    path, ref = gpt_oss_mxfp4
    monkeypatch.setattr(Mxfp4Config, "quantized_on_reference", True)
    hf = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    with caplog.at_level("INFO"):
        assert_greedy_matches_hf(path, hf)
    assert "mxfp4: the experts stay in MXFP4" in caplog.text
    assert "dequantized at load" not in caplog.text
    llm = LLM(model=str(path), dtype="float32", num_gpu_blocks_override=16)
    try:
        model = llm.llm_engine.runner.model
        experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
        assert experts and all(isinstance(m.quant_method, Mxfp4MoEMethod) for m in experts)
        assert all(m.w13_weight.dtype == torch.uint8 for m in experts)
    finally:
        llm.llm_engine.shutdown()


def test_dummy_weights_kept_in_mxfp4_generate(gpt_oss_mxfp4, monkeypatch):
    """``--load-format dummy`` on an MXFP4 config (the ``gpt-oss-20b-mxfp4`` benchmark shape's
    path): the method fills random codes and exponents of 2**-8 .. 2**-6 and zero biases; the
    model generates."""
    from engine import SamplingParams

    path, _ = gpt_oss_mxfp4
    monkeypatch.setattr(Mxfp4Config, "quantized_on_reference", True)
    llm = LLM(model=str(path), dtype="float32", load_format="dummy", num_gpu_blocks_override=16)
    try:
        layer = next(m for m in llm.llm_engine.runner.model.modules() if isinstance(m, FusedMoE))
        assert layer.w13_weight.dtype == torch.uint8
        assert {int(v) for v in layer.w2_weight_scale.unique()} == {119, 120, 121}
        assert not layer.w13_bias.any()
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.llm_engine.shutdown()
