"""What several engine cores' answers to one utility call add up to (a LoRA load or unload
goes to every core, each holding its own adapters). The blocking and the asyncio clients
(``engine.engine_core.client``, ``async_client``) and the all-or-nothing LoRA loads
(``engine.engine_core.lora_loads``) share these."""

from __future__ import annotations

from typing import Any


def combine_utility_results(method: str, results: list[Any]) -> Any:
    """One answer from every core's ``UtilityResult`` (each core holds its own adapters: a
    load or unload goes to all of them). The first error is raised; ``list_loras`` is the
    union, ``remove_lora`` whether any core had the adapter, else every core's answer holds."""
    from engine.engine_core.messages import raise_utility_error

    for r in results:
        if r.error is not None:
            raise_utility_error(r.error)
    values = [r.result for r in results]
    if method == "lora_adapters":  # those every core holds, by id (core 0's record)
        return common_lora_adapters(values)
    if method == "list_loras":
        return set().union(*(v or [] for v in values))
    if method == "remove_lora":
        return any(values)
    return values[0] if values else None


def common_lora_adapters(per_core: list[Any]) -> list[Any]:
    """The adapters (``LoRARequest``, by ``lora_int_id``) that every core's ``lora_adapters``
    answer holds under the same name, in id order; a msgspec-decoded answer's dicts become
    ``LoRARequest`` again. A load or unload still under way in some cores is left out."""
    from engine.lora.request import LoRARequest

    def adapters(value: Any) -> dict[tuple[int, str], Any]:
        out = {}
        for r in value or []:
            if isinstance(r, dict):
                r = LoRARequest(**r)
            out[(r.lora_int_id, r.lora_name)] = r
        return out

    if not per_core:
        return []
    first = adapters(per_core[0])
    keys = set(first).intersection(*(set(adapters(v)) for v in per_core[1:]))
    return [first[k] for k in sorted(keys)]
