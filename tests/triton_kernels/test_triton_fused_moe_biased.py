"""engine-triton's ``fused_moe_biased`` (GPT-OSS's experts: per-expert biases, SiLU-and-mul or
the clamped SwiGLU) against the torch reference, under the interpreter on the CPU.

Both ways through the experts (decode GEMVs, grouped GEMMs), both activations, with and
without biases (and each bias alone), on odd token counts, experts that get no token, every
token on one expert, choices held by another expert-parallel rank, top-1 and top-4, with
gate/up values well past GPT-OSS's limit of 7 so that the clamp bites on both sides. Then the
``FusedMoE`` layer through the registry's Triton kernels, the decode-graph guard, and a tiny
GPT-OSS through the engine with every kernel on Triton. tests/gpu/test_fused_moe_gpu.py
(``-k biased``) runs the gpt-oss-20b shape on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from kernel_tolerance import close, close_to_scale
from moe_routing import count_expert_paths, route

from engine.kernels import reference as ref

DTYPES = [torch.float32, torch.bfloat16]
ALPHA, LIMIT = 1.702, 7.0  # GPT-OSS's
# Small tiles (as test_triton_fused_moe.py's) so the interpreter's grids stay small while M, N
# and K still need masks.
DECODE = {"gate_up_n": 16, "gate_up_k": 32, "down_n": 16, "down_k": 16, "num_stages": 1}
GROUPED = {
    "block_m": 16,
    "block_n": 16,
    "block_k": 32,
    "group_m": 2,
    "num_stages": 1,
    "gate_up_n": 32,
}
CASES = {
    # tokens, experts, top-k, hidden, intermediate, popular expert, unused experts
    "batch1-top4": (1, 8, 4, 40, 24, None, ()),
    "odd-tokens-top4-idle-experts": (5, 8, 4, 40, 24, None, (0, 6)),
    "one-expert-takes-all-top1": (9, 8, 1, 24, 40, 3, ()),
    "grouped-sized-top4": (37, 16, 4, 32, 48, 5, (1, 2)),
}
BIASES = ["both", "none"]
# Every case through the grouped GEMMs; the decode GEMVs for the cases of up to 64 pairs
# (``DECODE_MAX_PAIRS``: the dispatch never sends more there, and the interpreter takes
# seconds per call on the 148 pairs of the grouped-sized case).
CASE_VARIANTS = [
    (case, variant)
    for case, (t, _, k, *_) in CASES.items()
    for variant in ("decode", "grouped")
    if variant == "grouped" or t * k <= 64
]


def _experts(e, h, i, dtype, gate_std=4.0):
    """Random experts and biases: gate/up values of std about ``gate_std`` (4: about 8% of
    them past +-7, GPT-OSS's clamp), down projections of unit gain, biases of std 1."""
    w13 = (torch.randn(e, 2 * i, h) * gate_std * h**-0.5).to(dtype)
    w2 = (torch.randn(e, h, i) * i**-0.5).to(dtype)
    b13 = torch.randn(e, 2 * i).to(dtype)
    b2 = torch.randn(e, h).to(dtype)
    return w13, w2, b13, b2


def _run(variant, args, device, activation, limit=LIMIT):
    from engine_triton.kernels.fused_moe import DecodeConfig, GroupedConfig, fused_moe_biased

    tensors = [None if a is None else a.to(device) for a in args]
    return fused_moe_biased(
        *tensors,
        activation,
        ALPHA,
        limit,
        variant=variant,
        decode_config=DecodeConfig(**DECODE),
        config=GroupedConfig(**GROUPED),
    )


def _gate_up(x, w13, b13, ids):
    """Every held choice's gate/up values ``[pairs, 2I]`` in float32 (to see the clamp bite)."""
    pairs = [(t, int(ids[t, j])) for t in range(ids.shape[0]) for j in range(ids.shape[1])]
    rows = [
        x[t].float() @ w13[e].float().T + (0 if b13 is None else b13[e].float())
        for t, e in pairs
        if e >= 0
    ]
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", BIASES)
@pytest.mark.parametrize("activation", ref.MOE_ACTIVATIONS)
@pytest.mark.parametrize("case,variant", CASE_VARIANTS)
def test_fused_moe_biased_matches_reference(case, variant, activation, bias, dtype, device, seed):
    t, e, k, h, i, popular, unused = CASES[case]
    x = torch.randn(t, h)
    x[0] *= 2.5  # token 0's gate/up values of std ~10: the clamp bites on either side
    x = x.to(dtype)
    w13, w2, b13, b2 = _experts(e, h, i, dtype)
    if bias == "none":
        b13 = b2 = None
    weights, ids = route(t, e, k, popular, unused)
    if case == "odd-tokens-top4-idle-experts":
        ids[2, 1] = -1  # held by another expert-parallel rank
    args = (x, w13, w2, weights, ids, b13, b2)
    out = _run(variant, args, device, activation)
    assert out.shape == (t, h) and out.dtype == dtype
    expected = ref.fused_moe_biased(*args, activation, ALPHA, LIMIT)
    close_to_scale(out, expected, dtype, seed)
    if activation == "swigluoai":  # the clamp was exercised, on both sides
        gate, up = _gate_up(x, w13, b13, ids).chunk(2, dim=-1)
        assert (gate > LIMIT).any() and (up > LIMIT).any() and (up < -LIMIT).any(), seed


@pytest.mark.parametrize("variant", ["decode", "grouped"])
@pytest.mark.parametrize("which", ["w13", "w2"])
def test_one_bias_alone(which, variant, device, seed):
    """Either bias may be absent on its own (the reference takes each as optional)."""
    t, e, k, h, i, dtype = 6, 8, 4, 40, 24, torch.bfloat16
    x = torch.randn(t, h).to(dtype)
    w13, w2, b13, b2 = _experts(e, h, i, dtype)
    if which == "w13":
        b2 = None
    else:
        b13 = None
    weights, ids = route(t, e, k)
    args = (x, w13, w2, weights, ids, b13, b2)
    out = _run(variant, args, device, "swigluoai")
    close(out, ref.fused_moe_biased(*args, "swigluoai", ALPHA, LIMIT), dtype, seed)


@pytest.mark.parametrize("variant", ["decode", "grouped"])
def test_the_bias_is_weighted_and_the_clamp_bites(variant, device, seed):
    """The two mistakes a kernel could make without a bf16 rounding hiding them (float32):
    adding the down bias after the routing weight (weights that do not sum to 1 per token
    make it count), and leaving the clamp out (limit 1: most gate/up values are past it).
    The kernel matches the reference, and both alternatives are far from it."""
    t, e, k, h, i, dtype = 7, 8, 4, 32, 24, torch.float32
    x = torch.randn(t, h)
    w13, w2, b13, b2 = _experts(e, h, i, dtype)
    weights, ids = route(t, e, k)
    weights = weights * 0.6  # the top-k weights sum to 0.6, not 1
    args = (x, w13, w2, weights, ids, b13, b2)
    limit = 1.0
    out = _run(variant, args, device, "swigluoai", limit).cpu()
    expected = ref.fused_moe_biased(*args, "swigluoai", ALPHA, limit)
    close(out, expected, dtype, seed)
    # The down bias outside the weighted sum: sum_k (w_k * (y_k - b2_k) + b2_k).
    unweighted_bias = expected + sum(
        (1 - weights[:, j, None]) * b2[ids[:, j].long()] for j in range(k)
    )
    no_clamp = ref.fused_moe_biased(*args, "swigluoai", ALPHA, float("inf"))
    for wrong in (unweighted_bias, no_clamp):
        assert (out - wrong).abs().max() > 0.1, seed


def test_default_dispatch_at_gpt_oss_routing(device, seed):
    """Without overrides, GPT-OSS's routing (32 experts, top-4): batch 1 and 2 take the
    decode kernels, 12 tokens the grouped ones, each with its real launch configuration
    (whole-tile masks on these small sizes)."""
    from engine_triton.kernels import fused_moe as fm

    e, k, h, i, dtype = 32, 4, 48, 40, torch.bfloat16
    assert fm.use_decode(1, k, e) and fm.use_decode(2, k, e) and not fm.use_decode(12, k, e)
    w13, w2, b13, b2 = _experts(e, h, i, dtype)
    for t in (1, 12):
        x = torch.randn(t, h).to(dtype)
        weights, ids = route(t, e, k)
        args = (x, w13, w2, weights, ids, b13, b2)
        out = fm.fused_moe_biased(*(a.to(device) for a in args), "swigluoai", ALPHA, LIMIT)
        close(out, ref.fused_moe_biased(*args, "swigluoai", ALPHA, LIMIT), dtype, seed)


@pytest.mark.parametrize("variant", ["decode", "grouped"])
def test_choices_held_by_other_ranks_add_nothing(variant, device, seed):
    """Expert parallelism: -1 ids contribute nothing, their biases included; a token whose
    every choice is elsewhere gets an exact zero row."""
    t, e, k, h, i, dtype = 6, 8, 2, 24, 16, torch.bfloat16
    x = torch.randn(t, h).to(dtype)
    w13, w2, b13, b2 = _experts(e, h, i, dtype)
    weights, ids = route(t, e, k)
    ids[1, 0] = -1
    ids[4] = -1
    args = (x, w13, w2, weights, ids, b13, b2)
    out = _run(variant, args, device, "swigluoai")
    close(out, ref.fused_moe_biased(*args, "swigluoai", ALPHA, LIMIT), dtype, seed)
    assert torch.equal(out[4].cpu(), torch.zeros(h, dtype=dtype))


def test_no_tokens(device):
    from engine_triton.kernels.fused_moe import fused_moe_biased

    e, h, i = 4, 16, 8
    w13, w2, b13, b2 = (a.to(device) for a in _experts(e, h, i, torch.float32))
    x = torch.empty(0, h, device=device)
    weights = torch.empty(0, 2, device=device)
    ids = torch.empty(0, 2, dtype=torch.int32, device=device)
    out = fused_moe_biased(x, w13, w2, weights, ids, b13, b2, "swigluoai")
    assert out.shape == (0, h)


def test_refuses_what_it_cannot_run(device):
    """Unsupported inputs raise rather than run something other than the reference."""
    from engine_triton.kernels.fused_moe import fused_moe_biased

    t, e, k, h, i = 2, 4, 2, 32, 16
    x = torch.randn(t, h, device=device)
    w13, w2, b13, b2 = (a.to(device) for a in _experts(e, h, i, torch.float32))
    weights, ids = (a.to(device) for a in route(t, e, k))
    with pytest.raises(ValueError, match="unknown MoE activation 'gelu'"):
        fused_moe_biased(x, w13, w2, weights, ids, b13, b2, "gelu")
    with pytest.raises(ValueError, match="unquantized experts in the activations' dtype"):
        fused_moe_biased(x, w13.bfloat16(), w2, weights, ids, b13, b2, "swigluoai")
    with pytest.raises(ValueError, match="unquantized experts"):
        fp8 = w13.to(torch.float8_e4m3fn)
        fused_moe_biased(x.bfloat16(), fp8, w2.bfloat16(), weights, ids, b13, b2, "swigluoai")
    with pytest.raises(ValueError, match="w13_bias .* does not fit"):
        fused_moe_biased(x, w13, w2, weights, ids, b13[:, :i], b2, "swigluoai")
    with pytest.raises(ValueError, match="w2_bias .* does not fit"):
        fused_moe_biased(x, w13, w2, weights, ids, b13, b2[:, None], "swigluoai")
    with pytest.raises(ValueError, match="shapes do not fit"):
        fused_moe_biased(x, w13, w2[:, :, :-1], weights, ids, b13, b2, "swigluoai")


def test_conformance_kit_accepts_the_override():
    """The kit's own kernel check (what ``--engine-conformance=cuda`` runs on a GPU), on its
    fused_moe_biased inputs (both activations, with and without biases, a clamp that bites)."""
    from engine.testing.checks import check_kernel
    from engine_triton.kernels import fused_moe as fm

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for dtype in ("float32", "bfloat16"):
        check_kernel("fused_moe_biased", fm.fused_moe_biased, device, dtype)


def test_moe_benchmark_sweep_times_the_biased_op(monkeypatch, capsys):
    """``python -m engine_triton.benchmark --moe-only`` times a biased shape (gpt-oss-20b's)
    through ``fused_moe_biased`` with the clamped SwiGLU, end to end on one tiny shape with
    the GPU timers stubbed, and ``--moe-fp8`` passes over it (its experts are unquantized)."""
    from engine_triton import benchmark
    from engine_triton.kernels import fused_moe as fm

    if torch.cuda.is_available():
        pytest.skip("runs for real on a GPU: python -m engine_triton.benchmark --moe-only")
    assert benchmark.MOE_SHAPES["gpt-oss-20b"]["biased"]
    tiny = dict(experts=8, top_k=4, hidden=32, inter=16, layers=2, other_params=1000, biased=True)
    monkeypatch.setattr(benchmark, "MOE_SHAPES", {"tiny-oss": tiny})
    monkeypatch.setattr(benchmark, "_graph_us", lambda call, calls=1: (call(0), call(1), 2.0)[-1])
    monkeypatch.setattr(benchmark, "_copy_gbps", lambda device: 4000.0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "interpreter")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    every = benchmark._moe_candidates
    monkeypatch.setattr(
        benchmark,
        "_moe_candidates",
        lambda t, k, e, bits, rule_bits=None: every(t, k, e, bits, rule_bits)[:2],
    )
    activations = []
    biased = fm.fused_moe_biased

    def counted(*args, **kwargs):
        activations.append(args[7])
        return biased(*args, **kwargs)

    monkeypatch.setattr(fm, "fused_moe_biased", counted)
    results: dict = {}
    benchmark.sweep_moe(results, tokens=(1, 5), device="cpu")
    out = capsys.readouterr().out
    assert "tiny-oss: fused_moe_biased (swigluoai), 8 experts, top-4" in out
    assert activations and set(activations) == {"swigluoai"}
    rows = results["moe tiny-oss T=5"]["rows"]
    assert any(r["config"].startswith("decode") for r in rows)
    assert any(r["config"].startswith("grouped") for r in rows)
    assert all("error" not in r and r["max_err"] < 0.06 for r in rows), rows
    benchmark.sweep_moe(results, tokens=(1,), device="cpu", fp8="block")
    assert "tiny-oss: passed over" in capsys.readouterr().out


# ---- the layer and the model ------------------------------------------------------------------
def _triton_kernels(platform: str):
    """The registry's kernels for ``platform`` with engine-triton's registered for it."""
    from engine.kernels.registry import KernelRegistry
    from engine_triton.kernels import register

    registry = KernelRegistry()
    register(registry, platforms=(platform,))
    return registry.resolve(platform)


def _gpt_oss_layer(kernels, dtype):
    from engine.layers.fused_moe import FusedMoE

    torch.manual_seed(0)
    layer = FusedMoE(16, 4, 40, 24, renormalize=True, kernels=kernels, dtype=dtype,
                     activation="swigluoai", bias=True, swiglu_alpha=ALPHA,
                     swiglu_limit=LIMIT)  # fmt: skip
    with torch.no_grad():
        for name, std in (("w13_weight", 4 * 40**-0.5), ("w2_weight", 24**-0.5),
                          ("w13_bias", 1.0), ("w2_bias", 1.0)):  # fmt: skip
            param = getattr(layer, name)
            param.copy_((torch.randn(param.shape) * std).to(dtype))
    return layer


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_moe_layer_on_triton_matches_reference(dtype, device, seed):
    """GPT-OSS's MoE layer (``FusedMoE(activation="swigluoai", bias=True)``) with the
    registry's Triton kernels (routing and experts) against the same layer on the torch
    references, at a decode-sized and a prefill-sized batch."""
    on_triton = _triton_kernels("cpu")
    assert on_triton.provider("fused_moe_biased") == "engine-llm-triton"
    from engine.kernels.registry import KernelRegistry

    reference = _gpt_oss_layer(KernelRegistry().resolve("cpu"), dtype)
    layer = _gpt_oss_layer(on_triton, dtype).to(device)
    for t in (1, 21):
        x = torch.randn(t, 40).to(dtype)
        logits = torch.randn(t, 16).to(dtype)
        with torch.no_grad():
            out = layer(x.to(device), logits.to(device))
            close(out, reference(x, logits), dtype, seed)


def test_gpt_oss_layers_on_triton_can_be_captured():
    """The decode-graph guard (``host_loop_problem``) counts engine-triton's
    ``fused_moe_biased`` as a kernel: GPT-OSS's MoE layers name no problem on CUDA with the
    plugin registered, and the host-loop problem without it."""
    from engine.kernels.registry import KernelRegistry

    layer = _gpt_oss_layer(_triton_kernels("cuda"), torch.float32)
    assert layer.quant_method.kernel_name(layer) == "fused_moe_biased"
    assert layer.quant_method.graph_capture_problem(layer) is None
    bare = _gpt_oss_layer(KernelRegistry().resolve("cuda"), torch.float32)
    problem = bare.quant_method.graph_capture_problem(bare)
    assert problem is not None and "no plugin provides fused_moe_biased on cuda" in problem


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without a GPU")
def test_gpt_oss_on_triton_interpreter_matches_torch(tmp_path, monkeypatch):
    """A tiny GPT-OSS (16 experts top-4, clamp 1.5, biases everywhere) through the engine with
    every kernel on Triton in the interpreter (attention on the torch reference backend, the
    one with sinks on the CPU): greedy tokens equal the torch reference path's, with chunked
    prefill and a request that decodes alone, so the decode and grouped expert paths both
    run."""
    import engine_triton.kernels as triton_kernels
    from engine import LLM, SamplingParams
    from engine.testing.tiny_models import build_tiny_model
    from engine_triton.kernels import fused_moe as fm

    path = str(build_tiny_model(tmp_path / "m", "gpt_oss", num_layers=2))
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [12, 13, 14]]
    # The second request outlives the first: its last steps decode alone (batch 1).
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (2, 5)]
    calls = count_expert_paths(monkeypatch, fm)

    def generate():
        llm = LLM(path, attention_backend="torch", dtype="float32", block_size=4,
                  max_num_batched_tokens=8, platform="cpu")  # fmt: skip
        kernels = llm.llm_engine.runner.kernels
        try:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            return [o.outputs[0].token_ids for o in outputs], kernels.provider("fused_moe_biased")
        finally:
            llm.llm_engine.shutdown()

    expected, provider = generate()
    assert provider == "engine-llm (torch reference)"
    register = triton_kernels.register
    monkeypatch.setattr(
        triton_kernels, "register", lambda registry: register(registry, platforms=("cpu",))
    )
    got, provider = generate()
    assert provider == "engine-llm-triton"
    assert got == expected
    assert calls["decode"] > 0 and calls["grouped"] > 0, calls
