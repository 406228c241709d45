"""``qk_norm_rotary``'s reference is exactly the ops it fuses: per-head ``rms_norm`` of q and k
(when weights are given), then ``rotary_embedding``, written in place."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import reference as ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_dim", [32, 16])  # full and partial rotary, head_size 32
@pytest.mark.parametrize("norms", ["qk", "none", "q"])
def test_qk_norm_rotary_is_norm_then_rotary(dtype, is_neox, rot_dim, norms):
    tokens, heads, kv_heads, d = 9, 6, 2, 32  # GQA
    sizes = [heads * d, kv_heads * d, kv_heads * d]
    qkv = torch.randn(tokens, sum(sizes)).to(dtype)
    original = qkv.clone()
    positions = torch.randint(0, 100, (tokens,))
    freqs = torch.outer(torch.arange(100.0), 1e4 ** -(torch.arange(0, rot_dim, 2) / rot_dim))
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    qw = (1 + 0.1 * torch.randn(d)).to(dtype) if "q" in norms else None
    kw = (1 + 0.1 * torch.randn(d)).to(dtype) if "k" in norms else None

    q, k = original[:, : sizes[0]], original[:, sizes[0] : sizes[0] + sizes[1]]
    if qw is not None:
        q = ref.rms_norm(q.unflatten(-1, (heads, d)), qw, 1e-6).view(tokens, -1)
    if kw is not None:
        k = ref.rms_norm(k.unflatten(-1, (kv_heads, d)), kw, 1e-6).view(tokens, -1)
    eq, ek = ref.rotary_embedding(positions, q, k, cache, d, is_neox)

    q_view, k_view, v_view = qkv.split(sizes, dim=-1)
    out_q, out_k = ref.qk_norm_rotary(positions, q_view, k_view, cache, d, is_neox, qw, kw, 1e-6)
    assert out_q is q_view and out_k is k_view
    assert torch.equal(q_view, eq) and torch.equal(k_view, ek)
    assert torch.equal(v_view, original[:, sizes[0] + sizes[1] :])
