"""Static shapes (engine.shape_buckets) on the CPU: padded steps give the same results, through
the torch reference and through engine-tpu's XLA backend (which also runs on CPU tensors), so
the padding the TPU platform asks for is checked in the default suite, without torch_xla."""

from __future__ import annotations

import pytest
import torch

from engine.attention_backends.torch_ref import TorchReferenceBackend
from engine.shape_buckets import ShapeBuckets, powers_of_two
from engine.testing.checks import attention_cases, check_attention_backend
from engine.testing.inputs import AttentionCase, default_plan
from engine.testing.tiny_models import build_tiny_model
from engine_cpu.platform import CpuPlatform
from engine_tpu.attention import XlaAttentionBackend, write_slots


def test_buckets() -> None:
    assert powers_of_two(16, 100) == (16, 32, 64, 128)
    b = ShapeBuckets.for_limits(100, 6, 9)
    assert b.tokens == (16, 32, 64, 128) and b.seqs == (6,) and b.blocks == (8, 16)
    assert (b.pad_tokens(1), b.pad_tokens(16), b.pad_tokens(17)) == (16, 16, 32)
    assert b.pad_seqs(3) == 6 and b.pad_blocks(9) == 16
    with pytest.raises(ValueError, match="sequences=7 is above the largest shape bucket 6"):
        b.pad_seqs(7)


@pytest.mark.parametrize("backend", [TorchReferenceBackend, XlaAttentionBackend])
def test_a_padded_layout_attends_like_the_real_one(backend) -> None:
    """Padded tokens (slot -1), padded sequences (length 0) and a wider table change nothing
    for the real tokens, and padding rows come back zero."""
    buckets = ShapeBuckets.for_limits(128, 16, 16)
    case = AttentionCase("float32")
    gen = torch.Generator().manual_seed(3)
    plan = default_plan(case.block_size, gen)
    args = (case.num_heads, case.head_size, case.num_kv_heads, case.scale)
    real, padded = backend(*args), backend(*args)
    shape = backend.kv_cache_shape(plan.num_blocks, case.block_size, 2, 64)
    cache, cache_padded = torch.zeros(shape), torch.zeros(shape)
    for layout in plan.layouts():
        t = sum(layout.query_lens)
        big = buckets.pad_layout(layout, t)
        tp = len(big.slot_mapping)
        b = buckets.pad_seqs(len(layout.query_lens))
        assert tp == buckets.pad_tokens(t) and len(big.query_lens) == b
        q, k, v = (torch.randn(tp, h, 64, generator=gen) for h in (4, 2, 2))
        want = real.forward(q[:t], k[:t], v[:t], cache, backend.build_metadata(layout, "cpu"))
        meta = backend.build_metadata(big, "cpu")
        width = buckets.pad_blocks(max(len(x) for x in layout.block_tables))
        assert tuple(meta.block_table.shape) == (b, width)
        got = padded.forward(q, k, v, cache_padded, meta)
        torch.testing.assert_close(got[:t], want)
        assert torch.count_nonzero(got[t:]) == 0
    torch.testing.assert_close(cache_padded, cache)  # padding tokens wrote nothing


def test_xla_backend_conforms_on_cpu_tensors() -> None:
    """The conformance checks (cached prefix, chunked prefill, GQA/MQA, window, soft-cap)
    on the CPU; tox -e tpu runs them on XLA's CPU device."""
    for case in attention_cases(XlaAttentionBackend, CpuPlatform):
        check_attention_backend(XlaAttentionBackend, TorchReferenceBackend, case, "cpu", seed=11)


def test_write_slots_skips_negative_slots_without_branching() -> None:
    flat = torch.arange(10.0).view(10, 1)
    write_slots(flat, torch.tensor([[100.0], [200.0], [300.0]]), torch.tensor([-1, 4, -1]))
    assert flat.view(-1).tolist() == [0, 1, 2, 3, 200, 5, 6, 7, 8, 9]
    write_slots(flat, torch.tensor([[7.0]]), torch.tensor([-1]))  # no real token at all
    assert flat.view(-1).tolist() == [0, 1, 2, 3, 200, 5, 6, 7, 8, 9]


@pytest.mark.parametrize("backend", [TorchReferenceBackend, XlaAttentionBackend])
def test_padded_steps_give_the_same_greedy_tokens(tmp_path, monkeypatch, backend) -> None:
    from engine.testing import greedy_driver
    from engine.testing.greedy_driver import GreedyDriver

    model = build_tiny_model(tmp_path / "m", "llama")
    prompts = [[5, 6, 7, 8, 9, 10, 11] * 3, [3, 1, 4], [2, 7, 1, 8, 2, 8] * 4, [9] * 17]

    def run() -> list[list[int]]:
        driver = GreedyDriver(
            str(model), block_size=4, max_num_seqs=4, max_num_batched_tokens=24, num_blocks=64,
            max_model_len=96, attn_backend_cls=backend,
        )  # fmt: skip
        return driver.generate(prompts, 6)[0]

    plain = run()
    monkeypatch.setattr(
        greedy_driver._CpuPlatform,
        "shape_buckets",
        classmethod(lambda cls, config: ShapeBuckets.for_limits(24, 4, 24, min_tokens=8)),
        raising=False,
    )
    monkeypatch.setattr(
        greedy_driver._CpuPlatform, "synchronize", staticmethod(lambda: None), raising=False
    )
    assert run() == plain
