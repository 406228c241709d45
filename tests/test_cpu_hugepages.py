"""``engine_cpu.hugepages``: the packed weights' memory (huge-page-advised anonymous mappings).

What is checked is what callers rely on: the shape, dtype and contiguity of ``torch.empty``,
writable memory that keeps its values, 64-byte alignment (the kernels' vector loads), small
tensors sharing a mapping without overlapping, a large one on a 2 MiB boundary of its own, and
the mapping living as long as a tensor carved from it. Whether Linux backs the memory with huge
pages is the kernel's decision (``/sys/kernel/mm/transparent_hugepage``) and is not asserted.
"""

from __future__ import annotations

import gc

import pytest
import torch

from engine_cpu import hugepages

pytestmark = pytest.mark.skipif(not hugepages.supported(), reason="no MADV_HUGEPAGE here")


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.int64])
def test_empty_is_a_writable_contiguous_tensor(dtype):
    t = hugepages.empty((37, 11), dtype)
    assert t.shape == (37, 11) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % 64 == 0
    t.copy_(torch.arange(37 * 11).view(37, 11).to(dtype))
    assert torch.equal(t, torch.arange(37 * 11).view(37, 11).to(dtype))


def test_small_tensors_do_not_overlap_and_large_ones_start_on_a_huge_page():
    small = [hugepages.empty((1000 + i,), torch.uint8) for i in range(50)]
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel()) for t in small)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
    for i, t in enumerate(small):
        t.fill_(i)
    assert all(int(t.min()) == int(t.max()) == i for i, t in enumerate(small))
    big = hugepages.empty((hugepages._CHUNK + 1,), torch.uint8)
    assert big.data_ptr() % (2 << 20) == 0
    assert hugepages.empty((0, 4)).shape == (0, 4)


def test_the_mapping_outlives_every_view_of_it():
    t = hugepages.empty((hugepages._CHUNK // 4 + 1,))  # its own mapping
    view = t[5:10]
    view.fill_(3.0)
    del t
    gc.collect()
    assert torch.equal(view, torch.full((5,), 3.0))
