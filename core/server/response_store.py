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
    """An LRU-bounded map of response id to ``StoredResponse`` (``capacity`` 0 keeps none)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._items)
