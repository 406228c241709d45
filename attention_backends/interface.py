"""The ``AttentionBackend`` interface and the metadata every backend receives.

Conventions shared by all backends (the reference backend in ``torch_ref.py`` is the spec):

* The model runner flattens one scheduled step into ``T`` tokens from ``B`` requests, **decodes
  first** (query length 1), then prefill chunks. Request ``i`` owns query tokens
  ``query_start_loc[i]:query_start_loc[i+1]``; its context after this step holds
  ``seq_lens[i]`` tokens, the last ``query_len`` of which are the new ones, so the new tokens sit
  at positions ``seq_lens[i] - query_len .. seq_lens[i] - 1``.
* ``slot_mapping[t] = block_id * block_size + offset`` is where token ``t``'s key/value go;
  a negative slot marks a padding token whose key/value must not be written.
* Query ``i`` at position ``p`` sees key position ``j`` iff ``j <= p`` and, with a sliding window
  ``W``, ``p - j < W`` (the Hugging Face convention).
* **Bidirectional spans** (a backend that sets ``supports_bidirectional_spans``): a request may
  name position spans ``[s, e)`` (``BatchLayout.bidirectional_spans``, the placeholder tokens of
  one image in Gemma 3) inside which every query also sees the keys after it: a query at ``p``
  in ``[s, e)`` sees ``j`` iff ``j <= p`` or ``j < e`` (and the window, ``p - j < W``, still
  holds). A span lies whole inside one step's new tokens or already-cached ones plus them.
* **A shared prefix** (a backend that sets ``supports_cascade_attention``): when decodes of a
  step start with the same physical blocks, the model runner finds them as a ``SharedPrefix``
  (its length in tokens, whole blocks all cached before the step, and the decodes that hold
  it) and, if the backend's ``use_cascade_attention`` accepts it, passes it on the device as
  ``AttentionMetadata.cascade`` (``CascadeInputs``); the backend may then attend over those
  blocks once for all those decodes and over each one's own rest separately, merging the two
  by their log-sum-exp (cascade attention). The result is the same attention. The inputs are
  read on the device, so captured decode graphs replay cascade steps too.
* Logit soft-capping, when set, maps a score ``s`` to ``cap * tanh(s / cap)`` before softmax.
* **Attention sinks** (a backend that sets ``supports_attention_sinks``; GPT-OSS): the layer
  sets ``AttentionBackend.sinks``, a float32 ``[num_heads]`` tensor of learned logits (this
  rank's heads), and query head ``h`` weighs its visible keys by
  ``p_j = exp(x_j) / (exp(sinks[h]) + sum_k exp(x_k))`` (``x`` the scaled, possibly
  soft-capped scores): the sink is one more softmax score with no value, so the weights sum to
  less than one. The sink is never soft-capped or masked, and it joins each query's softmax
  exactly once, however a backend splits the context (split-K slices, a cascade prefix). A
  query always sees at least its own key, so the denominator has a key term too. ``sinks``
  None (the default) is plain softmax.
* An fp8 KV cache (a backend lists the float8 dtypes it stores in
  ``supported_kv_cache_dtypes``) holds keys and values cast to that dtype (scale 1: the cast
  rounds, it does not rescale); attention reads them back as the compute dtype. The cache
  tensor's dtype says which one is in use.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch


# ``AttentionSpec.kv_cache_dtype`` spellings -> the float8 torch dtype name (None: the model
# dtype). "auto" and "fp8" are the engine's ``--kv-cache-dtype`` values.
KV_CACHE_DTYPE_NAMES: dict[str | None, str | None] = {"auto": None, "fp8": "float8_e4m3fn"}


@dataclass
class AttentionSpec:
    """What a model and cache ask of an attention backend. ``None`` means "not known yet"
    (``engine plugins`` checks backends before any model is chosen)."""

    device_type: str | None = None
    dtype: str | None = None  # float32 | bfloat16 | float16
    head_size: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    block_size: int | None = None
    sliding_window: bool = False
    logit_softcap: bool = False
    # The KV cache's dtype when it differs from the model dtype: a float8 torch dtype name
    # ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2"); None (or "auto") stores the model
    # dtype. The engine's ``--kv-cache-dtype fp8`` asks for "float8_e4m3fn" (``fp8`` is
    # accepted as that name).
    kv_cache_dtype: str | None = None
    # Queries see later keys inside given spans (image tokens of Gemma 3; see the module doc).
    bidirectional_spans: bool = False
    # A learned per-head logit joins every query's softmax (GPT-OSS; see the module doc): the
    # model class says so with ``attention_sinks = True``.
    attention_sinks: bool = False


@dataclass
class BatchLayout:
    """One step's batch in plain Python (CPU) form, from which a backend builds its metadata.

    ``block_tables[i]`` are request i's physical block ids for one KV-cache group.
    """

    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: list[int]
    block_size: int
    num_decodes: int  # the first num_decodes requests have query_len == 1
    # The block table's width when it must be wider than the longest table (static shapes:
    # ``engine.shape_buckets``); None: the longest table's length.
    table_width: int | None = None
    # Per request, the position spans [start, end) whose queries attend bidirectionally within
    # the span (see the module docstring); None: none in this step.
    bidirectional_spans: list[list[tuple[int, int]]] | None = None
    # A prefix that decodes of this step hold in the same blocks, for a backend that runs
    # cascade attention over it (see the module docstring); None: attend as usual.
    shared_prefix: SharedPrefix | None = None


@dataclass(frozen=True)
class SharedPrefix:
    """A prefix that several decodes of one step hold in the same physical blocks: ``length``
    tokens (whole blocks, all cached before the step) of the block table of ``rows[0]``, held
    by the decodes ``rows`` (ascending indices below ``num_decodes``)."""

    length: int
    rows: tuple[int, ...]

    def write(self, starts, pair) -> None:
        """Write the device form (``CascadeInputs``) into host arrays: ``starts`` (each
        decode's start after the prefix: the length for the rows that hold it, 0 for the
        others) and ``pair`` (the length, and the block-table row of the first holder)."""
        starts[:] = 0
        starts[list(self.rows)] = self.length
        pair[0], pair[1] = self.length, self.rows[0]


def find_shared_prefix(
    block_tables: list[list[int]], seq_lens: list[int], num_decodes: int, block_size: int
) -> SharedPrefix | None:
    """The shared prefix among the first ``num_decodes`` requests that saves the most reads:
    among the decodes whose first block is the most common one, the length ``L`` (in whole
    blocks below each one's newest token) that maximises ``(decodes holding L - 1) * L``.
    None when no two decodes share a block. Requests that joined later and computed the same
    prompt again (in the step that first cached it) hold other blocks: they are left out
    rather than cancelling the sharing of the rest."""
    if num_decodes < 2:
        return None
    from collections import Counter

    tables = block_tables[:num_decodes]
    first, count = Counter(t[0] if t else -1 for t in tables).most_common(1)[0]
    if count < 2 or first < 0:
        return None
    import numpy as np

    members = [i for i, t in enumerate(tables) if t and t[0] == first]
    usable = [min(len(tables[i]), (seq_lens[i] - 1) // block_size) for i in members]
    longest = max(usable)
    if longest <= 0:
        return None
    # Each member's shared length with the longest member's table (all share its block 0).
    # This runs on every decode step over hundreds of tables, so it compares list slices
    # (C-level): first the previous member's length (most members share the same prefix),
    # else a bisection (prefix equality is monotone in the length).
    ref = tables[members[usable.index(longest)]]
    shared = np.empty(len(members), dtype=np.int64)
    guess, ref_head = 0, []
    for row, (i, n) in enumerate(zip(members, usable, strict=True)):
        table = tables[i]
        g = min(guess, n)
        head_matches = table[:g] == (ref_head if g == guess else ref[:g])
        if head_matches and (g == n or table[g] != ref[g]):
            shared[row] = g
            continue
        lo, hi = (g, n + 1) if head_matches else (0, g)  # table[:lo] matches, table[:hi] not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if table[:mid] == ref[:mid]:
                lo = mid
            else:
                hi = mid
        shared[row] = guess = lo
        ref_head = ref[:guess]
    order = np.sort(shared)[::-1]  # order[k - 1]: the k-th longest; k members hold >= it
    gains = (np.arange(len(order))) * order  # (k - 1) * L_k
    best = int(gains.argmax())
    length = int(order[best])
    if length <= 0 or gains[best] <= 0:
        return None
    rows = tuple(members[r] for r in np.flatnonzero(shared >= length).tolist())
    return SharedPrefix(length * block_size, rows)


@dataclass
class CascadeInputs:
    """A ``SharedPrefix`` as the backend reads it, on the device: ``starts`` (int32
    ``[num_decodes]``: the prefix length for the decodes that hold it, 0 for the others) and
    ``prefix`` (int32 ``[2]``: the length in tokens, and a decode's row of the block table
    whose first blocks are the prefix). In an eager step ``build_metadata`` makes them; in a
    captured decode graph they are static buffers the runner fills before each replay, so
    one graph serves every prefix."""

    starts: torch.Tensor
    prefix: torch.Tensor

    @classmethod
    def from_prefix(
        cls, prefix: SharedPrefix, num_decodes: int, device: torch.device | str
    ) -> CascadeInputs:
        """One host-to-device copy of ``prefix``'s starts and (length, first holder)."""
        import torch

        host = torch.empty(num_decodes + 2, dtype=torch.int32)
        prefix.write(host[:num_decodes], host[num_decodes:])
        buf = host.to(device)
        return cls(starts=buf[:num_decodes], prefix=buf[num_decodes:])

    @classmethod
    def of_layout(cls, layout: BatchLayout, device: torch.device | str) -> CascadeInputs | None:
        """``from_prefix`` of the layout's shared prefix; None when it has none."""
        if layout.shared_prefix is None:
            return None
        return cls.from_prefix(layout.shared_prefix, layout.num_decodes, device)


@dataclass
class AttentionMetadata:
    """Tensors (on the model's device) describing one step's batch for one KV-cache group."""

    num_actual_tokens: int
    num_seqs: int
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    block_size: int
    query_start_loc: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B]
    block_table: torch.Tensor  # int32 [B, max_blocks]
    slot_mapping: torch.Tensor  # int64 [T]
    # Host copies, for backends that loop over requests in Python.
    query_start_loc_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    # Per request, bidirectional position spans (BatchLayout.bidirectional_spans), or None.
    bidirectional_spans_cpu: list[list[tuple[int, int]]] | None = None
    # BatchLayout.shared_prefix on the device, for cascade attention (None: attend as usual).
    cascade: CascadeInputs | None = None


class AttentionBackend(ABC):
    """A named attention implementation over the paged KV cache.

    Subclass it in a plugin and return the class from ``engine_attention_backends()``. The class
    attributes declare what the backend can serve; ``supports`` turns them into reasons.
    """

    name: ClassVar[str] = "unnamed"
    device_types: ClassVar[tuple[str, ...]] = ("cpu",)
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16", "float16")
    supported_head_sizes: ClassVar[tuple[int, ...] | None] = None  # None: any
    supported_block_sizes: ClassVar[tuple[int, ...] | None] = None  # None: any
    supports_sliding_window: ClassVar[bool] = False
    supports_logit_softcap: ClassVar[bool] = False
    # Float8 dtypes (torch names) this backend can keep the KV cache in, besides the model
    # dtype; empty: none. Since plugin API 1.1. A cache of such a dtype stores
    # ``key / k_scale`` and ``value / v_scale`` (the layer's ``k_scale`` / ``v_scale``, 1.0
    # unless the checkpoint gives them) rounded to it, as the reference ``write_kv_cache`` does,
    # and attention multiplies them back; ``--kv-cache-dtype fp8`` is "float8_e4m3fn".
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ()
    # True when ``forward`` on a pure-decode batch reads every length and table from the
    # metadata's tensors (never from its Python numbers or host lists beyond the batch size), so
    # the model runner may capture it in a CUDA graph and replay it with new tensors.
    supports_decode_graphs: ClassVar[bool] = False
    # True when ``forward`` honours ``AttentionMetadata.bidirectional_spans_cpu`` (queries see
    # later keys inside a span: image tokens of Gemma 3).
    supports_bidirectional_spans: ClassVar[bool] = False
    # True when ``forward`` honours ``self.sinks`` (attention sinks: a learned per-head logit
    # in each query's softmax, GPT-OSS; see the module docstring). A backend without it is
    # never given sinks: selection refuses it for such a model.
    supports_attention_sinks: ClassVar[bool] = False
    # True when ``forward`` honours ``AttentionMetadata.cascade`` (cascade attention over a
    # prefix many decodes share; see the module docstring), in captured decode graphs too
    # (``supports_decode_graphs``). The model runner then looks for one in each step.
    supports_cascade_attention: ClassVar[bool] = False
    # The fewest decodes ``use_cascade_attention`` ever accepts: no cascade decode graph is
    # captured for smaller batches.
    cascade_min_decodes: ClassVar[int] = 2

    @classmethod
    def use_cascade_attention(cls, prefix: SharedPrefix, num_decodes: int) -> bool:
        """Whether ``prefix`` (held by ``len(prefix.rows)`` of the step's ``num_decodes``
        decodes) should be attended once for them all: the backend's cost model."""
        return False

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        """Reasons independent of the model, e.g. a missing optional package. Cheap."""
        return []

    @classmethod
    def supports(cls, spec: AttentionSpec) -> list[str]:
        """Human-readable reasons this backend cannot serve ``spec``; empty when it can."""
        reasons = list(cls.unavailable_reasons())
        if spec.device_type is not None and spec.device_type not in cls.device_types:
            reasons.append(f"runs on {'/'.join(cls.device_types)} devices, not {spec.device_type}")
        if spec.dtype is not None and spec.dtype not in cls.supported_dtypes:
            reasons.append(
                f"dtype {spec.dtype} not supported (supported: {', '.join(cls.supported_dtypes)})"
            )
        if (
            spec.head_size is not None
            and cls.supported_head_sizes is not None
            and spec.head_size not in cls.supported_head_sizes
        ):
            reasons.append(
                f"head size {spec.head_size} not supported "
                f"(supported: {', '.join(map(str, cls.supported_head_sizes))})"
            )
        if (
            spec.block_size is not None
            and cls.supported_block_sizes is not None
            and spec.block_size not in cls.supported_block_sizes
        ):
            reasons.append(
                f"block size {spec.block_size} not supported "
                f"(supported: {', '.join(map(str, cls.supported_block_sizes))})"
            )
        if spec.sliding_window and not cls.supports_sliding_window:
            reasons.append("sliding-window attention not supported")
        if spec.logit_softcap and not cls.supports_logit_softcap:
            reasons.append("logit soft-capping not supported")
        if spec.attention_sinks and not cls.supports_attention_sinks:
            reasons.append(
                "attention sinks (a learned per-head softmax logit, GPT-OSS) not supported"
            )
        if spec.bidirectional_spans and not cls.supports_bidirectional_spans:
            reasons.append(
                "bidirectional attention within image tokens (Gemma 3 vision) not supported; "
                "serve text-only with --limit-mm-per-prompt '{\"image\": 0}' to use this backend"
            )
        kv = KV_CACHE_DTYPE_NAMES.get(spec.kv_cache_dtype, spec.kv_cache_dtype)
        if kv is not None and kv not in cls.supported_kv_cache_dtypes:
            supported = ", ".join(cls.supported_kv_cache_dtypes) or "none"
            asked = kv if kv == spec.kv_cache_dtype else f"{spec.kv_cache_dtype} ({kv})"
            reasons.append(
                f"KV cache dtype {asked} not supported (fp8 caches supported: {supported})"
            )
        return reasons

    @classmethod
    def kv_cache_shape(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor. The default layout is
        ``(2, num_blocks, block_size, num_kv_heads, head_size)``: keys then values."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def copy_blocks(cls, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks ``src[i] -> dst[i]`` (int64 tensors on the cache's device) inside
        one layer's cache, keys and values (copy-on-write). Override with ``kv_cache_shape``
        when the block dim is not dim 1."""
        if kv_cache.element_size() == 1:  # fp8: CPU index kernels have no float8 versions
            import torch

            kv_cache = kv_cache.view(torch.uint8)
        kv_cache[:, dst] = kv_cache[:, src]

    @classmethod
    def build_metadata(cls, layout: BatchLayout, device: torch.device) -> AttentionMetadata:
        """Turn a step's ``BatchLayout`` into tensors on ``device``. Override to add fields."""
        import torch

        qsl = [0]
        for n in layout.query_lens:
            qsl.append(qsl[-1] + n)
        width = max((len(t) for t in layout.block_tables), default=0) or 1
        width = max(width, layout.table_width or 0)
        table = torch.zeros((len(layout.block_tables), width), dtype=torch.int32)
        for i, blocks in enumerate(layout.block_tables):
            if blocks:
                table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        return AttentionMetadata(
            num_actual_tokens=qsl[-1],
            num_seqs=len(layout.query_lens),
            num_decodes=layout.num_decodes,
            max_query_len=max(layout.query_lens, default=0),
            max_seq_len=max(layout.seq_lens, default=0),
            block_size=layout.block_size,
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(layout.seq_lens, dtype=torch.int32, device=device),
            block_table=table.to(device),
            slot_mapping=torch.tensor(layout.slot_mapping, dtype=torch.int64, device=device),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=list(layout.seq_lens),
            bidirectional_spans_cpu=layout.bidirectional_spans,
            cascade=CascadeInputs.of_layout(layout, device),
        )

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        num_kv_heads: int,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        # Per-layer scales of an FP8 KV cache (the loader sets them from the checkpoint).
        self.k_scale = 1.0
        self.v_scale = 1.0
        # Attention sinks (see the module docstring): float32 [num_heads] on the layer's
        # device, this rank's heads, set by the ``Attention`` layer (a parameter the model
        # loads) when the model has them and the backend ``supports_attention_sinks``; None:
        # no sinks. Set after construction so that ``__init__``'s signature stays the same.
        self.sinks: torch.Tensor | None = None

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Write ``key``/``value`` ([T, num_kv_heads, head_size]) into ``kv_cache`` at
        ``metadata.slot_mapping``, then attend ``query`` ([T, num_heads, head_size]) over each
        request's cached context. Returns [T, num_heads, head_size] in the query's dtype."""


def _uint8():
    import torch

    return torch.uint8
