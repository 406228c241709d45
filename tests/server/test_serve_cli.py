"""``engine serve`` command line: registered, grouped help, vllm-style flag names."""

from __future__ import annotations

import pytest

from engine.cli.main import build_parser


def serve_help(capsys) -> str:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_serve_help_is_grouped(capsys):
    text = serve_help(capsys)
    for group in ("server:", "logging:", "model:", "KV cache:", "scheduler:"):
        assert f"\n{group}\n" in text, group
    for flag in (
        "--host",
        "--port",
        "--api-key",
        "--served-model-name",
        "--dtype",
        "--max-model-len",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--block-size",
        "--gpu-memory-utilization",
        "--enable-prefix-caching, --no-enable-prefix-caching",
        "--seed",
        "--attention-backend",
        "--platform",
        "--tensor-parallel-size",
        "--shutdown-timeout",
        "--disable-log-requests",
        "--disable-uvicorn-access-log",
        "--disable-access-log-for-endpoints",
        "--max-log-len",
        "--max-request-body-bytes",
        "--chat-template",
    ):
        assert flag in text, flag


def test_serve_defaults_and_engine_config():
    from engine.cli.args import engine_config_from_args

    args = build_parser().parse_args(["serve"])
    assert args.model is None  # the embedded default model, resolved when the engine loads
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 8000, None)
    assert args.max_request_body_bytes == 16 * 1024 * 1024
    args = build_parser().parse_args(
        ["serve", "/m", "--max-model-len", "64", "--no-enable-prefix-caching", "--api-key", "k"]
    )
    config = engine_config_from_args(args)
    assert config.model.model == "/m" and config.model.max_model_len == 64
    assert config.cache.enable_prefix_caching is False
    assert args.api_key == ["k"]


def test_chat_template_flag_reads_a_file(tmp_path):
    from engine.cli.serve import _read_chat_template

    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert _read_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert _read_chat_template("{{ x }}") == "{{ x }}"
    with pytest.raises(FileNotFoundError):
        _read_chat_template(str(tmp_path / "missing.jinja"))
