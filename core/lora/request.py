"""``LoRARequest``: which LoRA adapter a request runs with (vLLM's ``vllm.lora.request``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LoRARequest:
    """A LoRA adapter for a request: ``LoRARequest(lora_name, lora_int_id, lora_path)``.

    ``lora_name`` is a human-readable name (what the server lists and requests pick by
    ``model``); ``lora_int_id`` a positive id, unique among the adapters of one engine (the
    engine keys adapters by it: the same id with another path is an error until the first one
    is removed); ``lora_path`` a directory in the PEFT format (``adapter_config.json`` and
    ``adapter_model.safetensors``) or a Hugging Face repository id already in the local cache.
    ``base_model_name`` is what ``/v1/models`` reports as the adapter's ``parent`` (the served
    model when unset). ``load_inplace`` reloads the adapter from ``lora_path`` even when an
    adapter with this id is loaded (its running requests finish on the old weights).

    A plain dataclass: msgspec and pickle carry it between processes as they are.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    load_inplace: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise ValueError(f"lora_int_id must be an integer, got {self.lora_int_id!r}")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be > 0, got {self.lora_int_id}")
        self.lora_path = str(self.lora_path)

    def __hash__(self) -> int:
        return hash((self.lora_name, self.lora_int_id, self.lora_path))

    # vLLM's aliases
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def local_path(self) -> str:
        return self.lora_path
