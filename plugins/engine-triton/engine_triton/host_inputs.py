"""Attention metadata built through pinned host memory with one asynchronous copy per dtype.

The base ``AttentionBackend.build_metadata`` makes four small tensors and copies each to the
device with a blocking copy. Here the int32 arrays (query start locations, sequence lengths,
block table) are packed into one pinned buffer and the int64 slot mapping into another, and
both are copied with ``non_blocking=True``: the host goes on preparing the step while the copy
engine works. PyTorch's pinned-memory allocator keeps a buffer alive until its copy finished.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from engine.attention_backends.interface import AttentionMetadata, BatchLayout, CascadeInputs

if TYPE_CHECKING:
    import torch


def build_metadata_pinned(layout: BatchLayout, device: torch.device) -> AttentionMetadata:
    """``AttentionMetadata`` for ``layout`` on ``device`` (a CUDA device)."""
    import torch

    num_seqs = len(layout.query_lens)
    width = max((len(t) for t in layout.block_tables), default=0) or 1
    width = max(width, layout.table_width or 0)
    host32 = torch.empty(2 * num_seqs + 1 + num_seqs * width, dtype=torch.int32, pin_memory=True)
    a = host32.numpy()
    a[0] = 0
    np.cumsum(np.asarray(layout.query_lens, dtype=np.int32), out=a[1 : num_seqs + 1])
    a[num_seqs + 1 : 2 * num_seqs + 1] = layout.seq_lens
    table = a[2 * num_seqs + 1 :].reshape(num_seqs, width)
    table.fill(0)
    for i, blocks in enumerate(layout.block_tables):
        table[i, : len(blocks)] = blocks
    host64 = torch.empty(len(layout.slot_mapping), dtype=torch.int64, pin_memory=True)
    host64.numpy()[:] = layout.slot_mapping
    qsl_cpu = a[: num_seqs + 1].tolist()

    dev32 = host32.to(device, non_blocking=True)
    slot_mapping = host64.to(device, non_blocking=True)
    return AttentionMetadata(
        num_actual_tokens=qsl_cpu[-1],
        num_seqs=num_seqs,
        num_decodes=layout.num_decodes,
        max_query_len=max(layout.query_lens, default=0),
        max_seq_len=max(layout.seq_lens, default=0),
        block_size=layout.block_size,
        query_start_loc=dev32[: num_seqs + 1],
        seq_lens=dev32[num_seqs + 1 : 2 * num_seqs + 1],
        block_table=dev32[2 * num_seqs + 1 :].view(num_seqs, width),
        slot_mapping=slot_mapping,
        query_start_loc_cpu=qsl_cpu,
        seq_lens_cpu=list(layout.seq_lens),
        cascade=CascadeInputs.of_layout(layout, device),
    )
