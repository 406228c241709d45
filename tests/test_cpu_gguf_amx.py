"""The CPU plugin's AMX kernels for GGUF layers (``engine_cpu/csrc/gguf_amx.c``, built on first
use by ``engine_cpu.native``), against torch computations of what they must return:

* decode rows (int8 path): the product of the activations quantized per 32 values (amax / 127,
  rounded to nearest even, as the kernel does) with the dequantized weight, to float32
  summation order, for every kept type, row counts around the tile height and an output
  count that is not a multiple of 16;
* prefill rows (bf16 path): ``F.linear`` on the dequantized bf16 weight, to float32
  summation order;
* embedding rows: the reference's dequantization, bit for bit;
* a tiny Gemma 3 GGUF model: logits near the dequantized model's, in fewer bytes;
* the build: a cache directory of its own, and ``ENGINE_CPU_NATIVE=0``.

The module runs the AMX family alone (``ENGINE_CPU_NATIVE=amx``; the AVX2 kernels have
tests/test_cpu_gguf_avx2.py).

Skipped only where this machine cannot run AMX (the reason is the skip message).
"""

from __future__ import annotations

import pytest
import torch
from cpu_gguf_helpers import TYPES, gguf_blocks, quantized_activations

from engine.kernels import gguf as gk
from engine.testing.tiny_gguf import (
    MIXED_SHAPE,
    MIXED_TYPES,
    write_tiny_gemma3_gguf,
)
from engine_cpu import gguf as cpu_gguf
from engine_cpu import native

pytestmark = pytest.mark.skipif(
    native.load("amx") is None, reason=f"no AMX kernels here: {native.unavailable_reason('amx')}"
)


@pytest.fixture(autouse=True)
def amx_only(monkeypatch):
    """The AMX family alone (ENGINE_CPU_NATIVE=amx): float32 activations, which AMX leaves to
    the AVX2 kernels where those are allowed, then take the exact dense path."""
    monkeypatch.setenv("ENGINE_CPU_NATIVE", "amx")


@pytest.mark.parametrize("name", TYPES)
def test_decode_rows_multiply_int8_activations_with_the_exact_weights(name):
    n, k = 67, 512  # 67: the last 16-row tile is partly padding
    qtype = gk.gguf_type(name).ggml_type
    blocks = gguf_blocks(n, k, name, seed=11)
    packed = cpu_gguf._amx_pack(blocks, gk.gguf_type(name))  # every type: vocabularies use it
    assert packed["amx_values"].dtype == torch.int8
    w = gk.dequantize(blocks, name).double()
    gen = torch.Generator().manual_seed(12)
    for m in (1, 3, 16):
        x = torch.randn(m, k, generator=gen).bfloat16()
        want = quantized_activations(x) @ w.T
        got = cpu_gguf._amx_linear(x, packed).double()
        assert got.shape == (m, n)
        scale = float(want.abs().max())
        assert float((got - want).abs().max()) <= 2e-6 * scale, name
        out = cpu_gguf.gguf_linear(x, packed, qtype=qtype)
        assert out.dtype == torch.bfloat16 and torch.equal(out, got.float().bfloat16())


@pytest.mark.parametrize("name", TYPES)
def test_prefill_rows_equal_the_dense_bf16_product(name):
    n, k = 40, 512
    blocks = gguf_blocks(n, k, name, seed=13)
    packed = cpu_gguf._amx_pack(blocks, gk.gguf_type(name))
    w = gk.dequantize(blocks, name).bfloat16().double()
    gen = torch.Generator().manual_seed(14)
    for m in (cpu_gguf.BF16_ROWS + 1, 33, 50):  # one, two and an uneven pair of row tiles
        x = torch.randn(m, k, generator=gen).bfloat16()
        want = x.double() @ w.T
        got = cpu_gguf._amx_linear(x, packed).double()
        assert float((got - want).abs().max()) <= 1e-6 * float(want.abs().max()), (name, m)


@pytest.mark.parametrize("name", TYPES)
def test_embedding_rows_are_the_reference_rows(name):
    op = cpu_gguf.gguf_linear
    qtype = gk.gguf_type(name).ggml_type
    assert op.keeps_vocabulary(qtype, torch.bfloat16)
    assert not op.keeps_vocabulary(qtype, torch.float32) or name == "Q8_0"
    blocks = gguf_blocks(37, 256, name, seed=15)
    packed = op.prepack(blocks, qtype=qtype, dtype=torch.bfloat16, vocabulary=True)
    ids = torch.tensor([[0, 36, 5], [5, 17, 16]])
    rows = op.embedding(ids, packed, qtype=qtype, dtype=torch.bfloat16)
    assert torch.equal(rows, gk.dequantize(blocks, name).bfloat16()[ids])


@pytest.mark.parametrize("name", TYPES)
def test_every_kept_type_takes_the_amx_layout_in_bf16(name):
    qtype = gk.gguf_type(name).ggml_type
    packed = cpu_gguf.gguf_linear.prepack(
        gguf_blocks(32, 256, name, seed=18), qtype=qtype, dtype=torch.bfloat16
    )
    assert set(packed) >= {"amx_values", "amx_scales"} and "int4" not in packed


def test_float32_activations_keep_the_exact_dense_path():
    packed = cpu_gguf.gguf_linear.prepack(
        gguf_blocks(16, 256, "Q8_0", seed=16), qtype=8, dtype=torch.float32
    )
    assert "amx_values" not in packed


def test_a_bf16_model_runs_on_amx_near_the_dequantized_model(tmp_path):
    """Every layer and the tied vocabulary on the AMX layout, logits within the int8
    activations' error of the dequantized bf16 model (the same bound as the int4 path's
    test), greedy tokens equal where the logits are well separated, in half the bytes."""
    from quant_helpers import build, compare, prefill_logits

    path = write_tiny_gemma3_gguf(tmp_path / "tiny.gguf", seed=3, types=MIXED_TYPES, **MIXED_SHAPE)
    model, _ = build(path, dtype="bfloat16")
    layer = model.model.layers[0]
    names = {n for n, _ in layer.named_parameters()}
    assert any(n.endswith("_amx_values") for n in names), sorted(names)
    assert model.model.embed_tokens.vocab_method is not None
    ref, _ = build(path, quantization="none", dtype="bfloat16")
    want = prefill_logits(ref)
    compare(prefill_logits(model), want, 0.05 * float(want.abs().max()))

    def nbytes(m: torch.nn.Module) -> int:
        return sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])

    assert nbytes(model) < 0.7 * nbytes(ref)


def test_the_build_goes_to_its_cache_and_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("ENGINE_CPU_KERNEL_CACHE", str(tmp_path))
    lib = native.load("amx")
    assert lib is not None and lib.gguf_amx_available() == 1
    built = list(tmp_path.glob("engine_cpu_amx-*.so"))
    assert len(built) == 1 and not list(tmp_path.glob("*.so.tmp*"))
    monkeypatch.setenv("ENGINE_CPU_NATIVE", "0")
    assert native.load("amx") is None
    assert "ENGINE_CPU_NATIVE=0" in native.unavailable_reason("amx")
    packed = cpu_gguf.gguf_linear.prepack(
        gguf_blocks(16, 256, "Q5_0", seed=17), qtype=6, dtype=torch.bfloat16
    )
    assert "amx_values" not in packed


def test_a_failed_build_is_a_warning_with_the_compiler_output(tmp_path, monkeypatch, caplog):
    """On a machine that has AMX, a compiler that fails is said loudly (the GGUF layers then
    keep the torch packings, and the log says why)."""
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("ENGINE_CPU_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    with caplog.at_level("WARNING", logger="engine_cpu.native"):
        assert native.load("amx") is None
    assert "false -O3" in native.unavailable_reason("amx")
    assert any("compiled amx kernels are unavailable" in r.message for r in caplog.records)
    assert not list(tmp_path.iterdir())  # no half-written library left behind
