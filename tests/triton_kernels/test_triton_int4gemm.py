"""The W4A16 GEMM over torch's int4 tiles (``engine_triton/kernels/int4gemm.py``) against the
dequantized reference: the words from ``int4pack.pack`` (``pack_reference`` on the CPU, torch's
converter on a GPU), the weight from ``int4pack.dequantize``, a float32 matmul. Interpreter on
the CPU (small shapes), the GPU where there is one; the last test is GPU-only, at the
Llama-3.1-8B projections."""

from __future__ import annotations

import pytest
import torch
from kernel_tolerance import close

pytest.importorskip("triton")


def _layer(n: int, k: int, group: int, device):
    from engine_triton.kernels import int4pack

    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scales = torch.rand(n, k // group) * 0.02 + 1e-3
    zeros = torch.randint(0, 16, (n, k // group), dtype=torch.uint8)
    return {key: t.to(device) for key, t in int4pack.pack(q, scales, zeros, group).items()}


def _reference(x: torch.Tensor, packed, n: int, group: int, perm=None) -> torch.Tensor:
    from engine_triton.kernels import int4pack

    w = int4pack.dequantize(packed, n, group).float().cpu()
    xf = x.float().cpu()
    if perm is not None:
        xf = xf[:, perm.long().cpu()]
    return xf @ w.t()


def test_x_order_lines_x_up_with_the_fields():
    """Nibble ``j`` of 16-bit half ``h`` of word column ``i`` of every row, unpacked in the
    kernel's loop order, is the weight of the input ``x_order`` puts at that position: the
    words of a row, as the kernel addresses them, dotted with the gathered x is the row's
    product."""
    from engine_triton.kernels.int4gemm import x_order
    from engine_triton.kernels.int4pack import pack_reference

    n, k, inner = 16, 512, 8
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    words = pack_reference(q, inner).to(torch.int64) & 0xFFFFFFFF  # [N/8, K/128, 32, 4]
    for block_kw in (8, 16, 32):
        order = x_order(k, inner, block_kw)
        assert sorted(order.tolist()) == list(range(k))
        for row in range(n):
            # Word column c of the row: super-tile c // 16, lane 4 (row % 8) + c % 16 // 4.
            row_words = words[row // 8, :, 4 * (row % 8) : 4 * (row % 8) + 4].reshape(-1)
            seen = torch.empty(k, dtype=torch.int64)
            for k0 in range(0, k, 8 * block_kw):
                cols = row_words[k0 // 8 : k0 // 8 + block_kw]
                halves = torch.stack([cols & 0xFFFF, cols >> 16], dim=1).reshape(-1)
                for j in range(4):
                    pos = k0 + j * 2 * block_kw
                    seen[pos : pos + 2 * block_kw] = (halves >> (4 * j)) & 0xF
            assert torch.equal(seen.to(torch.uint8), q[row, order])


# (block_n, block_m, block_kw, split_k): small tiles for the interpreter (block_kw 8: half a
# super-tile per K block, the general addressing); row tiles cut by
# N and M, K split evenly and unevenly (at K = 384, 3 blocks of 128: four splits leave one
# with no K block, whose zero partial still counts).
CONFIGS = [(16, 16, 16, 1), (32, 32, 16, 2), (16, 32, 32, 1), (32, 16, 16, 4), (16, 16, 8, 2)]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize(
    ("m", "n", "k", "group"),
    [(17, 40, 256, 128), (33, 64, 256, 32), (20, 24, 384, 64), (17, 32, 512, 256)],
)
def test_gemm_matches_the_dequantized_product(m, n, k, group, config, device, seed, monkeypatch):
    """Odd row counts, N not a multiple of the tile, every group size (per K block or per word
    column), split-K on and off, a K block longer than K allows: within one bf16 rounding of
    the product with the dequantized weight."""
    from engine_triton.kernels import int4gemm

    block_n, block_m, block_kw, split = config  # K = 384 with block_kw 32: halved to 16
    monkeypatch.setattr(
        int4gemm, "_gemm_config", lambda *a: (block_n, block_m, block_kw, split, 4, 2)
    )
    packed = _layer(n, k, group, device)
    x = torch.randn(m, k).to(torch.bfloat16).to(device)
    y = int4gemm.gemm(x, packed["int4pack"], packed["scale_zero"], group)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    close(y, _reference(x, packed, n, group), torch.bfloat16, seed)
    if split > 1:  # the counters were put back: a second call sums the same partials
        again = int4gemm.gemm(x, packed["int4pack"], packed["scale_zero"], group)
        assert torch.equal(again, y), f"seed={seed}"


@pytest.mark.parametrize("split", [1, 2])
def test_act_order(split, device, seed, monkeypatch):
    """An act-order permutation composes with the gathering into the fields' order."""
    from engine_triton.kernels import int4gemm

    monkeypatch.setattr(int4gemm, "_gemm_config", lambda *a: (32, 32, 16, split, 4, 2))
    m, n, k, group = 33, 48, 256, 64
    packed = _layer(n, k, group, device)
    perm = torch.randperm(k).to(torch.int32).to(device)
    x = torch.randn(m, k).to(torch.bfloat16).to(device)
    y = int4gemm.gemm(x, packed["int4pack"], packed["scale_zero"], group, perm)
    close(y, _reference(x, packed, n, group, perm), torch.bfloat16, seed)


def test_linear_takes_the_gemm_only_when_switched_on(device, seed, monkeypatch):
    """``int4pack.linear``: with ``GEMM_MAX_ROWS`` 0 (the default) nothing reaches the GEMM;
    switched on it serves rows above ``MAX_ROWS`` up to it, with bias and act order, and the
    result is the dense path's up to rounding."""
    from engine_triton.kernels import int4gemm, int4pack

    assert int4pack.GEMM_MAX_ROWS == 0
    n, k, group, m = 32, 256, 128, int4pack.MAX_ROWS + 1
    packed = _layer(n, k, group, device)
    perm = torch.randperm(k).to(torch.int32).to(device)
    x = torch.randn(m, k).to(torch.bfloat16).to(device)
    bias = torch.randn(n).to(torch.bfloat16).to(device)
    calls = []
    real = int4gemm.gemm
    monkeypatch.setattr(int4gemm, "gemm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    dense = int4pack.linear(x, packed, group, bias, perm)
    assert calls == []
    monkeypatch.setattr(int4pack, "GEMM_MAX_ROWS", m)
    monkeypatch.setattr(int4gemm, "_gemm_config", lambda *a: (32, 32, 16, 2, 4, 2))
    y = int4pack.linear(x, packed, group, bias, perm)
    assert calls == [1]
    expected = _reference(x, packed, n, group, perm) + bias.float().cpu()
    close(y, expected, torch.bfloat16, seed)
    close(y, dense, torch.bfloat16, seed)


def test_default_config_is_valid():
    """The rule-of-thumb configuration: power-of-two row blocks of 16-128, a K split that
    leaves every split at least one K block, at the 8B shapes and the rows it may serve."""
    from engine_triton.kernels.int4gemm import _gemm_config

    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]:
        for m in (17, 33, 64, 100, 256, 512):
            block_n, block_m, block_kw, split, warps, stages = _gemm_config(m, n, k, 132)
            assert block_m in (16, 32, 64, 128) and block_m >= min(m, 128)
            assert k % (8 * block_kw) == 0 and 1 <= split <= k // (8 * block_kw)


@pytest.mark.gpu
@pytest.mark.parametrize("unpack_asm", [True, False])
@pytest.mark.parametrize("m", [17, 64, 256, 512])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_gemm_at_8b_sizes(n, k, m, unpack_asm, seed, monkeypatch):
    """On the GPU, at the Llama-3.1-8B projections, groups of 128 (AWQ): torch's own packing,
    the default configuration, with the PTX unpacking (the interpreter cannot run it) and
    without, against the dequantized weight through cuBLAS."""
    from engine_triton.kernels import int4gemm, int4pack

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setattr(int4gemm, "UNPACK_ASM", unpack_asm)
    group = 128
    q = torch.randint(0, 16, (n, k), device="cuda", dtype=torch.uint8)
    s = torch.rand(n, k // group, device="cuda") * 0.01 + 0.001
    z = torch.randint(0, 16, (n, k // group), device="cuda", dtype=torch.uint8)
    packed = int4pack.pack(q, s, z, group)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = int4gemm.gemm(x, packed["int4pack"], packed["scale_zero"], group)
    want = x.float() @ int4pack.dequantize(packed, n, group).float().t()
    err = float((y.float() - want).abs().max() / want.abs().max())
    assert err < 1e-2, f"seed={seed}: {err}"


def test_benchmark_sweep_dry_run(tmp_path, monkeypatch, capsys):
    """``quant_benchmark --int4-gemm-sweep --device cpu``: the sweep's code path (compiling
    in worker processes, layers, the dense reference, the default and a split-K candidate, the
    table, the JSON) in the interpreter on its tiny shapes, so the GPU run does not meet it for
    the first time."""
    import json

    from engine_triton import quant_benchmark

    if torch.cuda.is_available():
        pytest.skip("the dry run is the interpreter's; a GPU runs the real sweep")
    monkeypatch.setattr(quant_benchmark, "INT4_GEMM_CANDIDATES", [(32, 32, 16, 2, 4, 2)])
    out = tmp_path / "sweep.json"
    argv = ["--int4-gemm-sweep", "--device", "cpu", "--rows", "17", "--json", str(out)]
    argv += ["--compile-workers", "2"]  # the GPU run compiles in 12 spawned processes first
    assert quant_benchmark.main(argv) == 0
    assert "kernels compiled in 2 processes" in capsys.readouterr().out
    result = json.loads(out.read_text())["int4_gemm"]
    assert set(result) == set(quant_benchmark.INT4_GEMM_CPU_SHAPES)
    for by_m in result.values():
        entry = by_m["17"]
        assert entry["dense"] > 0 and entry["bf16"] > 0
        (cand,) = entry["candidates"]
        assert cand["config"][3] == 2  # K split in two
        for run in (entry["default"], entry["default_no_asm"], cand):
            assert "error" not in run and run["us"] > 0
            assert run["max_abs_err"] < 0.1  # bf16 outputs of |y| up to ~5: a rounding or two
