"""engine-triton's ``gguf_linear`` against the dequantized product (``gguf.quants.dequantize``
of random blocks of every kept type), in the interpreter on the CPU or on a GPU: the GEMV path
(one row) and the ``tl.dot`` path (several rows; split-K up to 16), with and without a bias, float32 and bf16.
Model-sized shapes and a GGUF model through the engine: tests/gpu/test_gguf_gpu.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from engine.kernels import gguf as ref  # noqa: E402
from engine.testing.tiny_gguf import RANDOM_BLOCK_TYPES, random_blocks  # noqa: E402


@pytest.mark.parametrize("name", RANDOM_BLOCK_TYPES)
@pytest.mark.parametrize("m", [1, 5, 20])  # GEMV split-K, dot split-K, dot whole K
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gguf_linear_matches_the_dequantized_product(name, m, dtype, device):
    from engine_triton.kernels.gguf_linear import gguf_linear

    n, k = 40, 512  # n not a multiple of the 64-feature tile
    t = ref.gguf_type(name)
    raw = random_blocks(n, k, name, seed=m)
    w = torch.from_numpy(dequantize(raw, GGMLQuantizationType[name]).copy())
    blocks = torch.from_numpy(raw).view(n, k // t.block_size, t.type_size).to(device)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    packed = gguf_linear.prepack(blocks, qtype=t.ggml_type, dtype=dtype)
    want = x @ w.T + bias
    got = gguf_linear(x.to(device, dtype), packed, qtype=t.ggml_type, bias=bias.to(device, dtype))
    tol = 1e-4 if dtype == torch.float32 else 0.05
    torch.testing.assert_close(got.float().cpu(), want, rtol=tol, atol=tol)
    nobias = gguf_linear(x.to(device, dtype), packed, qtype=t.ggml_type)
    torch.testing.assert_close(nobias.float().cpu(), x @ w.T, rtol=tol, atol=tol)
