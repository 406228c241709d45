"""Per-step time split for benchmarks: where an engine step's wall time goes.

``StepProfiler(llm_engine)`` wraps, on that one engine object, the scheduler's ``schedule``, the
runner's ``execute_async`` and ``collect`` and the model's forward (or the replay of a captured
graph), and records CUDA events from the launch of the first model kernel to the end of the
step's work on the stream (the copy of the sampled tokens to the host). A step's GPU span is the
time between those events; the rest of the wall time is time in which the GPU waits for the
host: scheduling, input preparation, sampling bookkeeping, detokenisation and stop checks that
the engine could not overlap with the device (with asynchronous scheduling most of them run
while the next step is on the device). ``collect_s`` is the host's time blocked waiting for
tokens. For replayed decode graphs an event after the replay also splits the span into the
forward pass (the graph) and the rest (logits, sampling, the copy of the tokens to the host),
and spans are averaged per batch size. For the steps that run eagerly (prefill chunks, mixed
steps) ``eager_launch_s`` is the host's time in ``execute_async`` launching them, against their
GPU span ``eager_gpu_span_s``.

``StepProfiler(engine, expert_load=True)`` also counts, for a mixture-of-experts model, the
tokens routed to each expert of every MoE layer during the profiled steps
(``engine.layers.fused_moe``: a few device ops per layer and step, so off by default; the
decode graphs are captured again with the counting in them) and ``summary()["expert_load"]``
reports each layer's tokens per expert and how far the busiest expert is above the mean.
"""

from __future__ import annotations

import time
from typing import Any


class StepProfiler:
    """Accumulates per-step timings of one ``LLMEngine``; ``summary()`` returns them."""

    def __init__(self, engine: Any, expert_load: bool = False) -> None:
        import torch

        self.engine = engine
        self.expert_load = expert_load and self._start_expert_load(engine.runner)
        self.cuda = engine.runner.device.type == "cuda"
        self.steps = 0
        self.decode_steps = 0
        self.step_s = 0.0
        self.schedule_s = 0.0
        self.execute_s = 0.0
        self.collect_s = 0.0
        self.cascade_graph_steps = 0
        self._pending_start: Any = None
        self._pending_graph_end: Any = None
        self._batch = 0
        # (start, end of graph replay or None, end, batch size) per step
        self._spans: list[tuple[Any, Any, Any, int]] = []
        # Host seconds spent in execute_async for the steps that ran eagerly.
        self._eager_launch_s = 0.0
        self._torch = torch
        self._wrap()

    @staticmethod
    def _start_expert_load(runner: Any) -> bool:
        """Turn on the MoE layers' load counters (False: not a MoE model) and, when decode
        graphs were captured without them, capture the graphs again (before any wrapping)."""
        from engine.layers.fused_moe import enable_expert_load_counting, read_expert_load

        if getattr(runner, "model", None) is None:
            raise SystemExit(
                f"--expert-load counts on the model in this process; with the "
                f"{getattr(runner, 'name', 'multi-process')} executor the model runs in worker "
                "processes: run the count with --tensor-parallel-size 1"
            )
        if not enable_expert_load_counting(runner.model):
            return False
        if runner.graphs is not None:
            runner.capture_graphs()
        read_expert_load(runner.model, reset=True)  # the capture's warm-up runs counted too
        return True

    def _event(self) -> Any:
        ev = self._torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _mark_forward(self) -> None:
        if self.cuda and self._pending_start is None:
            self._pending_start = self._event()

    def _wrap(self) -> None:
        engine, runner = self.engine, self.engine.runner
        step, schedule = engine.step, engine.scheduler.schedule
        execute, collect = runner.execute_async, runner.collect
        # A multi-process executor has no model here (its workers do): host split only.
        model = getattr(runner, "model", None)
        forward = model.forward if model is not None else None

        def timed_step(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            out = step(*a, **k)
            self.step_s += time.perf_counter() - t
            return out

        def timed_schedule(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            out = schedule(*a, **k)
            self.schedule_s += time.perf_counter() - t
            self._batch = len(out.scheduled)
            if out.scheduled:
                self.steps += 1
                if all(s.num_new_tokens == 1 for s in out.scheduled):
                    self.decode_steps += 1
            return out

        def timed_execute(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            out = execute(*a, **k)
            took = time.perf_counter() - t
            self.execute_s += took
            if self._pending_start is not None:
                if self._pending_graph_end is None:
                    self._eager_launch_s += took
                self._spans.append(
                    (self._pending_start, self._pending_graph_end, self._event(), self._batch)
                )
                self._pending_start = self._pending_graph_end = None
            return out

        def timed_collect(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            out = collect(*a, **k)
            self.collect_s += time.perf_counter() - t
            return out

        def marked_forward(*a: Any, **k: Any) -> Any:
            self._mark_forward()
            return forward(*a, **k)

        engine.step = timed_step
        engine.scheduler.schedule = timed_schedule
        runner.execute_async = timed_execute
        runner.collect = timed_collect
        if model is not None:
            model.forward = marked_forward
        graphs = getattr(runner, "graphs", None)
        if graphs is not None:
            for (_, cascade), graph in graphs._graphs.items():
                replay = graph.replay

                def marked_replay(replay: Any = replay, cascade: bool = cascade) -> Any:
                    self._mark_forward()
                    self.cascade_graph_steps += cascade
                    out = replay()
                    self._pending_graph_end = self._event()
                    return out

                graph.replay = marked_replay

    def summary(self) -> dict[str, Any]:
        """Totals in seconds and per-step means in milliseconds (and, when counted, the expert
        load under ``expert_load``)."""
        if self.cuda:
            self._torch.cuda.synchronize()
        extra: dict[str, Any] = {}
        if self.expert_load:
            from engine.layers.fused_moe import expert_load_summary, read_expert_load

            counts = read_expert_load(self.engine.runner.model)
            if counts is not None:
                extra["expert_load"] = expert_load_summary(counts)
        gpu_s = sum(a.elapsed_time(c) for a, _, c, _ in self._spans) / 1e3
        steps = max(self.steps, 1)
        graph_steps = [(a.elapsed_time(g), g.elapsed_time(c), n) for a, g, c, n in self._spans if g]
        buckets: dict[str, list[tuple[float, float]]] = {}
        for graph_ms, rest_ms, n in graph_steps:
            key = next((f"<={b}" for b in (1, 8, 32, 64, 128, 192, 256) if n <= b), ">256")
            buckets.setdefault(key, []).append((graph_ms, rest_ms))
        per_batch = {
            k: {
                "steps": len(v),
                "graph_ms": round(sum(x for x, _ in v) / len(v), 3),
                "after_graph_ms": round(sum(y for _, y in v) / len(v), 3),
            }
            for k, v in buckets.items()
        }
        eager = [a.elapsed_time(c) for a, g, c, _ in self._spans if g is None]
        return {
            "steps": self.steps,
            "eager_steps": len(eager),
            "eager_gpu_span_s": round(sum(eager) / 1e3, 3),
            "max_eager_step_ms": round(max(eager, default=0.0), 2),
            # Host time to launch the eager steps (inputs, metadata, every kernel launch):
            # where it approaches their GPU span, the GPU waits on the host in those steps
            # and capturing them in graphs would pay.
            "eager_launch_s": round(self._eager_launch_s, 3),
            "decode_only_steps": self.decode_steps,
            "step_s": round(self.step_s, 3),
            "gpu_span_s": round(gpu_s, 3),
            "host_only_s": round(self.step_s - gpu_s, 3),
            "schedule_s": round(self.schedule_s, 3),
            "execute_s": round(self.execute_s, 3),
            "collect_s": round(self.collect_s, 3),
            "mean_step_ms": round(1e3 * self.step_s / steps, 3),
            "mean_gpu_span_ms": round(1e3 * gpu_s / steps, 3),
            "mean_schedule_ms": round(1e3 * self.schedule_s / steps, 3),
            "mean_host_only_ms": round(1e3 * (self.step_s - gpu_s) / steps, 3),
            "graph_s": round(sum(x for x, _, _ in graph_steps) / 1e3, 3),
            "decode_graph_by_batch": per_batch,
            # Replays of cascade decode graphs (cascade attention over a shared prefix).
            "cascade_graph_steps": self.cascade_graph_steps,
            **extra,
        }


class TritonCompileWatch:
    """Records every Triton kernel variant this process compiles (or loads from the disk
    cache) while active: variants met for the first time in a timed run cost a JIT compile
    in the middle of it. A no-op without Triton."""

    def __init__(self) -> None:
        self.variants: list[str] = []
        self._knobs: Any = None
        self._previous: Any = None

    def __enter__(self) -> TritonCompileWatch:
        try:
            from triton import knobs
        except ImportError:
            return self
        self._knobs = knobs
        self._previous = knobs.runtime.jit_cache_hook

        def hook(*args: Any, **kwargs: Any) -> bool:
            fn = kwargs.get("fn")
            self.variants.append(getattr(fn, "name", None) or str(kwargs.get("repr", "?")))
            return False  # go on compiling

        knobs.runtime.jit_cache_hook = hook
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._knobs is not None:
            self._knobs.runtime.jit_cache_hook = self._previous
