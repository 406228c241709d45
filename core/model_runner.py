"""``ModelRunner``: turns a scheduled step into device tensors, runs the model, samples.

The runner is the only component that knows tensors live on a device. It owns the model and the
paged KV cache (one tensor per attention layer, shaped by the attention backend), sizes the cache
from memory, flattens each ``SchedulerOutput`` into one token batch with per-KV-group attention
metadata, and returns plain Python results (token ids, logprobs) to the engine.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.attention_backends.interface import (
    AttentionBackend,
    AttentionMetadata,
    BatchLayout,
    SharedPrefix,
    find_shared_prefix,
)
from engine.config import ConfigError, EngineConfig
from engine.cuda_graphs import feedback_row, gather_feedback
from engine.kernels.registry import Kernels
from engine.loader.lazy_tensor import ReadStats
from engine.models.base import CausalLM
from engine.outputs import Logprob
from engine.parallel import SINGLE_PROCESS, IntermediateTensors, ParallelContext
from engine.request import PLACEHOLDER_TOKEN, Request
from engine.sampler import SamplingRow
from engine.scheduler_output import ScheduledRequest, SchedulerOutput

if TYPE_CHECKING:
    from torch import nn

    from engine.models.registry import ModelRegistry
    from engine.platforms.interface import Platform

# Prompt-logprob rows are turned into [rows, vocab] float32 logits this many at a time.
_PROMPT_LOGPROB_CHUNK = 512
_GiB = 1 << 30

logger = logging.getLogger(__name__)


def _share(available: int | None, ranks: int) -> int | None:
    """One rank's share of the memory available to the ranks of this host."""
    return None if available is None else available // max(1, ranks)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


@dataclass
class RunnerOutput:
    """One step's results, keyed by request id.

    ``sampled`` holds the new token(s) of each request that sampled this step (``num_samples``
    of them, or for a speculative verification the accepted drafts plus the target's own
    token); ``logprobs`` their logprob entries, one per token (None when not requested). ``prompt_logprobs``
    covers requests that asked for them: one entry per chunk position ``p`` that has a next
    prompt token, i.e. the logprobs of prompt token ``p + 1`` given tokens ``0..p``. The chunks'
    lists concatenated, after a ``None`` for prompt token 0, give vLLM's ``prompt_logprobs``.
    """

    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[dict[int, Logprob]] | None] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[dict[int, Logprob] | None]] = field(default_factory=dict)
    # Speculative decoding: drafts proposed after this step, for the next one to verify.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Pooling models: each pooled request's embedding, float32 little-endian bytes.
    pooled: dict[str, bytes] = field(default_factory=dict)


@dataclass
class PendingStep:
    """A launched step whose results may still be on the device (``ModelRunner.collect``)."""

    out: RunnerOutput
    # The request of each token in ``tokens`` (one sample per row on this path).
    request_ids: list[str] = field(default_factory=list)
    tokens: torch.Tensor | None = None  # host (pinned) copy in flight, or None when done
    ready: Any = None  # a device event recorded after the copy, or None
    # Requests to propose drafts for once the tokens are known: (request, how many).
    proposals: list[tuple[Request, int]] = field(default_factory=list)
    # What the step sampled, for a draft model or EAGLE head: the (index, entry) pairs that
    # sampled, their newest token on the device, and (verifications) the tokens each kept.
    sampling: list[tuple[int, ScheduledRequest]] = field(default_factory=list)
    last_tokens: torch.Tensor | None = None
    accepted: list[list[int]] | None = None
    drafts: Any = None  # (entries, drafts [n, k] on the device) from a model proposer
    # Pooling: (request id, embedding on the device) of each request pooled in the step.
    pooled: list[tuple[str, torch.Tensor]] = field(default_factory=list)


@dataclass
class _Batch:
    """A step flattened for the model: inputs on device plus host-side bookkeeping."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: list[AttentionMetadata]
    query_start_loc: list[int]
    # One past each request's last real token when rows are padded (a verify graph).
    ends: list[int] | None = None
    # The target layers' hidden states an EAGLE-3 head reads, [tokens, 3 * hidden].
    aux_hidden: torch.Tensor | None = None
    # Image inputs: (placeholder rows, their embeddings) for the model's forward, or None.
    mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None

    def end(self, i: int) -> int:
        """One past request ``i``'s last token row."""
        return self.ends[i] if self.ends is not None else self.query_start_loc[i + 1]


def _padding_row() -> SamplingRow:
    """A greedy row for the padding rows of a static-shape batch (its token is dropped)."""
    from engine.sampling_params import SamplingParams

    return SamplingRow(SamplingParams(temperature=0.0), [], [], [None])


def _chunk_tokens(request: Request, start: int, num: int) -> list[int]:
    """``request.all_token_ids[start:start + num]`` without concatenating the whole lists."""
    prompt, output = request.prompt_token_ids, request.output_token_ids
    p = len(prompt)
    if start >= p:
        return output[start - p : start - p + num]
    if start + num <= p:
        return prompt[start : start + num]
    return prompt[start:] + output[: start + num - p]


class ModelRunner:
    """Owns the model and its KV cache on one device and executes scheduled steps."""

    def __init__(
        self,
        config: EngineConfig,
        platform: type[Platform],
        kernels: Kernels,
        attn_backend_cls: type[AttentionBackend],
        sampler: Any = None,
        *,
        sampler_cls: type | None = None,
        plugins: Any = None,
        model_registry: ModelRegistry | None = None,
        parallel: ParallelContext | None = None,
        device_index: int = 0,
        quant_config: Any = None,
    ) -> None:
        """``sampler`` is a ready ``engine.sampler.Sampler``-like object; without one,
        ``sampler_cls(vocab_size, device)`` (default ``engine.sampler.Sampler``) is built once
        the model is loaded. ``plugins`` (a ``PluginManager``) contributes model architectures
        through ``engine_models`` unless ``model_registry`` is given. ``parallel`` is this
        rank's place in a tensor x pipeline parallel replica (one process by default) and
        ``device_index`` the platform device it runs on. ``quant_config`` (an
        ``engine.quantization.QuantizationConfig``, None: unquantized) picks each linear
        layer's quantization method."""
        self.config = config
        self.platform = platform
        self.kernels = kernels
        self.attn_backend_cls = attn_backend_cls
        # Cascade attention over a prefix many decodes share, where the backend offers it.
        self._cascade = bool(
            getattr(attn_backend_cls, "supports_cascade_attention", False)
            and not config.model.disable_cascade_attn
        )
        self.sampler = sampler
        self.sampler_cls = sampler_cls
        self.plugins = plugins
        self.model_registry = model_registry
        self.parallel = parallel or SINGLE_PROCESS
        self.device_index = device_index
        self.device = platform.torch_device(device_index)
        self.dtype: torch.dtype | None = None  # the model's, once loaded
        self.load_stats = ReadStats()
        self.ranks_on_host = 1  # processes sharing this host's memory (set by a worker)
        self.quant_config = quant_config
        self.block_size = config.cache.block_size
        self.model: nn.Module | None = None
        self.num_blocks = 0
        self.kv_caches: list[torch.Tensor] = []
        self._groups: list[int | None] | None = None
        self.graphs: Any = None  # engine.cuda_graphs.DecodeGraphs once captured
        self.verify_graphs: Any = None  # the same for speculative verification steps
        self.lora: Any = None  # engine.lora.model_manager.LoRAModelManager with --enable-lora
        # On-device feedback for asynchronous scheduling: the previous step's first sample of
        # each sampling row (a fixed buffer, so captured graphs can read it) and the row of
        # each request in it.
        self._feedback = torch.zeros(
            config.scheduler.max_num_seqs, dtype=torch.int64, device=self.device
        )
        self._feedback_rows: dict[str, int] = {}
        # Platforms that compile one graph per input shape (XLA) pad every step to buckets.
        buckets = getattr(platform, "shape_buckets", None)  # duck-typed test platforms lack it
        self.shape_buckets = buckets(config) if buckets is not None else None
        self.proposer: Any = None  # speculative decoding (engine.spec_decode), see load_model
        self.mm: Any = None  # image inputs (engine.multimodal.runner.EncoderRunner), see load_model
        # A pooling model's pooler (engine.pooling.PoolerConfig), None for generation.
        self.pooler_config: Any = getattr(config.model, "pooler_config", None)

    def _no_grad(self) -> Any:
        """``torch.inference_mode()``, or ``no_grad`` on XLA: torch_xla's functionalization
        sets version counters, which inference tensors refuse."""
        return torch.no_grad() if self.device.type == "xla" else torch.inference_mode()

    # ---- model -------------------------------------------------------------------------------
    def load_model(self) -> nn.Module:
        """Load the model named by ``config.model`` onto this runner's device (and build the
        sampler if none was given)."""
        from engine.loader import load_model, resolve_dtype
        from engine.models.registry import ModelRegistry

        registry = self.model_registry or ModelRegistry.with_plugins(self.plugins)
        self.model = load_model(
            self.config.model,
            self.kernels,
            self.attn_backend_cls,
            self.device,
            registry,
            multimodal_config=getattr(self.config, "multimodal", None),
            parallel=self.parallel,
            stats=self.load_stats,
            quant_config=self.quant_config,
        )
        self.dtype = resolve_dtype(self.config.model, self.config.model.hf_config)
        if self.parallel.world_size > 1 and self.load_stats.offered:
            logger.info(
                "rank %d (tp %d/%d, pp %d/%d) read %s of the checkpoint",
                self.parallel.rank,
                self.parallel.tp_rank,
                self.parallel.tp_size,
                self.parallel.pp_rank,
                self.parallel.pp_size,
                self.load_stats.describe(),
            )
        self._pack_linears()
        spec = getattr(self.model, "image_input_spec", None)
        spec = spec() if callable(spec) else None
        if spec is not None:
            from engine.multimodal.runner import EncoderRunner

            self.mm = EncoderRunner(self.model, self.device, spec)
        if self.config.lora is not None:
            self._wrap_lora()
        if self.sampler is None:
            if self.sampler_cls is None:
                from engine.sampler import Sampler

                self.sampler_cls = Sampler
            self.sampler = self.sampler_cls(self.vocab_size, self.device)
        if self.config.speculative is not None:
            from engine.spec_decode import ProposerRegistry

            cls = ProposerRegistry().get(self.config.speculative.method)
            self.proposer = cls.create(self.config, self)  # a draft model loads here
        return self.model

    def _pack_linears(self) -> None:
        """On a CPU, prepack the linear layers for oneDNN (about 2x faster decode matmuls; see
        ``engine.layers.cpu_packed_linear``). It releases the plain weight copies, so it runs
        after loading; a no-op on other devices."""
        from engine.layers.cpu_packed_linear import pack_linears
        from engine.layers.embedding import VocabParallelEmbedding

        assert self.model is not None
        embeddings = tuple(
            m.weight for m in self.model.modules() if isinstance(m, VocabParallelEmbedding)
        )
        pack_linears(self.model, shared_weights=embeddings)

    def _wrap_lora(self) -> None:
        """Wrap the linear layers for LoRA (after packing, which swaps their methods; before
        the KV cache is sized, so the adapter slots count in the memory profile)."""
        from engine.lora.model_manager import LoRAModelManager

        sched = self.config.scheduler
        self.lora = LoRAModelManager(
            self.model,
            self.config.lora,
            self.kernels,
            self.device,
            max(sched.max_num_batched_tokens, sched.max_num_seqs),
        )

    def add_lora(self, key: int, lora_request: Any) -> None:
        """Load, check and register a LoRA adapter under the engine's ``key`` (raises
        ``engine.lora.errors.LoRAAdapterError`` with the reason)."""
        if self.lora is None:
            raise ConfigError("LoRA is not enabled: start the engine with --enable-lora")
        self.lora.add_adapter(key, lora_request)

    def remove_lora(self, key: int) -> None:
        """Forget a LoRA adapter (host copy and device slot)."""
        if self.lora is not None:
            self.lora.remove_adapter(key)

    @property
    def image_input_spec(self) -> Any:
        """How the model takes images (``engine.multimodal.ImageInputSpec``), None without."""
        return self.mm.spec if self.mm is not None else None

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size (logits width)."""
        hf_config = self.config.model.hf_config
        text = getattr(hf_config, "text_config", None) or hf_config
        return int(text.vocab_size)

    @property
    def max_model_len(self) -> int:
        n = self.config.model.max_model_len
        if n is None:
            raise ConfigError("max_model_len is unknown: load the model config first")
        return n

    def weights_bytes(self) -> int:
        """Bytes held by the model's parameters and buffers, and by the weights the CPU's
        oneDNN prepacking keeps outside them (``packed_weight``), each storage once."""
        assert self.model is not None
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        tensors += [
            m.packed_weight
            for m in self.model.modules()
            if isinstance(getattr(m, "packed_weight", None), torch.Tensor)
        ]
        seen: set[int] = set()
        total = 0
        for t in tensors:
            if t.is_mkldnn:  # an opaque oneDNN tensor: no storage pointer to share
                total += t.numel() * t.element_size()
                continue
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
        if self.proposer is not None and self.proposer.uses_model:
            total += self.proposer.weights_bytes()
        return total

    # ---- KV-cache layout -------------------------------------------------------------------
    def kv_cache_windows(self) -> set[int | None]:
        """The sliding windows of this runner's attention layers (None: full attention)."""
        assert self.model is not None, "load_model() first"
        return {layer.sliding_window for layer in self._attention_layers()}

    def kv_cache_groups(self, windows: Any = None) -> list[int | None]:
        """One KV-cache group per distinct sliding window (None = full attention, first when
        present); sets every attention layer's ``kv_group``. Returns each group's window.

        ``windows`` is the set of windows of the whole model when this runner holds one
        pipeline stage (the scheduler keeps one block table per group of the whole model;
        a stage's layers use some of them); by default this runner's own layers decide."""
        assert self.model is not None, "load_model() first"
        layers = self._attention_layers()
        own = {layer.sliding_window for layer in layers}
        if windows is None:
            windows = own
        elif not own <= set(windows):
            raise ValueError(f"sliding windows {own} are not all among the model's {windows}")
        groups: list[int | None] = [None] if None in windows else []
        groups += sorted(w for w in windows if w is not None)
        for layer in layers:
            layer.kv_group = groups.index(layer.sliding_window)
        self._groups = groups
        return groups

    def _cache_plan(self) -> list[list[Any]]:
        """Which layers share each cache tensor.

        A block id belongs to one group at a time (the pool is shared), so the i-th layer of
        every group can use the same tensor: hybrid models then pay for max(layers per group)
        layers per block instead of all of them. Layers whose cache shapes differ get their
        own tensors.
        """
        assert self.model is not None
        if self._groups is None:
            self.kv_cache_groups()
        layers = self._attention_layers()
        shapes = {self._layer_block_shape(layer) for layer in layers}
        if len(shapes) > 1:
            return [[layer] for layer in layers]
        by_group: dict[int, list[Any]] = {}
        for layer in layers:
            by_group.setdefault(layer.kv_group, []).append(layer)
        width = max(len(g) for g in by_group.values())
        return [[g[i] for g in by_group.values() if i < len(g)] for i in range(width)]

    def _attention_layers(self) -> list[Any]:
        """Every paged-attention layer whose KV the cache holds: the model's, then a draft
        model's or EAGLE head's (they share the block tables, each with its own tensors)."""
        assert self.model is not None
        layers = list(self.model.attention_layers())
        if self.proposer is not None and self.proposer.uses_model:
            layers += self.proposer.attention_layers()
        return layers

    def _layer_block_shape(self, layer: Any) -> tuple[int, ...]:
        return tuple(
            self.attn_backend_cls.kv_cache_shape(
                1, self.block_size, layer.num_kv_heads, layer.head_size
            )
        )

    def _kv_dtype(self) -> torch.dtype:
        """The cache's element type: e4m3 for ``--kv-cache-dtype fp8`` (half the bytes of
        bf16, so about twice the tokens in the same memory), else the model's dtype."""
        assert self.model is not None
        if self.config.cache.cache_dtype == "fp8":
            return torch.float8_e4m3fn
        # The model's dtype: a pipeline stage's or a quantized model's first parameter may
        # have another one (a float32 norm, packed int4).
        return self.dtype or next(self.model.parameters()).dtype

    def bytes_per_block(self) -> int:
        """Bytes one block id costs across all cache tensors."""
        elem = torch.empty((), dtype=self._kv_dtype()).element_size()
        return sum(
            math.prod(self._layer_block_shape(layers[0])) * elem for layers in self._cache_plan()
        )

    def blocks_per_request(self) -> int:
        """Blocks one max-length request needs across all KV-cache groups (the KV-cache
        manager reserves one more block, the null block, on top of these)."""
        from engine.kv_cache_manager import KVCacheGroupSpec, max_blocks_needed

        groups = self._groups if self._groups is not None else self.kv_cache_groups()
        specs = [KVCacheGroupSpec(sliding_window=w) for w in groups]
        # Sliding-window groups hold only the blocks of their window (plus one step's chunk),
        # the same bound the scheduler admits requests by.
        return max_blocks_needed(
            specs,
            self.block_size,
            self.max_model_len,
            self.config.scheduler.max_num_batched_tokens,
        )

    def determine_num_blocks(self, max_model_len_fixed: bool = True) -> int:
        """How many KV-cache blocks to allocate.

        ``cache.num_gpu_blocks`` wins when set. On CPU, ``engine.cpu_kv_cache.plan_cpu_kv_cache``
        decides from what ``max_num_seqs`` max-length requests can use, the
        ``cpu_kv_cache_gb`` budget and the memory available; it may lower ``max_model_len``
        to fit unless ``max_model_len_fixed`` (the user set it). On accelerators a forward pass
        at ``max_num_batched_tokens`` is profiled and the cache gets what remains of
        ``total_memory * gpu_memory_utilization``. Raises ``ConfigError`` with the numbers
        when not even one max-length request fits.
        """
        cache = self.config.cache
        if cache.num_gpu_blocks is not None:
            return cache.num_gpu_blocks
        per_block = self.bytes_per_block()
        if self.device.type == "cpu":
            return self._cpu_num_blocks(per_block, max_model_len_fixed)
        return self._profile_num_blocks(per_block, self.blocks_per_request())

    def _cpu_num_blocks(self, per_block: int, max_model_len_fixed: bool) -> int:
        """The CPU cache size (``engine.cpu_kv_cache``), logged with the reason; applies a
        lowered ``max_model_len`` to the config."""
        from engine.cpu_kv_cache import available_memory, plan_cpu_kv_cache
        from engine.kv_cache_manager import KVCacheGroupSpec, max_blocks_needed

        groups = self._groups if self._groups is not None else self.kv_cache_groups()
        specs = [KVCacheGroupSpec(sliding_window=w) for w in groups]
        chunk = self.config.scheduler.max_num_batched_tokens
        plan = plan_cpu_kv_cache(
            bytes_per_block=per_block,
            blocks_for_len=lambda n: max_blocks_needed(specs, self.block_size, n, chunk),
            max_num_seqs=self.config.scheduler.max_num_seqs,
            max_model_len=self.max_model_len,
            max_model_len_fixed=max_model_len_fixed,
            budget_gib=self.config.cache.cpu_kv_cache_gb,
            available_bytes=_share(available_memory(), self.ranks_on_host),
        )
        if plan.max_model_len != self.max_model_len:
            logger.warning(
                "max_model_len lowered from %d to %d to fit the CPU KV cache",
                self.max_model_len,
                plan.max_model_len,
            )
            self.config.model.max_model_len = plan.max_model_len
        logger.info(
            "CPU KV cache: %d blocks of %d tokens, %s: %s",
            plan.num_blocks,
            self.block_size,
            _human_bytes(plan.num_blocks * per_block),
            plan.reason,
        )
        return plan.num_blocks

    def _profile_num_blocks(self, per_block: int, per_request: int) -> int:
        platform, index = self.platform, self.device_index
        weights = self.weights_bytes()
        platform.synchronize(index)
        platform.reset_peak_memory(index)
        profile_cache_bytes = self._profile_run()
        platform.synchronize(index)
        peak = platform.peak_memory(index) - profile_cache_bytes
        budget = int(platform.total_memory(index) * self.config.cache.gpu_memory_utilization)
        available = budget - peak - self._encoder_cache_bytes()
        num_blocks = max(0, available // per_block)
        if num_blocks < per_request + 1:  # + the scheduler's reserved null block
            raise ConfigError(
                f"not enough device memory for the KV cache: budget {budget / _GiB:.2f} GiB "
                f"(total x gpu_memory_utilization={self.config.cache.gpu_memory_utilization}), "
                f"weights {weights / _GiB:.2f} GiB, activations "
                f"{(peak - weights) / _GiB:.2f} GiB at max_num_batched_tokens="
                f"{self.config.scheduler.max_num_batched_tokens}, leaving "
                f"{max(available, 0) / _GiB:.2f} GiB; one request of max_model_len="
                f"{self.max_model_len} needs {per_request * per_block / _GiB:.2f} GiB of KV "
                "cache. Lower max_model_len or max_num_batched_tokens, or raise "
                "gpu_memory_utilization"
            )
        return num_blocks

    def _encoder_cache_bytes(self) -> int:
        """Device memory the encoder cache of image embeddings may take (0 without images)."""
        if self.mm is None:
            return 0
        return int(self.config.multimodal.mm_encoder_cache_gb * _GiB)

    def _profile_run(self) -> int:
        """Run a forward at ``max_num_batched_tokens`` (plus logits for ``max_num_seqs`` rows)
        against a temporary cache; returns the temporary cache's bytes."""
        sched = self.config.scheduler
        num_tokens = min(sched.max_num_batched_tokens, sched.max_num_seqs * self.max_model_len)
        lens = [self.max_model_len] * (num_tokens // self.max_model_len)
        if num_tokens % self.max_model_len:
            lens.append(num_tokens % self.max_model_len)
        groups = self._groups if self._groups is not None else self.kv_cache_groups()
        tables, next_block = [], 0
        for n in lens:
            nb = math.ceil(n / self.block_size)
            tables.append(list(range(next_block, next_block + nb)))
            next_block += nb
        self.allocate_kv_cache(next_block)
        cache_bytes = next_block * self.bytes_per_block()
        try:
            positions = np.concatenate([np.arange(n) for n in lens])
            # Each table is a contiguous run of blocks, so slots are contiguous too.
            slots = np.concatenate(
                [np.arange(n) + t[0] * self.block_size for t, n in zip(tables, lens, strict=True)]
            ).tolist()
            layout = BatchLayout(lens, lens, tables, slots, self.block_size, 0)
            md = self.attn_backend_cls.build_metadata(layout, self.device)
            input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
            positions_t = torch.from_numpy(positions).to(self.device)
            with self._no_grad():
                args: tuple[Any, ...] = (input_ids, positions_t, [md] * len(groups))
                if self.parallel.pp_size > 1:  # each stage profiles on its own
                    stage_input = None
                    if not self.parallel.is_first_stage:
                        stage_input = self._stage_buffer(num_tokens)
                        stage_input = IntermediateTensors(stage_input[0], stage_input[1])
                    args += (stage_input,)
                hidden = self.model(*args)
                if not self.parallel.is_last_stage:
                    return cache_bytes
                rows = min(sched.max_num_seqs, num_tokens)
                if self.proposer is not None and self.proposer.uses_model:
                    # A draft model / EAGLE head mirrors the same tokens in the same step.
                    aux = self.proposer.take_aux() if self.proposer.wants_aux else None
                    self.proposer.profile(input_ids, positions_t, [md] * len(groups), hidden, aux)
                if self.pooler_config is not None:  # no logits: one pooled vector per row
                    hidden[:rows].float().sum(dim=-1)
                    return cache_bytes
                logits = self.model.compute_logits(hidden[:rows])
                torch.softmax(logits, dim=-1)  # stands in for the sampler's temporaries
                if self.mm is not None:  # the vision encoder's activations at its step budget
                    mm = self.config.multimodal
                    self.mm.profile(mm.max_num_encoder_input_tokens or num_tokens)
                if isinstance(self.model, CausalLM) and hasattr(self.sampler, "warm_up"):
                    self.sampler.warm_up(self.model.compute_logits(hidden[:1], False))
        finally:
            self.free_kv_cache()
        return cache_bytes

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate the cache tensors for ``num_blocks`` blocks and attach them to the layers."""
        self.free_kv_cache()
        dtype = self._kv_dtype()
        for layers in self._cache_plan():
            first = layers[0]
            shape = self.attn_backend_cls.kv_cache_shape(
                num_blocks, self.block_size, first.num_kv_heads, first.head_size
            )
            tensor = torch.zeros(shape, dtype=dtype, device=self.device)
            self.kv_caches.append(tensor)
            for layer in layers:
                layer.kv_cache = tensor
        self.num_blocks = num_blocks
        if self.shape_buckets is not None:
            self.platform.synchronize()  # materialise the zeroed caches outside any step graph

    def free_kv_cache(self) -> None:
        self.graphs = self.verify_graphs = None  # captured graphs point at the cache tensors
        if self.proposer is not None and self.proposer.uses_model:
            self.proposer.release_graphs()
        if self.model is not None:
            for layer in self._attention_layers():
                layer.kv_cache = None
        self.kv_caches = []
        self.num_blocks = 0

    def capture_graphs(self, eager: bool = False) -> float | None:
        """Capture decode CUDA graphs (``engine.cuda_graphs``) for the allocated cache when the
        platform names a capturing class (``Platform.decode_graphs_class``: CUDA graphs, or
        the CPU's native plans), the attention backend declares ``supports_decode_graphs`` and
        ``enforce_eager`` is off. With speculative decoding the
        verification steps (``num_speculative_tokens + 1`` tokens per request) get their own
        graphs, for the batches that speculate. Returns the seconds taken, or None when graphs
        are not used. ``eager=True`` (tests) builds the same replay machinery without
        recording graphs, on any device."""
        from engine.cuda_graphs import DecodeGraphs

        graphs_cls = DecodeGraphs if eager else self.platform.decode_graphs_class()
        if not eager and (
            self.config.enforce_eager
            or graphs_cls is None
            or not getattr(self.attn_backend_cls, "supports_decode_graphs", False)
        ):
            return None
        if self.parallel.pp_size > 1:
            logger.info("decode graphs are not captured under pipeline parallelism (eager steps)")
            return None
        if graphs_cls is DecodeGraphs and not eager:
            from engine.layers.fused_moe import graph_capture_problems

            # A kernel that synchronises with the host (a reference MoE op on a platform no
            # plugin serves) would fail the capture: run eagerly and say why.
            problems = graph_capture_problems(self.model)
            if problems:
                logger.warning("decode CUDA graphs are not captured: %s", "; ".join(problems))
                return None
        if graphs_cls is not DecodeGraphs and (
            self.lora is not None or self.config.speculative is not None
        ):
            # A platform's own replay (the CPU's native plans) takes plain decode steps only.
            logger.info("decode steps stay eager with LoRA or speculative decoding here")
            return None
        assert self.model is not None and self.kv_caches, "allocate_kv_cache() first"
        from contextlib import nullcontext

        groups = self._groups if self._groups is not None else self.kv_cache_groups()
        max_num_seqs = self.config.scheduler.max_num_seqs
        args = (self.model, len(groups), self.block_size, self.max_model_len)
        # An EAGLE-3 head reads inner layers' hidden states: the graphs keep them too.
        extra = None
        if self.proposer is not None and getattr(self.proposer, "wants_aux", False):
            extra = self.proposer.take_aux
        # Collectives run inside the graphs under tensor parallelism; the process group's
        # watchdog thread must stay free to query its events during a capture.
        capture_error_mode = "thread_local" if self.parallel.world_size > 1 else "global"
        self.graphs = graphs_cls(
            *args,
            max_num_seqs,
            self.device,
            self._feedback,
            eager=eager,
            extra=extra,
            capture_error_mode=capture_error_mode,
            # Only full-attention layers cascade; that group is first when there is one.
            cascade_group=0 if self._cascade and groups[0] is None else None,
            cascade_min_batch=self.attn_backend_cls.cascade_min_decodes,
        )
        # With LoRA the graphs contain the adapter kernels, reading the mapping buffers.
        with self.lora.capturing() if self.lora is not None else nullcontext():
            seconds = self.graphs.capture()
            spec = self.config.speculative
            if spec is not None:
                self.verify_graphs = DecodeGraphs(
                    *args,
                    min(max_num_seqs, int(spec.disable_by_batch_size or max_num_seqs)),
                    self.device,
                    self._feedback,
                    query_len=int(spec.num_speculative_tokens) + 1,
                    eager=eager,
                    extra=extra,
                    capture_error_mode=capture_error_mode,
                )
                seconds += self.verify_graphs.capture()
                if self.proposer is not None and self.proposer.uses_model:
                    seconds += self.proposer.capture_graphs(eager)
        return seconds

    # ---- one step ---------------------------------------------------------------------------
    def execute(
        self,
        sched_out: SchedulerOutput,
        sampling_rows: dict[str, Any],
        prompt_logprobs: dict[str, int] | None = None,
    ) -> RunnerOutput:
        """Run one scheduled step: block copies, forward, logits where needed, sampling.

        ``sampling_rows`` maps the id of every request that samples this step to its
        ``engine.sampler.SamplingRow``; ``prompt_logprobs`` maps request ids to the number of
        top prompt logprobs wanted.
        """
        return self.collect(self.execute_async(sched_out, sampling_rows, prompt_logprobs))

    def execute_async(
        self,
        sched_out: SchedulerOutput,
        sampling_rows: dict[str, Any],
        prompt_logprobs: dict[str, int] | None = None,
    ) -> PendingStep:
        """Launch a step like ``execute`` but return before its tokens reach the host when
        that is possible (every row plain: one sample, no logprobs); ``collect`` waits.

        A decode whose input token is still a placeholder (asynchronous scheduling) reads it
        from the previous launched step's samples on the device, so steps must be launched
        in order and each one right after the one before it.
        """
        assert self.model is not None and self.kv_caches, "load_model() and allocate_kv_cache()"
        if sched_out.blocks_to_copy:
            pairs = torch.tensor(sched_out.blocks_to_copy, dtype=torch.long, device=self.device)
            for cache in self.kv_caches:
                self.attn_backend_cls.copy_blocks(cache, pairs[:, 0], pairs[:, 1])
        pending = PendingStep(RunnerOutput())
        scheduled = sched_out.scheduled
        if self.mm is not None and sched_out.free_encoder_hashes:
            self.mm.free(sched_out.free_encoder_hashes)
        if not scheduled:
            self._feedback_rows = {}
            return pending
        with self._no_grad():
            if self.lora is not None:
                self.lora.prepare(scheduled)  # adapter slots and the per-token mapping
            hidden = None
            if self.graphs is not None and not (
                self.mm is not None and self.mm.spans_any(scheduled)
            ):
                hidden = self.graphs.run(
                    scheduled, self._feedback_rows, self._graph_shared_prefix(scheduled)
                )
            if hidden is not None:  # replayed a captured decode graph
                ids = self.graphs.last_input_ids(len(scheduled))
                batch = _Batch(ids, None, [], list(range(len(scheduled) + 1)))
                batch.aux_hidden = self.graphs.last_extra(len(scheduled))
            elif self.verify_graphs is not None and any(s.spec_token_ids for s in scheduled):
                hidden = self.verify_graphs.run(scheduled, self._feedback_rows)
                if hidden is not None:  # request i's tokens at rows i * q, padded to q
                    q = self.verify_graphs.query_len
                    batch = _Batch(
                        self.verify_graphs.last_input_ids(len(scheduled)),
                        None,
                        [],
                        list(range(0, q * len(scheduled) + 1, q)),
                        [i * q + s.num_new_tokens for i, s in enumerate(scheduled)],
                    )
                    batch.aux_hidden = self.verify_graphs.last_extra(len(scheduled))
            if hidden is None:
                batch = self._prepare(scheduled)
                if batch.mm_embeds is not None:
                    # Images run only with pp_size == 1 (engine.runtime refuses them otherwise).
                    hidden = self.model(
                        batch.input_ids,
                        batch.positions,
                        batch.attn_metadata,
                        mm_embeds=batch.mm_embeds,
                    )
                elif self.parallel.pp_size == 1:
                    hidden = self.model(batch.input_ids, batch.positions, batch.attn_metadata)
                else:
                    hidden = self._run_stage(batch)
                    if hidden is None:  # not the last stage: handed on to the next one
                        self._feedback_rows = {}
                        return pending
                if self.proposer is not None and getattr(self.proposer, "wants_aux", False):
                    batch.aux_hidden = self.proposer.take_aux()
            if self.pooler_config is not None:
                self._pool(scheduled, batch, hidden, pending)
            self._sample(scheduled, batch, hidden, sampling_rows, pending)
            if self.proposer is not None and self.proposer.uses_model:
                pending.drafts = self.proposer.run(
                    scheduled,
                    batch,
                    hidden,
                    pending.sampling,
                    sampling_rows,
                    pending.last_tokens,
                    pending.accepted,
                )
            if prompt_logprobs and self.parallel.is_output_rank:
                self._prompt_logprobs(scheduled, batch, hidden, prompt_logprobs, pending.out)
        if self.shape_buckets is not None:
            # A static-shape (lazily traced, XLA) platform: run the step's whole graph - the
            # forward, the KV-cache writes, the sampling - as one, so the next step traces from
            # materialised caches instead of growing one graph across steps.
            self.platform.synchronize()
        return pending

    # ---- pipeline stages --------------------------------------------------------------------
    def _stage_buffer(self, num_tokens: int) -> torch.Tensor:
        """``[2, num_tokens, hidden]``: a stage boundary's hidden states and residual."""
        hf_config = self.config.model.hf_config
        hidden_size = (getattr(hf_config, "text_config", None) or hf_config).hidden_size
        return torch.zeros((2, num_tokens, hidden_size), dtype=self._kv_dtype(), device=self.device)

    def _run_stage(self, batch: _Batch) -> torch.Tensor | None:
        """This pipeline stage's part of a step: receive the previous stage's hidden states
        and residual (one tensor, one message), run the stage's layers, and hand the result
        to the next stage; the last stage returns the final hidden states instead (None
        elsewhere). Every stage sees the steps in the same order, so messages pair up."""
        parallel = self.parallel
        stage_input = None
        if not parallel.is_first_stage:
            received = parallel.pp.recv(
                self._stage_buffer(batch.query_start_loc[-1]), src=parallel.pp_rank - 1
            )
            stage_input = IntermediateTensors(received[0], received[1])
        out = self.model(batch.input_ids, batch.positions, batch.attn_metadata, stage_input)
        if parallel.is_last_stage:
            return out
        parallel.pp.send(torch.stack((out.hidden, out.residual)), dst=parallel.pp_rank + 1)
        return None

    def collect(self, pending: PendingStep) -> RunnerOutput:
        """Wait for a launched step's tokens and return its results (with the drafts of a
        host-side proposer, proposed now that the tokens are known)."""
        out = pending.out
        for rid, vector in pending.pooled:  # only the pooled vectors leave the device
            out.pooled[rid] = vector.cpu().numpy().astype("<f4", copy=False).tobytes()
        pending.pooled = []
        if pending.tokens is not None:
            if pending.ready is not None:
                pending.ready.synchronize()
            # Static shapes may have padded the rows: the real ones come first.
            tokens = pending.tokens.tolist()[: len(pending.request_ids)]
            for rid, token in zip(pending.request_ids, tokens, strict=True):
                out.sampled[rid] = [token]
                out.logprobs[rid] = None
            pending.tokens = pending.ready = None
        if pending.drafts is not None:  # drafted on the device by a model proposer
            entries, drafts = pending.drafts
            for entry, row in zip(entries, drafts.tolist(), strict=True):
                out.draft_token_ids[entry.request.request_id] = row[: entry.num_to_propose]
            pending.drafts = None
        if pending.proposals:
            propose = self.proposer.propose
            for request, k in pending.proposals:
                tokens = out.sampled.get(request.request_id)
                if tokens:
                    drafts = propose(request, tokens, k)
                    if drafts:
                        out.draft_token_ids[request.request_id] = drafts
            pending.proposals = []
        return out

    def _prepare(self, scheduled: list[ScheduledRequest]) -> _Batch:
        """Flatten the step (decodes first, as scheduled) into inputs and per-group metadata."""
        tokens: list[int] = []
        for s in scheduled:
            if s.spec_token_ids:  # a verification: its known token, then the drafts
                tokens += _chunk_tokens(s.request, s.start, s.num_known_tokens)
                tokens += s.spec_token_ids
            else:
                tokens += _chunk_tokens(s.request, s.start, s.num_new_tokens)
        input_ids = np.array(tokens, dtype=np.int64)
        positions, metadata, qsl = self.layout(
            [s.start for s in scheduled],
            [s.num_new_tokens for s in scheduled],
            [s.block_ids for s in scheduled],
            bidirectional_spans=self._bidirectional_spans(scheduled),
        )
        # Placeholders (asynchronous scheduling) index the previous step's samples instead.
        feedback = self._feedback_sources(scheduled, qsl, input_ids)
        if self.shape_buckets is not None:  # padded tokens: id 0 at position 0, never sampled
            pad = self.shape_buckets.pad_tokens(len(input_ids)) - len(input_ids)
            input_ids = np.pad(input_ids, (0, pad))
            if feedback is not None:
                feedback = np.pad(feedback, (0, pad), constant_values=-1)
        ids = self._to_device(input_ids)
        if feedback is not None:
            ids = gather_feedback(ids, self._to_device(feedback), self._feedback)
        return _Batch(
            input_ids=ids,
            positions=positions,
            attn_metadata=metadata,
            query_start_loc=qsl.tolist(),
            mm_embeds=self.mm.embeddings(scheduled, qsl) if self.mm is not None else None,
        )

    def _bidirectional_spans(
        self, scheduled: list[ScheduledRequest]
    ) -> list[list[tuple[int, int]]] | None:
        """Image tokens' spans (Gemma 3), or for an encoder (BERT) each whole prompt: a
        pooling request runs whole in one step, so the span lies inside its tokens."""
        if self.mm is not None:
            return self.mm.spans(scheduled)
        if getattr(self.model, "bidirectional_attention", False):
            return [[(0, s.request.num_prompt_tokens)] for s in scheduled]
        return None

    def _pool(
        self,
        scheduled: list[ScheduledRequest],
        batch: _Batch,
        hidden: torch.Tensor,
        pending: PendingStep,
    ) -> None:
        """Pool, truncate and normalise the hidden states of the requests whose whole
        prompt ran in this step (on the device; ``collect`` copies the vectors out)."""
        from engine.pooling import finish_classes, finish_embeddings, pool

        rows = [(i, s) for i, s in enumerate(scheduled) if s.pools]
        if not rows:
            return
        for _, s in rows:
            if s.start != 0 or s.num_new_tokens != s.request.num_prompt_tokens:
                raise RuntimeError(
                    f"pooling request {s.request.request_id!r} was scheduled in chunks "
                    f"({s.start}+{s.num_new_tokens} of {s.request.num_prompt_tokens} tokens)"
                )
        cfg = self.pooler_config
        qsl = batch.query_start_loc
        pooled = pool(
            hidden, [qsl[i] for i, _ in rows], [batch.end(i) for i, _ in rows], cfg.pooling_type
        )
        params = [s.request.pooling_params for _, s in rows]
        if cfg.task == "classify":
            vectors = finish_classes(self.model.classify(pooled))
        else:
            vectors = finish_embeddings(pooled, params, cfg.normalize)
        pending.pooled = [
            (s.request.request_id, v) for (_, s), v in zip(rows, vectors, strict=True)
        ]

    def _cascade_prefix(
        self, tables: list[list[int]], seq_lens: list[int], num_decodes: int
    ) -> SharedPrefix | None:
        """The shared prefix the backend attends once for this step's decodes; None: none."""
        if not self._cascade or num_decodes < max(2, self.attn_backend_cls.cascade_min_decodes):
            return None
        prefix = find_shared_prefix(tables, seq_lens, num_decodes, self.block_size)
        if prefix is not None and self.attn_backend_cls.use_cascade_attention(prefix, num_decodes):
            return prefix
        return None

    def _graph_shared_prefix(self, scheduled: list[ScheduledRequest]) -> SharedPrefix | None:
        """The shared prefix a decode graph replay of ``scheduled`` attends once (through a
        cascade graph), or None: no cascade graphs, a batch they do not hold, a step with a
        prefill (it runs eagerly and finds its prefix in ``layout``), or no prefix worth it."""
        graphs = self.graphs
        if (
            graphs.cascade_group is None
            or not graphs.takes_cascade(len(scheduled))
            or any(s.num_new_tokens != 1 for s in scheduled)
        ):
            return None
        g = graphs.cascade_group
        tables = [s.block_ids[g] for s in scheduled]
        lens = [s.start + 1 for s in scheduled]
        return self._cascade_prefix(tables, lens, len(scheduled))

    def layout(
        self,
        starts: list[int],
        query_lens: list[int],
        block_ids: list[list[list[int]]],
        bidirectional_spans: list[list[tuple[int, int]]] | None = None,
    ) -> tuple[torch.Tensor, list[AttentionMetadata], np.ndarray]:
        """Positions (on the device), per-group attention metadata and query start locations
        of a batch where request ``i`` computes ``query_lens[i]`` tokens from ``starts[i]``
        with tables ``block_ids[i]`` (one per KV-cache group; leading one-token requests are
        the backend's decodes), and request ``i``'s queries attend bidirectionally inside
        ``bidirectional_spans[i]`` (image tokens). A draft model's forward uses it too: its
        layers share the target's block tables."""
        bs = self.block_size
        groups = self._groups if self._groups is not None else self.kv_cache_groups()
        lens = np.asarray(query_lens, dtype=np.int64)
        starts_np = np.asarray(starts, dtype=np.int64)
        qsl = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=qsl[1:])
        num_tokens = int(qsl[-1])
        # Token t of request i sits at position starts[i] + (t - qsl[i]).
        positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(starts_np - qsl[:-1], lens)
        num_decodes = 0
        while num_decodes < len(lens) and lens[num_decodes] == 1:
            num_decodes += 1
        seq_lens = (starts_np + lens).tolist()
        req_of_token = np.repeat(np.arange(len(lens)), lens)
        block_of_token = positions // bs
        metadata = []
        for g in range(len(groups)):
            tables = [blocks[g] for blocks in block_ids]
            width = max(len(t) for t in tables)
            padded = np.zeros((len(tables), width), dtype=np.int64)
            for i, t in enumerate(tables):
                padded[i, : len(t)] = t
            slots = padded[req_of_token, block_of_token] * bs + positions % bs
            layout = BatchLayout(
                lens.tolist(),
                seq_lens,
                tables,
                slots.tolist(),
                bs,
                num_decodes,
                bidirectional_spans=bidirectional_spans,
                # Sliding-window layers never cascade (their old blocks are null placeholders).
                shared_prefix=(
                    self._cascade_prefix(tables, seq_lens, num_decodes)
                    if groups[g] is None
                    else None
                ),
            )
            if self.shape_buckets is not None:
                layout = self.shape_buckets.pad_layout(layout, num_tokens)
            metadata.append(self.attn_backend_cls.build_metadata(layout, self.device))
        if self.shape_buckets is not None:  # padded positions: 0, never sampled
            positions = np.pad(
                positions, (0, self.shape_buckets.pad_tokens(num_tokens) - num_tokens)
            )
        return self._to_device(positions), metadata, qsl

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A host array on the device without blocking the host: a pageable copy would wait
        for the device to finish its queue, which with asynchronous scheduling is the step
        still running."""
        tensor = torch.from_numpy(array)
        if self.device.type == "cpu":
            return tensor
        if self.device.type != "cuda":  # pinned host memory is a CUDA (and HIP) notion
            return tensor.to(self.device)
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _feedback_sources(
        self, scheduled: list[ScheduledRequest], qsl: np.ndarray, input_ids: np.ndarray
    ) -> np.ndarray | None:
        """Per input token: the index into the feedback buffer holding its value, or -1 when
        the host knows it. None when no token is a placeholder."""
        holes = np.flatnonzero(input_ids == PLACEHOLDER_TOKEN)
        if holes.size == 0:
            return None
        src = np.full(input_ids.shape, -1, dtype=np.int64)
        owner = np.searchsorted(qsl, holes, side="right") - 1
        for t, i in zip(holes.tolist(), owner.tolist(), strict=True):
            src[t] = feedback_row(self._feedback_rows, scheduled[i].request.request_id)
        return src

    def _sample(
        self,
        scheduled: list[ScheduledRequest],
        batch: _Batch,
        hidden: torch.Tensor,
        sampling_rows: dict[str, Any],
        pending: PendingStep,
    ) -> None:
        out = pending.out
        sampling = [(i, s) for i, s in enumerate(scheduled) if s.samples]
        if not sampling:
            self._feedback_rows = {}
            return
        missing = [
            s.request.request_id for _, s in sampling if s.request.request_id not in sampling_rows
        ]
        if missing:
            raise KeyError(f"no sampling row for requests that sample this step: {missing}")
        rows = [sampling_rows[s.request.request_id] for _, s in sampling]
        pending.sampling = sampling
        if self.proposer is not None and not self.proposer.uses_model:
            pending.proposals = [
                (s.request, s.num_to_propose) for _, s in sampling if s.num_to_propose
            ]
        if any(s.spec_token_ids for _, s in sampling):
            self._verify(sampling, batch, hidden, rows, pending)
            return
        if not (len(sampling) == hidden.shape[0] == batch.query_start_loc[-1]):
            last = np.array([batch.end(i) - 1 for i, _ in sampling])
            if self.shape_buckets is not None:  # static shapes: pad with greedy dummy rows
                pad = self.shape_buckets.pad_seqs(len(rows)) - len(rows)
                last = np.pad(last, (0, pad), mode="edge")
                rows = rows + [_padding_row()] * pad
            hidden = hidden[self._to_device(last)]  # else one token per request: no gather
        sampler = self.sampler
        # Samplers that are not engine.sampler.Sampler (tests, plugins) get the classic
        # synchronous ``sample`` with float32 logits.
        plain = hasattr(sampler, "sample_tokens") and all(
            isinstance(r, SamplingRow) and r.num_samples == 1 and r.params.logprobs is None
            for r in rows
        )
        native = plain and isinstance(self.model, CausalLM)
        if native and not sampler.wants_float32_logits(rows):
            logits = self.model.compute_logits(hidden, False)
        else:
            logits = self.model.compute_logits(hidden)
        ids = [s.request.request_id for _, s in sampling]
        if not plain:
            result = sampler.sample(logits, rows)
            for j, rid in enumerate(ids):  # padding rows (static shapes) come last: dropped
                out.sampled[rid] = list(result.token_ids[j])
                out.logprobs[rid] = result.logprobs[j] if result.logprobs is not None else None
            first = torch.tensor([t[0] for t in result.token_ids], device=self.device)
        else:
            first = sampler.sample_tokens(logits, rows)
            pending.request_ids = ids
            if self.device.type != "cuda":
                pending.tokens = first
            else:
                pending.tokens = torch.empty(first.shape, dtype=first.dtype, pin_memory=True)
                pending.tokens.copy_(first, non_blocking=True)
                pending.ready = torch.Event(device=self.device)
                pending.ready.record()
        num_rows = first.shape[0]  # len(ids), or its shape bucket (padding rows last)
        if num_rows > self._feedback.numel():  # only hand-built steps exceed max_num_seqs
            if self.graphs is not None:
                raise ValueError(
                    f"{num_rows} sampling rows exceed max_num_seqs={self._feedback.numel()}"
                )
            self._feedback = torch.zeros(num_rows, dtype=torch.int64, device=self.device)
        self._feedback[:num_rows].copy_(first, non_blocking=True)
        self._feedback_rows = {rid: j for j, rid in enumerate(ids)}
        pending.last_tokens = first

    def _verify(
        self,
        sampling: list[tuple[int, ScheduledRequest]],
        batch: _Batch,
        hidden: torch.Tensor,
        rows: list[Any],
        pending: PendingStep,
    ) -> None:
        """Speculative decoding: score every sampling request's drafts (the logits of its
        last ``k + 1`` positions) and keep what verification accepts. Synchronous: the
        accepted lengths decide the next step."""
        from engine.spec_decode.rejection import verify

        index: list[int] = []
        drafts = []
        for i, s in sampling:
            k = len(s.spec_token_ids)
            end = batch.end(i)
            index.extend(range(end - k - 1, end))
            drafts.append(s.spec_token_ids)
        hidden = hidden[self._to_device(np.asarray(index, dtype=np.int64))]
        float32 = not isinstance(self.model, CausalLM) or self.sampler.wants_float32_logits(rows)
        logits = self.model.compute_logits(hidden, float32)
        draft_probs = None
        if self.proposer is not None and self.proposer.uses_model:
            draft_probs = [
                self.proposer.take_draft_probs(s.request, len(s.spec_token_ids))
                for _, s in sampling
            ]
        result = verify(self.sampler, logits, rows, drafts, draft_probs)
        out = pending.out
        last = []
        for (_, s), tokens, lps in zip(sampling, result.token_ids, result.logprobs, strict=True):
            rid = s.request.request_id
            out.sampled[rid] = tokens
            out.logprobs[rid] = lps
            last.append(tokens[-1])
        # The feedback buffer holds each row's newest token (nothing reads it before the next
        # step is scheduled from the host's tokens, but it stays consistent).
        n = min(len(last), self._feedback.numel())
        last_tokens = torch.tensor(last, dtype=torch.int64, device=self.device)
        self._feedback[:n].copy_(last_tokens[:n])
        self._feedback_rows = {s.request.request_id: j for j, (_, s) in enumerate(sampling[:n])}
        pending.last_tokens = last_tokens
        pending.accepted = result.token_ids

    def _prompt_logprobs(
        self,
        scheduled: list[ScheduledRequest],
        batch: _Batch,
        hidden: torch.Tensor,
        wanted: dict[str, int],
        out: RunnerOutput,
    ) -> None:
        for i, s in enumerate(scheduled):
            rid = s.request.request_id
            if rid not in wanted:
                continue
            prompt = s.request.prompt_token_ids
            entries: list[dict[int, Logprob] | None] = []
            # Position p predicts prompt token p + 1.
            end = min(s.start + s.num_new_tokens, len(prompt) - 1)
            base = batch.query_start_loc[i] - s.start
            for lo in range(s.start, end, _PROMPT_LOGPROB_CHUNK):
                hi = min(end, lo + _PROMPT_LOGPROB_CHUNK)
                logits = self.model.compute_logits(hidden[base + lo : base + hi])
                entries += self.sampler.compute_prompt_logprobs(
                    logits, prompt[lo + 1 : hi + 1], wanted[rid]
                )
            out.prompt_logprobs[rid] = entries
