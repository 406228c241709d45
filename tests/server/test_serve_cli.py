"""``engine serve`` command line: registered, grouped help, vllm-style flag names."""

from __future__ import annotations

import pytest

from engine.cli.main import build_parser
from engine.config import ConfigError


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
        "--enable-log-requests",
        "--disable-uvicorn-access-log",
        "--disable-access-log-for-endpoints",
        "--max-log-len",
        "--max-request-body-bytes",
        "--chat-template",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "--exclude-tools-when-tool-choice-none",
        "--api-server-count",
        "--stream-interval",
        "--data-parallel-size",
    ):
        assert flag in text, flag
    assert "\ntool calling:\n" in text
    assert "hermes, llama3_json, mistral, openai, pythonic" in " ".join(text.split())  # wrapped
    assert "openai_gptoss" in text


def test_serve_defaults_and_engine_config():
    from engine.cli.args import engine_config_from_args

    args = build_parser().parse_args(["serve"])
    assert args.model is None  # the embedded default model, resolved when the engine loads
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 8000, None)
    assert args.max_request_body_bytes == 16 * 1024 * 1024
    assert (args.api_server_count, args.stream_interval, args.data_parallel_size) == (1, 1, 1)
    for flag in ("--api-server-count", "--stream-interval"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", flag, "0"])
    args = build_parser().parse_args(["serve", "/m", "-dp", "2", "--api-server-count", "3"])
    assert engine_config_from_args(args).parallel.data_parallel_size == 2
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
    with pytest.raises(ConfigError, match="no such file"):
        _read_chat_template(str(tmp_path / "missing.jinja"))


def test_several_served_model_names():
    from engine.cli.args import engine_config_from_args

    args = build_parser().parse_args(
        ["serve", "/m", "--served-model-name", "a", "b", "--seed", "1"]
    )
    config = engine_config_from_args(args)
    assert config.model.served_model_names == ["a", "b"]
    args = build_parser().parse_args(["serve", "/m", "--served-model-name", "a"])
    assert engine_config_from_args(args).model.served_model_name == "a"
    args = build_parser().parse_args(["serve", "/m", "--served-model-name", "a", "a"])
    with pytest.raises(ConfigError, match="lists a name twice"):
        engine_config_from_args(args)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
        (["--tool-call-parser", "hermes"], "requires --enable-auto-tool-choice"),
        (["--enable-auto-tool-choice", "--tool-call-parser", "granite"], "unknown tool call"),
    ],
)
def test_tool_flags_fail_at_startup(flags, message, capsys):
    """Before the port is bound or the model loads: one paragraph, exit status 2."""
    from engine.cli.main import main

    assert main(["serve", "/does/not/exist", "--port", "1", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("engine: error:") and message in " ".join(err.split())


def test_request_logging_is_opt_in(caplog):
    """As vLLM since 0.11: --enable-log-requests turns it on; the old --disable-log-requests is
    accepted (old scripts keep starting) with a warning that it does nothing."""
    import logging

    from engine.cli.serve import log_requests

    assert "--disable-log-requests" not in build_parser().format_help()
    assert not log_requests(build_parser().parse_args(["serve"]))
    assert log_requests(build_parser().parse_args(["serve", "--enable-log-requests"]))
    with caplog.at_level(logging.WARNING, logger="engine.server"):
        assert not log_requests(build_parser().parse_args(["serve", "--disable-log-requests"]))
    assert "--disable-log-requests is deprecated" in caplog.text


def test_image_input_flags():
    from engine.cli.args import engine_config_from_args

    args = build_parser().parse_args(
        [
            "serve",
            "/m",
            "--limit-mm-per-prompt",
            '{"image": 2}',
            "--allowed-local-media-path",
            "/data/images",
            "--allowed-media-domains",
            "images.example.com",
            "cdn.example.com",
            "--max-image-pixels",
            "1000000",
            "--mm-encoder-cache-gb",
            "0.5",
        ]
    )
    mm = engine_config_from_args(args).multimodal
    assert mm.limit("image") == 2
    assert mm.allowed_local_media_path == "/data/images"
    assert mm.allowed_media_domains == ["images.example.com", "cdn.example.com"]
    assert (mm.max_image_pixels, mm.mm_encoder_cache_gb) == (1000000, 0.5)
    defaults = engine_config_from_args(build_parser().parse_args(["serve", "/m"])).multimodal
    assert defaults.allowed_local_media_path is None and defaults.allowed_media_domains is None
    for bad, message in (("{image: 2}", "not valid JSON"), ('{"video": 1}', "'video' is not")):
        args = build_parser().parse_args(["serve", "/m", "--limit-mm-per-prompt", bad])
        with pytest.raises(ConfigError, match=message):
            engine_config_from_args(args)
