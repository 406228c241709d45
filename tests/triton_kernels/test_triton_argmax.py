"""engine-llm-triton's split-row ``argmax`` against ``torch.argmax`` (exact indices).

Odd vocabularies, forced split counts (the cross-program combine through the workspace and the
arrival counters), ties planted in different splits, all -inf and NaN rows, strided row views,
and back-to-back calls (the counters must be left at zero). Fresh random inputs; sizes stay
small for the interpreter. The real vocabularies are checked on a GPU in
tests/gpu/test_triton_gpu.py.
"""

from __future__ import annotations

import pytest
import torch


def _check(logits, seed, **kw):
    from engine_triton.kernels.argmax import argmax

    out = argmax(logits, **kw)
    expected = torch.argmax(logits.cpu(), dim=-1)
    assert out.dtype == torch.int64 and out.shape == expected.shape
    assert torch.equal(out.cpu(), expected), f"seed={seed} {kw}: {out.cpu()} != {expected}"


@pytest.mark.parametrize("splits", [None, 1, 2, 4])
@pytest.mark.parametrize("n,v", [(1, 4099), (3, 1000), (16, 1000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_matches_torch(dtype, n, v, splits, device, seed):
    logits = torch.randn(n, v).to(dtype).to(device)
    _check(logits, seed, splits=splits)


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_ties_special_rows_and_strided_views(dtype, splits, device, seed):
    v = 1001  # chunks of 251 with 4 splits
    base = torch.randn(6, v + 24).to(dtype)
    logits = base[:, :v]  # a padded-vocabulary view: row stride v + 24
    top = logits.max() + 1
    logits[0, 700] = logits[0, 100] = top  # tie across splits: 100 wins
    logits[1, 900] = logits[1, 300] = logits[1, 301] = top  # within a split and across
    logits[2] = float("-inf")  # torch gives 0
    logits[3, 5] = float("nan")  # NaN is the maximum
    logits[3, 600] = float("nan")
    logits[4, :] = top  # every entry tied: 0
    logits[5, v - 1] = top  # the last entry
    assert logits.stride(0) == v + 24
    _check(logits.to(device), seed, splits=splits)


def test_calling_twice_leaves_counters_zeroed(device, seed):
    from engine_triton.kernels.argmax import _SCRATCH

    for n in (3, 3, 1, 16, 16):
        _check(torch.randn(n, 999, device=device), seed, splits=8)
    counters = _SCRATCH.bufs[torch.empty(0, device=device).device][2]
    assert int(counters.abs().sum()) == 0


def test_many_rows_go_to_torch(monkeypatch, device):
    """Above MAX_ROWS rows torch's reduction is faster: the kernel is not launched."""
    from engine_triton.kernels import argmax as mod

    launched = []
    monkeypatch.setattr(mod, "_argmax_kernel", _Spy(mod._argmax_kernel, launched))
    logits = torch.randn(mod.MAX_ROWS + 1, 300, device=device)
    assert torch.equal(mod.argmax(logits).cpu(), torch.argmax(logits.cpu(), dim=-1))
    assert not launched
    mod.argmax(logits[: mod.MAX_ROWS])
    assert launched


class _Spy:
    def __init__(self, kernel, calls):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        self.calls.append(grid)
        return self.kernel[grid]


def test_num_splits_fills_the_sms():
    from engine_triton.kernels.argmax import num_splits

    assert num_splits(1, 151936, 132) == 128
    assert num_splits(8, 151936, 132) == 32
    assert num_splits(100, 128256, 132) == 2
    assert num_splits(132, 151936, 132) == 1
    assert num_splits(1, 1000, 132) == 1  # too short to split
    for n in range(1, 300):
        s = num_splits(n, 128256, 132)
        assert s & (s - 1) == 0 and 1 <= s <= 128


def test_registered_for_gpu_platforms():
    from engine.kernels.registry import KernelRegistry
    from engine_triton.kernels import register
    from engine_triton.kernels.argmax import argmax

    registry = KernelRegistry()
    register(registry)
    assert registry.resolve("cuda").argmax is argmax
    assert registry.resolve("cpu").provider("argmax") == "engine-llm (torch reference)"


@pytest.mark.parametrize("splits", [1, 2])
def test_ties_within_one_lane(splits, device, seed):
    """Chunks longer than the block: a lane sees several entries; the first tied one wins."""
    v = 9000  # one split: 4096-wide blocks; two: chunks of 4500 in 4096-wide blocks
    logits = torch.randn(2, v)
    top = logits.max() + 1
    logits[0, 100] = logits[0, 100 + 4096] = top  # same lane of the first program
    logits[1, 4600] = logits[1, 4600 + 4096] = top  # same lane of the second (or only) one
    _check(logits.to(device), seed, splits=splits)
