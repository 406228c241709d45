"""All-or-nothing LoRA loads across data-parallel engine cores, for every multi-core client.

A load goes to every core; when some load the adapter and another refuses it, the ones that
loaded it are undone (a fresh load is removed; an in-place reload gets the previous adapter
back) and the refusal is raised naming the core and its reason, so every core keeps the same
adapters (docs/lora.md).

The logic is written once, without I/O, as a generator (``add_lora_everywhere``): it yields
each utility call it needs as ``(method, args, engines)`` and is sent back the cores'
``UtilityResult``s in the order of ``engines``; its return value is the load's answer. The
synchronous client (``engine.engine_core.client.SyncMPClient``) drives it with blocking
calls (``run_calls``), the asynchronous ones (``engine.engine_core.async_client``) with awaits.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Generator
from typing import Any

logger = logging.getLogger(__name__)

# (method, args, engines) -> the cores' UtilityResults, in the order of engines.
UtilityCalls = Generator[tuple[str, list[Any], list[int]], list[Any], Any]


def add_lora_everywhere(args: list[Any], num_engines: int) -> UtilityCalls:
    """``add_lora(*args)`` on every core, all or nothing; see the module docstring."""
    from engine.engine_core.messages import RequestError, raise_utility_error
    from engine.engine_core.utility_results import combine_utility_results

    request, rest = args[0], list(args[1:])
    results = yield ("add_lora", [request, *rest], list(range(num_engines)))
    failed = [r for r in results if r.error is not None]
    loaded = [r.engine_index for r in results if r.error is None]
    if not failed or not loaded:
        return combine_utility_results("add_lora", results)
    # Some cores hold the adapter and others not: undo it where it loaded.
    first = failed[0]
    undone = yield from _undo_add_lora(request, rest, loaded, first.engine_index, num_engines)
    cores = ", ".join(str(i) for i in loaded)
    message = (
        f"LoRA adapter '{request.lora_name}' was not loaded: engine core "
        f"{first.engine_index} (of {num_engines}) refused it: {first.error.message} "
        f"(engine core(s) {cores} had loaded it; {undone}, so every core serves the same "
        "adapters)"
    )
    err = first.error
    raise_utility_error(RequestError(err.request_id, err.kind, message, err.param))


def _undo_add_lora(
    request: Any, rest: list[Any], loaded: list[int], refused_by: int, num_engines: int
) -> UtilityCalls:
    """Undo a load on the ``loaded`` cores; return what was done. A fresh load is removed;
    an in-place reload loads the previous adapter (as the refusing core still has it)
    again, and when even that fails the adapter is removed from every core."""
    from engine.engine_core.utility_results import common_lora_adapters

    if request.load_inplace:
        held = yield ("lora_adapters", [], [refused_by])
        previous = next(
            (
                r
                for r in common_lora_adapters([held[0].result])
                if r.lora_int_id == request.lora_int_id
            ),
            None,
        )
        if previous is not None:
            previous = dataclasses.replace(previous, load_inplace=True)
            again = yield ("add_lora", [previous, *rest], loaded)
            if all(r.error is None for r in again):
                logger.warning(
                    "LoRA adapter %r: in-place reload refused by engine core %d; "
                    "the previous adapter was reloaded on engine core(s) %s",
                    request.lora_name,
                    refused_by,
                    loaded,
                )
                return "they went back to the previous adapter"
        loaded = list(range(num_engines))
    yield ("remove_lora", [request.lora_int_id], loaded)
    logger.warning(
        "LoRA adapter %r: load refused by engine core %d; removed again from engine core(s) %s",
        request.lora_name,
        refused_by,
        loaded,
    )
    if request.load_inplace:
        return "the adapter was removed from every core"
    return "it was unloaded from them again"


def run_calls(steps: UtilityCalls, call: Callable[[str, list[Any], list[int]], list[Any]]) -> Any:
    """Drive ``steps`` with a blocking ``call(method, args, engines)``; its return value."""
    results = None
    try:
        while True:
            results = call(*steps.send(results))
    except StopIteration as done:
        return done.value
