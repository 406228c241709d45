"""The engine side of multi-LoRA serving: which adapters exist and which requests use them.

``LoRARegistry`` maps the users' ``lora_int_id`` to the engine's own *key* for an adapter (a
serial number, never reused, stored on every ``Request`` as ``lora_id``: it is what the
scheduler counts, the prefix cache hashes and the model runner's slots hold), loads adapters
through the runner when they are added (so a bad adapter is refused right there), counts the
requests in flight per adapter, and removes an adapter only once its last request finished:
``remove(lora_int_id)`` makes the id free at once (new requests cannot use the old adapter;
the id may be loaded again, under a new key) while the requests already running finish on it.

The server names adapters, not ids: ``add(request, unique_name=True)`` refuses a name another
id holds (two front ends loading one name at once), and ``acquire_loaded(request)`` runs a
request on the adapter registered under its name *now*, refusing it when there is none
(``LoRAAdapterNotLoadedError``: the name was unloaded, maybe through another front end), so
the registry, not a front end's list of names, decides what a request may use.

Torch-free: the loading and unloading are the runner's (``add_lora`` / ``remove_lora``).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

from engine.errors import InvalidRequestError
from engine.lora.errors import LoRAAdapterNotLoadedError
from engine.lora.request import LoRARequest

logger = logging.getLogger(__name__)


@dataclass
class _Adapter:
    key: int
    request: LoRARequest
    in_flight: int = 0
    removed: bool = False


class LoRARegistry:
    """See the module docstring. ``load(key, request)`` / ``unload(key)`` are the runner's
    ``add_lora`` / ``remove_lora``."""

    def __init__(
        self, load: Callable[[int, LoRARequest], None], unload: Callable[[int], None]
    ) -> None:
        self._load = load
        self._unload = unload
        self._by_id: dict[int, _Adapter] = {}
        self._by_key: dict[int, _Adapter] = {}
        self._by_name: dict[str, _Adapter] = {}
        self._keys = itertools.count(1)

    def add(self, request: LoRARequest, unique_name: bool = False) -> int:
        """Register (and load) an adapter, or return the key it already has. The same
        ``lora_int_id`` with another path or name is an error until it is removed;
        ``load_inplace`` replaces a loaded adapter (its running requests keep the old one).
        ``unique_name``: also an error when another id holds ``request.lora_name``."""
        if not isinstance(request, LoRARequest):
            raise InvalidRequestError(
                f"lora_request must be a LoRARequest, got {type(request).__name__}", "lora_request"
            )
        current = self._by_id.get(request.lora_int_id)
        named = self._by_name.get(request.lora_name)
        if unique_name and named is not None and named is not current:
            raise InvalidRequestError(
                f"The lora adapter '{request.lora_name}' has already been loaded.", "lora_name"
            )
        if current is not None:
            same = (current.request.lora_path, current.request.lora_name) == (
                request.lora_path,
                request.lora_name,
            )
            if same and not request.load_inplace:
                return current.key
            if not same and not request.load_inplace:
                raise InvalidRequestError(
                    f"lora_int_id {request.lora_int_id} is already adapter "
                    f"{current.request.lora_name!r} from {current.request.lora_path!r}; remove it "
                    f"first or give {request.lora_name!r} another id",
                    "lora_request",
                )
        key = next(self._keys)
        self._load(key, request)  # raises LoRAAdapterError: nothing registered
        if current is not None:
            self._retire(current)
        adapter = _Adapter(key, request)
        self._by_id[request.lora_int_id] = adapter
        self._by_key[key] = adapter
        self._by_name[request.lora_name] = adapter
        logger.info(
            "LoRA adapter %r (id %d) loaded from %s",
            request.lora_name,
            request.lora_int_id,
            request.lora_path,
        )
        return key

    def acquire(self, request: LoRARequest) -> int:
        """The key of a request's adapter (added now if new), counted as in flight until
        ``release``."""
        key = self.add(request)
        self._by_key[key].in_flight += 1
        return key

    def acquire_loaded(self, request: LoRARequest) -> int:
        """As ``acquire``, but only on the adapter registered under ``request.lora_name`` now
        (whatever its id and path: it may have been reloaded meanwhile), never loading one:
        ``LoRAAdapterNotLoadedError`` when no adapter has that name."""
        adapter = self._by_name.get(request.lora_name)
        if adapter is None:
            raise LoRAAdapterNotLoadedError(request.lora_name)
        adapter.in_flight += 1
        return adapter.key

    def release(self, key: int) -> None:
        """A request of adapter ``key`` finished (or was aborted)."""
        adapter = self._by_key.get(key)
        if adapter is None:
            return
        adapter.in_flight -= 1
        if adapter.removed and adapter.in_flight <= 0:
            self._drop(adapter)

    def remove(self, lora_int_id: int) -> bool:
        """Remove adapter ``lora_int_id`` (False: not loaded). Its requests in flight finish on
        it first; it is unloaded after the last one."""
        adapter = self._by_id.pop(lora_int_id, None)
        if adapter is None:
            return False
        self._retire(adapter)
        return True

    def _retire(self, adapter: _Adapter) -> None:
        if self._by_id.get(adapter.request.lora_int_id) is adapter:
            del self._by_id[adapter.request.lora_int_id]
        if self._by_name.get(adapter.request.lora_name) is adapter:
            del self._by_name[adapter.request.lora_name]
        adapter.removed = True
        if adapter.in_flight <= 0:
            self._drop(adapter)
        else:
            logger.info(
                "LoRA adapter %r (id %d) removed; unloaded once its %d request(s) in flight finish",
                adapter.request.lora_name,
                adapter.request.lora_int_id,
                adapter.in_flight,
            )

    def _drop(self, adapter: _Adapter) -> None:
        self._by_key.pop(adapter.key, None)
        self._unload(adapter.key)

    def list_ids(self) -> set[int]:
        """The ``lora_int_id`` of every adapter loaded (removed ones excluded)."""
        return set(self._by_id)

    def requests(self) -> list[LoRARequest]:
        return [a.request for a in self._by_id.values()]

    def in_flight(self, lora_int_id: int) -> int:
        """Requests in flight on the adapter currently registered as ``lora_int_id``."""
        adapter = self._by_id.get(lora_int_id)
        return 0 if adapter is None else adapter.in_flight

    @property
    def num_draining(self) -> int:
        """Removed adapters still serving requests."""
        return sum(1 for a in self._by_key.values() if a.removed)
