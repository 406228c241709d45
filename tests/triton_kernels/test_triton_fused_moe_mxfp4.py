"""engine-triton's ``fused_moe_mxfp4`` (GPT-OSS's experts as released: MXFP4 weights, per-expert
biases, SiLU-and-mul or the clamped SwiGLU) against the torch reference, under the interpreter
on the CPU.

The in-register E2M1 decode bit-exact for every byte value at exponents across the range; then
both ways through the experts (decode GEMVs, grouped GEMMs), both activations, with and
without biases, on odd token counts, experts that get no token, every token on one expert,
choices held by another expert-parallel rank, top-1 and top-4, rows of one and of several
32-feature blocks (K steps that end past K, and steps spanning blocks), with gate/up values
past the clamp on both sides; bf16, fp16 and float32 activations. Then the MXFP4 ``FusedMoE``
layer and a tiny GPT-OSS kept in MXFP4 through the engine, with engine-triton's kernels and
``fused_moe_mxfp4`` registered for the cpu platform by the test itself: ``register`` leaves it
out until it has run on a GPU (tests/gpu/test_fused_moe_gpu.py ``-k mxfp4``).
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_tolerance import close_to_scale
from moe_routing import count_expert_paths, route

from engine.kernels import reference as ref
from engine.kernels.quantized import dequantize_mxfp4_experts

DTYPES = [torch.float32, torch.bfloat16]
ALPHA, LIMIT = 1.702, 7.0  # GPT-OSS's
# Small tiles so the interpreter's grids stay small while M, N and K still need masks: K steps
# of two blocks (64 features) over rows of one, two and three blocks.
DECODE = {"gate_up_n": 16, "gate_up_k": 64, "down_n": 16, "down_k": 64, "num_stages": 1}
GROUPED = {
    "block_m": 16,
    "block_n": 16,
    "block_k": 64,
    "group_m": 2,
    "num_stages": 1,
    "gate_up_n": 32,
}
CASES = {
    # tokens, experts, top-k, hidden, intermediate, popular expert, unused experts
    "batch1-top4": (1, 8, 4, 64, 32, None, ()),
    "odd-tokens-top4-idle-experts": (5, 8, 4, 96, 32, None, (0, 6)),
    "one-expert-takes-all-top1": (9, 8, 1, 32, 64, 3, ()),
    "grouped-sized-top4": (37, 16, 4, 64, 96, 5, (1, 2)),
}
BIASES = ["both", "none"]
# Every case through the grouped GEMMs; the decode GEMVs for the cases of up to 64 pairs (the
# dispatch never sends more there).
CASE_VARIANTS = [
    (case, variant)
    for case, (t, _, k, *_) in CASES.items()
    for variant in ("decode", "grouped")
    if variant == "grouped" or t * k <= 64
]


def _fm():
    from engine_triton.kernels import fused_moe as fm

    return fm


def _mxfp4(e, n, k, std):
    """Random MXFP4 experts ``[E, N, K]`` (every byte value) whose products with unit inputs
    have about ``std``: exponents within one of the one giving it (E2M1's random codes have
    an RMS of about 2.93). Returns (uint8 blocks ``[E, N, K / 2]``, uint8 exponents ``[E, N,
    K / 32]``)."""
    center = 127 + round(math.log2(std / (2.93 * math.sqrt(k))))
    blocks = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8)
    scales = torch.randint(center - 1, center + 2, (e, n, k // 32), dtype=torch.uint8)
    return blocks, scales


def _experts(e, h, i, dtype, gate_std=4.0):
    """Random MXFP4 experts and biases: gate/up values of std about ``gate_std`` (4: some of
    them past +-7, GPT-OSS's clamp), down projections of about unit gain, biases of std 1."""
    w13, s13 = _mxfp4(e, 2 * i, h, gate_std)
    w2, s2 = _mxfp4(e, h, i, 1.0)
    b13 = torch.randn(e, 2 * i).to(dtype)
    b2 = torch.randn(e, h).to(dtype)
    return w13, w2, s13, s2, b13, b2


def _run(variant, args, device, activation, limit=LIMIT):
    fm = _fm()
    tensors = [None if a is None else a.to(device) for a in args]
    return fm.fused_moe_mxfp4(
        *tensors,
        activation,
        ALPHA,
        limit,
        variant=variant,
        decode_config=fm.DecodeConfig(**DECODE),
        config=fm.GroupedConfig(**GROUPED),
    )


def _gate_up(x, w13, s13, b13, ids):
    """Every held choice's gate/up values ``[pairs, 2I]`` in float32 (to see the clamp bite)."""
    dq = dequantize_mxfp4_experts(w13, s13)
    pairs = [(t, int(ids[t, j])) for t in range(ids.shape[0]) for j in range(ids.shape[1])]
    rows = [
        x[t].float() @ dq[e].T + (0 if b13 is None else b13[e].float()) for t, e in pairs if e >= 0
    ]
    return torch.stack(rows)


# ---- the decode --------------------------------------------------------------------------------
def test_e2m1_decode_is_bit_exact_for_every_byte(device):
    """``_e2m1_to_f32`` on all 256 bytes (both nibbles) at exponents from 2 to 252 (the range
    it is exact for; checkpoints hold about 110-130) equals ``dequantize_mxfp4_experts``'s
    float32 values bit for bit, signed zeros included."""
    from e2m1_decode import decode_mxfp4, every_byte_at_every_exponent

    blocks, scales = every_byte_at_every_exponent()
    out = decode_mxfp4(blocks.to(device), scales.to(device)).cpu()
    want = dequantize_mxfp4_experts(blocks[None], scales[None])[0]
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))


# ---- the op ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", BIASES)
@pytest.mark.parametrize("activation", ref.MOE_ACTIVATIONS)
@pytest.mark.parametrize("case,variant", CASE_VARIANTS)
def test_fused_moe_mxfp4_matches_reference(case, variant, activation, bias, dtype, device, seed):
    t, e, k, h, i, popular, unused = CASES[case]
    x = torch.randn(t, h)
    x[0] *= 2.5  # token 0's gate/up values of std ~10: the clamp bites on either side
    x = x.to(dtype)
    w13, w2, s13, s2, b13, b2 = _experts(e, h, i, dtype)
    if bias == "none":
        b13 = b2 = None
    weights, ids = route(t, e, k, popular, unused)
    if case == "odd-tokens-top4-idle-experts":
        ids[2, 1] = -1  # held by another expert-parallel rank
    args = (x, w13, w2, weights, ids, s13, s2, b13, b2)
    out = _run(variant, args, device, activation)
    assert out.shape == (t, h) and out.dtype == dtype
    expected = ref.fused_moe_mxfp4(*args, activation, ALPHA, LIMIT)
    close_to_scale(out, expected, dtype, seed)
    if activation == "swigluoai":  # the clamp was exercised, on both sides
        gate, up = _gate_up(x, w13, s13, b13, ids).chunk(2, dim=-1)
        assert (gate > LIMIT).any() and (up > LIMIT).any() and (up < -LIMIT).any(), seed


@pytest.mark.parametrize("variant", ["decode", "grouped"])
def test_float16_activations(variant, device, seed):
    """fp16 activations: the grouped GEMMs convert the decoded tile to fp16 (exact at these
    exponents, as the reference's dequantization)."""
    t, e, k, h, i, dtype = 6, 8, 4, 96, 64, torch.float16
    x = torch.randn(t, h).to(dtype)
    w13, w2, s13, s2, b13, b2 = _experts(e, h, i, dtype)
    weights, ids = route(t, e, k)
    args = (x, w13, w2, weights, ids, s13, s2, b13, b2)
    out = _run(variant, args, device, "swigluoai")
    close_to_scale(out, ref.fused_moe_mxfp4(*args, "swigluoai", ALPHA, LIMIT), dtype, seed)


@pytest.mark.parametrize("variant", ["decode", "grouped"])
def test_choices_held_by_other_ranks_add_nothing(variant, device, seed):
    """Expert parallelism: -1 ids contribute nothing, their biases included; a token whose
    every choice is elsewhere gets an exact zero row."""
    t, e, k, h, i, dtype = 6, 8, 2, 32, 32, torch.bfloat16
    x = torch.randn(t, h).to(dtype)
    w13, w2, s13, s2, b13, b2 = _experts(e, h, i, dtype)
    weights, ids = route(t, e, k)
    ids[1, 0] = -1
    ids[4] = -1
    args = (x, w13, w2, weights, ids, s13, s2, b13, b2)
    out = _run(variant, args, device, "swigluoai")
    close_to_scale(out, ref.fused_moe_mxfp4(*args, "swigluoai", ALPHA, LIMIT), dtype, seed)
    assert torch.equal(out[4].cpu(), torch.zeros(h, dtype=dtype))


def test_default_dispatch_at_gpt_oss_routing(device, seed):
    """Without overrides, GPT-OSS's routing (32 experts, top-4): batch 1 takes the decode
    kernels with ``MXFP4_DECODE`` (the 4-bit rule: up to 8 tokens), 12 tokens the grouped
    ones with the general rule's tiling, each with its real launch configuration (K steps
    past these small rows)."""
    fm = _fm()
    e, k, h, i, dtype = 32, 4, 96, 64, torch.bfloat16
    assert fm.use_decode(8, k, e, bits=4) and not fm.use_decode(12, k, e, bits=4)
    w13, w2, s13, s2, b13, b2 = _experts(e, h, i, dtype)
    for t in (1, 12):
        x = torch.randn(t, h).to(dtype)
        weights, ids = route(t, e, k)
        args = (x, w13, w2, weights, ids, s13, s2, b13, b2)
        out = fm.fused_moe_mxfp4(*(a.to(device) for a in args), "swigluoai", ALPHA, LIMIT)
        expected = ref.fused_moe_mxfp4(*args, "swigluoai", ALPHA, LIMIT)
        close_to_scale(out, expected, dtype, seed)


def test_no_tokens(device):
    e, h, i = 4, 32, 32
    w13, w2, s13, s2, b13, b2 = (a.to(device) for a in _experts(e, h, i, torch.float32))
    x = torch.empty(0, h, device=device)
    weights = torch.empty(0, 2, device=device)
    ids = torch.empty(0, 2, dtype=torch.int32, device=device)
    out = _fm().fused_moe_mxfp4(x, w13, w2, weights, ids, s13, s2, b13, b2)
    assert out.shape == (0, h)


def test_refuses_what_it_cannot_run(device):
    """Inputs the kernels cannot compute as the reference does raise a ``ValueError``."""
    fm = _fm()
    t, e, k, h, i = 2, 4, 2, 64, 32
    x = torch.randn(t, h, device=device)
    w13, w2, s13, s2, b13, b2 = (a.to(device) for a in _experts(e, h, i, torch.float32))
    weights, ids = (a.to(device) for a in route(t, e, k))
    args = (x, w13, w2, weights, ids, s13, s2)
    with pytest.raises(ValueError, match="unknown MoE activation 'gelu'"):
        fm.fused_moe_mxfp4(*args, b13, b2, "gelu")
    with pytest.raises(ValueError, match="takes bfloat16, float16 or float32 activations"):
        fm.fused_moe_mxfp4(x.to(torch.float64), *args[1:], b13, b2)
    with pytest.raises(ValueError, match="w13 must be uint8"):
        fm.fused_moe_mxfp4(x, w13.to(torch.int8), *args[2:], b13, b2)
    with pytest.raises(ValueError, match="w2_scales must be uint8"):
        fm.fused_moe_mxfp4(*args[:6], s2.float(), b13, b2)
    with pytest.raises(ValueError, match="shapes do not fit"):
        fm.fused_moe_mxfp4(x, w13, w2[:, :, :-1], *args[3:], b13, b2)
    with pytest.raises(ValueError, match="scales do not fit"):
        fm.fused_moe_mxfp4(*args[:5], s13[:, :, :1], s2, b13, b2)
    with pytest.raises(ValueError, match="w13_bias .* does not fit"):
        fm.fused_moe_mxfp4(*args, b13[:, :i], b2)
    with pytest.raises(ValueError, match="w2_bias .* does not fit"):
        fm.fused_moe_mxfp4(*args, b13, b2[:, None])
    # 48 features: the shapes pair up, but a row is not whole blocks of 32.
    w13_48 = torch.zeros(e, 2 * i, 24, dtype=torch.uint8, device=device)
    w2_48 = torch.zeros(e, 48, i // 2, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="multiples of the MXFP4 block of 32"):
        fm.fused_moe_mxfp4(x[:, :48], w13_48, w2_48, weights, ids, s13[:, :, :1], s2[:, :48])
    with pytest.raises(ValueError, match="power-of-two multiple of the MXFP4 block"):
        config = fm.GroupedConfig(16, 16, 16)
        fm.fused_moe_mxfp4(*args, b13, b2, variant="grouped", config=config)


def test_conformance_kit_accepts_the_kernel():
    """The kit's own kernel check (what ``--engine-conformance=cuda`` will run once the op is
    registered), on its fused_moe_mxfp4 inputs (every byte value, both activations, with and
    without biases, a clamp that bites)."""
    from engine.testing.checks import check_kernel

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for dtype in ("float32", "bfloat16"):
        check_kernel("fused_moe_mxfp4", _fm().fused_moe_mxfp4, device, dtype)


def test_not_registered_for_gpus_yet():
    """``register`` leaves ``fused_moe_mxfp4`` to the reference on every platform (GPT-OSS on a
    GPU keeps dequantizing its experts at load) until the kernel has run on a GPU; it is
    importable for the tests and for registering by hand."""
    from engine.kernels.registry import KernelRegistry
    from engine_triton.kernels import register

    registry = KernelRegistry()
    register(registry)
    for platform in ("cuda", "rocm", "cpu"):
        assert registry.resolve(platform).is_reference("fused_moe_mxfp4")
    assert callable(_fm().fused_moe_mxfp4)


def test_moe_benchmark_sweep_times_the_mxfp4_op(monkeypatch, capsys):
    """``python -m engine_triton.benchmark --moe-only --moe-shapes gpt-oss`` times the MXFP4
    shapes through ``fused_moe_mxfp4`` with the clamped SwiGLU, counting the MXFP4 bytes and
    exponents read, end to end on one tiny shape with the GPU timers stubbed, and ``--moe-fp8``
    passes over them."""
    from engine_triton import benchmark

    fm = _fm()
    if torch.cuda.is_available():
        pytest.skip("runs for real on a GPU: python -m engine_triton.benchmark --moe-only")
    assert benchmark.MOE_SHAPES["gpt-oss-120b-mxfp4"]["mxfp4"]
    assert benchmark.MOE_SHAPES["gpt-oss-20b-mxfp4"]["mxfp4"]
    tiny = dict(experts=8, top_k=4, hidden=64, inter=32, layers=2, other_params=1000,
                biased=True, mxfp4=True)  # fmt: skip
    monkeypatch.setattr(benchmark, "MOE_SHAPES", {"tiny-oss-mxfp4": tiny})
    monkeypatch.setattr(benchmark, "_graph_us", lambda call, calls=1: (call(0), call(1), 2.0)[-1])
    monkeypatch.setattr(benchmark, "_copy_gbps", lambda device: 4000.0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "interpreter")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    every = benchmark._moe_candidates
    monkeypatch.setattr(
        benchmark,
        "_moe_candidates",
        lambda *args, **kwargs: every(*args, **kwargs)[:2],
    )
    activations = []
    op = fm.fused_moe_mxfp4

    def counted(*args, **kwargs):
        activations.append(args[9])
        return op(*args, **kwargs)

    monkeypatch.setattr(fm, "fused_moe_mxfp4", counted)
    results: dict = {}
    benchmark.sweep_moe(results, tokens=(1, 9), device="cpu")
    out = capsys.readouterr().out
    assert "tiny-oss-mxfp4: fused_moe_mxfp4 (swigluoai), 8 experts, top-4" in out
    assert activations and set(activations) == {"swigluoai"}
    assert results["moe tiny-oss-mxfp4 T=1"]["rows"][0]["config"] == fm.MXFP4_DECODE.short()
    rows = results["moe tiny-oss-mxfp4 T=9"]["rows"]
    assert any(r["config"].startswith("decode") for r in rows)
    assert any(r["config"].startswith("grouped") for r in rows)
    assert all("error" not in r and r["max_err"] < 0.06 for r in rows), rows
    # The bytes a call must read: the distinct experts' MXFP4 bytes and exponents (4.25 bits a
    # weight), plus the activations.
    t1 = results["moe tiny-oss-mxfp4 T=1"]
    per_expert = 3 * 64 * 32 * (0.5 + 1 / 32)
    assert t1["bytes"] == round(t1["distinct_experts"] * per_expert + 2 * 64 * 2)
    benchmark.sweep_moe(results, tokens=(1,), device="cpu", fp8="block")
    assert "tiny-oss-mxfp4: passed over" in capsys.readouterr().out


# ---- the layer and the model ------------------------------------------------------------------
def _triton_kernels(platform: str):
    """The registry's kernels for ``platform`` with engine-triton's registered for it and, by
    hand, ``fused_moe_mxfp4`` (``register`` leaves it out until it has run on a GPU)."""
    from engine.kernels.registry import KernelRegistry
    from engine_triton.kernels import register

    registry = KernelRegistry()
    _register_with_mxfp4(registry, register, (platform,))
    return registry.resolve(platform)


def _register_with_mxfp4(registry, register, platforms):
    from engine_triton.kernels import PRIORITY, PROVIDER

    register(registry, platforms=platforms)
    registry.register(
        "fused_moe_mxfp4", _fm().fused_moe_mxfp4, platforms=platforms, priority=PRIORITY,
        provider=PROVIDER,
    )  # fmt: skip


def _mxfp4_layer(kernels, dtype):
    """GPT-OSS's MoE layer with its experts kept in MXFP4 (``Mxfp4MoEMethod``): 16 experts,
    top-4, hidden 64, intermediate 96, random codes and exponents, biases of std 1."""
    from engine.layers.fused_moe import FusedMoE
    from engine.quantization.mxfp4 import Mxfp4MoEMethod

    torch.manual_seed(0)
    layer = FusedMoE(16, 4, 64, 96, renormalize=True, kernels=kernels, dtype=dtype,
                     quant_method=Mxfp4MoEMethod(), prefix="mlp.experts",
                     activation="swigluoai", bias=True, swiglu_alpha=ALPHA,
                     swiglu_limit=LIMIT)  # fmt: skip
    w13, w2, s13, s2, b13, b2 = _experts(16, 64, 96, dtype)
    with torch.no_grad():
        for name, value in (("w13_weight", w13), ("w2_weight", w2), ("w13_weight_scale", s13),
                            ("w2_weight_scale", s2), ("w13_bias", b13), ("w2_bias", b2)):  # fmt: skip
            getattr(layer, name).copy_(value)
    return layer


@pytest.mark.parametrize("dtype", DTYPES)
def test_mxfp4_layer_on_triton_matches_reference(dtype, device, seed):
    """The ``FusedMoE`` layer with MXFP4 experts on the registry's Triton kernels (routing
    and ``fused_moe_mxfp4``) against the same layer on the torch references, at a
    decode-sized and a prefill-sized batch."""
    from engine.kernels.registry import KernelRegistry

    kernels = _triton_kernels("cpu")
    assert kernels.provider("fused_moe_mxfp4") == "engine-llm-triton"
    reference = _mxfp4_layer(KernelRegistry().resolve("cpu"), dtype)
    layer = _mxfp4_layer(kernels, dtype).to(device)
    assert layer.w13_weight.dtype == torch.uint8
    for t in (1, 21):
        x = torch.randn(t, 64).to(dtype)
        logits = torch.randn(t, 16).to(dtype)
        with torch.no_grad():
            out = layer(x.to(device), logits.to(device))
            close_to_scale(out, reference(x, logits), dtype, seed)


def _tiny_gpt_oss_mxfp4(path):
    """A tiny GPT-OSS checkpoint with its experts in MXFP4, the released layout (the packer
    and layout of tests/test_gpt_oss.py's ``gpt_oss_mxfp4`` fixture)."""
    import json

    from safetensors.torch import load_file, save_file
    from test_gpt_oss import mxfp4_pack

    from engine.testing.tiny_models import build_tiny_model

    model = build_tiny_model(path / "bf16", "gpt_oss", num_layers=2)
    out = path / "mxfp4"
    out.mkdir()
    tensors = load_file(str(model / "model.safetensors"))
    quantized = {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4_pack(t.transpose(1, 2))  # [E, out, in] in blocks of 32
            quantized[f"{name}_blocks"] = blocks.reshape(*scales.shape, 16)
            quantized[f"{name}_scales"] = scales
        else:
            quantized[name] = t
    for f in model.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    save_file(quantized, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without a GPU")
def test_tiny_gpt_oss_kept_in_mxfp4_on_triton_interpreter_matches_torch(tmp_path, monkeypatch):
    """A tiny GPT-OSS with MXFP4 experts (16 experts top-4, clamp 1.5, biases everywhere)
    through the engine with every kernel on Triton in the interpreter, ``fused_moe_mxfp4``
    registered for the cpu platform by hand (attention on the torch reference backend, the one
    with sinks on the CPU): the experts stay uint8, and greedy tokens equal those of the same
    model kept in MXFP4 on the torch reference, with chunked prefill and a request that
    decodes alone, so the decode and grouped expert paths both run."""
    import engine_triton.kernels as triton_kernels
    from engine import LLM, SamplingParams
    from engine.layers.fused_moe import FusedMoE
    from engine.quantization.mxfp4 import Mxfp4Config

    fm = _fm()
    path = str(_tiny_gpt_oss_mxfp4(tmp_path))
    monkeypatch.setattr(Mxfp4Config, "quantized_on_reference", True)  # the expected run
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [12, 13, 14]]
    # The second request outlives the first: its last steps decode alone (batch 1).
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (2, 5)]
    calls = count_expert_paths(monkeypatch, fm)

    def generate():
        llm = LLM(path, attention_backend="torch", dtype="float32", block_size=4,
                  max_num_batched_tokens=8, platform="cpu")  # fmt: skip
        kernels = llm.llm_engine.runner.kernels
        try:
            experts = [m for m in llm.llm_engine.runner.model.modules()
                       if isinstance(m, FusedMoE)]  # fmt: skip
            assert experts and all(m.w13_weight.dtype == torch.uint8 for m in experts)
            outputs = llm.generate(prompts, params, use_tqdm=False)
            return [o.outputs[0].token_ids for o in outputs], kernels.provider("fused_moe_mxfp4")
        finally:
            llm.llm_engine.shutdown()

    expected, provider = generate()
    assert provider == "engine-llm (torch reference)"
    assert calls == {"decode": 0, "grouped": 0}
    register = triton_kernels.register
    monkeypatch.setattr(
        triton_kernels,
        "register",
        lambda registry: _register_with_mxfp4(registry, register, ("cpu",)),
    )
    got, provider = generate()
    assert provider == "engine-llm-triton"
    assert got == expected
    assert calls["decode"] > 0 and calls["grouped"] > 0, calls
