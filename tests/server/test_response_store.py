"""The Responses API's in-memory store: least recently used out first, items indexed by id
with their response (and gone with it), references not indexed, capacity 0 keeps nothing."""

from __future__ import annotations

from engine.server.response_store import ResponseStore, StoredResponse


def _stored(n: int) -> StoredResponse:
    return StoredResponse(
        response={"id": f"resp_{n}", "output": [{"id": f"msg_out_{n}", "type": "message"}]},
        input_items=[
            {"id": f"msg_in_{n}", "type": "message"},
            {"id": "msg_out_0", "type": "item_reference"},
        ],
        messages=[],
    )


def test_least_recently_used_goes_first_with_its_items():
    store = ResponseStore(capacity=2)
    for n in range(2):
        store.put(f"resp_{n}", _stored(n))
    assert store.get("resp_0") is not None  # now the most recently used
    store.put("resp_2", _stored(2))
    assert store.get("resp_1") is None and len(store) == 2
    assert store.item("msg_in_1") is None and store.item("msg_out_1") is None
    assert store.item("msg_in_0")["type"] == "message"
    # resp_2's reference to msg_out_0 is not an item: the real one is found.
    assert store.item("msg_out_0") == {"id": "msg_out_0", "type": "message"}
    assert store.delete("resp_0") and not store.delete("resp_0")
    assert store.item("msg_out_0") is None and store.item("msg_in_2") is not None


def test_capacity_zero_keeps_nothing():
    store = ResponseStore(capacity=0)
    store.put("resp_0", _stored(0))
    assert store.get("resp_0") is None and store.item("msg_in_0") is None and len(store) == 0
