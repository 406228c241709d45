"""The scheduler's LoRA limit: at most ``max_loras`` distinct adapters in one step.

The rule is kept on the *running* set, which every step is drawn from: a waiting request with
an adapter is admitted only when its adapter already has a running request or fewer than
``max_loras`` adapters do. So no step can hold more, whatever the token budget picks.

Rotation without starvation: a waiting request the limit holds back closes the door to every
later waiting request with an adapter (requests without one still pass: they take no slot).
The running adapters then drain, the first one to finish its running requests frees a slot,
and the held-back request goes in. Requests of a running adapter that arrived before the
held-back one are admitted as usual; none overtakes it. More adapters than ``max_loras`` in
flight therefore all complete, in arrival order by adapter.

Device-free: adapters are the integers of ``Request.lora_id`` (0 = the base model).
"""

from __future__ import annotations

from engine.request import Request


class LoRAAdmission:
    """Running requests per adapter, and the admission test of the scheduler."""

    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.max_loras = max_loras
        self._running: dict[int, int] = {}

    @property
    def running_adapters(self) -> set[int]:
        """Adapters with at least one running request."""
        return set(self._running)

    def fits(self, request: Request) -> bool:
        """Whether ``request`` may start running now."""
        lora = request.lora_id
        return not lora or lora in self._running or len(self._running) < self.max_loras

    def started(self, request: Request) -> None:
        """``request`` became running (admitted, resumed or forked)."""
        lora = request.lora_id
        if lora:
            self._running[lora] = self._running.get(lora, 0) + 1

    def stopped(self, request: Request) -> None:
        """``request`` stopped running (finished, aborted or preempted)."""
        lora = request.lora_id
        if lora:
            n = self._running.get(lora, 0) - 1
            if n > 0:
                self._running[lora] = n
            else:
                self._running.pop(lora, None)
