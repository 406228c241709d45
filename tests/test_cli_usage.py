"""The command line as a vLLM user types it: how the model is given, what a mistake prints."""

from __future__ import annotations

import pytest

from engine.cli.args import engine_config_from_args, merge_model_args
from engine.cli.main import build_parser, main
from engine.config import ConfigError


def parsed_model(argv: list[str]) -> str | None:
    args = build_parser().parse_args(argv)
    merge_model_args(args)
    return args.model


@pytest.mark.parametrize(
    "prefix",
    [["serve"], ["chat"], ["bench", "throughput"], ["bench", "latency"]],
    ids=["serve", "chat", "bench-throughput", "bench-latency"],
)
def test_model_positional_or_option(prefix):
    """`vllm serve X` and `vllm serve --model X` both work; so do ours."""
    assert parsed_model([*prefix, "/m"]) == "/m"
    assert parsed_model([*prefix, "--model", "/m"]) == "/m"
    assert parsed_model([*prefix, "--model=/m"]) == "/m"
    assert parsed_model([*prefix, "/m", "--model", "/m"]) == "/m"  # the same twice is fine
    assert parsed_model(prefix) is None


def test_generate_takes_model_as_option():
    """`engine generate` takes prompts as its positional arguments, so only --model."""
    args = build_parser().parse_args(["generate", "--model", "/m", "Hello", "World"])
    merge_model_args(args)
    assert (args.model, args.prompts) == ("/m", ["Hello", "World"])


def test_serve_model_option_reaches_the_engine_config():
    args = build_parser().parse_args(["serve", "--model", "/m", "--max-model-len", "64"])
    config = engine_config_from_args(args)
    assert config.model.model == "/m" and config.model.max_model_len == 64


def test_two_different_models_are_an_error(capsys):
    args = build_parser().parse_args(["serve", "/a", "--model", "/b"])
    with pytest.raises(ConfigError, match="given twice"):
        merge_model_args(args)
    assert main(["serve", "/a", "--model", "/b"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("engine: error: the model is given twice, as '/a' and as --model '/b'")


@pytest.mark.parametrize("kind", ["throughput", "latency"])
def test_bench_defaults_to_the_embedded_model(kind, tiny_default_model, tmp_path):
    """`engine bench throughput` without a model benchmarks the embedded default model, as
    `engine serve` serves it (here a tiny stand-in Gemma 3 GGUF)."""
    import json

    out = tmp_path / "result.json"
    workload = {
        "throughput": ["--num-prompts", "3", "--input-len", "8", "--output-len", "4"],
        "latency": ["--input-len", "8", "--output-len", "3", "--num-iters", "1"],
    }[kind]
    flags = ["--max-model-len", "512", "--max-num-seqs", "8", "--json", str(out)]
    assert main(["bench", kind, *workload, *flags]) == 0
    result = json.loads(out.read_text())
    assert result["model"] == str(tiny_default_model)
    assert result["settings"]["max_model_len"] == 512
