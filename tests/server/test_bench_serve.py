"""``engine bench serve`` against the tiny-model server: the figures it reports add up to what
the server did, failures are counted, and its statistics are the usual ones."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest
from server_harness import API_KEY

from engine.benchmarks import serve as bench
from engine.benchmarks.workload import random_workload


def bench_args(server, tmp_path, **overrides) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_cli_args(parser)
    argv = ["--base-url", server.base_url, "--api-key", API_KEY, "--num-prompts", "6",
            "--random-input-len", "12", "--random-output-len", "5", "--random-range-ratio",
            "0.5", "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,99", "--json", str(tmp_path / "result.json")]  # fmt: skip
    args = parser.parse_args(argv)
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_figures_add_up_to_what_was_served(server, tmp_path, capsys):
    args = bench_args(server, tmp_path, request_rate=200.0, max_concurrency=3)
    assert bench.run(args) == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "P99 TPOT (ms):" in out
    record = json.loads((tmp_path / "result.json").read_text())
    assert "api_key" not in record["settings"] and record["model"] == "tiny"
    summary, requests = record["summary"], record["requests"]
    # The same seeded workload the benchmark drew (the tokenizer's vocabulary bounds the ids).
    vocab = len(server.engine.tokenizer)
    workload = random_workload(6, (6, 18), (2, 7), vocab, seed=0)
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert [r["prompt_len"] for r in requests] == list(map(len, workload.prompts))
    assert [r["output_tokens"] for r in requests] == workload.output_lens  # ignore_eos
    assert summary["total_input_tokens"] == workload.input_tokens
    assert summary["total_output_tokens"] == workload.output_tokens
    for r in requests:
        assert 0 < r["ttft"] <= r["e2el"] and r["error"] == ""
        assert len(r["itl"]) <= r["output_tokens"] - 1
    ttfts = [r["ttft"] * 1000 for r in requests]
    assert summary["mean_ttft_ms"] == pytest.approx(np.mean(ttfts))
    assert summary["p99_ttft_ms"] == pytest.approx(np.percentile(ttfts, 99))
    assert summary["output_throughput"] == pytest.approx(
        workload.output_tokens / summary["duration_s"]
    )
    assert server.engine.num_used_blocks == 0


def test_several_client_processes_send_the_same_workload(server, tmp_path, capsys):
    args = bench_args(server, tmp_path, num_workers=2, max_concurrency=3)
    assert bench.run(args) == 0
    out = capsys.readouterr().out
    assert "Client processes:" in out and "Client CPU, busiest process (% of run):" in out
    record = json.loads((tmp_path / "result.json").read_text())
    summary, requests = record["summary"], record["requests"]
    workload = random_workload(6, (6, 18), (2, 7), len(server.engine.tokenizer), seed=0)
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert [r["prompt_len"] for r in requests] == list(map(len, workload.prompts))  # in order
    assert [r["output_tokens"] for r in requests] == workload.output_lens
    assert len(summary["client_cpu_s"]) == 2
    # One figure per client process (a short run may round a process's CPU time to 0).
    assert len(summary["client_cpu_utilization"]) == 2
    assert all(u >= 0 for u in summary["client_cpu_utilization"])
    assert server.engine.num_used_blocks == 0


def test_failed_requests_are_counted_and_fail_the_run(server, tmp_path, capsys):
    args = bench_args(server, tmp_path, random_input_len=300, random_range_ratio=0.0)
    assert bench.run(args) == 1  # prompts longer than max_model_len (256): 400s
    summary = json.loads((tmp_path / "result.json").read_text())["summary"]
    assert summary["completed"] == 0 and summary["failed"] == 6
    assert "HTTP 400" in capsys.readouterr().err


def test_arrivals_and_percentiles():
    gaps = bench._gaps(4000, rate=20.0, burstiness=1.0, seed=1)
    assert math.isclose(sum(gaps) / len(gaps), 1 / 20.0, rel_tol=0.05)
    bursty = bench._gaps(4000, rate=20.0, burstiness=0.2, seed=1)
    assert math.isclose(sum(bursty) / len(bursty), 1 / 20.0, rel_tol=0.15)
    assert np.std(bursty) > 2 * np.std(gaps)  # gamma shape 0.2: far burstier than Poisson
    assert bench._gaps(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    values = [5.0, 1.0, 3.0, 2.0, 8.0]
    for q in (0, 25, 50, 90, 99, 100):
        assert bench._percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_bad_flags_are_refused(server, tmp_path):
    with pytest.raises(SystemExit, match="--request-rate must be > 0"):
        bench.run(bench_args(server, tmp_path, request_rate=0.0))
    with pytest.raises(SystemExit, match="unknown \\['ttfb'\\]"):
        bench.run(bench_args(server, tmp_path, percentile_metrics="ttft,ttfb"))
    with pytest.raises(SystemExit, match="--num-workers must be >= 1"):
        bench.run(bench_args(server, tmp_path, num_workers=0))
