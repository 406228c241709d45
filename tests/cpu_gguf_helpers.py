"""Helpers shared by the tests of engine-cpu's compiled GGUF kernels (test_cpu_gguf_amx.py,
test_cpu_gguf_avx2.py)."""

from __future__ import annotations

import torch

from engine.kernels import gguf as gk
from engine.testing.tiny_gguf import random_blocks

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


def gguf_blocks(rows: int, cols: int, name: str, seed: int) -> torch.Tensor:
    """Random valid raw blocks ``uint8 [rows, cols / block_size, type_size]`` of type ``name``."""
    t = gk.gguf_type(name)
    raw = random_blocks(rows, cols, name, seed)
    return torch.from_numpy(raw).view(rows, cols // t.block_size, t.type_size)


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the kernels read it: per 32 values d = amax / 127 and q = round(x * 127 /
    amax) (nearest even), returned dequantized (float64 d * q)."""
    m, k = x.shape
    blocks = x.float().view(m, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    # A float32 division of two tensors, as the kernels' 127.0f / amax (torch turns a Python
    # scalar over a tensor into reciprocal-then-multiply, which rounds differently).
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv).clamp(-127, 127)
    return (q.double() * (amax / 127.0).double()).view(m, k)
