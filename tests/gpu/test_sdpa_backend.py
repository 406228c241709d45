"""The ``sdpa`` fall-back backend (engine-llm-cuda) against the float64 paged oracle.

It runs on the CPU as well, so these tests run everywhere; on a GPU they run there too.
"""

from __future__ import annotations

import pytest
import torch
from paged_reference import TOLERANCE, make_batch, reference_attention, rel_error

from engine.attention_backends.interface import BatchLayout

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype,window,cap",
    [(torch.float32, None, None), (torch.bfloat16, 5, None), (torch.float32, 7, 3.0)],
)
def test_sdpa_mixed_batch(dtype, window, cap, device, seed):
    from engine_cuda.sdpa_backend import SdpaAttentionBackend

    batch = make_batch([1, 1, 6, 3], [10, 3, 6, 11], 4, 2, 16, 4, dtype, device)
    layout = BatchLayout(batch.query_lens, batch.seq_lens, batch.block_tables,
                         batch.slot_mapping, batch.block_size, batch.num_decodes)  # fmt: skip
    meta = SdpaAttentionBackend.build_metadata(layout, torch.device(device))
    backend = SdpaAttentionBackend(4, 16, 2, 0.25, sliding_window=window, logit_softcap=cap)
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, meta)
    expected = reference_attention(batch.query, batch.kv_cache, batch.query_lens,
                                   batch.seq_lens, batch.block_tables, 0.25, window, cap)  # fmt: skip
    err = rel_error(out, expected)
    assert err < TOLERANCE[dtype], f"seed={seed} rel_error={err}"


def test_flash_attn_backend_explains_when_missing():
    import importlib.util

    from engine_cuda.flash_attn_backend import FlashAttnBackend

    reasons = FlashAttnBackend.unavailable_reasons()
    if importlib.util.find_spec("flash_attn") is None:
        assert reasons == ["flash_attn is not installed"]
    else:
        assert reasons == []
