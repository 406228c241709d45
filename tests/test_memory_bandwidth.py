"""``python -m engine.benchmarks.memory_bandwidth``: every way of reading memory is timed and
reported as a rate (no timing is asserted; the rates only have to be real numbers)."""

from __future__ import annotations

import math

from engine.benchmarks.memory_bandwidth import main, measure


def test_measure_reports_each_way_of_reading():
    rates = measure(megabytes=2, threads=1, repeats=2)
    assert set(rates) == {"float32 sum", "bfloat16 sum", "bfloat16 matrix-vector"}
    assert all(math.isfinite(r) and r > 0 for r in rates.values())


def test_main_prints_the_best(capsys):
    assert main(["--megabytes", "2", "--repeats", "1", "--threads", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and lines[-1].startswith("best: ")
    assert lines[-1].endswith("GB/s (1 threads, 2 MB)")
