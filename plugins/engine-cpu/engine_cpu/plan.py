"""Native plans: a CPU decode step recorded once, then run by one foreign call.

On the CPU a decode step of a small model is about 150 compiled kernel calls (products, norms,
rotary, attention, activations) of a few microseconds to a few hundred each, and the Python
that calls them (modules, wrappers, argument checks) costs about as much as the work: the
embedded Gemma 3 270M spent 11 of its 24.5 ms a step outside the kernels on a 2-core EPYC.
``CpuDecodePlans`` does for the CPU what CUDA graphs do for a GPU, through the same static
buffers (``engine.cuda_graphs.DecodeGraphs``, whose subclass it is):

* The first decode step of each batch size runs the model as usual while a ``PlanRecorder``
  takes every compiled call down (``engine_cpu.native.Kernel``: the function's twin and its
  arguments as int64 words), and a ``CaptureGuard`` (a torch dispatch mode) watches every
  torch op in between. Views, no-op casts and allocations are fine; anything that computes
  (a torch op the recording would not repeat) or reads a tensor's value on the host makes the
  recording fail, with the op named in one log line, and the steps stay eager.
* The buffers the step allocated are then laid out in one arena by their lifetimes (first and
  last recorded use; a buffer whose life has ended gives its bytes to a later one, as a CUDA
  graph's memory pool does), and the recorded pointers into them are moved there. Pointers
  into anything else (weights, the KV cache, the static inputs, scratch buffers the kernels
  keep) stay as recorded: that memory outlives the plans, which are dropped with the cache.
* Later steps of that size copy their inputs into the static buffers and call
  ``cpu_plan_run`` once (``csrc/cpu_plan.c``); the hidden states are a view of the arena,
  valid until the next step.

Like a CUDA graph, a plan assumes that the forward decides nothing from a step's values on the
host (only from its batch size): the attention backend declares ``supports_decode_graphs``
(the ``cpu`` backend's compiled decode reads lengths, tables and slots from tensors), and a
float16 or FP8 KV cache, which the reference attention serves, keeps the steps eager. A
recording whose forward raises falls back to the eager step, with a warning.

Batches are recorded at their exact size (padding costs real arithmetic on a CPU) up to
``MAX_PLAN_BATCH``: above it the kernels' own time dwarfs the Python's. Steps with prefill
chunks, LoRA and speculative verification stay eager. ``--enforce-eager`` turns plans off.
"""

from __future__ import annotations

import bisect
import logging
import struct
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.cuda_graphs import DecodeGraphs, gather_feedback
from engine_cpu import native

logger = logging.getLogger(__name__)

MAX_PLAN_BATCH = 64
_ALIGN = 64

# torch ops that allocate (their results become arena buffers) ...
_ALLOCATIONS = frozenset(
    {
        "aten.empty.memory_format",
        "aten.empty_like.default",
        "aten.empty_strided.default",
        "aten.new_empty.default",
        "aten.new_empty_strided.default",
    }
)
# ... and ops that only look at a tensor's metadata (no data read or written).
_METADATA = frozenset({"aten.resolve_neg.default", "aten.resolve_conj.default"})


_NATIVE_CACHES = (torch.float32, torch.bfloat16)


class PlanRecordingError(RuntimeError):
    """A decode step cannot be recorded into a native plan (the message says why)."""


class _RecordingFailed(RuntimeError):
    """The recorded step raised: the runner takes it eagerly instead."""


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class CaptureGuard(TorchDispatchMode):
    """A dispatch mode over the recorded step: keeps every tensor the step allocates (so no
    address is reused within the recording) and notes every op that computes rather than
    views, casts in place of nothing, or allocates."""

    def __init__(self) -> None:
        super().__init__()
        self.allocations: list[torch.Tensor] = []
        self.refused: list[str] = []

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Nothing here runs under torch.compile; torch would otherwise wrap the hook to keep
        # Dynamo out, importing torch._dynamo (1.2 s) on a recording's first op.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if name in _ALLOCATIONS:
            self.allocations.append(out)
        elif name not in _METADATA and not self._aliases(func, args, out):
            self.refused.append(name)
        return out

    @staticmethod
    def _aliases(func, args, out) -> bool:
        """Whether ``out`` is a view (or the very tensor) of an input, made without writing."""
        if func._schema.is_mutable:
            return False
        outs = out if isinstance(out, (list, tuple)) else (out,)
        if not outs or not all(_strided(o) for o in outs):
            return False  # a Python number read off a tensor, say
        inputs = {
            a.untyped_storage().data_ptr()
            for a in torch.utils._pytree.tree_leaves(args)
            if _strided(a)
        }
        return all(o.untyped_storage().data_ptr() in inputs for o in outs)


def _strided(t: Any) -> bool:
    """A tensor with a storage (not an opaque one, like a oneDNN-packed weight)."""
    return isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_mkldnn


class PlanRecorder:
    """Takes down the compiled calls of one step (set as ``native.Kernel.recorder``)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, list[int], str]] = []
        self.refused: list[str] = []

    def record(self, kernel: native.Kernel, args: tuple[Any, ...]) -> None:
        if kernel.twin is None:
            self.refused.append(kernel.name)
            return
        words = []
        for kind, value in zip(kernel.kinds, args, strict=True):
            if kind == "f":
                words.append(struct.unpack("<q", struct.pack("<d", float(value)))[0])
            else:
                words.append(int(value or 0))
        self.calls.append((kernel.twin, words, kernel.kinds))


class NativePlan:
    """A recorded step: the flat plan array, the arena it points into, and the output."""

    def __init__(self, array: torch.Tensor, count: int, arena: torch.Tensor, output: torch.Tensor):
        self.array, self.count, self.arena, self.output = array, count, arena, output
        self._lib = native.load("avx2")

    def run(self) -> torch.Tensor:
        self._lib.cpu_plan_run(self.array.data_ptr(), self.count)
        return self.output


def _owner(spans: list[tuple[int, int]], starts: list[int], ptr: int) -> int | None:
    """The index of the span (start, bytes) that holds ``ptr``, or None."""
    i = bisect.bisect_right(starts, ptr) - 1
    if i >= 0 and ptr < spans[i][0] + max(spans[i][1], 1):
        return i
    return None


def _layout(
    calls, allocations, output: torch.Tensor
) -> tuple[list[tuple[int, int]], list[int], list[int], int]:
    """Offsets in one arena for the recording's ``allocations`` (by their storages), so that
    two buffers whose recorded uses overlap never share bytes; the ``output``'s buffer lives to
    the end. Returns (storage spans as (start, bytes), their starts, offsets, arena bytes);
    unused buffers get no bytes (offset -1)."""
    spans = sorted({_storage(t) for t in allocations})
    starts = [s for s, _n in spans]
    first = [None] * len(spans)
    last = [-1] * len(spans)

    def owner(ptr: int) -> int | None:
        return _owner(spans, starts, ptr)

    for c, (_fn, words, kinds) in enumerate(calls):
        for kind, word in zip(kinds, words, strict=True):
            if kind == "p" and word:
                i = owner(word)
                if i is not None:
                    first[i] = c if first[i] is None else first[i]
                    last[i] = c
    out_owner = owner(output.data_ptr())
    if out_owner is None:
        raise PlanRecordingError("the step's output is not a buffer it allocated")
    if first[out_owner] is None:
        raise PlanRecordingError("no compiled kernel wrote the step's output")
    last[out_owner] = len(calls)
    # In order of first use, each at the lowest offset that is free over its whole lifetime.
    order = sorted((i for i in range(len(spans)) if first[i] is not None), key=lambda i: first[i])
    placed: list[tuple[int, int, int, int]] = []  # (offset, end, first, last)
    offsets = [-1] * len(spans)
    top = 0
    for i in order:
        size = -(-spans[i][1] // _ALIGN) * _ALIGN
        busy = sorted((o, e) for o, e, f, end in placed if not (end < first[i] or last[i] < f))
        offset = 0
        for o, e in busy:
            if offset + size <= o:
                break
            offset = max(offset, e)
        placed.append((offset, offset + size, first[i], last[i]))
        offsets[i] = offset
        top = max(top, offset + size)
    return spans, starts, offsets, top


def build_plan(calls, allocations, output: torch.Tensor) -> NativePlan:
    """The plan of a recording: its buffers moved into one arena (see ``_layout``)."""
    spans, starts, offsets, size = _layout(calls, allocations, output)
    arena = torch.empty(max(size, _ALIGN) + _ALIGN, dtype=torch.uint8)
    base = arena.data_ptr() + (-arena.data_ptr() % _ALIGN)

    def moved(ptr: int) -> int:
        i = _owner(spans, starts, ptr)
        if i is not None and offsets[i] >= 0:
            return base + offsets[i] + (ptr - spans[i][0])
        return ptr

    words: list[int] = []
    for fn, args, kinds in calls:
        words += [fn, len(args)]
        words += [moved(w) if k == "p" and w else w for k, w in zip(kinds, args, strict=True)]
    array = torch.from_numpy(np.asarray(words, dtype=np.int64))
    # The output at its new place: the same shape and strides over the arena's bytes.
    at = moved(output.data_ptr()) - arena.data_ptr()
    out = arena.view(output.dtype).as_strided(
        output.shape, output.stride(), at // output.element_size()
    )
    return NativePlan(array, len(calls), arena, out)


class CpuDecodePlans(DecodeGraphs):
    """``DecodeGraphs`` for the CPU: decode steps run as native plans (module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        num_groups: int,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        device: torch.device,
        feedback: torch.Tensor,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("query_len", 1) != 1:
            raise ValueError("native plans record decode steps only (one token a request)")
        kwargs.update(eager=True, cascade_group=None)  # host buffers, no CUDA events
        batch = min(max_num_seqs, MAX_PLAN_BATCH)
        super().__init__(
            model, num_groups, block_size, max_model_len, batch, device, feedback, **kwargs
        )
        self.sizes = list(range(1, self.max_batch + 1))  # exact sizes, recorded on first use
        self._plans: dict[int, NativePlan] = {}
        self._refused: str | None = None

    def capture(self) -> float:
        seconds = super().capture()  # eager: zeroes the static buffers
        # The compiled attention reads float32 and bfloat16 caches; any other (float16, FP8)
        # goes through the reference, which needs the host-side lengths a replay lacks.
        caches = {
            m.kv_cache.dtype
            for m in self.model.modules()
            if isinstance(getattr(m, "kv_cache", None), torch.Tensor)
        }
        other = sorted(str(d).replace("torch.", "") for d in caches - set(_NATIVE_CACHES))
        if other:
            self._refused = f"a {', '.join(other)} KV cache (plans read float32 or bfloat16)"
            logger.info("decode steps stay eager: %s", self._refused)
        else:
            logger.info(
                "decode steps of 1..%d requests run as native plans (recorded on first use)",
                self.max_batch,
            )
        return seconds

    def run(self, scheduled, feedback_rows=None, shared_prefix=None):
        if self._refused is not None or shared_prefix is not None:
            return None
        try:
            return super().run(scheduled, feedback_rows, None)
        except _RecordingFailed:
            return None  # the runner runs this step eagerly, as every later one

    def _execute(self, n: int, cascade: bool) -> torch.Tensor:
        ids = self._ids(n)
        t = 2 * self.max_tokens
        if (self._np_i64[t : t + n] >= 0).any():  # asynchronous scheduling's in-flight tokens
            ids.copy_(gather_feedback(ids, self._sources(n), self.feedback))
        self._last_ids, self._last_extra = ids, None
        plan = self._plans.get(n)
        if plan is not None:
            return plan.run()
        return self._record(n)

    @torch.inference_mode()
    def _record(self, n: int) -> torch.Tensor:
        """Run the model for ``n`` requests while recording it; the step's own output."""
        recorder, guard = PlanRecorder(), CaptureGuard()
        native.Kernel.recorder = recorder
        try:
            with guard:
                hidden = self.model(self._ids(n), self._positions(n), self._metadata(n))
        except Exception as e:
            # A path the replay's static inputs do not serve (one that wants host-side
            # lengths, say). Whatever it wrote to the cache, the eager step rewrites alike.
            self._refused = f"the recorded step failed ({type(e).__name__}: {e})"
            logger.warning("decode steps stay eager: %s", self._refused)
            raise _RecordingFailed from e
        finally:
            native.Kernel.recorder = None
        try:
            if guard.refused:
                names = ", ".join(sorted(set(guard.refused)))
                raise PlanRecordingError(f"torch ops between the compiled kernels ({names})")
            if recorder.refused:
                names = ", ".join(sorted(set(recorder.refused)))
                raise PlanRecordingError(f"compiled kernels a plan cannot call yet ({names})")
            self._plans[n] = build_plan(recorder.calls, guard.allocations, hidden)
        except PlanRecordingError as e:
            self._refused = str(e)
            logger.info("decode steps stay eager on this model: %s", e)
        return hidden
