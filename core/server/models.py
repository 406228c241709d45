"""The models the server answers to: the base model's names and the LoRA adapters.

``ServingModels`` (vLLM's ``OpenAIServingModels``) resolves a request's ``model`` to the base
model or an adapter (a 404 listing every served name otherwise), lists them for
``/v1/models`` (an adapter's ``parent`` is its base model), and loads and unloads adapters at
run time for ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, which exist only when
the environment sets ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` to ``1`` or ``true``, as in vLLM.

Adapters named by ``--lora-modules`` get the ids 1..n and are loaded before the server is
ready (``preload_lora_adapters``); a bad one stops the start with the reason. Adapters loaded
at run time get the next ids. Loading goes through the engine thread (``AsyncEngine.call``),
so a bad adapter is a 400 with the reason and the server keeps serving; unloading removes the
name at once while the adapter's requests in flight finish on it.

Several front ends (``--api-server-count``): the engine cores' adapters are the served set,
each front end's ``loras`` only a cache of it. A request is sent with ``lora_loaded_only``, so
a core runs it on the adapter loaded under its name *at that moment* and refuses it (404)
when there is none: an unload through any front end is final once it answered. A name a front
end does not know sends it to the cores for their adapters before the 404 (``ensure``), and
``/v1/models``, load and unload ask them too: a load through any front end is seen by all once
it answered. Run-time ids are disjoint per front end (``static + 1 + index + k * count``), and
the cores refuse a name another id holds, so two front ends never give one id two adapters.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from engine.lora.request import LoRARequest
from engine.server.errors import APIError, bad_request
from engine.server.protocol import ModelCard

if TYPE_CHECKING:
    from engine.server.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating_allowed() -> bool:
    """Whether ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` enables the load/unload routes."""
    return os.environ.get(RUNTIME_LORA_ENV, "0").strip().lower() in ("1", "true")


@dataclass
class LoRAModulePath:
    """One ``--lora-modules`` entry: ``name=path`` or ``{"name", "path", "base_model_name"}``."""

    name: str
    path: str
    base_model_name: str | None = None


def lora_requests_for(modules: list[LoRAModulePath]) -> list[LoRARequest]:
    """The ``LoRARequest`` of each static adapter, with ids 1..n in order."""
    return [
        LoRARequest(m.name, i, m.path, base_model_name=m.base_model_name)
        for i, m in enumerate(modules, start=1)
    ]


async def preload_lora_adapters(engine: Any, requests: list[LoRARequest]) -> None:
    """Load the ``--lora-modules`` adapters into a freshly started ``AsyncEngine`` (every
    engine core, before the server serves)."""
    for request in requests:
        try:
            await engine.call("add_lora", request)
        except ValueError as e:
            from engine.config import ConfigError

            raise ConfigError(f"--lora-modules {request.lora_name}={request.lora_path}: {e}") from e


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter``."""

    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (by name; ``lora_int_id`` alone also works)."""

    lora_name: str = ""
    lora_int_id: int | None = None


class ServingModels:
    """Base model names and LoRA adapters; see the module docstring."""

    def __init__(
        self,
        base_names: list[str],
        model_path: str,
        max_model_len: int,
        lora_requests: list[LoRARequest] | None = None,
        lora_enabled: bool = False,
        client_index: int = 0,
        num_clients: int = 1,
    ) -> None:
        self.base_names = list(base_names)
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.lora_enabled = lora_enabled
        self.loras: dict[str, LoRARequest] = {r.lora_name: r for r in lora_requests or []}
        # Run-time ids: static_max + 1 + client_index + k * num_clients (disjoint per front end).
        self._id_base = max((r.lora_int_id for r in self.loras.values()), default=0) + 1
        self._client_index, self._num_clients = client_index, max(1, num_clients)
        self._next_k = 0
        self._loading: set[str] = set()  # names whose load is in flight
        self._refresh: asyncio.Future | None = None  # the cores' adapters, being asked
        self._refresh_sent = False
        self._refresh_seq = self._applied_seq = 0

    @property
    def asks_cores(self) -> bool:
        """Whether the cores' adapters may differ from the static ones (run-time loads)."""
        return self.lora_enabled and runtime_lora_updating_allowed()

    async def refresh(self, engine: AsyncEngine) -> None:
        """Take the engine cores' adapters (those every core holds) as this front end's.
        Callers share a round trip only when it was not sent yet: one sent before a caller
        came might miss a load that answered just before the caller's request arrived."""
        if not self.asks_cores:
            return
        if self._refresh is None or self._refresh_sent:
            self._refresh_sent = False
            self._refresh = asyncio.ensure_future(self._ask_cores(engine))
        await asyncio.shield(self._refresh)

    async def _ask_cores(self, engine: AsyncEngine) -> None:
        self._refresh_sent = True  # engine.call sends before its first await
        self._refresh_seq += 1
        seq = self._refresh_seq
        adapters = await engine.call("lora_adapters")
        if seq > self._applied_seq:  # an older answer never overwrites a newer one
            self._applied_seq = seq
            self.loras = {r.lora_name: r for r in adapters}

    async def ensure(self, engine: AsyncEngine, name: str | None) -> None:
        """Before ``resolve``: a name this front end does not know may have been loaded
        through another one, so ask the cores."""
        if name and name not in self.base_names and name not in self.loras:
            await self.refresh(engine)

    def _new_id(self) -> int:
        taken = {r.lora_int_id for r in self.loras.values()}
        while True:
            lora_id = self._id_base + self._client_index + self._next_k * self._num_clients
            self._next_k += 1
            if lora_id not in taken:
                return lora_id

    @property
    def names(self) -> list[str]:
        """Every name a request may use: the base model's, then the adapters'."""
        return self.base_names + list(self.loras)

    def resolve(self, name: str | None) -> tuple[str, LoRARequest | None]:
        """The served name and adapter (None: the base model) for a request's ``model``;
        a 404 naming every served model when it is none of them."""
        if not name:
            return self.base_names[0], None
        if name in self.base_names:
            return name, None
        lora = self.loras.get(name)
        if lora is not None:
            return name, lora
        raise APIError(
            404,
            f"The model `{name}` does not exist. Served models: {', '.join(self.names)}.",
            param="model",
            code="model_not_found",
        )

    def cards(self) -> list[ModelCard]:
        """``/v1/models``: the base names, then each adapter with its ``parent``."""
        cards = [
            ModelCard(id=name, root=self.model_path, max_model_len=self.max_model_len)
            for name in self.base_names
        ]
        for lora in self.loras.values():
            parent = lora.base_model_name
            if parent not in self.base_names:
                parent = self.base_names[0]
            cards.append(ModelCard(id=lora.lora_name, root=lora.lora_path, parent=parent))
        return cards

    # ---- run-time loading ---------------------------------------------------------------------
    async def load(self, engine: AsyncEngine, body: LoadLoRAAdapterRequest) -> str:
        """Load an adapter through the engine thread; 400 with the reason when it fails."""
        if not self.lora_enabled:
            raise bad_request(
                "LoRA is not enabled: start the server with --enable-lora", "lora_name"
            )
        if not body.lora_name or not body.lora_path:
            raise bad_request("Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
        name = body.lora_name
        await self.refresh(engine)  # another front end may have loaded or unloaded it
        current = self.loras.get(name)
        if name in self.base_names:
            raise bad_request(f"'{name}' is the name of the base model", "lora_name")
        if (current is not None and not body.load_inplace) or name in self._loading:
            raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        if current is not None:
            lora_id = current.lora_int_id
        else:  # taken before the await, so concurrent loads never share an id
            lora_id = self._new_id()
        request = LoRARequest(name, lora_id, body.lora_path, load_inplace=body.load_inplace)
        self._loading.add(name)
        try:
            # unique_name: the cores refuse a name another front end gave another id.
            await engine.call("add_lora", request, True)
        except ValueError as e:
            raise bad_request(str(e), getattr(e, "param", None) or "lora_path") from e
        finally:
            self._loading.discard(name)
        self.loras[name] = request
        logger.info("Loaded LoRA adapter %r from %s", name, body.lora_path)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, engine: AsyncEngine, body: UnloadLoRAAdapterRequest) -> str:
        """Remove an adapter's name now; the engine unloads it after its requests finish."""
        if not body.lora_name and body.lora_int_id is None:
            raise bad_request(
                "either 'lora_name' or 'lora_int_id' needs to be provided.", "lora_name"
            )
        await self.refresh(engine)  # it may have been loaded through another front end
        lora = self.loras.get(body.lora_name) if body.lora_name else None
        if lora is None and body.lora_int_id is not None and not body.lora_name:
            lora = next((r for r in self.loras.values() if r.lora_int_id == body.lora_int_id), None)
        if lora is None:
            raise APIError(
                404,
                f"The lora adapter '{body.lora_name or body.lora_int_id}' cannot be found.",
                param="lora_name",
                code="lora_adapter_not_found",
            )
        del self.loras[lora.lora_name]
        await engine.call("remove_lora", lora.lora_int_id)
        logger.info("Removed LoRA adapter %r", lora.lora_name)
        return f"Success: LoRA adapter '{lora.lora_name}' removed successfully."
