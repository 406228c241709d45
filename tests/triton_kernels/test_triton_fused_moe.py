"""engine-triton's MoE kernels (routing and the fused experts) against the torch references.

Both ways through the experts (the sort-free decode GEMVs and the grouped GEMMs over the
expert-sorted pairs) on odd token counts, experts that get no token, every token on one
expert, choices held by another expert-parallel rank (-1), top-2 and top-8, in bf16 and
float32. Sizes stay tiny for the interpreter; tests/gpu/test_fused_moe_gpu.py runs the real
model shapes.
"""

from __future__ import annotations

import pytest
import torch
from kernel_tolerance import close
from moe_routing import count_expert_paths, route

from engine.kernels import reference as ref

DTYPES = [torch.float32, torch.bfloat16]
# Small tiles so that the interpreter's grids stay small while M, N and K still need masks.
DECODE = {"gate_up_n": 16, "gate_up_k": 32, "down_n": 16, "down_k": 16, "num_stages": 1}
GROUPED = {
    "block_m": 16,
    "block_n": 16,
    "block_k": 32,
    "group_m": 2,
    "num_stages": 1,
    "gate_up_n": 32,
}


def _experts(e, h, i, dtype):
    w13 = (torch.randn(e, 2 * i, h) * h**-0.5).to(dtype)
    w2 = (torch.randn(e, h, i) * i**-0.5).to(dtype)
    return w13, w2


def _run(variant, x, w13, w2, weights, ids, device):
    from engine_triton.kernels.fused_moe import DecodeConfig, GroupedConfig, fused_moe

    args = [a.to(device) for a in (x, w13, w2, weights, ids)]
    return fused_moe(
        *args,
        variant=variant,
        decode_config=DecodeConfig(**DECODE),
        config=GroupedConfig(**GROUPED),
    )


CASES = {
    # tokens, experts, top-k, hidden, intermediate, (popular expert, unused experts)
    "batch1-top8": (1, 16, 8, 40, 24, None, ()),
    "odd-tokens-top2-idle-experts": (5, 8, 2, 40, 24, None, (0, 6, 7)),
    "one-expert-takes-all": (9, 8, 1, 24, 40, 3, ()),
    "top8-many-experts": (3, 32, 8, 32, 24, 5, (1,)),
}


@pytest.mark.parametrize("variant", ["decode", "grouped"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_fused_moe_matches_reference(case, dtype, variant, device, seed):
    t, e, k, h, i, popular, unused = CASES[case]
    x = torch.randn(t, h).to(dtype)
    w13, w2 = _experts(e, h, i, dtype)
    weights, ids = route(t, e, k, popular, unused)
    out = _run(variant, x, w13, w2, weights, ids, device)
    assert out.shape == (t, h) and out.dtype == dtype
    close(out, ref.fused_moe(x, w13, w2, weights, ids), dtype, seed)


# FP8 experts: (tokens, experts, top-k, hidden, intermediate, popular, unused) x scales.
FP8_CASES = {
    "odd-tokens-idle-experts": (5, 8, 2, 40, 24, None, (0, 6, 7)),
    "one-expert-takes-all": (9, 8, 1, 48, 40, 3, ()),
    "batch1-top8": (1, 16, 8, 64, 48, None, ()),
}
FP8_SCALES = {"channel": None, "block128": (128, 128), "block16x32": (16, 32)}


def _fp8_experts(e, h, i, block):
    """Random e4m3 experts with positive scales of the layout ``block`` asks for."""
    from engine.testing.inputs import _fp8_expert_scales

    w13 = (torch.randn(e, 2 * i, h) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    w2 = (torch.randn(e, h, i) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    s13 = _fp8_expert_scales(gen, e, 2 * i, h, h**-0.5, block, slices=2)
    s2 = _fp8_expert_scales(gen, e, h, i, i**-0.5, block)
    return w13, w2, s13, s2


@pytest.mark.parametrize("variant", ["decode", "grouped"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scales", list(FP8_SCALES))
@pytest.mark.parametrize("case", list(FP8_CASES))
def test_fused_moe_fp8_matches_reference(case, scales, dtype, variant, device, seed):
    """FP8 experts (weight-only) through both paths: per-channel scales, 128x128 blocks on
    sizes that leave partial blocks (H 40-64, I 24-48), and 16x32 blocks (several per expert,
    the K step cut to 32 where the configuration asks for more)."""
    from engine_triton.kernels.fused_moe import DecodeConfig, GroupedConfig, fused_moe_fp8

    t, e, k, h, i, popular, unused = FP8_CASES[case]
    block = FP8_SCALES[scales]
    x = torch.randn(t, h).to(dtype)
    w13, w2, s13, s2 = _fp8_experts(e, h, i, block)
    weights, ids = route(t, e, k, popular, unused)
    if case == "odd-tokens-idle-experts":
        ids[2, 1] = -1  # held by another expert-parallel rank
    args = (x, w13, w2, weights, ids, s13, s2)
    decode = {**DECODE, "gate_up_k": 64}  # cut to the 32-wide blocks of block16x32
    out = fused_moe_fp8(
        *(a.to(device) for a in args),
        block,
        variant=variant,
        decode_config=DecodeConfig(**decode),
        config=GroupedConfig(**{**GROUPED, "block_k": 64}),
    )
    assert out.shape == (t, h) and out.dtype == dtype
    close(out, ref.fused_moe_fp8(*args, block), dtype, seed)


def test_fused_moe_fp8_rejects_what_it_cannot_run(device):
    from engine_triton.kernels.fused_moe import fused_moe_fp8

    t, e, k, h, i = 2, 4, 2, 32, 16
    x = torch.randn(t, h, device=device)
    w13, w2, s13, s2 = (a.to(device) for a in _fp8_experts(e, h, i, None))
    weights, ids = (a.to(device) for a in route(t, e, k))
    with pytest.raises(ValueError, match="scales do not fit"):
        fused_moe_fp8(x, w13, w2, weights, ids, s13[:, :i], s2)
    with pytest.raises(ValueError, match="multiple of 16"):
        fused_moe_fp8(x, w13, w2, weights, ids, s13, s2, (128, 8))
    with pytest.raises(ValueError, match="float8_e4m3fn experts"):
        fused_moe_fp8(x, w13.float(), w2, weights, ids, s13, s2)


@pytest.mark.parametrize("variant", ["decode", "grouped"])
def test_choices_held_by_other_ranks_add_nothing(variant, device, seed):
    """Expert parallelism: -1 ids (experts on another rank) contribute zero; a token whose
    every choice is elsewhere gets an exact zero row."""
    t, e, k, h, i, dtype = 6, 8, 2, 24, 16, torch.bfloat16
    x = torch.randn(t, h).to(dtype)
    w13, w2 = _experts(e, h, i, dtype)
    weights, ids = route(t, e, k)
    ids[1, 0] = -1
    ids[4] = -1
    out = _run(variant, x, w13, w2, weights, ids, device)
    close(out, ref.fused_moe(x, w13, w2, weights, ids), dtype, seed)
    assert torch.equal(out[4].cpu(), torch.zeros(h, dtype=dtype))


def test_default_dispatch_and_configs(device, seed):
    """Without overrides: batch 1 takes the decode kernels, a bigger batch the grouped ones,
    each with its real launch configuration (masks over whole tiles)."""
    from engine_triton.kernels import fused_moe as fm

    e, k, h, i, dtype = 16, 4, 48, 40, torch.bfloat16
    assert fm.use_decode(1, k, e) and not fm.use_decode(12, k, e)
    w13, w2 = _experts(e, h, i, dtype)
    for t in (1, 12):
        x = torch.randn(t, h).to(dtype)
        weights, ids = route(t, e, k)
        out = fm.fused_moe(*(a.to(device) for a in (x, w13, w2, weights, ids)))
        close(out, ref.fused_moe(x, w13, w2, weights, ids), dtype, seed)


def test_moe_align_groups_pairs_by_expert(device, seed):
    from engine_triton.kernels.fused_moe import moe_align

    t, k, e, block_m = 13, 3, 7, 4
    ids = torch.randint(0, e, (t, k), dtype=torch.int32)
    ids[2, 1] = -1  # held elsewhere: in no run
    ids[:, 0] = 5  # expert 5 in several blocks
    counts, sorted_pairs, max_m = moe_align(ids.to(device), e, block_m)
    counts, sorted_pairs = counts.cpu(), sorted_pairs.cpu()
    flat = ids.flatten()
    assert counts.tolist() == torch.bincount(flat[flat >= 0].long(), minlength=e).tolist()
    start = 0
    for expert in range(e):
        run = sorted_pairs[start : start + int(counts[expert])].tolist()
        assert sorted(run) == torch.nonzero(flat == expert).flatten().tolist(), expert
        start += -(-int(counts[expert]) // block_m) * block_m
    assert start <= max_m * block_m


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "e,k,renorm", [(8, 2, True), (60, 8, False), (128, 8, True), (5, 1, False)]
)
def test_topk_softmax_matches_reference(e, k, renorm, dtype, device, seed):
    from engine_triton.kernels.fused_moe import moe_topk_softmax

    t = 6
    # Distinct logits (multiples of 1/8: exact in bf16) so the choice is unambiguous; read
    # through a strided view, as a slice of a wider projection would be.
    wide = torch.zeros(t, e + 3, dtype=dtype)
    wide[:, :e] = (torch.stack([torch.randperm(e) for _ in range(t)]).float() / 8 - 4).to(dtype)
    logits = wide.to(device)[:, :e]
    weights, ids = moe_topk_softmax(logits, k, renorm)
    exp_w, exp_ids = ref.moe_topk_softmax(wide[:, :e], k, renorm)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids.cpu(), exp_ids), f"seed={seed}"
    torch.testing.assert_close(weights.cpu(), exp_w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["fused_moe", "fused_moe_fp8", "moe_topk_softmax"])
def test_conformance_kit_accepts_the_overrides(name):
    """The kit's own kernel check (what ``--engine-conformance=cuda`` runs on a GPU)."""
    from engine.testing.checks import check_kernel
    from engine_triton.kernels import fused_moe as fm

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for dtype in ("float32", "bfloat16"):
        check_kernel(name, getattr(fm, name), device, dtype)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without a GPU")
@pytest.mark.parametrize("quantization", [None, "fp8", "gptq-act-order"])
def test_moe_model_on_triton_interpreter_matches_torch(tmp_path, monkeypatch, quantization):
    """A tiny Qwen3-MoE through the engine with every kernel, routing and experts included, in
    the interpreter: greedy tokens equal the torch reference path's (chunked prefill, decodes
    of several requests: the decode and the grouped expert paths both run). With
    ``--quantization fp8`` the experts go through ``fused_moe_fp8`` (online per-channel FP8,
    weight-only), the dense layers through the FP8 linears; a GPTQ checkpoint (4-bit, groups
    of 32, zero points, act-order) through ``fused_moe_wna16`` and ``wna16_linear``."""
    import engine_triton.kernels as triton_kernels
    from engine import LLM, SamplingParams
    from engine.testing.tiny_models import build_tiny_model

    path = str(build_tiny_model(tmp_path / "m", "qwen3_moe", num_layers=2, num_experts=16,
                                num_experts_per_tok=4))  # fmt: skip
    experts_kernel = {None: "fused_moe", "fp8": "fused_moe_fp8"}.get(quantization)
    if quantization == "gptq-act-order":
        from engine.testing.quantized_models import write_gptq

        gptq, _ = write_gptq(path, tmp_path / "gptq", group_size=32, sym=False, desc_act=True)
        path, quantization, experts_kernel = str(gptq), None, "fused_moe_wna16"
    from engine_triton.kernels import fused_moe as fm

    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [12, 13, 14]]
    # The second request outlives the first: its last steps decode alone (batch 1).
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (2, 5)]
    calls = count_expert_paths(monkeypatch, fm)

    def generate():
        llm = LLM(path, attention_backend="torch", dtype="float32", block_size=4,
                  max_num_batched_tokens=8, platform="cpu", quantization=quantization)  # fmt: skip
        kernels = llm.llm_engine.runner.kernels
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)], (
            kernels.provider(experts_kernel)
        )

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


@pytest.mark.parametrize("fp8,wna16", [(None, None), ("block", None), (None, "w4-g128-zp")])
def test_moe_benchmark_sweep_runs(monkeypatch, capsys, fp8, wna16):
    """``python -m engine_triton.benchmark --moe-only [--moe-fp8 block | --moe-wna16 ...]``
    end to end on one tiny shape with the GPU timers stubbed (the numbers mean nothing here;
    the code path and the error check do)."""
    from engine_triton import benchmark
    from engine_triton.kernels import fused_moe as fm

    if torch.cuda.is_available():
        pytest.skip("runs for real on a GPU: python -m engine_triton.benchmark --moe-only")
    tiny = dict(experts=8, top_k=2, hidden=32, inter=16, layers=2, other_params=1000)
    monkeypatch.setattr(benchmark, "MOE_SHAPES", {"tiny": tiny})
    # Groups of 16 (the tiny experts are 16 wide), zero points kept.
    monkeypatch.setitem(benchmark.MOE_WNA16_SCHEMES, "w4-g128-zp", (4, 16, False))
    monkeypatch.setattr(benchmark, "_graph_us", lambda call, calls=1: (call(0), call(1), 2.0)[-1])
    monkeypatch.setattr(benchmark, "_copy_gbps", lambda device: 4000.0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "interpreter")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    every = benchmark._moe_candidates
    assert every(1, 8, 128)[0][0] == "decode" and every(64, 8, 128)[0][0] == "grouped"
    assert not any(v == "decode" for v, _ in every(64, 8, 128))  # 512 pairs: grouped only
    assert len(set(every(5, 2, 8))) == len(every(5, 2, 8))
    # The rule's choice and one alternative per batch: the interpreter compiles each one.
    assert every(1, 8, 128, 4)[0][1] == fm.WNA16_DECODE[4]
    # The grouped rule's row is what the dispatch runs: GGUF Q4_K gate/up with a Q6_K down
    # projection (bytes) takes the general rule, all-Q4_K the 4-bit one.
    assert benchmark._wna16_rule_bits("gguf-q4k-q6k") == 0
    assert benchmark._wna16_rule_bits("gguf-q4k") == 4
    assert every(32, 8, 128, 4, 0)[0][1] == fm.grouped_config(256, 128, 0)
    assert every(32, 8, 128, 4)[0][1] == fm.grouped_config(256, 128, 4)
    monkeypatch.setattr(
        benchmark,
        "_moe_candidates",
        lambda t, k, e, bits, rule_bits=None: every(t, k, e, bits, rule_bits)[:2],
    )
    results: dict = {}
    benchmark.sweep_moe(results, tokens=(1, 5), device="cpu", fp8=fp8, wna16=wna16)
    out = capsys.readouterr().out
    assert "tiny: 8 experts, top-2" in out and "T=1 " in out and "T=5 " in out
    assert ("fp8 experts (block scales" in out) == bool(fp8)
    assert ("integer experts (w4-g128-zp" in out) == bool(wna16)
    tag = " fp8-block" if fp8 else f" {wna16}" if wna16 else ""
    rows = results[f"moe{tag} tiny T=5"]["rows"]
    assert rows[0]["rule"] and rows[0]["config"].startswith("grouped")
    assert any(r["config"].startswith("decode") for r in rows)
    assert all("error" not in r and r["max_err"] < 0.06 for r in rows), rows


def test_decode_top_k_sum_leaves_its_counters_zeroed(device, seed):
    """The decode path's last-arriver sum re-zeroes its counters: a second launch (another
    batch, as the next layer or step would make) is right too."""
    from engine_triton.kernels import fused_moe as fm

    e, k, h, i, dtype = 8, 4, 24, 16, torch.float32
    w13, w2 = _experts(e, h, i, dtype)
    for t in (2, 1):
        x = torch.randn(t, h).to(dtype)
        weights, ids = route(t, e, k)
        out = _run("decode", x, w13, w2, weights, ids, device)
        close(out, ref.fused_moe(x, w13, w2, weights, ids), dtype, seed)
        counters = fm._SCRATCH.counters[out.device]  # cuda:0, not cuda
        assert int(counters.abs().sum()) == 0
