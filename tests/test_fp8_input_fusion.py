"""FP8 activations written by their producer (``engine.layers.fp8_input``), on the CPU with
the torch reference kernels and W8A8 forced on: the fused model's logits and greedy tokens
are identical to the unfused model's, the fusion is linked only where it is exact and the
consumer takes it, and a consumer that cannot take FP8 input (below the kernel's row
threshold, a LoRA wrapper) never receives it. engine-triton's kernels are checked the same way
in tests/triton_kernels/test_triton_fp8_fusion.py, and on a GPU in
tests/gpu/test_fp8_fusion_gpu.py."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
from quant_helpers import PROMPT, build, prefill_logits
from torch import nn

from engine.kernels import KernelRegistry
from engine.kernels import quantized as ref
from engine.kernels.quantized import Fp8Activation
from engine.layers import ColumnParallelLinear, GatedActivation, RMSNorm
from engine.layers.fp8_input import link_fp8_inputs, unlink_fp8_inputs
from engine.quantization.fp8 import Fp8LinearMethod
from engine.testing import quantized_models as qm
from engine.testing.tiny_models import save_tiny_model

FUSED_OPS = ("rms_norm_quant_fp8", "fused_add_rms_norm_quant_fp8", "silu_and_mul_quant_fp8")
LAYERS = 2


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return save_tiny_model(
        "llama",
        tmp_path_factory.mktemp("src"),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        initializer_range=0.1,
    )


def _count_calls(kernels, counts: Counter) -> None:
    """Wrap ``kernels``' fused ops and ``fp8_linear`` (in place) to count their calls, and
    the ``fp8_linear`` calls that were given an ``Fp8Activation``."""

    def wrap(name, fn):
        @functools.wraps(fn)  # keeps fp8_activation_min_rows
        def counted(*args, **kwargs):
            counts[name] += 1
            if isinstance(args[0], Fp8Activation):
                counts["fp8_linear given Fp8Activation"] += 1
            return fn(*args, **kwargs)

        return counted

    for name in (*FUSED_OPS, "fp8_linear"):
        setattr(kernels, name, wrap(name, getattr(kernels, name)))


def _greedy(model, steps: int = 4) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens after ``PROMPT`` (each step re-runs the prefill of the longer prompt)
    and every step's logits."""
    tokens, logits = list(PROMPT), []
    for _ in range(steps):
        step = prefill_logits(model, tokens)
        logits.append(step)
        tokens.append(int(step[-1].argmax()))
    return tokens[len(PROMPT) :], logits


def _checkpoint(kind, source, tmp_path):
    if kind == "fp8-online":
        return source, "fp8"
    if kind == "fp8-per-tensor-dynamic":
        return qm.write_fp8(source, tmp_path / "q", None)[0], None
    if kind == "fp8-per-tensor-static":
        return qm.write_fp8(source, tmp_path / "q", None, activation_scheme="static")[0], None
    assert kind == "fp8-block"
    return qm.write_fp8(source, tmp_path / "q", None, block=(32, 32))[0], None


def _bit_identical(path, quantization, pairs_per_layer: int = 3):
    """Build ``path`` on the reference kernels with W8A8 forced: all declared pairs link, and
    the fused model's logits and greedy tokens equal the unfused model's; the fused ops ran,
    each linked linear was given FP8 input once per forward, and none of that once unlinked."""
    kernels = KernelRegistry().resolve("cpu")  # references: fused and plain from one provider
    counts: Counter = Counter()
    _count_calls(kernels, counts)
    model, _ = build(path, quantization, dtype="bfloat16", activation_quant=True, kernels=kernels)
    links = link_fp8_inputs(model)
    assert len(links) == pairs_per_layer * LAYERS, links
    assert all(not r for r in links.values()), links

    fused_tokens, fused_logits = _greedy(model)
    steps = len(fused_logits)
    assert counts["fp8_linear given Fp8Activation"] == len(links) * steps
    assert counts["rms_norm_quant_fp8"] == steps  # the first layer's norm has no residual
    assert counts["fused_add_rms_norm_quant_fp8"] == (2 * LAYERS - 1) * steps
    assert counts["silu_and_mul_quant_fp8"] == LAYERS * steps

    unlink_fp8_inputs(model)
    counts.clear()
    plain_tokens, plain_logits = _greedy(model)
    assert not any(counts[name] for name in FUSED_OPS)
    assert counts["fp8_linear given Fp8Activation"] == 0
    assert fused_tokens == plain_tokens
    for fused, plain in zip(fused_logits, plain_logits, strict=True):
        assert torch.equal(fused, plain), float((fused - plain).abs().max())


@pytest.mark.parametrize("kind", ["fp8-online", "fp8-per-tensor-dynamic"])
def test_fused_model_is_bit_identical_to_the_unfused_one(kind, source, tmp_path):
    """Every norm and SiLU-and-mul of the Llama decoder writes FP8 for its linear (three per
    layer): the same logits to the bit, the same greedy tokens."""
    path, quantization = _checkpoint(kind, source, tmp_path)
    _bit_identical(path, quantization)


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "qwen3", "phi3"])
def test_llama_family_models_are_bit_identical_fused(arch, tmp_path):
    """The models that reuse the Llama decoder (q/k/v bias, q/k norm, Phi-3's fused
    checkpoint tensors), with online FP8."""
    from engine.testing.tiny_models import build_tiny_model

    path = build_tiny_model(tmp_path, arch, num_layers=LAYERS)
    _bit_identical(path, "fp8")


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])
def test_moe_models_fuse_their_attention_and_dense_layers(arch, tmp_path):
    """The MoE decoder links its input norm to ``qkv_proj`` on every layer, and on a dense
    layer (``mlp_only_layers``) the post-attention norm and the SiLU as in Llama (and Qwen2-MoE's
    shared expert its SiLU); the sparse
    blocks' input (router and FP8 experts, weight-only) stays bf16. Logits and greedy tokens
    equal the unfused model's to the bit."""
    from engine.testing.tiny_models import build_tiny_model

    path = build_tiny_model(tmp_path, arch, num_layers=LAYERS, mlp_only_layers=[1])
    kernels = KernelRegistry().resolve("cpu")
    counts: Counter = Counter()
    _count_calls(kernels, counts)
    model, _ = build(path, "fp8", dtype="bfloat16", activation_quant=True, kernels=kernels)
    links = link_fp8_inputs(model)
    assert all(not r for r in links.values()), links
    expected = [
        "model.layers.0.input_layernorm -> model.layers.0.self_attn.qkv_proj",
        "model.layers.1.input_layernorm -> model.layers.1.self_attn.qkv_proj",
        "model.layers.1.mlp.act_fn -> model.layers.1.mlp.down_proj",
        "model.layers.1.post_attention_layernorm -> model.layers.1.mlp.gate_up_proj",
    ]
    if arch == "qwen2_moe":  # the shared expert is a gated MLP of its own
        expected.append("model.layers.0.mlp.shared_expert.act_fn -> "
                        "model.layers.0.mlp.shared_expert.down_proj")  # fmt: skip
    assert sorted(links) == sorted(expected)
    fused_tokens, fused_logits = _greedy(model)
    assert counts["fp8_linear given Fp8Activation"] == len(links) * len(fused_logits)
    unlink_fp8_inputs(model)
    counts.clear()
    plain_tokens, plain_logits = _greedy(model)
    assert counts["fp8_linear given Fp8Activation"] == 0
    assert fused_tokens == plain_tokens
    for fused, plain in zip(fused_logits, plain_logits, strict=True):
        assert torch.equal(fused, plain), float((fused - plain).abs().max())


@pytest.mark.parametrize(
    "kind,activation_quant,platform_kernels,why",
    [
        ("fp8-online", None, True, "takes no FP8 input"),  # the CPU: weight-only
        ("fp8-online", True, True, "comes from"),  # engine-cpu's ops, reference fused
        ("fp8-per-tensor-static", True, False, "takes no FP8 input"),
        ("fp8-block", True, False, "takes no FP8 input"),
    ],
)
def test_not_linked_where_inexact_or_not_taken(
    kind, activation_quant, platform_kernels, why, source, tmp_path
):
    """Weight-only FP8, static input scales, block-wise FP8, and fused ops from another
    provider than the plain ones stay unfused, with the reason; no linear gets FP8 input."""
    path, quantization = _checkpoint(kind, source, tmp_path)
    kernels = None if platform_kernels else KernelRegistry().resolve("cpu")
    model, _ = build(
        path, quantization, dtype="bfloat16", activation_quant=activation_quant, kernels=kernels
    )
    links = link_fp8_inputs(model)
    assert links and all(any(why in r for r in reasons) for reasons in links.values()), links
    kernels = model.model.layers[0].input_layernorm.kernels
    counts: Counter = Counter()
    _count_calls(kernels, counts)
    prefill_logits(model)
    assert counts["fp8_linear given Fp8Activation"] == 0
    assert not any(counts[name] for name in FUSED_OPS)


# ---- one norm feeding one linear -------------------------------------------------------------
class _NormThenLinear(nn.Module):
    fp8_input_producers = (("norm", "proj"), ("act", "down"))

    def __init__(self, kernels) -> None:
        super().__init__()
        dtype = torch.bfloat16
        self.norm = RMSNorm(64, 1e-6, kernels, dtype)
        self.proj = ColumnParallelLinear(
            64,
            96,
            bias=True,
            kernels=kernels,
            dtype=dtype,
            quant_method=Fp8LinearMethod(serialized=False),
        )
        self.act = GatedActivation("silu", kernels)
        self.down = ColumnParallelLinear(
            48, 32, kernels=kernels, dtype=dtype, quant_method=Fp8LinearMethod(serialized=False)
        )
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            self.norm.weight.copy_(1 + 0.1 * torch.randn(64, generator=gen))
            for layer in (self.proj, self.down):
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) * 0.05)
                if layer.bias is not None:
                    layer.bias.copy_(torch.randn(layer.bias.shape, generator=gen))
                layer.process_weights_after_loading()

    def forward(self, x, residual):
        h, residual = self.norm(x, residual)
        return self.down(self.act(self.proj(h))), residual


def _kernels_from(min_rows: int):
    """Reference kernels whose fp8_linear takes FP8 input from ``min_rows`` rows only (as
    engine-triton's does from 17)."""
    registry = KernelRegistry()

    def fp8_linear(*args, **kwargs):
        return ref.fp8_linear(*args, **kwargs)

    fp8_linear.fp8_activation_min_rows = min_rows
    registry.register("fp8_linear", fp8_linear, provider="test")
    return registry.resolve("cpu")


@pytest.mark.parametrize("rows", [0, 5, 16, 17, 33])
def test_fp8_input_only_from_the_kernels_row_threshold(rows):
    kernels = _kernels_from(17)
    block = _NormThenLinear(kernels)
    assert all(not r for r in link_fp8_inputs(block).values())
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
    residual = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
    normed, _ = block.norm(x, residual)
    assert isinstance(normed, Fp8Activation) == (rows >= 17)
    if rows >= 17:
        assert normed.data.dtype == torch.float8_e4m3fn and normed.scale.shape == (rows, 1)
        assert normed.shape == x.shape and normed.dtype == torch.bfloat16
    fused = block(x, residual)
    unlink_fp8_inputs(block)
    plain = block(x, residual)
    assert torch.equal(fused[0], plain[0]) and torch.equal(fused[1], plain[1])


def test_a_lora_wrapped_consumer_is_never_given_fp8_input():
    """A method swapped in after linking (LoRA wraps the linears after loading) answers for
    itself: the LoRA wrapper takes no FP8 input, so the norm goes back to bf16."""
    from engine.lora.layers import LoRALinearMethod

    kernels = KernelRegistry().resolve("cpu")
    block = _NormThenLinear(kernels)
    assert all(not r for r in link_fp8_inputs(block).values())
    x = torch.randn(20, 64).to(torch.bfloat16)
    assert isinstance(block.norm(x, x.clone())[0], Fp8Activation)

    class NoAdapters:
        active = False

    block.proj.quant_method = LoRALinearMethod(
        block.proj.quant_method, block.proj, NoAdapters(), kernels
    )
    normed, _ = block.norm(x, x.clone())
    assert isinstance(normed, torch.Tensor)
    assert isinstance(block.act(torch.randn(20, 96).to(torch.bfloat16)), Fp8Activation)
    block(x, x.clone())  # runs: the wrapper's own arithmetic gets a tensor


def test_gelu_has_no_fp8_form():
    kernels = KernelRegistry().resolve("cpu")
    assert GatedActivation("gelu_pytorch_tanh", kernels).fp8_fusion_reasons()
    assert not GatedActivation("silu", kernels).fp8_fusion_reasons()
