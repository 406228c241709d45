"""``python -m engine.benchmarks.serve_vs_offline``: the server and the offline engine run at
once, so on a GPU each must ask for its share of the device (two engines at the default 0.9
asked for 180% of it, and the second ran out of memory); the CPU path keeps working."""

from __future__ import annotations

from engine.benchmarks import serve_vs_offline as bench


def flags_and_command(*argv: str) -> tuple[float, list[str]]:
    args = bench.build_parser().parse_args(list(argv))
    flags = bench._engine_flags(args)
    cmd = bench.server_command("/m", args, 1234)
    served = float(cmd[cmd.index("--gpu-memory-utilization") + 1])
    assert served == flags["gpu_memory_utilization"]  # the server gets what the offline run gets
    return flags["gpu_memory_utilization"], cmd


def test_both_engines_get_half_the_device_each():
    share, _ = flags_and_command()
    assert share == 0.45
    share, _ = flags_and_command("--gpu-memory-utilization", "0.8")
    assert share == 0.4


def test_one_engine_alone_gets_all_of_it():
    assert flags_and_command("--modes", "offline")[0] == 0.9
    assert flags_and_command("--modes", "stream,plain")[0] == 0.9


def test_cpu_path_runs(capsys):
    argv = ["--num-prompts", "4", "--input-len", "8", "--output-len", "4", "--repeats", "1"]
    argv += ["--hidden-size", "64", "--num-layers", "1", "--max-model-len", "64"]
    argv += ["--max-num-seqs", "4", "--cpu-kv-cache-gb", "0.01", "--torch-threads", "1"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    for label in ("offline LLM.generate", "HTTP, streaming", "HTTP, non-streaming"):
        assert label in out, out
    assert "gpu_memory_utilization 0.45 per engine" in out
