"""The ``triton`` attention backend: paged attention through engine-llm-triton's kernels.

It keeps the default KV-cache layout ``(2, num_blocks, block_size, num_kv_heads, head_size)``
and the reference's slot convention, so a cache written by the reference ``write_kv_cache`` is
read correctly here and vice versa. Decode tokens (the first ``num_decodes`` of a batch) go
through the split-KV decode kernel, the rest through the varlen prefill kernel, which attends
over each request's cached prefix as well (chunked prefill, prefix caching). When many decodes
share a long cached prefix (``AttentionMetadata.cascade``), the decode kernel is preceded
by a shared pass over it (cascade attention, ``kernels/attention.py``), in the captured
decode graphs too. Attention sinks (GPT-OSS, ``self.sinks``) go to every kernel, which fold
them in once per query and head, however the decode splits the context.

Importing this module is cheap: Triton and torch are imported when the backend is used.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, ClassVar

from engine.attention_backends.interface import (
    AttentionBackend,
    AttentionMetadata,
    BatchLayout,
    SharedPrefix,
)
from engine.platforms.detect import module_available

if TYPE_CHECKING:
    import torch


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class TritonAttentionBackend(AttentionBackend):
    """Paged attention in Triton: GQA, sliding window, logit soft-cap, attention sinks, any
    block size, and an FP8 (e4m3, per-layer scales) KV cache."""

    name: ClassVar[str] = "triton"
    # The CPU only through Triton's interpreter (TRITON_INTERPRET=1, for tests): ``supports``
    # refuses it otherwise. Checked per call, because tests switch the interpreter on late.
    device_types: ClassVar[tuple[str, ...]] = ("cuda", "cpu")
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16", "float16")
    supports_sliding_window: ClassVar[bool] = True
    supports_logit_softcap: ClassVar[bool] = True
    # ``self.sinks`` reaches prefill, decode (split or not) and cascade alike; the kernels read
    # the layer's float32 parameter in place, so captured decode graphs keep up with it. Not
    # declared yet: the sink path (``HAS_SINKS``) has passed its tests under Triton's
    # interpreter but not yet run on a GPU, so selection still gives GPT-OSS the torch backend
    # there; tests declare it with the ``triton_sinks_declared`` fixture (tests/conftest.py),
    # and it turns True once tests/gpu (``-k "sink or gpt_oss"``) has passed with it.
    supports_attention_sinks: ClassVar[bool] = False
    supports_decode_graphs: ClassVar[bool] = True  # lengths come from tensors; see kernels
    # Not under Triton's interpreter: there the FP8-cache attention differs from the reference
    # on the conformance kit's float32 case (85.8% of elements past 1e-3 on 2026-12-02, cause
    # not found; the same case passed on the H200), so the interpreter does not offer an FP8
    # cache. tests/triton_kernels/test_triton_fp8_kv.py still runs the kernels on one.
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = (
        () if os.environ.get("TRITON_INTERPRET") == "1" else ("float8_e4m3fn",)
    )
    max_head_size: ClassVar[int] = 256
    supports_cascade_attention: ClassVar[bool] = True

    # Cascade attention pays when the shared prefix is read by many decodes: the shared pass
    # then reads it once per tile of 64 (request, head) rows instead of once per request. Its
    # cost is one more launch per layer and the merge of each holder's partials; a decode
    # graph batch is padded to the next cascade graph size (DecodeGraphs.cascade_sizes). The
    # shared prefix must be at least CASCADE_MIN_PREFIX tokens, held by ``cascade_min_decodes``
    # decodes, and save at least CASCADE_MIN_SAVED token reads (Llama-3.1-8B: 4 KiB a token
    # and layer, so 16,384 saved reads are 64 MiB, about 20 us of HBM time, a layer). On an
    # H100 with a 2,000-token prefix it paid from about 65 decodes up (15.5 against 19.6 ms a
    # step at 193-256) and cost up to 0.2 ms a step at 32 or fewer: with few readers the L2
    # cache already serves the shared blocks (docs/benchmarks.md, 2026-12-06 third session).
    cascade_min_decodes: ClassVar[int] = 64
    CASCADE_MIN_PREFIX: ClassVar[int] = 256
    CASCADE_MIN_SAVED: ClassVar[int] = 16384

    @classmethod
    def use_cascade_attention(cls, prefix: SharedPrefix, num_decodes: int) -> bool:
        rows = len(prefix.rows)
        return (
            rows >= cls.cascade_min_decodes
            and prefix.length >= cls.CASCADE_MIN_PREFIX
            and (rows - 1) * prefix.length >= cls.CASCADE_MIN_SAVED
        )

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        # module_available, not find_spec: a tests/triton/ folder on sys.path is not triton.
        if not module_available("triton"):
            return ["triton is not installed"]
        return []

    @classmethod
    def supports(cls, spec) -> list[str]:
        reasons = super().supports(spec)
        if spec.device_type == "cpu" and not _interpreting():
            reasons.append("runs on the CPU only under TRITON_INTERPRET=1 (Triton's interpreter)")
        if spec.head_size is not None and spec.head_size > cls.max_head_size:
            reasons.append(f"head size {spec.head_size} > {cls.max_head_size} not supported")
        return reasons

    @classmethod
    def build_metadata(cls, layout: BatchLayout, device: torch.device) -> AttentionMetadata:
        """Like the base builder, but on CUDA every array goes through one pinned host buffer
        and one asynchronous copy instead of one blocking copy per tensor."""
        if getattr(device, "type", device) != "cuda":
            return super().build_metadata(layout, device)
        from engine_triton.host_inputs import build_metadata_pinned

        return build_metadata_pinned(layout, device)

    def _split_counters(self, needed: int, device: torch.device) -> torch.Tensor:
        """This layer's zeroed arrival counters for split-KV decode (the kernel leaves them
        zeroed). Allocated on the first decode, which the model runner runs eagerly before any
        graph capture, at the largest captured size first."""
        import torch

        buf = getattr(self, "_counters", None)
        if buf is None or buf.numel() < needed or buf.device != device:
            buf = torch.zeros(max(needed, 4096), dtype=torch.int32, device=device)
            self._counters = buf
        return buf

    def _cascade_args(self, metadata: AttentionMetadata) -> dict:
        """``paged_decode``'s cascade arguments for this step (none under a sliding window:
        such a layer's old blocks are dropped, never shared)."""
        cascade = metadata.cascade
        if cascade is None or self.sliding_window:
            return {}
        return {"cascade_starts": cascade.starts, "cascade_prefix": cascade.prefix}

    def launch_configs(self, device: torch.device) -> dict[str, dict]:
        """Launch configurations by kernel regime (``"prefill"``, ``"decode"``,
        ``"decode_split"``, ``"decode_many_splits"``, ``"shared_prefix"``) overriding the
        kernels' defaults, which were tuned on an H200. Empty here; a platform's subclass
        returns its tuning table (engine-rocm's per gfx family)."""
        return {}

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        import torch

        from engine_triton.kernels.attention import paged_decode, paged_prefill
        from engine_triton.kernels.kv_cache import write_kv_cache

        out = torch.empty_like(query)
        tuning = self.launch_configs(query.device)
        num_tokens = metadata.num_actual_tokens
        num_decodes = metadata.num_decodes
        if num_tokens > num_decodes:  # decodes append their own key/value (below)
            write_kv_cache(
                key[num_decodes:num_tokens],
                value[num_decodes:num_tokens],
                kv_cache,
                metadata.slot_mapping[num_decodes:num_tokens],
                self.k_scale,
                self.v_scale,
            )
        if num_decodes:
            paged_decode(
                query,
                kv_cache,
                out,
                metadata.seq_lens,
                metadata.block_table,
                num_decodes,
                self.scale,
                self.sliding_window,
                self.logit_softcap,
                key=key,
                value=value,
                slot_mapping=metadata.slot_mapping,
                split_counters=self._split_counters(num_decodes * self.num_kv_heads, query.device),
                configs=tuning,
                k_scale=self.k_scale,
                v_scale=self.v_scale,
                sinks=self.sinks,
                **self._cascade_args(metadata),
            )
        if metadata.num_seqs > num_decodes:
            paged_prefill(
                query,
                kv_cache,
                out,
                metadata.query_start_loc[num_decodes:],
                metadata.seq_lens[num_decodes:],
                metadata.block_table[num_decodes:],
                metadata.num_seqs - num_decodes,
                num_tokens - num_decodes,
                self.scale,
                self.sliding_window,
                self.logit_softcap,
                config=tuning.get("prefill"),
                k_scale=self.k_scale,
                v_scale=self.v_scale,
                sinks=self.sinks,
            )
        if query.shape[0] > num_tokens:  # padding rows (e.g. a padded graph batch)
            out[num_tokens:].zero_()
        return out
