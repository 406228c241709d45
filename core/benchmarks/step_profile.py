"""Per-step time split for benchmarks: where an engine step's wall time goes.

``StepProfiler(llm_engine)`` wraps, on that one engine object, the scheduler's ``schedule``, the
runner's ``execute`` and the model's forward (or the replay of a captured graph), and records
CUDA events from the launch of the first model kernel to the end of ``execute`` (which returns
only once the sampled tokens are on the host). The engine synchronises every step, so a step's
wall time is its GPU span plus the time the GPU waits for the host: scheduling, input
preparation, sampling bookkeeping, detokenisation and stop checks.
"""

from __future__ import annotations

import time
from typing import Any


class StepProfiler:
    """Accumulates per-step timings of one ``LLMEngine``; ``summary()`` returns them."""

    def __init__(self, engine: Any) -> None:
        import torch

        self.engine = engine
        self.cuda = engine.runner.device.type == "cuda"
        self.steps = 0
        self.decode_steps = 0
        self.step_s = 0.0
        self.schedule_s = 0.0
        self.execute_s = 0.0
        self._pending_start: Any = None
        self._spans: list[tuple[Any, Any]] = []
        self._torch = torch
        self._wrap()

    def _event(self) -> Any:
        ev = self._torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _mark_forward(self) -> None:
        if self.cuda and self._pending_start is None:
            self._pending_start = self._event()

    def _wrap(self) -> None:
        engine, runner = self.engine, self.engine.runner
        step, schedule, execute = engine.step, engine.scheduler.schedule, runner.execute
        forward = runner.model.forward

        def timed_step(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            out = step(*a, **k)
            self.step_s += time.perf_counter() - t
            return out

        def timed_schedule(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            out = schedule(*a, **k)
            self.schedule_s += time.perf_counter() - t
            if out.scheduled:
                self.steps += 1
                if all(s.num_new_tokens == 1 for s in out.scheduled):
                    self.decode_steps += 1
            return out

        def timed_execute(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            out = execute(*a, **k)
            self.execute_s += time.perf_counter() - t
            if self._pending_start is not None:
                self._spans.append((self._pending_start, self._event()))
                self._pending_start = None
            return out

        def marked_forward(*a: Any, **k: Any) -> Any:
            self._mark_forward()
            return forward(*a, **k)

        engine.step = timed_step
        engine.scheduler.schedule = timed_schedule
        runner.execute = timed_execute
        runner.model.forward = marked_forward
        graphs = getattr(runner, "graphs", None)
        if graphs is not None:
            for graph in graphs._graphs.values():
                replay = graph.replay

                def marked_replay(replay: Any = replay) -> Any:
                    self._mark_forward()
                    return replay()

                graph.replay = marked_replay

    def summary(self) -> dict[str, float]:
        """Totals in seconds and per-step means in milliseconds."""
        if self.cuda:
            self._torch.cuda.synchronize()
        gpu_s = sum(a.elapsed_time(b) for a, b in self._spans) / 1e3
        steps = max(self.steps, 1)
        return {
            "steps": self.steps,
            "decode_only_steps": self.decode_steps,
            "step_s": round(self.step_s, 3),
            "gpu_span_s": round(gpu_s, 3),
            "host_only_s": round(self.step_s - gpu_s, 3),
            "schedule_s": round(self.schedule_s, 3),
            "execute_s": round(self.execute_s, 3),
            "mean_step_ms": round(1e3 * self.step_s / steps, 3),
            "mean_gpu_span_ms": round(1e3 * gpu_s / steps, 3),
            "mean_schedule_ms": round(1e3 * self.schedule_s / steps, 3),
            "mean_host_only_ms": round(1e3 * (self.step_s - gpu_s) / steps, 3),
        }
