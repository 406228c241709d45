"""``--cpu-threads`` / ``LLM(cpu_threads=...)``: torch's CPU thread team, by default the
physical cores this process may use (affinity, SMT, cgroup quota), logged at start."""

from __future__ import annotations

import logging
import os

import psutil
import pytest
import torch

import engine.cpu_threads as ct


@pytest.fixture(autouse=True)
def keep_torch_threads(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def host(monkeypatch, tmp_path):
    """An 8-logical/4-physical-CPU host whose affinity allows CPUs 0-3, no cgroup quota."""
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 8 if logical else 4)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(ct, "CGROUP_CPU_MAX", str(tmp_path / "cpu.max"))
    monkeypatch.setattr(ct, "CGROUP_V1_CPU", (str(tmp_path / "q"), str(tmp_path / "p")))
    return tmp_path


def test_default_is_the_physical_cores_of_the_affinity(host):
    choice = ct.resolve_cpu_threads(None)
    assert choice.num_threads == 2  # 4 allowed logical CPUs, 2 per core
    assert "2 physical core(s) in this process's CPU affinity (4 logical CPU(s), 2 per core)" in (
        choice.reason
    )


@pytest.mark.parametrize(
    ("files", "want"),
    [
        ({"cpu.max": "150000 100000\n"}, 2),  # docker --cpus=1.5: 2 threads, not 4
        ({"cpu.max": "100000 100000\n"}, 1),
        ({"cpu.max": "max 100000\n"}, 2),  # no quota: the affinity decides
        ({"q": "100000\n", "p": "100000\n"}, 1),  # cgroup v1
        ({"q": "-1\n", "p": "100000\n"}, 2),
    ],
)
def test_a_cgroup_quota_lowers_it(host, files, want):
    for name, text in files.items():
        (host / name).write_text(text)
    assert ct.resolve_cpu_threads(None).num_threads == want


def test_flag_then_environment(host, monkeypatch):
    assert ct.resolve_cpu_threads(3) == ct.CpuThreads(3, "--cpu-threads")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert ct.resolve_cpu_threads(None) == ct.CpuThreads(1, "OMP_NUM_THREADS")
    assert ct.resolve_cpu_threads(2).num_threads == 2  # the flag wins


def test_llm_applies_and_logs_it(tmp_path, caplog, monkeypatch):
    from engine import LLM, SamplingParams
    from engine.testing.tiny_models import build_tiny_model

    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    path = build_tiny_model(tmp_path / "m", "llama", max_position_embeddings=64)
    torch.set_num_threads(2)
    with caplog.at_level(logging.INFO, logger="engine.cpu_threads"):
        llm = LLM(str(path), dtype="float32", max_num_seqs=2, cpu_threads=1)
    assert torch.get_num_threads() == 1
    assert "CPU threads: 1 (from --cpu-threads" in caplog.text
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"
    out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_cli_flag(capsys):
    from engine.cli.args import engine_config_from_args
    from engine.cli.main import build_parser, main

    args = build_parser().parse_args(["serve", "/m", "--cpu-threads", "3"])
    assert engine_config_from_args(args).cpu_threads == 3
    assert engine_config_from_args(build_parser().parse_args(["serve"])).cpu_threads is None
    assert main(["serve", "/m", "--cpu-threads", "0"]) == 2
    assert "cpu_threads must be >= 1, got 0" in capsys.readouterr().err


def test_the_cli_makes_openmp_threads_sleep_when_idle(monkeypatch, capsys):
    """Spinning idle OpenMP threads take the CPU from everything else on shared cores; the CLI
    sets OMP_WAIT_POLICY=PASSIVE (with a bounded spin first) before torch is loaded, unless the
    user chose a policy."""
    from engine.cli.main import main
    from engine.cpu_threads import SPIN_BEFORE_SLEEP

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert main(["plugins", "--json"]) == 0
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    # ... after a bounded spin (about a millisecond), which the user may set otherwise.
    assert os.environ["GOMP_SPINCOUNT"] == SPIN_BEFORE_SLEEP
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    assert main(["plugins", "--json"]) == 0
    assert os.environ["GOMP_SPINCOUNT"] == "0"
    # A policy the user chose is left alone, and gets no spin count added.
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.delenv("GOMP_SPINCOUNT")
    assert main(["plugins", "--json"]) == 0
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    assert "GOMP_SPINCOUNT" not in os.environ
    capsys.readouterr()
