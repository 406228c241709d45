"""Data parallelism: the router's choices (pure Python), and ``LLM(data_parallel_size=2)``
(two engine-core processes) against the in-process engine."""

from __future__ import annotations

import psutil
import pytest

from engine.engine_core.routing import DataParallelRouter
from engine.sampling_params import SamplingParams


def test_router_balances_equal_loads_and_follows_the_least_loaded():
    router = DataParallelRouter(2, block_size=4)
    picks = []
    for i in range(4):
        engine, hashes = router.choose([100 + i, 1, 2])  # shorter than a block: no prefix
        router.add(f"r{i}", engine, 1, hashes)
        picks.append(engine)
    assert picks == [0, 1, 0, 1]
    router.request_done("r0")
    router.request_done("r2")  # engine 0 is idle now, engine 1 holds two
    assert router.choose([7, 8, 9])[0] == 0


class _FakeGpuPlatform:
    name = "cuda"
    device_type = "cuda"
    device_control_env_var = "CUDA_VISIBLE_DEVICES"

    @staticmethod
    def device_count() -> int:
        return 4


@pytest.fixture
def fake_gpus(monkeypatch):
    import engine.plugins

    class Manager:
        def resolve_platform(self, requested):
            return _FakeGpuPlatform

    monkeypatch.setattr(engine.plugins.PluginManager, "from_env", staticmethod(Manager))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def _config(dp: int, tp: int = 1, pp: int = 1):
    from engine.config import EngineConfig, ModelConfig, ParallelConfig

    return EngineConfig(
        model=ModelConfig(model=None),
        platform="cuda",
        parallel=ParallelConfig(
            tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp
        ),
    )


def test_each_engine_core_gets_its_own_devices_with_tensor_parallelism(fake_gpus, monkeypatch):
    from engine.engine_core.proc import data_parallel_env

    assert data_parallel_env(_config(dp=4), 4) == [
        {"CUDA_VISIBLE_DEVICES": str(i)} for i in range(4)
    ]
    assert data_parallel_env(_config(dp=2, tp=2), 2) == [
        {"CUDA_VISIBLE_DEVICES": "0,1"},
        {"CUDA_VISIBLE_DEVICES": "2,3"},
    ]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7,5,3,1")
    assert data_parallel_env(_config(dp=2, pp=2), 2) == [
        {"CUDA_VISIBLE_DEVICES": "7,5"},
        {"CUDA_VISIBLE_DEVICES": "3,1"},
    ]


def test_too_few_devices_for_data_x_tensor_parallelism_is_a_clear_error(fake_gpus):
    from engine.config import ConfigError
    from engine.engine_core.proc import data_parallel_env

    with pytest.raises(ConfigError, match=r"needs 6 cuda devices, 2 \(tensor x pipeline ranks\) "
                       r"per engine core; 4 are visible"):  # fmt: skip
        data_parallel_env(_config(dp=3, tp=2), 3)


def test_router_prefers_the_core_holding_the_prefix_unless_it_is_much_busier():
    router = DataParallelRouter(2, block_size=4)
    prefix = list(range(10, 22))  # three full blocks
    engine, hashes = router.choose(prefix + [1])
    assert len(hashes) == 3
    router.add("first", engine, 1, hashes)
    holder = engine
    # Same prefix, other suffix: the holder, although it is busier.
    for i in range(DataParallelRouter.imbalance_limit(0)):
        pick, hashes = router.choose(prefix + [2 + i])
        assert pick == holder
        router.add(f"again{i}", pick, 1, hashes)
    # Too busy now (5 requests against 0): the prefix is not worth the imbalance.
    assert router.choose(prefix + [99])[0] != holder
    # A prompt sharing only the first block still counts as a prefix hit.
    assert router._prefix_holder(router._hashes(prefix[:4] + [0, 0, 0, 0])) == holder
    assert router._prefix_holder(router._hashes([0, 0, 0, 0] + prefix[4:])) is None


def test_router_forgets_old_hashes_and_counts_every_completion():
    router = DataParallelRouter(2, block_size=2, max_hashes=3)
    engine, hashes = router.choose([1, 2, 3, 4, 5, 6])
    router.add("a", engine, 2, hashes)
    assert len(router._owner) == 3
    engine2, hashes2 = router.choose([7, 8, 9, 10])
    router.add("b", engine2, 1, hashes2)
    assert len(router._owner) == 3  # bounded: the oldest went
    assert router.load(engine) == 1
    router.sequence_done("a", 0)
    router.sequence_done("a", 0)  # twice (the core and a stop string): counted once
    assert router.load(engine) == 1 and router.engine_of("a") == engine
    router.sequence_done("a", 1)
    assert router.load(engine) == 0 and router.engine_of("a") is None


def test_router_counts_other_front_ends_from_the_cores_stats():
    from engine.engine_core.messages import EngineStats

    router = DataParallelRouter(2)
    router.on_stats(0, EngineStats(num_running=6, num_waiting=2))  # others' requests
    assert router.load(0) == 8 and router.choose([1, 2, 3])[0] == 1


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from engine.testing.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("dp"), "llama", max_position_embeddings=256)


KW = dict(dtype="float32", platform="cpu", max_model_len=256, cpu_kv_cache_gb=0.05)


def test_data_parallel_llm_gives_the_same_greedy_outputs_and_routes_prefixes(model_dir):
    from engine.llm import LLM

    prefix = list(range(20, 68))  # three blocks of 16
    first = [{"prompt_token_ids": prefix + [5]}]
    batch = []
    for i in range(3):
        batch.append({"prompt_token_ids": prefix + [6 + i, 7]})  # shares the prefix
        batch.append({"prompt_token_ids": [100 + i] * (20 + i)})  # shares nothing
    batch.append("A text prompt, tokenized by the front end")
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = LLM(str(model_dir), **KW)
    with LLM(str(model_dir), data_parallel_size=2, **KW) as dp:
        engine = dp.llm_engine
        children = [
            p for p in psutil.Process().children() if "engine-core-" in " ".join(p.cmdline())
        ]
        assert len(children) == 2
        for prompts in (first, batch):
            got = dp.generate(prompts, params, use_tqdm=False)
            ref = want.generate(prompts, params, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
            assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in ref]
        stats = engine.client.get_stats_by_engine()
        assert sorted(stats) == [0, 1]
        # The three prefix-sharing requests went to the core that computed the prefix.
        hits = {i: s.prefix_cache_hits for i, s in stats.items()}
        assert sorted(hits.values()) == [0, 3 * 48], hits
        assert all(s.generation_tokens_total > 0 for s in stats.values()), stats
        assert engine.num_used_blocks == 0
        with pytest.raises(AttributeError, match="other processes"):
            engine.runner  # noqa: B018 - no in-process core
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, "engine-core processes outlived LLM.shutdown()"


def test_data_parallel_llm_serves_lora_adapters_on_every_core(model_dir, tmp_path):
    """``LLM(data_parallel_size=2, enable_lora=True)``: the requests' LoRARequests cross to
    both engine-core processes (transformers' tokens with the adapter merged, on both cores),
    add_lora / remove_lora / list_loras reach every core."""
    from engine.llm import LLM
    from engine.lora.request import LoRARequest
    from engine.testing.lora import hf_greedy, make_peft_adapter, merged_model

    adapter = make_peft_adapter(model_dir, tmp_path / "a", rank=4, seed=5)
    prompts = [[1, 30 + i, 31 + i, 32 + i] for i in range(4)]
    hf = merged_model(model_dir, adapter)
    want = [hf_greedy(hf, p, 6) for p in prompts]
    lora = LoRARequest("a", 1, str(adapter))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(str(model_dir), data_parallel_size=2, enable_lora=True, max_lora_rank=8, **KW) as dp:
        assert dp.add_lora(lora) is True and dp.list_loras() == {1}
        got = dp.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=lora
        )
        assert [o.outputs[0].token_ids for o in got] == want
        stats = dp.llm_engine.client.get_stats_by_engine()
        assert all(s.generation_tokens_total > 0 for s in stats.values()), stats
        assert dp.remove_lora(1) is True and dp.list_loras() == set()
        assert dp.remove_lora(1) is False
        with pytest.raises(ValueError, match="does not exist"):
            dp.add_lora(LoRARequest("b", 2, str(tmp_path / "missing")))
        assert dp.llm_engine.num_used_blocks == 0


# Only in the process engine-core-1 (the spawned core's last argument), the LoRA registry
# refuses adapters whose directory holds REFUSE_ON_CORE_1, as a core whose disk lacks a file
# would (as tests/server/test_lora_front_ends.py does for the server): core 0 loads them.
SITECUSTOMIZE = """
import sys

if sys.argv[-1:] == ["engine-core-1"]:
    import os

    import engine.lora.registry as registry
    from engine.lora.errors import LoRAAdapterError

    _add = registry.LoRARegistry.add

    def add(self, request, unique_name=False):
        if os.path.exists(os.path.join(request.lora_path, "REFUSE_ON_CORE_1")):
            raise LoRAAdapterError(f"injected: core 1 cannot read {request.lora_path}")
        return _add(self, request, unique_name)

    registry.LoRARegistry.add = add
"""


def test_data_parallel_add_lora_is_all_or_nothing(model_dir, tmp_path, monkeypatch):
    """``LLM(data_parallel_size=2).add_lora`` of an adapter core 1 refuses: core 0 drops it
    again and one error names core 1 and its reason; a good load of the same name and id
    then serves on both cores. An in-place reload core 1 refuses puts the previous adapter
    back on core 0."""
    from engine.llm import LLM
    from engine.lora.request import LoRARequest
    from engine.testing.lora import hf_greedy, make_peft_adapter, merged_model

    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "inject"))
    good = make_peft_adapter(model_dir, tmp_path / "good", rank=4, seed=5)
    refused = make_peft_adapter(model_dir, tmp_path / "refused", rank=4, seed=6)
    (refused / "REFUSE_ON_CORE_1").write_text("")
    prompts = [[1, 30 + i, 31 + i, 32 + i] for i in range(4)]
    want = [hf_greedy(merged_model(model_dir, good), p, 6) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(str(model_dir), data_parallel_size=2, enable_lora=True, max_lora_rank=8, **KW) as dp:
        with pytest.raises(ValueError) as refusal:
            dp.add_lora(LoRARequest("part", 1, str(refused)))
        message = str(refusal.value)
        assert "engine core 1 (of 2) refused it" in message and "injected" in message, message
        assert "engine core(s) 0 had loaded it; it was unloaded from them again" in message
        assert dp.list_loras() == set()  # the union over both cores
        # Core 0 really dropped it: it would refuse the name still held under that id.
        lora = LoRARequest("part", 1, str(good))
        assert dp.add_lora(lora) is True and dp.list_loras() == {1}

        def tokens():
            got = dp.generate(
                [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                lora_request=lora,
            )  # fmt: skip
            return [o.outputs[0].token_ids for o in got]

        assert tokens() == want
        stats = dp.llm_engine.client.get_stats_by_engine()
        assert all(s.generation_tokens_total > 0 for s in stats.values()), stats
        with pytest.raises(ValueError, match="went back to the previous adapter"):
            dp.add_lora(LoRARequest("part", 1, str(refused), load_inplace=True))
        assert dp.list_loras() == {1} and tokens() == want
        assert dp.remove_lora(1) is True and dp.list_loras() == set()
        assert dp.llm_engine.num_used_blocks == 0
