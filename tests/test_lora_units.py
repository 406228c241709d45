"""Units of engine.lora: the token mapping buffers, PEFT's per-module patterns, the engine-side
registry (ids, in-place reloads, deferred removal) and the config's checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.config import ConfigError
from engine.errors import InvalidRequestError
from engine.lora.config import LoRAConfig
from engine.lora.mapping import LoRABatchMapping, group_by_slot
from engine.lora.peft import module_scaling
from engine.lora.registry import LoRARegistry
from engine.lora.request import LoRARequest


def test_group_by_slot():
    sorted_tokens, starts = group_by_slot(np.array([2, -1, 0, 2, 0, -1, 1]), 4)
    assert sorted_tokens.tolist() == [2, 4, 6, 0, 3, 1, 5]
    assert starts.tolist() == [0, 2, 3, 5, 5]
    with pytest.raises(ValueError, match="token slots must be in"):
        group_by_slot(np.array([4]), 4)


def test_mapping_buffers_keep_rows_past_the_step_at_minus_one():
    m = LoRABatchMapping(8, 3, torch.device("cpu"))
    m.set(np.array([0, 1, -1, 2, 2], dtype=np.int32))
    assert m.active and m.token_slots.tolist() == [0, 1, -1, 2, 2, -1, -1, -1]
    assert m.slot_starts.tolist() == [0, 1, 2, 4]
    assert m.sorted_tokens.tolist() == [0, 1, 3, 4, 2, 5, 6, 7]  # then the identity
    m.set(np.array([1, -1], dtype=np.int32))  # a smaller step: the old rows go back
    assert m.token_slots.tolist() == [1, -1, -1, -1, -1, -1, -1, -1]
    assert m.slot_starts.tolist() == [0, 0, 1, 1]
    assert m.sorted_tokens.tolist() == list(range(8))
    m.set(np.array([2, 0], dtype=np.int32))
    m.set(np.array([-1, -1, -1], dtype=np.int32))
    assert not m.active and m.token_slots.tolist() == [-1] * 8
    assert m.slot_starts.tolist() == [0, 0, 0, 0]
    assert m.sorted_tokens.tolist() == list(range(8))
    m.set(np.arange(12, dtype=np.int32) % 3)  # grows while no graph reads it
    assert m.capacity == 12 and m.slot_starts.tolist() == [0, 4, 8, 12]
    with m.capturing():
        assert m.active and m.token_slots.max() == -1
    assert not m.active
    with pytest.raises(ValueError, match="captured graphs read the buffers"):
        m.set(np.zeros(20, dtype=np.int32))


def test_alpha_and_rank_patterns_match_as_in_peft():
    from peft.utils.other import get_pattern_key

    config = {"lora_alpha": 16, "alpha_pattern": {"q_proj": 4, r"layers\.1\.mlp\.down_proj": 2}}
    for module, rank in (
        ("model.layers.0.self_attn.q_proj", 4),
        ("model.layers.1.mlp.down_proj", 8),
        ("model.layers.0.mlp.down_proj", 8),
        ("model.layers.0.self_attn.k_proj", 8),
    ):
        key = get_pattern_key(config["alpha_pattern"].keys(), module)
        alpha = config["alpha_pattern"].get(key, config["lora_alpha"])
        assert module_scaling(config, module, rank) == alpha / rank, module
    assert module_scaling({"lora_alpha": 16, "use_rslora": True}, "m", 4) == 8.0


def _registry():
    loaded, unloaded = {}, []

    def load(key, request):
        if "bad" in request.lora_path:
            raise InvalidRequestError("bad adapter", "lora_path")
        loaded[key] = request

    return LoRARegistry(load, unloaded.append), loaded, unloaded


def test_registry_ids_reloads_and_deferred_removal():
    reg, loaded, unloaded = _registry()
    a = LoRARequest("a", 1, "/a")
    key = reg.acquire(a)
    assert reg.add(a) == key and reg.list_ids() == {1}
    with pytest.raises(InvalidRequestError, match="lora_int_id 1 is already adapter 'a'"):
        reg.add(LoRARequest("b", 1, "/b"))
    with pytest.raises(InvalidRequestError, match="bad adapter"):
        reg.add(LoRARequest("c", 2, "/bad"))
    assert reg.list_ids() == {1}
    # In place: a new key; the old one drains its request, then unloads.
    new = reg.add(LoRARequest("a", 1, "/a2", load_inplace=True))
    assert new != key and unloaded == [] and reg.num_draining == 1
    reg.release(key)
    assert unloaded == [key] and reg.num_draining == 0
    # Removal with a request in flight: the id is free at once, the unload waits.
    k2 = reg.acquire(LoRARequest("a", 1, "/a2"))
    assert k2 == new and reg.remove(1) and reg.list_ids() == set()
    assert unloaded == [key]
    again = reg.add(LoRARequest("a", 1, "/a2"))  # loaded again under a fresh key
    assert again not in (key, new)
    reg.release(k2)
    assert unloaded == [key, new]
    assert not reg.remove(7)


def test_registry_serves_requests_by_loaded_name():
    """The server's requests (``acquire_loaded``) run on the adapter registered under their
    name now, whatever id or path the front end had cached, and are refused when none is;
    ``unique_name`` loads refuse a name another id holds."""
    from engine.lora.errors import LoRAAdapterNotLoadedError

    reg, loaded, unloaded = _registry()
    with pytest.raises(LoRAAdapterNotLoadedError) as e:
        reg.acquire_loaded(LoRARequest("x", 3, "/x"))
    assert e.value.code == "model_not_found" and not loaded
    key = reg.add(LoRARequest("x", 3, "/x"), unique_name=True)
    with pytest.raises(InvalidRequestError, match="already been loaded"):
        reg.add(LoRARequest("x", 4, "/y"), unique_name=True)
    assert reg.acquire_loaded(LoRARequest("x", 99, "/stale")) == key
    assert reg.remove(3) and unloaded == []  # one request in flight: unloaded after it
    with pytest.raises(LoRAAdapterNotLoadedError):
        reg.acquire_loaded(LoRARequest("x", 3, "/x"))
    new = reg.add(LoRARequest("x", 4, "/y"), unique_name=True)  # the name is free again
    assert reg.acquire_loaded(LoRARequest("x", 3, "/x")) == new != key
    reg.release(key)
    assert unloaded == [key]
    assert [r.lora_int_id for r in reg.requests()] == [4]


def test_config_checks():
    assert LoRAConfig(max_loras=4).max_cpu_loras == 4
    with pytest.raises(ConfigError, match="max_cpu_loras .2. must be >= max_loras .4."):
        LoRAConfig(max_loras=4, max_cpu_loras=2)
    with pytest.raises(ConfigError, match="max_lora_rank must be >= 1"):
        LoRAConfig(max_lora_rank=0)
    with pytest.raises(ValueError, match="lora_name must be a non-empty string"):
        LoRARequest("", 1, "/x")
