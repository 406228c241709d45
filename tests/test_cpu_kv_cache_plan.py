"""The CPU KV cache size: what requests can use, the budget, the memory available, and a
max_model_len lowered to fit only when the user left it unset (``engine.cpu_kv_cache``), plus
the one-shot commands' small default, through the real ``LLM`` and CLI on a tiny model."""

from __future__ import annotations

import logging

import pytest

import engine.cpu_kv_cache as kv
from engine.config import ConfigError
from engine.cpu_kv_cache import GiB, plan_cpu_kv_cache

BLOCK = 1 << 20  # 1 MiB per block
BLOCK_SIZE = 16


def blocks_for_len(n: int) -> int:
    """One full-attention group of 16-token blocks."""
    return -(-n // BLOCK_SIZE)


def plan(**kw):
    args = dict(
        bytes_per_block=BLOCK,
        blocks_for_len=blocks_for_len,
        max_num_seqs=4,
        max_model_len=4096,  # 256 blocks a request
        max_model_len_fixed=False,
        budget_gib=None,
        available_bytes=64 * GiB,
    )
    return plan_cpu_kv_cache(**{**args, **kw})


def test_what_requests_can_use_bounds_the_cache():
    p = plan()
    assert (p.num_blocks, p.max_model_len) == (4 * 256 + 1, 4096)
    assert "all that max_num_seqs=4 requests of max_model_len=4096" in p.reason
    assert "within the default 4 GiB budget" in p.reason


def test_default_budget_is_4_gib_or_half_the_available_memory():
    p = plan(max_num_seqs=256)  # could use 64 GiB
    assert p.num_blocks == 4 * GiB // BLOCK
    assert "capped by the default 4 GiB budget" in p.reason
    p = plan(max_num_seqs=256, available_bytes=3 * GiB)
    assert p.num_blocks == int(1.5 * GiB) // BLOCK
    assert "capped by 50% of the 3.00 GiB of memory available" in p.reason
    p = plan(max_num_seqs=256, available_bytes=None)  # unknown: the default budget
    assert p.num_blocks == 4 * GiB // BLOCK


def test_an_explicit_budget_is_not_capped_by_memory(caplog):
    with caplog.at_level(logging.WARNING, logger="engine.cpu_kv_cache"):
        p = plan(max_num_seqs=256, budget_gib=2.0, available_bytes=1 * GiB)
    assert p.num_blocks == 2 * GiB // BLOCK
    assert "capped by the cpu_kv_cache_gb=2 budget" in p.reason
    assert "more than the 1.00 GiB of memory available" in caplog.text


def test_unset_max_model_len_is_lowered_to_fit():
    budget_blocks = 100  # a 4096-token request needs 256
    p = plan(budget_gib=budget_blocks * BLOCK / GiB)
    assert p.max_model_len == 99 * BLOCK_SIZE  # 99 blocks + the null block
    assert p.num_blocks == budget_blocks
    assert "max_model_len is lowered to 1584" in p.reason
    p = plan(budget_gib=budget_blocks * BLOCK / GiB, max_num_seqs=1)
    assert p.num_blocks == 100 and blocks_for_len(p.max_model_len) + 1 == 100


def test_given_max_model_len_that_does_not_fit_is_an_error():
    with pytest.raises(ConfigError, match=r"max_model_len=4096 needs 256 .*lower --max-model-len"):
        plan(budget_gib=100 * BLOCK / GiB, max_model_len_fixed=True)
    with pytest.raises(ConfigError, match="too few for any request"):
        plan(budget_gib=1 * BLOCK / GiB)


def test_available_memory_reads_the_cgroup_limit(tmp_path, monkeypatch):
    limit, usage = tmp_path / "memory.max", tmp_path / "memory.current"
    limit.write_text(f"{2 * GiB}\n")
    usage.write_text(f"{GiB // 2}\n")
    monkeypatch.setattr(kv, "CGROUP_MEMORY_FILES", ((str(limit), str(usage)),))
    assert kv.available_memory() == GiB + GiB // 2  # below what the host has free
    limit.write_text("max\n")
    host = kv.available_memory()
    assert host is not None and host > 0


# ---- through the engine ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from engine.testing.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("kv-plan"), "llama")  # 1024 positions


def test_llm_lowers_an_unset_max_model_len_to_fit(tiny, caplog):
    from engine import LLM, SamplingParams
    from engine.errors import PromptTooLongError

    # 2 layers x (k, v) x 16 tokens x 2 KV heads x 16 dims x 4 bytes = 8 KiB a block;
    # 33 blocks hold one request of 32 blocks = 512 tokens, not 1024.
    budget = 33 * 8192 / GiB
    with caplog.at_level(logging.INFO):
        llm = LLM(str(tiny), dtype="float32", max_num_seqs=2, cpu_kv_cache_gb=budget)
    engine = llm.llm_engine
    assert engine.runner.num_blocks == 33
    assert engine.max_model_len == 512 == engine.config.model.max_model_len
    assert "max_model_len lowered from 1024 to 512" in caplog.text
    out = llm.generate([[5] * 500], SamplingParams(max_tokens=20, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 12  # stops at the lowered length (512)
    with pytest.raises(PromptTooLongError):
        llm.generate([[5] * 512], use_tqdm=False)
    assert engine.num_used_blocks == 0
    with pytest.raises(ConfigError, match="max_model_len=1024 needs 64"):
        LLM(str(tiny), dtype="float32", max_model_len=1024, cpu_kv_cache_gb=budget)


def test_llm_default_budget_follows_available_memory(tiny, monkeypatch):
    from engine import LLM

    monkeypatch.setattr(kv, "available_memory", lambda: 2 * 40 * 8192)  # half: 40 blocks
    llm = LLM(str(tiny), dtype="float32", max_num_seqs=8)  # could use 8 x 64 + 1 blocks
    assert llm.llm_engine.runner.num_blocks == 40
    assert llm.llm_engine.max_model_len == 39 * 16  # lowered: one request fills the rest


def test_one_shot_commands_default_to_a_small_budget(tiny, caplog, capsys):
    from engine.cli.main import main

    with caplog.at_level(logging.INFO):
        assert main(["generate", "--model", str(tiny), "Hello", "--max-tokens", "2"]) == 0
    assert "engine generate runs a few requests, so a CPU KV cache gets a 0.5 GiB" in caplog.text
    assert "within the cpu_kv_cache_gb=0.5 budget" in caplog.text
    capsys.readouterr()
