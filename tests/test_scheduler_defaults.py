"""Step limits sized by the platform (issue 20, item 1): the flags a user leaves unset take the
platform's defaults for the device and the usage (offline ``LLM`` or ``engine serve``); the
values a user sets are kept; the engine logs what it applied."""

from __future__ import annotations

import logging

import pytest

from engine.config import EngineConfig, ModelConfig, SchedulerConfig
from engine.platforms.torch_cuda import LARGE_DEVICE_BYTES, TorchCudaPlatform
from engine.runtime import apply_scheduler_defaults

GiB = 2**30


class _Gpu(TorchCudaPlatform):
    name = "fakegpu"
    memory = 0

    @classmethod
    def total_memory(cls, index: int = 0) -> int:
        return cls.memory


def _config(**sched) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model="unused"), scheduler=SchedulerConfig(**sched))


@pytest.mark.parametrize(
    ("memory", "usage", "expected"),
    [
        (141 * GiB, "offline", (1024, 16384)),  # H200
        (80 * GiB, "server", (1024, 8192)),  # H100: a server keeps 8192 for its ITL
        (LARGE_DEVICE_BYTES - 1, "offline", (256, 8192)),  # smaller cards: the generic limits
        (24 * GiB, "server", (256, 8192)),
    ],
)
def test_a_cuda_device_sizes_the_unset_limits(monkeypatch, caplog, memory, usage, expected):
    monkeypatch.setattr(_Gpu, "memory", memory)
    config = _config(usage=usage)
    assert config.scheduler.defaulted == ("max_num_seqs", "max_num_batched_tokens")
    with caplog.at_level(logging.INFO, logger="engine.runtime"):
        apply_scheduler_defaults(config, _Gpu)
    sched = config.scheduler
    assert (sched.max_num_seqs, sched.max_num_batched_tokens) == expected
    assert sched.defaulted == ()
    assert f"max_num_seqs={expected[0]}, max_num_batched_tokens={expected[1]}" in caplog.text
    assert f"{usage} defaults (fakegpu)" in caplog.text


def test_values_the_user_set_are_kept(monkeypatch):
    monkeypatch.setattr(_Gpu, "memory", 141 * GiB)
    config = _config(max_num_seqs=64)
    apply_scheduler_defaults(config, _Gpu)
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (64, 16384)
    both = _config(max_num_seqs=8, max_num_batched_tokens=256)
    assert both.scheduler.defaulted == ()
    apply_scheduler_defaults(both, _Gpu)
    assert (both.scheduler.max_num_seqs, both.scheduler.max_num_batched_tokens) == (8, 256)


def test_a_scheduler_config_built_directly_has_the_generic_limits():
    sched = SchedulerConfig()
    assert (sched.max_num_seqs, sched.max_num_batched_tokens) == (256, 8192)
    with pytest.raises(Exception, match="max_num_seqs must be >= 1"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(Exception, match="usage='batch' is not one of offline, server"):
        SchedulerConfig(usage="batch")


def test_serve_and_offline_commands_declare_their_usage():
    from engine.cli.args import engine_config_from_args
    from engine.cli.main import build_parser

    parser = build_parser()
    serve = engine_config_from_args(parser.parse_args(["serve", "m"]))
    assert serve.scheduler.usage == "server"
    assert serve.scheduler.defaulted == ("max_num_seqs", "max_num_batched_tokens")
    bench = parser.parse_args(["bench", "throughput", "--model", "m", "--max-num-seqs", "32"])
    offline = engine_config_from_args(bench)
    assert offline.scheduler.usage == "offline"
    assert offline.scheduler.max_num_seqs == 32
    assert offline.scheduler.defaulted == ("max_num_batched_tokens",)


@pytest.mark.parametrize("multiprocess", [False, True], ids=["inproc", "engine-core"])
def test_the_engine_applies_the_platform_defaults(tmp_path, caplog, multiprocess):
    """The whole path on the CPU platform (its generic limits): in this process (logged), and
    through an engine-core process, whose front end learns the values its core applied."""
    from engine.llm_engine import LLMEngine
    from engine.testing.tiny_models import build_tiny_model

    model = build_tiny_model(tmp_path / "m", "llama")
    config = EngineConfig(
        model=ModelConfig(model=str(model), max_model_len=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=512),
    )
    config.cache.num_gpu_blocks = 32
    with caplog.at_level(logging.INFO, logger="engine.runtime"):
        engine = LLMEngine.from_config(config, multiprocess=multiprocess)
    try:
        sched = engine.config.scheduler
        assert (sched.max_num_seqs, sched.max_num_batched_tokens) == (256, 512)
        assert sched.defaulted == ()
        if not multiprocess:
            assert "offline defaults (cpu) for the unset max_num_seqs: max_num_seqs=256" in (
                caplog.text
            )
    finally:
        engine.shutdown()
