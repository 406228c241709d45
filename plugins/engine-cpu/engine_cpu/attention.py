"""The ``cpu`` attention backend: the torch reference with its decode path and KV-cache write
compiled (``csrc/cpu_ops.c``, the ``avx2`` family of ``engine_cpu.native``).

The reference (``engine.attention_backends.torch_ref``) gathers every decode's keys and values
through the block tables into one padded tensor, builds a mask and calls SDPA: about 20 torch
ops a layer, 0.3 ms a call for one 64-token decode of the embedded Gemma 3 270M on a 2-core
EPYC. Here one call reads the cache through the block table in place, per request and KV head
(grouped query heads together; with fewer of those than threads, each context is also cut into
slices whose softmax sums are combined): scores in float32, soft-capping, the sliding window
and attention sinks (GPT-OSS: folded into the combined softmax once per head) as the reference
applies them, softmax, the weighted sum of values, rounded once to the query's dtype. Prefill chunks keep the reference's path (SDPA over the gathered context, which is
compute-bound there), and so does every case the compiled kernels do not take: a float16 or
FP8 cache (the reference dequantizes FP8 as it gathers) or activations of another dtype than
the cache's.

``auto`` picks this backend on the cpu platform where the compiled kernels build (x86-64 with
AVX2 and a C compiler), else ``torch``; ``--attention-backend torch`` keeps the reference.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from engine.attention_backends.interface import AttentionMetadata
from engine.attention_backends.torch_ref import TorchReferenceBackend
from engine_cpu import native

_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


class CpuAttentionBackend(TorchReferenceBackend):
    """Paged attention on the CPU with compiled decode and cache-write paths (see the module
    docstring); everything else as the torch reference."""

    name: ClassVar[str] = "cpu"
    device_types: ClassVar[tuple[str, ...]] = ("cpu",)
    # A batch of decodes reads its lengths, tables and slots from the metadata's tensors only
    # (the compiled paths), so the CPU's native plans (engine_cpu.plan) may record it. Any
    # other path is torch ops, which a recording refuses.
    supports_decode_graphs: ClassVar[bool] = True
    # The reference's prefill honours ``self.sinks``; so does the compiled decode, which reads
    # the layer's float32 parameter in place (a pointer that native plans record as it is).
    supports_attention_sinks: ClassVar[bool] = True

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        if native.load("avx2") is None:
            return [
                f"needs engine-cpu's compiled AVX2 kernels ({native.unavailable_reason('avx2')})"
            ]
        return []

    def _native(self, kv_cache: torch.Tensor, *tensors: torch.Tensor):
        """The compiled library when the cache and ``tensors`` (rows of unit stride) share a
        float32/bfloat16 dtype and the cache is contiguous; None otherwise (the reference)."""
        if kv_cache.dtype not in _NATIVE_DTYPES or not kv_cache.is_contiguous():
            return None
        for t in tensors:
            if t.dtype != kv_cache.dtype or t.stride(-1) != 1:
                return None
        return native.load("avx2")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """See ``AttentionBackend.forward``. A batch of decodes only (one query row each) goes
        straight to the compiled write and decode, with no output to zero and copy into."""
        n = query.shape[0]
        if (
            metadata.num_decodes == metadata.num_seqs == metadata.num_actual_tokens == n
            and metadata.cascade is None
            and self._native(kv_cache, query, key, value) is not None
        ):
            self._write_kv(key, value, kv_cache, metadata)
            return self._decode(query, kv_cache, metadata, metadata.seq_lens_cpu)
        return super().forward(query, key, value, kv_cache, metadata)

    def _write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        lib = self._native(kv_cache, key, value)
        if lib is None:
            return super()._write_kv(key, value, kv_cache, metadata)
        num_tokens = metadata.num_actual_tokens
        _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
        slots = metadata.slot_mapping[:num_tokens].to(torch.int64).contiguous()
        lib.cpu_write_kv(
            key.data_ptr(),
            key.stride(0),
            key.stride(1),
            value.data_ptr(),
            value.stride(0),
            value.stride(1),
            kv_cache.data_ptr(),
            num_blocks * block_size * num_kv_heads * head_size,
            slots.data_ptr(),
            int(kv_cache.dtype == torch.bfloat16),
            num_tokens,
            num_kv_heads,
            head_size,
        )

    def _decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        seq_lens: list[int],
    ) -> torch.Tensor:
        lib = self._native(kv_cache, query)
        sinks = self.sinks
        if sinks is not None:
            if sinks.numel() != self.num_heads:
                raise ValueError(
                    f"attention sinks hold {sinks.numel()} values for {self.num_heads} heads"
                )
            if sinks.dtype != torch.float32 or not sinks.is_contiguous():
                lib = None  # the kernel reads float32 [Hq] in place; the reference converts
        if lib is None:
            return super()._decode(query, kv_cache, md, seq_lens)
        nd = query.shape[0]
        _, _, block_size, num_kv_heads, head_size = kv_cache.shape
        table = md.block_table[:nd]
        if table.dtype != torch.int32 or table.stride(-1) != 1:
            table = table.to(torch.int32).contiguous()
        lens = md.seq_lens[:nd].to(torch.int32).contiguous()
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
        lib.cpu_paged_decode(
            query.data_ptr(),
            query.stride(0),
            query.stride(1),
            kv_cache[0].data_ptr(),
            kv_cache[1].data_ptr(),
            table.data_ptr(),
            table.stride(0),
            lens.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            out.stride(1),
            int(kv_cache.dtype == torch.bfloat16),
            nd,
            self.num_heads,
            num_kv_heads,
            head_size,
            block_size,
            self.scale,
            self.logit_softcap or 0.0,
            self.sliding_window or 0,
            None if sinks is None else sinks.data_ptr(),
        )
        return out
