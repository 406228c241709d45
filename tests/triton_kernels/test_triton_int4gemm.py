"""The W4A16 GEMM over torch's int4 tiles (``engine_triton/kernels/int4gemm.py``) against a
float32 product with the dequantized weight, built here in torch from the layout's description
(``int4pack.unpack_reference`` of the packed words and the bf16 ``scale_zero``), not by the
Triton dequantization kernel. Interpreter on the CPU (small shapes, configurations pinned so
that split-K, partial blocks and every scale path run), the GPU where there is one; the tests
marked ``gpu`` run only there, at the Llama-3.1-8B projections.

Tolerance (``_check``): the kernel accumulates in float32 and rounds once to bf16, as the
reference does (``kernel_tolerance.close``: one bf16 rounding); its weights are the layout's
bf16 values ``(q - 8) * scale + zero``, which the GPU's fused bf16 multiply-add rounds once
and the interpreter's separate multiply and add twice, so each weight may be up to half a bf16
ulp of the product plus half an ulp of the sum away: that, times ``|x|``, summed over K, is
added to each output's allowance (worst case, all of one sign).
"""

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


def _dense(packed, n: int, k: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 ``[N, K]`` weight the layer stands for: the fields unpacked by the layout's
    description, ``(q - 8) * scale + zero`` with the bf16 scale and zero, rounded to bf16;
    and how far a kernel's bf16 arithmetic may honestly put each weight from it: half a bf16
    ulp (2^-8 relative) of the product ``(q - 8) * scale`` and of the sum, which the GPU's
    fused multiply-add rounds once and the interpreter twice."""
    from engine_triton.kernels.int4pack import unpack_reference

    q = unpack_reference(packed["int4pack"].cpu(), n, k).float()
    sz = packed["scale_zero"].float().cpu()  # [K / group, N, 2]
    s = sz[..., 0].t().repeat_interleave(group, 1)
    z = sz[..., 1].t().repeat_interleave(group, 1)
    w = ((q - 8) * s + z).to(torch.bfloat16).float()
    return w, 2.0**-8 * (((q - 8) * s).abs() + w.abs())


def _check(y, x, packed, n, k, group, seed, perm=None, bias=None) -> None:
    """``y`` within one bf16 rounding of ``x @ W^T (+ bias)`` plus, per output, the sum over
    its inputs of ``|x|`` times the weights' rounding allowance (``_dense``): errors of the
    GEMM's own (a wrong field, input or group) are of the size of the output itself."""
    xf = x.float().cpu()
    if perm is not None:
        xf = xf[:, perm.long().cpu()]
    w, w_err = _dense(packed, n, k, group)
    expected = xf @ w.t()
    if bias is not None:
        expected += bias.float().cpu()
    close(y, expected, torch.bfloat16, seed, slack=xf.abs() @ w_err.t())


def _pin(monkeypatch, config):
    from engine_triton.kernels import int4gemm

    cfg = int4gemm.GemmConfig(*config)
    monkeypatch.setattr(int4gemm, "_gemm_config", lambda *a: cfg)


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


# (m, n, k, group, (block_n, block_m, block_kw, split_k, num_warps, num_stages)): the rows the
# GEMM serves (17 to 256), N cut by the output block, every group size (per K block: 128, 256;
# per word column: 32, 64), K split evenly, unevenly and with an empty range (K = 640, five
# blocks of 128 over four ranges of two), several row blocks with a partial last one, K blocks
# of half a super-tile (block_kw 8: the general addressing), and one longer than K allows
# (block_kw 32 at K = 384: halved to 16).
CASES = [
    (17, 40, 256, 128, (16, 32, 16, 1, 4, 2)),
    (31, 24, 384, 64, (32, 32, 16, 2, 4, 2)),
    (64, 64, 512, 32, (32, 64, 16, 4, 4, 2)),
    (100, 48, 256, 256, (16, 128, 8, 2, 4, 2)),
    (100, 40, 640, 128, (16, 32, 16, 4, 4, 2)),
    (256, 32, 256, 128, (32, 256, 16, 2, 4, 2)),
    (33, 56, 384, 128, (16, 64, 32, 1, 4, 2)),
    (20, 16, 256, 32, (16, 16, 8, 2, 4, 2)),
]


@pytest.mark.parametrize(("m", "n", "k", "group", "config"), CASES)
def test_gemm_matches_the_dequantized_product(m, n, k, group, config, device, seed, monkeypatch):
    """Within one bf16 rounding of x @ W^T with the layout's weight, for every case above;
    a second call gives the same bits (the split-K counters were put back, the partials are
    summed in a fixed order)."""
    from engine_triton.kernels import int4gemm

    _pin(monkeypatch, config)
    packed = _layer(n, k, group, device)
    x = torch.randn(m, k).to(torch.bfloat16).to(device)
    y = int4gemm.gemm(x, packed["int4pack"], packed["scale_zero"], group)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    _check(y, x, packed, n, k, group, seed)
    again = int4gemm.gemm(x, packed["int4pack"], packed["scale_zero"], group)
    assert torch.equal(again, y), f"seed={seed}"


@pytest.mark.parametrize("split", [1, 3])
def test_bias_and_act_order(split, device, seed, monkeypatch):
    """An act-order permutation composes with the gathering into the fields' order; the bias
    is added in float32 before the one rounding, by the program that stores y (split or not)."""
    from engine_triton.kernels import int4gemm

    _pin(monkeypatch, (32, 64, 16, split, 4, 2))
    m, n, k, group = 33, 48, 384, 64
    packed = _layer(n, k, group, device)
    perm = torch.randperm(k).to(torch.int32).to(device)
    x = torch.randn(m, k).to(torch.bfloat16).to(device)
    bias = torch.randn(n).to(torch.bfloat16).to(device)
    y = int4gemm.gemm(x, packed["int4pack"], packed["scale_zero"], group, perm, bias)
    _check(y, x, packed, n, k, group, seed, perm, bias)


def test_a_row_does_not_depend_on_the_other_rows(device, seed, monkeypatch):
    """At a given row count and configuration, row r's output is a function of row r alone
    (bit for bit, K split included): changing every other row changes nothing in it. Across
    row counts it is not guaranteed: the configuration (K order, split) depends on M."""
    from engine_triton.kernels import int4gemm

    _pin(monkeypatch, (32, 32, 16, 2, 4, 2))
    m, n, k, group = 40, 32, 256, 128
    packed = _layer(n, k, group, device)
    x = torch.randn(m, k).to(torch.bfloat16).to(device)
    other = torch.randn(m, k).to(torch.bfloat16).to(device)
    keep = torch.zeros(m, dtype=torch.bool, device=device)
    keep[[0, 17, 39]] = True
    y = int4gemm.gemm(x, packed["int4pack"], packed["scale_zero"], group)
    y2 = int4gemm.gemm(torch.where(keep[:, None], x, other), packed["int4pack"],
                       packed["scale_zero"], group)  # fmt: skip
    assert torch.equal(y[keep], y2[keep]), f"seed={seed}"
    assert not torch.equal(y[~keep], y2[~keep])


def test_linear_takes_the_gemm_only_between_its_rows(device, seed, monkeypatch):
    """``int4pack.linear``: with ``GEMM_MAX_ROWS`` 0 nothing reaches the GEMM; set, it serves MAX_ROWS < M <= GEMM_MAX_ROWS, with bias and act order (through
    ``linear``'s own arguments), and the result is the dense path's up to rounding; one row
    more goes back to the dense path."""
    from engine_triton.kernels import int4gemm, int4pack

    monkeypatch.setattr(int4pack, "GEMM_MAX_ROWS", 0)
    n, k, group, m = 32, 256, 128, int4pack.MAX_ROWS + 1
    packed = _layer(n, k, group, device)
    perm = torch.randperm(k).to(torch.int32).to(device)
    x = torch.randn(m + 1, k).to(torch.bfloat16).to(device)
    bias = torch.randn(n).to(torch.bfloat16).to(device)
    calls = []
    real = int4gemm.gemm
    monkeypatch.setattr(int4gemm, "gemm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    dense = int4pack.linear(x[:m], packed, group, bias, perm)
    assert calls == []
    monkeypatch.setattr(int4pack, "GEMM_MAX_ROWS", m)
    _pin(monkeypatch, (32, 32, 16, 2, 4, 2))
    y = int4pack.linear(x[:m], packed, group, bias, perm)
    assert calls == [1]
    _check(y, x[:m], packed, n, k, group, seed, perm, bias)
    close(y, dense, torch.bfloat16, seed)
    int4pack.linear(x, packed, group, bias, perm)  # M = GEMM_MAX_ROWS + 1
    assert calls == [1]


def test_configurations_are_valid_and_the_table_wins():
    """The rule of thumb at the 8B shapes and every row count the GEMM may serve: power-of-two
    row blocks of at most 128 covering M where they can, K blocks dividing K, a split that
    leaves each range a K block; a ``TUNED`` entry replaces it up to its swept row count."""
    from engine_triton.kernels import int4gemm

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(int4gemm, "TUNED", {})
        for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]:
            for m in (17, 33, 64, 100, 256, 512):
                c = int4gemm._gemm_config(m, n, k, 132)
                assert c.block_m in (16, 32, 64, 128) and c.block_m >= min(m, 128)
                assert k % (8 * c.block_kw) == 0 and 1 <= c.split_k <= k // (8 * c.block_kw)
    for (bucket, n, k), c in int4gemm.TUNED.items():  # the sweep's entries are launchable
        assert bucket > 16 and c.block_m in (16, 32, 64, 128, 256)  # above tinygemm's rows
        assert k % (8 * c.block_kw) == 0 and 1 <= c.split_k <= k // (8 * c.block_kw)
        assert int4gemm._gemm_config(bucket, n, k, 132) == c
    tuned = int4gemm.GemmConfig(64, 128, 16, 2, 4, 3)
    table = {(128, 4096, 4096): tuned}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(int4gemm, "TUNED", table)
        assert int4gemm._gemm_config(100, 4096, 4096, 132) == tuned
        assert int4gemm._gemm_config(64, 4096, 4096, 132) == tuned  # the smallest that covers
        assert int4gemm._gemm_config(129, 4096, 4096, 132) != tuned  # past it: rule of thumb
        # A row count between the powers of two serves the rows up to it; the next one above.
        between = int4gemm.GemmConfig(128, 128, 16, 1, 8, 3)
        mp.setitem(table, (192, 4096, 4096), between)
        assert int4gemm._gemm_config(150, 4096, 4096, 132) == between
        assert int4gemm._gemm_config(128, 4096, 4096, 132) == tuned


def _power_of_two_bucket(m: int) -> int:
    """The power of two from 32 that covers ``m`` (the lookup's buckets until 2026-12-07)."""
    bucket = 32
    while bucket < m:
        bucket *= 2
    return bucket


def test_tuned_lookup_serves_every_row_count_as_the_power_of_two_buckets_did():
    """With the table as swept (row counts 32-512, powers of two), every row count the GEMM
    serves gets the configuration of its power-of-two bucket, the lookup before row counts
    between them were allowed; the kernels' launches are unchanged."""
    from engine_triton.kernels import int4gemm

    shapes = {(n, k) for (_, n, k) in int4gemm.TUNED}
    for n, k in shapes:
        for m in range(17, 513):
            want = int4gemm.TUNED.get((_power_of_two_bucket(m), n, k))
            assert int4gemm.tuned_config(m, n, k) == want, (m, n, k)


def test_supported_shapes():
    from engine_triton.kernels.int4gemm import supported

    assert supported(4096, 128) and supported(14336, 32) and supported(128, 256)
    assert not supported(4160, 64)  # K not a multiple of 128
    assert not supported(4096, 16)  # groups shorter than a word's 32 inputs
    assert not supported(4096, 96)  # not a power of two


@pytest.mark.gpu
@pytest.mark.parametrize("m", [17, 64, 256, 512])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_gemm_at_8b_sizes(n, k, m, seed, monkeypatch):
    """On the GPU, at the Llama-3.1-8B projections, groups of 128 (AWQ), torch's own packing,
    the default configuration: the PTX unpacking (which the interpreter cannot run) gives the
    same bits as the plain Triton one, and both are within a bf16 rounding of the product."""
    from engine_triton.kernels import int4gemm, int4pack

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    group = 128
    q = torch.randint(0, 16, (n, k), device="cuda", dtype=torch.uint8)
    s = torch.rand(n, k // group, device="cuda") * 0.01 + 0.001
    z = torch.randint(0, 16, (n, k // group), device="cuda", dtype=torch.uint8)
    packed = int4pack.pack(q, s, z, group)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = int4gemm.gemm(x, packed["int4pack"], packed["scale_zero"], group)
    monkeypatch.setattr(int4gemm, "UNPACK_ASM", False)
    plain = int4gemm.gemm(x, packed["int4pack"], packed["scale_zero"], group)
    assert torch.equal(y, plain), f"seed={seed}: PTX and Triton unpacking differ"
    want = x.float() @ int4pack.dequantize(packed, n, group).float().t()
    close(y, want, torch.bfloat16, seed)


def _candidates() -> list:
    from engine_triton.int4gemm_sweep import CANDIDATES

    return CANDIDATES


@pytest.mark.gpu
@pytest.mark.parametrize("cand", _candidates())
def test_every_sweep_candidate_runs(cand, seed):
    """On the GPU, each configuration the sweep may time (``int4gemm_sweep.CANDIDATES``
    resolved at 64 and 256 rows) compiles, fits the SM and is right, on one small 8B-like
    layer, so the sweep's budget is not spent discovering a broken candidate."""
    from engine_triton import int4gemm_sweep
    from engine_triton.kernels import int4gemm, int4pack

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    n, k, group = 1024, 4096, 128
    q = torch.randint(0, 16, (n, k), device="cuda", dtype=torch.uint8)
    s = torch.rand(n, k // group, device="cuda") * 0.01 + 0.001
    z = torch.randint(0, 16, (n, k // group), device="cuda", dtype=torch.uint8)
    packed = int4pack.pack(q, s, z, group)
    w = int4pack.dequantize(packed, n, group).float()
    sms = int4gemm._sm_count(torch.device("cuda"))
    for m in (64, 256):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        cfg = int4gemm_sweep.resolve(cand, m, n, k, sms)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(int4gemm, "_gemm_config", lambda *a, c=cfg: c)
            y = int4gemm.gemm(x, packed["int4pack"], packed["scale_zero"], group)
        close(y, x.float() @ w.t(), torch.bfloat16, f"{seed} {cfg} M={m}")


def test_benchmark_sweep_dry_run(tmp_path, monkeypatch, capsys):
    """``quant_benchmark --int4-gemm-sweep --device cpu``: the sweep's code path (compiling
    in worker processes, layers, the dense and tinygemm references, the default and a split-K
    candidate, the table, the suggested table entries, the JSON) in the interpreter on its tiny
    shapes, so the GPU run does not meet it for the first time."""
    import json

    from engine_triton import int4gemm_sweep, quant_benchmark

    if torch.cuda.is_available():
        pytest.skip("the dry run is the interpreter's; a GPU runs the real sweep")
    monkeypatch.setattr(int4gemm_sweep, "CANDIDATES", [(32, 32, 16, 2, 4, 2)])
    out = tmp_path / "sweep.json"
    argv = ["--int4-gemm-sweep", "--device", "cpu", "--rows", "17", "--json", str(out)]
    argv += ["--compile-workers", "2"]  # the GPU run compiles in 12 spawned processes first
    assert quant_benchmark.main(argv) == 0
    printed = capsys.readouterr().out
    assert "kernels compiled in 2 processes" in printed
    assert "TUNED[(17, " in printed and "GEMM_MAX_ROWS" in printed  # keyed by the rows swept
    result = json.loads(out.read_text())["int4_gemm"]
    assert set(result) == set(int4gemm_sweep.CPU_SHAPES)
    for by_m in result.values():
        entry = by_m["17"]
        assert entry["dense"] > 0 and entry["bf16"] > 0 and "tinygemm" in entry
        (cand,) = entry["candidates"]
        assert cand["config"][3] == 2  # K split in two
        for run in (entry["default"], entry["default_no_asm"], cand):
            assert "error" not in run and run["us"] > 0
            assert run["max_abs_err"] < 0.1  # bf16 outputs of |y| up to ~5: a rounding or two
