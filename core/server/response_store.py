"""The responses kept for ``GET /v1/responses/{id}`` and ``previous_response_id``.

Kept in this front-end process's memory, newest last, up to a bound (the oldest go first), as
vLLM keeps them: a server restart forgets them, and with ``--api-server-count`` above 1 each
front end keeps its own (a later request may reach another front end and not find one).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class StoredResponse:
    """One kept response.

    ``response``: the response object as answered. ``input_items``: the request's input as
    items (``GET /v1/responses/{id}/input_items``). ``messages``: the conversation as chat
    messages, the answer included and the instructions not: what a request naming this
    response in ``previous_response_id`` continues.
    """

    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    messages: list[dict[str, Any]]


class ResponseStore:
    """An LRU-bounded map of response id to ``StoredResponse`` (``capacity`` 0 keeps none),
    with the input and output items of the kept responses by item id (``item_reference``)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self._items: dict[str, dict[str, Any]] = {}

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        self.delete(response_id)
        self._responses[response_id] = stored
        for item in _items_of(stored):
            self._items[item["id"]] = item
        while len(self._responses) > self.capacity:
            oldest = next(iter(self._responses))
            self.delete(oldest)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._responses.get(response_id)
        if stored is not None:
            self._responses.move_to_end(response_id)
        return stored

    def item(self, item_id: str) -> dict[str, Any] | None:
        """An input or output item of a kept response, by its id."""
        return self._items.get(item_id)

    def delete(self, response_id: str) -> bool:
        stored = self._responses.pop(response_id, None)
        if stored is None:
            return False
        for item in _items_of(stored):
            if self._items.get(item["id"]) is item:
                del self._items[item["id"]]
        return True

    def __len__(self) -> int:
        return len(self._responses)


def _items_of(stored: StoredResponse) -> list[dict[str, Any]]:
    items = [*stored.input_items, *stored.response.get("output", [])]
    # A reference is not an item of its own (its id is the item it names).
    return [i for i in items if isinstance(i.get("id"), str) and i.get("type") != "item_reference"]
