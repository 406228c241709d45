"""torch's int4 tile layout (``engine_triton/kernels/int4pack.py``): the packer written from the
layout's description against one written from the conversion kernel's byte arithmetic, the
inverse, and the Triton dequantization (interpreter on the CPU, or a GPU). On a GPU
tests/gpu/test_quant_gpu.py also holds torch's own converter and matmul to these."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")


def _bytewise_pack(q: torch.Tensor, inner: int) -> torch.Tensor:
    """The packing as torch's CUDA converter computes it, one word at a time: lane ``t`` of
    row tile ``nt`` reads bytes ``k0 + t % 4``, ``+ 4``, ``+ 8``, ``+ 12`` (two 16-value k
    tiles, even values in the high nibble of each byte) of row ``8 nt + t // 4`` and puts the
    four low nibbles in the top half-word, the four high nibbles in the bottom one."""
    n, k = q.shape
    b = ((q[:, 0::2].to(torch.int64) << 4) | q[:, 1::2].to(torch.int64)).tolist()
    out = torch.zeros((n // 8, k // (16 * inner), 32, inner // 2), dtype=torch.int64)
    for nt in range(n // 8):
        for ko in range(k // (16 * inner)):
            for t in range(32):
                row = b[8 * nt + t // 4]
                for tile in range(0, inner, 2):
                    base = (ko * inner + tile) * 8
                    v = [row[base + t % 4 + off] for off in (0, 4, 8, 12)]
                    word = 0
                    for i in range(4):
                        word |= (v[i] & 0xF) << (16 + 4 * i)
                        word |= (v[i] >> 4) << (4 * i)
                    out[nt, ko, t, tile // 2] = word
    return (out - ((out >> 31) << 32)).to(torch.int32)


@pytest.mark.parametrize(("n", "k", "inner"), [(8, 32, 2), (16, 128, 8), (24, 128, 4)])
def test_the_layout_description_matches_the_converters_arithmetic(n, k, inner, seed):
    from engine_triton.kernels.int4pack import pack_reference, unpack_reference

    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    words = pack_reference(q, inner)
    assert words.shape == (n // 8, k // (16 * inner), 32, inner // 2)
    assert torch.equal(words, _bytewise_pack(q, inner)), f"seed={seed}"
    assert torch.equal(unpack_reference(words, n, k), q)


def test_hand_made_word():
    """One word by hand: row 1's first 32 inputs hold k % 16, lane t = 4 (row 1, column pair
    0) packs inputs 0, 8, 16, 24 (low fields) and 1, 9, 17, 25 (high fields)."""
    from engine_triton.kernels.int4pack import pack_reference

    q = torch.zeros((8, 32), dtype=torch.uint8)
    q[1] = torch.arange(32) % 16
    word = int(pack_reference(q, 2)[0, 0, 4, 0]) & 0xFFFFFFFF
    assert [(word >> (4 * f)) & 0xF for f in range(8)] == [0, 8, 0, 8, 1, 9, 1, 9]


@pytest.mark.parametrize(
    ("n", "k", "group"), [(40, 256, 128), (64, 128, 32), (16, 192, 64), (8, 64, 64)]
)
def test_dequantize_matches_the_dense_weight(n, k, group, device, seed):
    from engine_triton.kernels import int4pack

    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scales = torch.rand(n, k // group) * 0.02 + 1e-3
    zeros = torch.randint(0, 16, (n, k // group), dtype=torch.uint8)
    packed = {key: t.to(device) for key, t in int4pack.pack(q, scales, zeros, group).items()}
    assert packed["int4pack"].shape[-1] == int4pack.inner_k_tiles(k) // 2
    # The layout's own numbers: bf16 scale and zero, (q - 8) * scale + zero.
    sz = packed["scale_zero"].float().cpu()  # [K / group, N, 2]
    s = sz[..., 0].t().repeat_interleave(group, 1)
    z = sz[..., 1].t().repeat_interleave(group, 1)
    expected = ((q.float() - 8) * s + z).to(torch.bfloat16)
    dense = int4pack.dequantize(packed, n, group)
    assert dense.dtype == torch.bfloat16 and dense.shape == (n, k)
    assert torch.equal(dense.cpu(), expected), f"seed={seed}"
    # ... which is the checkpoint's (q - z) * s up to the bf16 rounding of scale and zero.
    exact = (q.float() - zeros.float().repeat_interleave(group, 1)) * scales.repeat_interleave(
        group, 1
    )
    torch.testing.assert_close(dense.cpu().float(), exact, atol=2e-3, rtol=1e-2)


def test_more_than_max_rows_multiply_the_dequantized_weight(device, seed):
    from engine_triton.kernels import int4pack

    n, k, group, m = 24, 128, 32, int4pack.MAX_ROWS + 3
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scales = torch.rand(n, k // group) * 0.02 + 1e-3
    zeros = torch.randint(0, 16, (n, k // group), dtype=torch.uint8)
    packed = {key: t.to(device) for key, t in int4pack.pack(q, scales, zeros, group).items()}
    perm = torch.randperm(k).to(torch.int32)
    x = torch.randn(m, k).to(torch.bfloat16)
    bias = torch.randn(n).to(torch.bfloat16)
    y = int4pack.linear(x.to(device), packed, group, bias.to(device), perm.to(device))
    w = int4pack.dequantize(packed, n, group).float().cpu()
    expected = x.float()[:, perm.long()] @ w.t() + bias.float()
    torch.testing.assert_close(y.float().cpu(), expected, atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="bfloat16"):
        int4pack.linear(x.half().to(device), packed, group, None, None)


def test_only_where_torch_has_the_kernel():
    from engine_triton.kernels.int4pack import supported

    cpu = torch.device("cpu")
    assert not supported(4096, 4096, 4, 128, cpu, torch.bfloat16)  # not CUDA
    cuda = torch.device("cuda", 0)
    # Checked before any device query (none on a CPU machine):
    assert not supported(4096, 4096, 8, 128, cuda, torch.bfloat16)  # 8-bit
    assert not supported(4096, 4096, 4, 128, cuda, torch.float16)  # the kernel is bf16 only
    assert not supported(4096, 4096, 4, 48, cuda, torch.bfloat16)  # no such group size
    assert not supported(4100, 4096, 4, 128, cuda, torch.bfloat16)  # N not a multiple of 8
    assert not supported(4096, 4112, 4, 32, cuda, torch.bfloat16)  # K not a multiple of 32
