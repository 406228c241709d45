"""The CPU plugin's AVX2 kernels for GGUF layers (``engine_cpu/csrc/gguf_avx2.c``, built on first
use by ``engine_cpu.native``), against torch computations of what they must return:

* products up to ``AVX2_DENSE_ROWS`` rows: the activations quantized per 32 values (amax /
  127, rounded to nearest even, as the kernel does) times the dequantized weight, to float32
  summation order, for every kept type, float32 and bfloat16 activations, row counts around
  the kernel's tiling (one tile up to 128 rows, tiles of 128 above) and an odd output count,
  every row length of the interleaved order (groups of 8 blocks, of 4, blocks alone); above
  it (patched down to 128), the float32 product of the exact weights, tile by tile;
* the products in both instruction sets where the CPU has AVX-512 VNNI (``gguf_vnni.c``, and
  the AVX2 instructions by ``AVX2_ONLY``), each against that reference, and each row's result
  the same bits whatever rows share its batch;
* the packing: 4-bit types as two values a byte, Q8_0 signed without offsets, its scales
  float16;
* embedding rows: the reference's dequantization, bit for bit;
* a tiny Gemma 3 GGUF model in float32 (this CPU kind's default dtype): logits near the
  dequantized model's, in fewer bytes;
* ``ENGINE_CPU_NATIVE``: ``0`` turns the kernels off, a family list keeps only those.

The module runs the AVX2 family alone (``ENGINE_CPU_NATIVE=avx2``), so a CPU with AMX tests it
too. Skipped only where this machine cannot run AVX2 (the reason is the skip message).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from cpu_gguf_helpers import TYPES, gguf_blocks, quantized_activations

from engine.kernels import gguf as gk
from engine.layers.embedding import round_to_dtype
from engine.testing.tiny_gguf import MIXED_SHAPE, MIXED_TYPES, write_tiny_gemma3_gguf
from engine_cpu import gguf as cpu_gguf
from engine_cpu import native
from engine_cpu.cpuinfo import cpuinfo_field

pytestmark = pytest.mark.skipif(
    native.load("avx2") is None, reason=f"no AVX2 kernels here: {native.unavailable_reason('avx2')}"
)


@pytest.fixture(autouse=True)
def avx2_only(monkeypatch):
    monkeypatch.setenv("ENGINE_CPU_NATIVE", "avx2")


@pytest.fixture(params=["avx2", "vnni"])
def instructions(request, monkeypatch):
    """The products' instructions: the AVX2 ones (``gguf_avx2.c``) on every CPU, the AVX-512
    VNNI ones (``gguf_vnni.c``) where the library was built with them."""
    if request.param == "vnni" and not native.load("avx2").gguf_avx2_vnni():
        pytest.skip("this CPU has no AVX-512 VNNI (F, BW, VL and VNNI)")
    monkeypatch.setattr(cpu_gguf, "AVX2_ONLY", request.param == "avx2")
    return request.param


def test_the_vnni_products_are_built_where_the_cpu_has_them():
    flags = (cpuinfo_field("flags") or "").split()
    has = all(f in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"))
    assert native.load("avx2").gguf_avx2_vnni() == int(has)


@pytest.mark.parametrize("name", TYPES)
def test_products_are_int8_activations_times_the_exact_weights(name, instructions):
    # n odd: the last weight row goes alone when two are paired (16+ rows); k = 640 for the
    # 32-value block types (20 blocks: one row's eight-block scale loads end on a partial
    # eight at one activation row), 512 for the K-quants' 256-value super-blocks
    n, k = 67, 512 if name.endswith("_K") else 640
    qtype = gk.gguf_type(name).ggml_type
    blocks = gguf_blocks(n, k, name, seed=11)
    packed = cpu_gguf.gguf_linear.prepack(blocks, qtype=qtype, dtype=torch.float32)
    assert "avx2_values" in packed
    w = gk.dequantize(blocks, name).double()
    gen = torch.Generator().manual_seed(12)
    # (128 rows of 16-value groups outgrow the scratch buffer's first 64 KB; from 129 rows the
    # kernel tiles the activation rows, 300 ending on a partial tile)
    for m in (1, 2, 3, 4, 5, 15, 16, 19, 40, 128, 129, 300):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, k, generator=gen).to(dtype)
            want = quantized_activations(x) @ w.T
            got = cpu_gguf._avx2_linear(x, packed).double()
            assert got.shape == (m, n)
            scale = float(want.abs().max())
            assert float((got - want).abs().max()) <= 2e-6 * scale, (name, m, dtype)
            out = cpu_gguf.gguf_linear(x, packed, qtype=qtype)
            assert out.dtype == dtype and torch.equal(out, got.float().to(dtype))


@pytest.mark.parametrize("name", TYPES)
def test_bfloat16_results_are_the_float32_ones_rounded(name, instructions):
    """The products write bfloat16 themselves (a decode step then needs no cast between
    kernels): into a fresh tensor and into columns of a wider output, bit for bit the float32
    product's ``Tensor.to``; with a bias, float32 until the bias is added."""
    qtype = gk.gguf_type(name).ggml_type
    blocks = gguf_blocks(37, 512, name, seed=41)
    packed = cpu_gguf.gguf_linear.prepack(blocks, qtype=qtype, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(42)
    for m in (1, 4, 16):
        x = torch.randn(m, 512, generator=gen).bfloat16()
        f32 = cpu_gguf._avx2_linear(x, packed)
        want = f32.to(torch.bfloat16)
        assert torch.equal(cpu_gguf.gguf_linear(x, packed, qtype=qtype), want)
        wide = torch.zeros(m, 50, dtype=torch.bfloat16)
        cpu_gguf.gguf_linear(x, packed, qtype=qtype, out=wide[:, 5:42])
        assert torch.equal(wide[:, 5:42], want) and not wide[:, :5].any() and not wide[:, 42:].any()
        bias = torch.randn(37, generator=gen).bfloat16()
        got = cpu_gguf.gguf_linear(x, packed, qtype=qtype, bias=bias)
        assert torch.equal(got, (f32 + bias.float()).to(torch.bfloat16))


@pytest.mark.parametrize("name", TYPES)
def test_every_row_length_of_the_interleaved_order(name, monkeypatch, instructions):
    """Rows of 8-block groups, a 4-block group and blocks left in their own order (k / 32 =
    1, 3, 7, 13, 24 for the 32-value types; 8, 24, 40 for the K-quants' super-blocks): the
    products, the prefill's dequantized tiles and the lookups all read the same weights."""
    qtype = gk.gguf_type(name).ggml_type
    lengths = (256, 768, 1280) if name.endswith("_K") else (32, 96, 224, 416, 768)
    gen = torch.Generator().manual_seed(31)
    monkeypatch.setattr(cpu_gguf, "AVX2_DENSE_ROWS", 128)
    for k in lengths:
        blocks = gguf_blocks(9, k, name, seed=k)
        packed = cpu_gguf.gguf_linear.prepack(blocks, qtype=qtype, dtype=torch.float32)
        w = gk.dequantize(blocks, name)
        for m in (1, 3, 17):
            x = torch.randn(m, k, generator=gen)
            want = quantized_activations(x) @ w.double().T
            got = cpu_gguf._avx2_linear(x, packed).double()
            assert float((got - want).abs().max()) <= 2e-6 * float(want.abs().max()), (k, m)
        x = torch.randn(cpu_gguf.AVX2_DENSE_ROWS + 1, k, generator=gen)
        dense = cpu_gguf._avx2_linear(x, packed)
        assert torch.allclose(dense, x @ w.T, rtol=1e-5, atol=1e-4), k
        ids = torch.tensor([0, 8, 3])
        assert torch.equal(cpu_gguf._avx2_rows(packed, ids), w[ids]), k


@pytest.mark.parametrize("name", TYPES)
def test_a_rows_result_does_not_depend_on_its_batch(name, instructions):
    """Each activation row's products, bit for bit, at every place of batches whose sizes cross
    the register tiles (4 rows, then 2, then 1), the 128-row cache tiles and an odd output
    count (a weight row alone after the pairs): the same as alone in the AVX2 instructions; in
    VNNI, the same in every batch of 2 rows or more (one row alone runs the AVX2 instructions,
    next test)."""
    qtype = gk.gguf_type(name).ggml_type
    n, k = 37, 768 if name.endswith("_K") else 416  # K / 32 = 24 or 13: every kind of block
    blocks = gguf_blocks(n, k, name, seed=51)
    packed = cpu_gguf.gguf_linear.prepack(blocks, qtype=qtype, dtype=torch.float32)
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(52)).bfloat16()
    if instructions == "avx2":
        single = [cpu_gguf._avx2_linear(x[i : i + 1], packed) for i in range(300)]
    else:  # each row in a batch of two, beside another row
        single = [cpu_gguf._avx2_linear(x[[i, (i + 1) % 300]], packed)[:1] for i in range(300)]
    alone = torch.cat(single)
    for m in (2, 3, 5, 7, 16, 129, 300):
        assert torch.equal(cpu_gguf._avx2_linear(x[:m], packed), alone[:m]), m
    assert torch.equal(cpu_gguf._avx2_linear(x[-7:], packed), alone[-7:])


@pytest.mark.parametrize("name", TYPES)
def test_one_row_takes_the_avx2_instructions(name):
    """On a CPU with AVX-512 VNNI one activation row (a decode step at batch 1) runs the AVX2
    instructions, which read the weights faster there (docs/benchmarks.md, ninth CPU
    session): bit for bit ``AVX2_ONLY``'s result, in float32 and bfloat16 outputs; from two
    rows on, the VNNI products, whose sums run in another order."""
    if not native.load("avx2").gguf_avx2_vnni():
        pytest.skip("this CPU has no AVX-512 VNNI (F, BW, VL and VNNI)")
    qtype = gk.gguf_type(name).ggml_type
    n, k = 37, 768 if name.endswith("_K") else 416
    packed = cpu_gguf.gguf_linear.prepack(gguf_blocks(n, k, name, seed=61), qtype=qtype)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(62))
    for dtype in (torch.float32, torch.bfloat16):
        for i in range(40):
            row = x[i : i + 1]
            cpu_gguf.AVX2_ONLY = True
            try:
                want = cpu_gguf._avx2_linear(row, packed, dtype=dtype)
                pair_avx2 = cpu_gguf._avx2_linear(x[i : i + 2], packed, dtype=dtype)
            finally:
                cpu_gguf.AVX2_ONLY = False
            assert torch.equal(cpu_gguf._avx2_linear(row, packed, dtype=dtype), want), (i, dtype)
            # two rows take the VNNI products: another order of the same sums, so not the
            # AVX2 bits everywhere, but as close as float32 rounding allows
            pair = cpu_gguf._avx2_linear(x[i : i + 2], packed, dtype=dtype)
            assert torch.allclose(pair.float(), pair_avx2.float(), rtol=1e-2, atol=1e-5)
    pairs = torch.cat([cpu_gguf._avx2_linear(x[i : i + 2], packed) for i in range(0, 40, 2)])
    cpu_gguf.AVX2_ONLY = True
    try:
        pairs_avx2 = torch.cat(
            [cpu_gguf._avx2_linear(x[i : i + 2], packed) for i in range(0, 40, 2)]
        )
    finally:
        cpu_gguf.AVX2_ONLY = False
    assert not torch.equal(pairs, pairs_avx2), "two rows should have taken the VNNI products"


@pytest.mark.parametrize("name", TYPES)
def test_many_rows_are_the_float32_product_of_the_exact_weights(name, monkeypatch):
    """Above AVX2_DENSE_ROWS the product runs over tiles of the weight dequantized per call:
    F.linear on the dequantized float32 weight, to summation order; with tiles of 16 rows
    (patched) an output count of 67 needs five, the last one partial."""
    monkeypatch.setattr(cpu_gguf, "_TILE_VALUES", 16 * 512)
    monkeypatch.setattr(cpu_gguf, "_scratch", [])
    monkeypatch.setattr(cpu_gguf, "AVX2_DENSE_ROWS", 128)
    n, k = 67, 512
    qtype = gk.gguf_type(name).ggml_type
    blocks = gguf_blocks(n, k, name, seed=23)
    packed = cpu_gguf.gguf_linear.prepack(blocks, qtype=qtype, dtype=torch.float32)
    w = gk.dequantize(blocks, name).double()
    gen = torch.Generator().manual_seed(24)
    for m in (cpu_gguf.AVX2_DENSE_ROWS + 1, 300):
        x = torch.randn(m, k, generator=gen)
        want = x.double() @ w.T
        got = cpu_gguf.gguf_linear(x, packed, qtype=qtype).double()
        assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max()), (name, m)
        got = cpu_gguf.gguf_linear(x.bfloat16(), packed, qtype=qtype)
        assert got.dtype == torch.bfloat16
        want = x.bfloat16().double() @ w.T
        assert float((got.double() - want).abs().max()) <= 1e-2 * float(want.abs().max())


@pytest.mark.parametrize("name", TYPES)
def test_the_packing_holds_the_values_in_their_bits(name):
    t = gk.gguf_type(name)
    n, k = 8, 256
    packed = cpu_gguf._avx2_pack(gguf_blocks(n, k, name, seed=21), t)
    values = packed["avx2_values"]
    if t.bits == 4:
        assert values.shape == (n, k // 2)
    elif name == "Q6_K":  # 6 bits a value: a nibble plane and a 2-bit plane per 256 values
        assert values.shape == (n, k // 4 * 3)
    elif name == "Q5_K":  # 5 bits a value: a nibble plane and a 1-bit plane per 256 values
        assert values.shape == (n, k // 8 * 5)
    else:
        assert values.shape == (n, k)
    # no offsets for Q8_0 (signed values), where they are -z times the scale, and for the
    # K-quants (their mins are in the compact scales)
    kquant = name in ("Q4_K", "Q5_K", "Q6_K")
    assert ("avx2_offsets" in packed) == (
        name not in ("Q4_0", "Q5_0", "Q6_K", "Q8_0", "Q4_K", "Q5_K")
    )
    if kquant:  # a record per 256 values: float16 d (and dmin), integer sub-scales (and mins)
        assert packed["avx2_scales"].shape == (n, k // 256, 18 if name == "Q6_K" else 20)
        assert packed["avx2_scales"].dtype == torch.uint8
        assert int(packed["avx2_layout"][0]) & cpu_gguf._KSCALES
    else:
        assert packed["avx2_scales"].shape == (n, k // t.group)
        # Q8_0's scales as the file holds them (float16, exact), the others' float32
        assert packed["avx2_scales"].dtype == (torch.float16 if name == "Q8_0" else torch.float32)
        assert not int(packed["avx2_layout"][0]) & cpu_gguf._KSCALES


def _float32_scales_form(blocks: torch.Tensor, packed: dict) -> dict:
    """The same K-quant weight in the form every type had before the compact scales: float32
    scales per group (and float32 offsets for Q4_K / Q5_K), ``ref.unpack``'s, the layout word
    without its bit, and Q5_K's and Q6_K's values a byte each; the values copied (the MoE
    descriptors are cached per values tensor)."""
    word, group = packed["avx2_layout"].reshape(-1, 2)[0].tolist()
    name = "Q6_K" if group == 16 else "Q4_K" if word & 0xFF == cpu_gguf._PACK_U4 else "Q5_K"
    stacked = blocks.dim() == 4
    flat = blocks.flatten(0, 1) if stacked else blocks
    u, scale, offset = gk.unpack(flat, name)
    shape = (*blocks.shape[: 2 if stacked else 1], -1)
    values = packed["avx2_values"].clone()
    if name in ("Q5_K", "Q6_K"):  # a byte a value then, in the interleaved order
        word = word & ~0xFF | cpu_gguf._PACK_U8
        values = u[:, cpu_gguf._avx2_order(u.shape[1])].reshape(shape).contiguous()
    old = {
        "avx2_values": values,
        "avx2_scales": scale.reshape(shape).contiguous(),
        "avx2_layout": packed["avx2_layout"].clone(),
    }
    old["avx2_layout"][..., 0] = word & ~(cpu_gguf._KSCALES | 0xFF) | word & 0xFF
    if name != "Q6_K":
        old["avx2_offsets"] = offset.reshape(shape).contiguous()
    return old


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_compact_k_scales_give_the_float32_scales_bits(name, monkeypatch, instructions):
    """The K-quants' compact scales (float16 d and dmin, integer sub-scales and mins per 256
    values) against the float32 scales and offsets they replace: every product (one row, odd
    and even batches, past a 128-row cache tile; float32 and bfloat16 in and out), the
    prefill's dequantized tiles and the lookups, bit for bit."""
    t = gk.gguf_type(name)
    gen = torch.Generator().manual_seed(61)
    for n, k in ((7, 256), (37, 768), (16, 2048)):
        blocks = gguf_blocks(n, k, name, seed=n + k)
        new = cpu_gguf._avx2_pack(blocks, t)
        old = _float32_scales_form(blocks, new)
        for m in (1, 2, 3, 5, 8, 130):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(m, k, generator=gen).to(dtype)
                got = cpu_gguf._avx2_linear(x, new, dtype=dtype)
                want = cpu_gguf._avx2_linear(x, old, dtype=dtype)
                assert torch.equal(_bits(got), _bits(want)), (n, k, m, dtype)
        monkeypatch.setattr(cpu_gguf, "AVX2_DENSE_ROWS", 16)
        x = torch.randn(17, k, generator=gen)
        assert torch.equal(cpu_gguf._avx2_linear(x, new), cpu_gguf._avx2_linear(x, old))
        monkeypatch.undo()
        monkeypatch.setattr(cpu_gguf, "AVX2_ONLY", instructions == "avx2")
        ids = torch.tensor([n - 1, 0, 3, 3])
        for dtype, scale in ((torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, 2.5)):
            got = cpu_gguf._avx2_rows(new, ids, dtype, scale)
            assert torch.equal(_bits(got), _bits(cpu_gguf._avx2_rows(old, ids, dtype, scale)))
            assert torch.equal(got, gk.dequantize(blocks, name)[ids].to(dtype) * (scale or 1))


@pytest.mark.parametrize("gate_up", ["Q4_K", "Q5_K"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compact_k_scales_in_a_moe_stack(dtype, gate_up, instructions):
    """A MoE layer's stacks in one call (``gguf_avx2_moe``: descriptors with byte strides):
    Q4_K or Q5_K gate / up and Q6_K down experts with compact scales (and 5- and 6-bit
    values), bit for bit the layer with float32 scales and byte values."""
    e, h, inter, tokens, top_k = 4, 512, 256, 5, 2
    gen = torch.Generator().manual_seed(71)

    def stack(rows, cols, name, seed):
        t = gk.gguf_type(name)
        blocks = torch.stack([gguf_blocks(rows, cols, name, seed=seed + i) for i in range(e)])
        parts = [cpu_gguf._avx2_pack(b, t) for b in blocks]
        new = {key: torch.stack([p[key] for p in parts]) for key in parts[0]}
        return new, _float32_scales_form(blocks, new)

    gu_new, gu_old = stack(2 * inter, h, gate_up, 1)
    down_new, down_old = stack(h, inter, "Q6_K", 11)
    hidden = torch.randn(tokens, h, generator=gen).to(dtype)
    weights = torch.rand(tokens, top_k, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(tokens)])
    op = cpu_gguf.gguf_linear
    got = op.routed_experts(hidden, weights, ids, [gu_new], down_new)
    want = op.routed_experts(hidden, weights, ids, [gu_old], down_old)
    assert got is not None and torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("name", TYPES)
def test_embedding_rows_are_the_reference_rows(name):
    op = cpu_gguf.gguf_linear
    qtype = gk.gguf_type(name).ggml_type
    for dtype in (torch.float32, torch.bfloat16):
        assert op.keeps_vocabulary(qtype, dtype)
        blocks = gguf_blocks(37, 256, name, seed=15)
        packed = op.prepack(blocks, qtype=qtype, dtype=dtype, vocabulary=True)
        ids = torch.tensor([[0, 36, 5], [5, 17, 16]])
        rows = op.embedding(ids, packed, qtype=qtype, dtype=dtype)
        want = gk.dequantize(blocks, name).to(dtype)[ids]
        assert torch.equal(rows, want)
        # With Gemma's embedding scale folded into the lookup: the reference's multiply.
        scale = round_to_dtype(25.3, dtype)
        scaled = op.embedding(ids, packed, qtype=qtype, dtype=dtype, scale=scale)
        assert torch.equal(scaled, want * scale)


def test_a_float32_model_runs_on_avx2_near_the_dequantized_model(tmp_path):
    """Every layer and the tied vocabulary in the AVX2 layout, logits within the int8
    activations' error of the dequantized float32 model, in well under half the bytes."""
    from quant_helpers import build, compare, prefill_logits

    path = write_tiny_gemma3_gguf(tmp_path / "tiny.gguf", seed=3, types=MIXED_TYPES, **MIXED_SHAPE)
    model, _ = build(path, dtype="float32")
    layer = model.model.layers[0]
    names = {n for n, _ in layer.named_parameters()}
    assert any(n.endswith("_avx2_values") for n in names), sorted(names)
    assert model.model.embed_tokens.vocab_method is not None
    ref, _ = build(path, quantization="none", dtype="float32")
    want = prefill_logits(ref)
    compare(prefill_logits(model), want, 0.05 * float(want.abs().max()))

    def nbytes(m: torch.nn.Module) -> int:
        return sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])

    assert nbytes(model) < 0.45 * nbytes(ref)


def test_the_setting_picks_the_families(monkeypatch):
    monkeypatch.setenv("ENGINE_CPU_NATIVE", "0")
    assert native.load("avx2") is None
    assert "ENGINE_CPU_NATIVE=0" in native.unavailable_reason("avx2")
    packed = cpu_gguf.gguf_linear.prepack(gguf_blocks(16, 256, "Q5_0", seed=17), qtype=6)
    assert "avx2_values" not in packed
    monkeypatch.setenv("ENGINE_CPU_NATIVE", "amx")
    assert native.load("avx2") is None
    assert "not in ENGINE_CPU_NATIVE=amx" in native.unavailable_reason("avx2")
    monkeypatch.setenv("ENGINE_CPU_NATIVE", "avx2")
    assert native.load("amx") is None and native.load("avx2") is not None
    with pytest.raises(ValueError, match="unknown CPU kernel family 'sse'"):
        native.load("sse")


def test_the_environment_keeps_the_products_on_avx2():
    """``ENGINE_CPU_GGUF_AVX2_ONLY=1`` sets ``AVX2_ONLY`` in a fresh process (a benchmark's model
    runs in spawned ones); unset or ``0`` leaves it off."""
    code = "from engine_cpu import gguf; print(gguf.AVX2_ONLY)"
    for value, want in (("1", "True"), ("0", "False"), (None, "False")):
        env = {k: v for k, v in os.environ.items() if k != "ENGINE_CPU_GGUF_AVX2_ONLY"}
        if value is not None:
            env["ENGINE_CPU_GGUF_AVX2_ONLY"] = value
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == want, value


def test_each_family_builds_into_its_own_library(tmp_path, monkeypatch):
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("ENGINE_CPU_KERNEL_CACHE", str(tmp_path))
    lib = native.load("avx2")
    assert lib is not None and lib.gguf_avx2_available() == 1
    built = list(tmp_path.glob("engine_cpu_avx2-*.so"))
    assert len(built) == 1 and not list(tmp_path.glob("tmp*.so"))


def test_a_failed_build_is_a_warning_with_the_compiler_output(tmp_path, monkeypatch, caplog):
    """A compiler that fails is said loudly (the GGUF layers then keep the torch packings, and
    the log says why)."""
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("ENGINE_CPU_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    with caplog.at_level("WARNING", logger="engine_cpu.native"):
        assert native.load("avx2") is None
    assert "false -O3" in native.unavailable_reason("avx2")
    assert any("compiled avx2 kernels are unavailable" in r.message for r in caplog.records)
    assert not list(tmp_path.iterdir())  # no half-written library left behind
    packed = cpu_gguf.gguf_linear.prepack(gguf_blocks(16, 256, "Q5_0", seed=17), qtype=6)
    assert "avx2_values" not in packed


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_an_untied_embedding_and_head_each_stay_quantized_in_their_own_type(tmp_path, dtype):
    """A Llama-style file with an untied Q4_K embedding and Q6_K head (as Q4_K_M files ship):
    each keeps its blocks in the AVX2 layout (its own ``GGUFVocabMethod``, no dense matrix),
    the lookups are the dequantized rows exactly, the logits within the int8 activations'
    error of the model dequantized at load, in fewer bytes."""
    from quant_helpers import build, compare, prefill_logits
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.testing.tiny_gguf import tiny_vocab, write_tiny_llama_gguf

    cfg = LlamaConfig(
        vocab_size=len(tiny_vocab()[0]), hidden_size=256, intermediate_size=512,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    types = {**MIXED_TYPES, "token_embd": "Q4_K", "output": "Q6_K"}
    path = write_tiny_llama_gguf(tmp_path / "llama.gguf", LlamaForCausalLM(cfg).eval(), types)
    model, _ = build(path, dtype=dtype)
    emb, head = model.model.embed_tokens, model.lm_head
    assert emb.vocab_method is not None and head.vocab_method is not None
    assert emb.vocab_method is not head.vocab_method
    assert (emb.vocab_method.type.name, head.vocab_method.type.name) == ("Q4_K", "Q6_K")
    assert emb.weight.numel() == head.weight.numel() == 0
    ref, _ = build(path, quantization="none", dtype=dtype)
    ids = torch.tensor([2, 9, 40, 300])
    with torch.inference_mode():
        assert torch.equal(emb(ids), ref.model.embed_tokens(ids))
    want = prefill_logits(ref)
    compare(prefill_logits(model), want, 0.05 * float(want.abs().max()))

    def vocab_bytes(m: torch.nn.Module) -> int:
        return sum(
            t.numel() * t.element_size()
            for mod in (m.model.embed_tokens, m.lm_head)
            for t in mod.parameters()
        )

    assert vocab_bytes(model) < 0.75 * vocab_bytes(ref)


def test_the_kernel_timing_harness_builds_and_times_both_paths(tmp_path):
    """``python -m engine_cpu.gguf_kernel_timing`` compiles its own library from the AVX2
    family's sources; it must link (it broke once when gguf_avx2.c began calling cpu_ops.c) and
    time each path once a round."""
    from engine_cpu import gguf_kernel_timing as timing

    lib = timing._timing_library(tmp_path)
    if not lib.gguf_avx2_vnni():
        pytest.skip("the harness compares the VNNI products with the AVX2 ones")
    times = timing.time_product(lib, "Q4_K", 64, 256, rows=2, rounds=2, min_bytes=1 << 16)
    assert sorted(times) == ["avx2", "vnni"]
    # one time per copy of the weight and round, for each path
    assert len(times["vnni"]) == len(times["avx2"]) >= 2, times
    assert min(times["vnni"] + times["avx2"]) > 0, times
    # the K-quants' compact scales against the float32 ones (--forms)
    times = timing.time_product(lib, "Q6_K", 64, 512, 1, 2, 1 << 16, form="both")
    assert sorted(times) == ["compact", "float32"]
    # (one time per copy and round: the compact form is smaller, so it has more copies)
    assert len(times["compact"]) >= len(times["float32"]) >= 2, times
