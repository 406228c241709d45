"""GGUF mixture-of-experts files (Qwen3-MoE ``qwen3moe``, Qwen2-MoE ``qwen2moe``, Mixtral as a
``llama`` with experts) written with the ``gguf`` library the way llama.cpp's converter writes
them: stacked experts quantized to Q8_0/Q4_0/Q5_0, the router, Qwen2-MoE's shared expert,
Mixtral's permuted q/k rows. The config must be the model's, the weights exactly what the
``gguf`` library dequantizes, and greedy tokens those of transformers running those weights.

On the CPU the experts stay GGUF blocks (``engine.quantization.gguf_moe``): through the exact
torch kernels the tokens are transformers'; through the compiled ones (int8 activations, as
llama.cpp) each layer is within their error of the reference computation and the model within
it of the dequantized model, in fewer bytes; split (TP=2) and placed (expert parallelism) over
two gloo processes it is one process's model. On a GPU the experts are converted for the fused
expert kernel (``fused_moe_wna16`` with float offsets), which reproduces the blocks' exact
weights (checked here through the torch reference; the Triton kernel in
tests/triton_kernels/test_triton_fused_moe_wna16.py and on the GPU); without a plugin's kernel
they are dequantized at load (said in the log). A tensor-parallel split off the blocks is
refused at build."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.benchmarks.gguf_moe_cpu import build_gguf_moe_layer
from engine.kernels import gguf as gk
from engine.layers.fused_moe import moe_layers
from engine.loader.gguf_loader import iter_weights, load_config
from engine.quantization.base import QuantizationError
from engine.quantization.gguf_moe import GGUFMoEMethod
from engine.testing.tiny_gguf import (
    TINY_MOE,
    gguf_round_trip_state_dict,
    tiny_moe_hf,
    write_tiny_moe_gguf,
)
from engine_cpu import native


@pytest.fixture(scope="module", params=list(TINY_MOE))
def moe_gguf(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    kind = request.param
    hf = tiny_moe_hf(kind)
    path = write_tiny_moe_gguf(tmp_path_factory.mktemp(kind) / f"{kind}.gguf", hf)
    reference = AutoModelForCausalLM.from_config(hf.config).eval()
    reference.load_state_dict(gguf_round_trip_state_dict(hf))
    return kind, path, reference


def test_config_is_the_models(moe_gguf):
    kind, path, reference = moe_gguf
    ours, theirs = load_config(path), reference.config
    assert ours.architectures == [type(reference).__name__]
    keys = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "num_experts_per_tok", "vocab_size"]  # fmt: skip
    if kind == "mixtral":
        keys += ["num_local_experts", "intermediate_size"]
    else:
        keys += ["num_experts", "moe_intermediate_size", "norm_topk_prob"]
    if kind == "qwen2_moe":
        keys += ["shared_expert_intermediate_size", "qkv_bias"]
    if kind == "qwen3_moe":
        keys += ["head_dim"]
    for key in keys:
        assert getattr(ours, key) == getattr(theirs, key), key


def test_weights_are_the_gguf_librarys_dequantization(moe_gguf):
    """Stacked experts come out as ``<block>.experts.{gate,up,down}_proj`` (every expert at
    once), bit-equal to the gguf library's dequantization; the rest under HF names."""
    kind, path, reference = moe_gguf
    expected = reference.state_dict()
    block = "block_sparse_moe" if kind == "mixtral" else "mlp"
    seen = set()
    for name, tensor in iter_weights(path, load_config(path), torch.float32):
        stacked = name.rsplit(".", 2)
        if ".experts." in name:
            layer = name.split(".")[2]
            assert name.startswith(f"model.layers.{layer}.{block}.experts."), name
            gate_up = expected[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
            want = {
                "gate_proj": gate_up.chunk(2, dim=1)[0],
                "up_proj": gate_up.chunk(2, dim=1)[1],
                "down_proj": expected[f"model.layers.{layer}.mlp.experts.down_proj"],
            }[stacked[-2]]
        else:
            want = expected[name.replace(f".{block}.", ".mlp.")]
        assert torch.equal(tensor, want), name
        seen.add(name)
    # Every HF tensor, the fused gate_up_proj of each layer as two (gate, up).
    assert len(seen) == len(expected) + reference.config.num_hidden_layers


def test_greedy_tokens_equal_transformers_on_the_same_weights(
    moe_gguf, tmp_path, monkeypatch, torch_cpu_kernels
):
    """Token for token, so through the exact torch kernels: the compiled CPU ones quantize
    activations to int8 (tests/test_cpu_gguf_avx2.py holds them to that)."""
    kind, path, reference = moe_gguf
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    rng = random.Random(1)
    vocab = reference.config.vocab_size
    prompts = [[rng.randrange(6, vocab) for _ in range(n)] for n in (1, 5, 19, 40)]
    llm = LLM(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=16,
              num_gpu_blocks_override=96)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        ids, expected = torch.tensor([prompt]), []
        with torch.no_grad():
            for _ in range(8):
                expected.append(int(reference(ids).logits[0, -1].argmax()))
                ids = torch.cat([ids, torch.tensor([[expected[-1]]])], dim=1)
        assert out.outputs[0].token_ids == expected, f"{kind}: prompt of {len(prompt)}"
    assert llm.llm_engine.num_used_blocks == 0
    layers = moe_layers(llm.llm_engine.runner.model)
    assert layers and all(isinstance(m.quant_method, GGUFMoEMethod) for m in layers)


def _experts_and_reference(types, seed=0, experts=6, hidden=64, inter=64):
    """A ``FusedMoE`` with ``GGUFMoEMethod`` on the CPU plugin's kernels, loaded from random
    GGUF stacks of ``types`` (gate, up, down) through the loader's stacked names, and the
    stacks dequantized (float64)."""
    layer, stacks = build_gguf_moe_layer(types, experts, hidden, inter, top_k=2, seed=seed)
    dense = {}
    for proj, raw in stacks.items():
        e, rows, _, size = raw.shape
        name = types[("gate", "up", "down").index(proj)]
        dense[proj] = gk.dequantize(raw.reshape(e * rows, -1, size), name).view(e, rows, -1)
        dense[proj] = dense[proj].double()
    return layer, dense


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q4_0", "Q5_0")])
def test_each_expert_is_its_gguf_products_with_int8_activations(types):
    """A Q4_K_M-like layer (gate and up one Q4_K product, down Q6_K) and one with three types:
    every token's output is the routed sum of int8-activation products of the exact weights
    (as the compiled kernels compute; tests/test_cpu_gguf_avx2.py holds those to 2e-6), and
    within the activations' rounding of the exact float computation."""
    from cpu_gguf_helpers import quantized_activations

    if native.load("avx2") is None:
        pytest.skip(f"no compiled GGUF kernels here: {native.unavailable_reason('avx2')}")
    hidden = 256 if "Q4_K" in types else 64  # K-quants: 256-value super-blocks
    layer, dense = _experts_and_reference(types, hidden=hidden, inter=256)
    names = {n for n, _ in layer.named_parameters()}
    assert not any(n.startswith(("w13_weight", "w2_weight")) for n in names), sorted(names)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, hidden, generator=gen)
    logits = torch.randn(7, 6, generator=gen)
    with torch.inference_mode():
        got = layer(x, logits).double()
        weights, ids = layer.select_experts(logits)
    want = torch.zeros_like(got)
    exact = torch.zeros_like(got)
    for t in range(7):
        for w, e in zip(weights[t].tolist(), ids[t].tolist(), strict=True):
            gate_up = torch.cat([dense["gate"][e], dense["up"][e]])
            for acts, out in ((quantized_activations, want), (lambda v: v.double(), exact)):
                h = acts(x[t : t + 1]) @ gate_up.T
                inter = h.shape[1] // 2
                a = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]).float()
                out[t] += w * (acts(a) @ dense["down"][e].T)[0]
    scale = float(want.abs().max())
    # The intermediate activations are re-quantized from float32 values that may differ in the
    # last bit from the float64 reference's, so an int8 step may flip: 1e-3 of the scale.
    assert float((got - want).abs().max()) <= 1e-3 * scale
    assert float((got - exact).abs().max()) <= 3e-2 * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_compiled_call_per_layer_is_the_loop_over_experts(dtype, monkeypatch):
    """The CPU plugin's ``routed_experts`` (``gguf_avx2_moe``: sorting, gathering, the three
    products, SiLU-and-mul and the weighted sum in one call) gives the bits of the torch loop
    over the same kernels, at decode and prefill sizes, with experts that get no token and a
    choice held by another rank (-1)."""
    if native.load("avx2") is None:
        pytest.skip(f"no compiled GGUF kernels here: {native.unavailable_reason('avx2')}")
    layer, _ = _experts_and_reference(("Q4_K", "Q4_K", "Q6_K"), hidden=256, inter=256)
    op = layer.kernels.gguf_linear
    calls = []
    fused = op.routed_experts
    monkeypatch.setattr(op, "routed_experts", lambda *a: calls.append(1) or fused(*a))
    gen = torch.Generator().manual_seed(4)
    for t in (1, 3, 40):
        x = torch.randn(t, 256, generator=gen).to(dtype)
        weights = torch.rand(t, 2, generator=gen)
        # Two distinct experts a token, as top-k routes
        ids = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(t)]).int()
        ids[0, 1] = -1
        with torch.inference_mode():
            got = layer.quant_method.apply(layer, x, weights, ids)
            monkeypatch.setattr(op, "routed_experts", lambda *a: None)
            want = layer.quant_method.apply(layer, x, weights, ids)
            monkeypatch.setattr(op, "routed_experts", lambda *a: calls.append(1) or fused(*a))
        assert got.dtype == dtype and torch.equal(got, want), t
    assert len(calls) == 3
    # One token given the same expert twice (top-k never does): the expert then has more
    # pairs than there are tokens, which the call takes in chunks of as many rows as tokens.
    # A chunk of one row may take other instructions than two rows together (VNNI), so close,
    # not equal.
    x = torch.randn(2, 256, generator=gen).to(dtype)
    ids = torch.tensor([[4, 4], [4, 1]], dtype=torch.int32)
    weights = torch.rand(2, 2, generator=gen)
    with torch.inference_mode():
        got = layer.quant_method.apply(layer, x, weights, ids)
        monkeypatch.setattr(op, "routed_experts", lambda *a: None)
        want = layer.quant_method.apply(layer, x, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["qwen2_moe", "mixtral"])
def test_the_model_runs_its_experts_quantized_near_the_dequantized_model(kind, tmp_path):
    """Through the compiled kernels: logits near the model dequantized at load
    (``--quantization none``), greedy tokens equal where the logits are well separated, the
    experts in under a third of the bytes.

    The router weights are scaled up 4x so that no token's expert set changes under the int8
    activations' error: where one does (a near tie in the router, as in the fixture's
    Qwen3-MoE, whose 16 experts top-4 flip even with only the dense layers kept quantized),
    that position's logits move by up to a quarter of their range, which says nothing about the
    experts' products (the layer test above holds those). 10% of the largest logit: these
    tiny models' weights are large (std 1.5 / sqrt(fan-in)), so the int8 error grows through
    them (the dense layers alone kept quantized: 1.6% on these two; with the experts
    kept too, 4% and 7%)."""
    from quant_helpers import build, compare, prefill_logits

    if native.load("avx2") is None:
        pytest.skip(f"no compiled GGUF kernels here: {native.unavailable_reason('avx2')}")
    hf = tiny_moe_hf(kind, router_scale=4.0)
    path = write_tiny_moe_gguf(tmp_path / f"{kind}.gguf", hf)
    model, _ = build(path, dtype="float32")
    layers = moe_layers(model)
    assert layers and all(isinstance(m.quant_method, GGUFMoEMethod) for m in layers)
    ref, _ = build(path, quantization="none", dtype="float32")
    assert not any(isinstance(m.quant_method, GGUFMoEMethod) for m in moe_layers(ref))
    want = prefill_logits(ref)
    compare(prefill_logits(model), want, 0.1 * float(want.abs().max()))

    def expert_bytes(m: torch.nn.Module) -> int:
        return sum(
            t.numel() * t.element_size() for layer in moe_layers(m) for t in layer.parameters()
        )

    # Q8_0 / Q4_0 / Q5_0 stacks: 4.5 to 8.5 bits a weight with their scales, against 32.
    assert expert_bytes(model) < 0.33 * expert_bytes(ref)


def test_experts_split_and_placed_over_two_ranks_match_one_process(tmp_path):
    """A Qwen3-MoE GGUF whose experts are 64 wide, at TP=2 (each rank's 32 intermediate
    features one whole Q8_0 block of the down projection's rows) and with expert parallelism
    (8 of the 16 experts per rank) on two gloo worker processes: greedy tokens equal one
    process's, logprobs within 1e-4, no KV block left in use."""
    from engine.testing.moe_parallel import assert_moe_layouts_match_one_process
    from engine.testing.tiny_gguf import MOE_TYPES

    if native.load("avx2") is None:
        pytest.skip(f"no compiled GGUF kernels here: {native.unavailable_reason('avx2')}")
    hf = tiny_moe_hf("qwen3_moe", moe_intermediate_size=64)
    # The head in F16: one process would keep a Q8_0 head quantized (int8 activations in its
    # product), two ranks cannot (GGUFVocabMethod is single-process), and that difference is
    # not the experts'. (The Q8_0 embedding kept by one process looks rows up exactly.) With an
    # F16 embedding instead, one prompt's logprobs differed by up to 1.6e-2 at TP=2: the ranks'
    # partial sums round differently in the last bits, and an int8 activation of a later
    # quantized product (Q5_0/Q8_0 attention, Q8_0 down) then lands on the other side of a
    # rounding boundary; with those products in F32 the two agreed within 2e-6 (2026-12-07).
    types = {**MOE_TYPES, "ffn_gate_exps": "Q4_0", "ffn_up_exps": "Q4_0", "ffn_down_exps": "Q8_0",
             "output": "F16"}  # fmt: skip
    path = write_tiny_moe_gguf(tmp_path / "qwen3_moe.gguf", hf, types)
    # Down: [experts, hidden 64, 32-value groups of the rank's intermediate features].
    shapes = {False: [(16, 64, 1)] * 2, True: [(8, 64, 2)] * 2}
    assert_moe_layouts_match_one_process(
        str(path), "model.layers.0.mlp.experts.w2_avx2_scales", shapes, prompt_lens=(2, 9)
    )


class _Kernels:
    """The two questions ``GGUFConfig.get_moe_method`` asks a platform's kernels."""

    def __init__(self, platform: str, fused: bool) -> None:
        self.platform, self.fused = platform, fused

    def is_reference(self, name: str) -> bool:
        return not self.fused

    def provider(self, name: str) -> str:
        return "a-plugin" if self.fused else "engine-llm (torch reference)"


def test_gguf_experts_off_the_cpu_take_the_fused_kernel_or_are_dequantized(caplog):
    """Off the CPU, ``get_moe_method`` converts the stacks for a plugin's ``fused_moe_wna16``
    and logs it once; where that op is only the torch reference, it gives the unquantized
    method (the stacks dequantized at load) and says why. On the CPU, stacks of a type
    ``gguf_linear`` does not multiply are dequantized too, named in the log."""
    from types import SimpleNamespace

    from engine.quantization.base import QuantizationSpec
    from engine.quantization.gguf import GGUFConfig

    types = {f"m.experts.{p}_proj": t for p, t in (("gate", "Q4_K"), ("up", "Q4_K"),
                                                   ("down", "Q6_K"))}  # fmt: skip
    spec = QuantizationSpec(platform="cuda", device_type="cuda")
    gpu = GGUFConfig(types)
    gpu.bind(spec)
    layer = SimpleNamespace(kernels=_Kernels("cuda", fused=True))
    with caplog.at_level("INFO", logger="engine.quantization.gguf"):
        method = gpu.get_moe_method(layer, "m.experts")
        assert isinstance(method, GGUFMoEMethod) and method.integer
        assert gpu.get_moe_method(layer, "m.experts").integer
    assert caplog.text.count("multiplied by a-plugin's fused_moe_wna16") == 1
    assert gpu.kept_modules == set(types)
    bare = GGUFConfig(types)
    bare.bind(spec)
    with caplog.at_level("INFO", logger="engine.quantization.gguf"):
        assert (
            bare.get_moe_method(SimpleNamespace(kernels=_Kernels("cuda", False)), "m.experts")
            is None
        )
    assert "no plugin provides fused_moe_wna16 on cuda" in caplog.text
    assert not bare.kept_modules
    cpu = GGUFConfig(types)
    cpu.bind(QuantizationSpec(platform="cpu", device_type="cpu"))
    method = cpu.get_moe_method(None, "m.experts")
    assert isinstance(method, GGUFMoEMethod) and not method.integer
    assert cpu.kept_modules == set(types)
    other = GGUFConfig({**types, "m.experts.down_proj": "IQ4_XS"})
    other.bind(QuantizationSpec(platform="cpu", device_type="cpu"))
    with caplog.at_level("INFO", logger="engine.quantization.gguf"):
        assert other.get_moe_method(None, "m.experts") is None
    assert "GGML type IQ4_XS is not kept quantized" in caplog.text
    with pytest.raises(QuantizationError, match="no expert stack for m.experts.up_proj"):
        GGUFConfig({"m.experts.gate_proj": "Q4_K"}).get_moe_method(None, "m.experts")


@pytest.mark.parametrize(
    "types,bits,groups,offsets",
    [
        (("Q4_K", "Q4_K", "Q6_K"), (4, 8), (32, 16), (True, False)),  # Q4_K_M's experts
        (("Q8_0", "Q4_0", "Q5_0"), (8, 8), (32, 32), (False, False)),  # gate, up: one form
        (("Q6_K", "Q4_K", "Q4_1"), (8, 4), (16, 32), (True, True)),  # up's groups split to 16
    ],
)
def test_the_gpu_form_is_the_blocks_exact_weights(types, bits, groups, offsets):
    """``integer=True`` (the GPU's form: ``fused_moe_wna16`` operands, float offsets for the
    types with a minimum, the symmetric ones shifted) run through the torch reference gives
    bit for bit ``fused_moe`` on the stacks' exact float32 weights (``gguf.quants``'
    dequantization), in the bytes the module docstring states."""
    from engine.kernels import reference as ref

    hidden = 256  # K-quants: 256-value super-blocks
    layer, stacks = build_gguf_moe_layer(types, experts=6, hidden=hidden, inter=256, top_k=2,
                                         integer=True)  # fmt: skip
    method = layer.quant_method
    assert method.bits == bits
    assert layer.w13_scales.shape == (6, 512, hidden // groups[0])
    assert layer.w2_scales.shape == (6, hidden, 256 // groups[1])
    assert layer.w13_scales.dtype == layer.w2_scales.dtype == torch.float32
    assert (hasattr(layer, "w13_offsets"), hasattr(layer, "w2_offsets")) == offsets
    dense = {}
    for proj, raw in stacks.items():
        e, rows, _, size = raw.shape
        name = types[("gate", "up", "down").index(proj)]
        dense[proj] = gk.dequantize(raw.reshape(e * rows, -1, size), name).view(e, rows, -1)
    w13 = torch.cat([dense["gate"], dense["up"]], dim=1)
    gen = torch.Generator().manual_seed(5)
    for t in (1, 9):
        x = torch.randn(t, hidden, generator=gen)
        logits = torch.randn(t, 6, generator=gen)
        with torch.inference_mode():
            weights, ids = layer.select_experts(logits)
            got = layer.quant_method.apply(layer, x, weights, ids)
        assert torch.equal(got, ref.fused_moe(x, w13, dense["down"], weights, ids)), t
    words = {4: 0.5, 8: 1.0}
    held = sum(p.numel() * p.element_size() for p in layer.parameters())
    weights_13, weights_2 = 6 * 512 * hidden, 6 * hidden * 256
    group_bytes = [4 + 4 * o for o in offsets]  # the scale, and the offset where kept
    want = weights_13 * (words[bits[0]] + group_bytes[0] / groups[0]) + weights_2 * (
        words[bits[1]] + group_bytes[1] / groups[1]
    )
    assert held == want


def test_a_tensor_parallel_split_off_the_blocks_is_refused():
    from engine.kernels import KernelRegistry
    from engine.layers.fused_moe import FusedMoE, MoEParallel

    method = GGUFMoEMethod({p: gk.gguf_type("Q4_K") for p in ("gate", "up", "down")})
    with pytest.raises(QuantizationError, match="do not start and end on a block boundary"):
        FusedMoE(8, 2, 256, 256, renormalize=True, kernels=KernelRegistry().resolve("cpu"),
                 parallel=MoEParallel(tp_rank=1, tp_size=2), communicator=object(),
                 quant_method=method, prefix="m.experts")  # fmt: skip


def test_the_benchmark_file_loads_with_its_experts_kept(tmp_path):
    """``engine.benchmarks.gguf_moe_cpu``'s synthetic Q4_K_M-typed file (here at a small
    shape) loads with every expert stack kept and decodes."""
    from engine.benchmarks.gguf_moe_cpu import write_moe_gguf

    path = write_moe_gguf(tmp_path / "moe.gguf", layers=1, experts=8, top_k=2, hidden=256,
                          moe_inter=256, heads=2, kv_heads=1, head_dim=128)  # fmt: skip
    llm = LLM(model=str(path), dtype="float32", block_size=4, num_gpu_blocks_override=32)
    layers = moe_layers(llm.llm_engine.runner.model)
    assert len(layers) == 1 and isinstance(layers[0].quant_method, GGUFMoEMethod)
    assert {t.name for t in layers[0].quant_method.types.values()} == {"Q4_K", "Q6_K"}
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [5, 9, 30]}], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.llm_engine.num_used_blocks == 0
