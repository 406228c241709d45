"""``engine serve [MODEL]``: the OpenAI-compatible HTTP server.

Engine flags come from ``engine.cli.args`` (shared with generate/chat/bench); the flags here
are the server's, named like ``vllm serve``'s. Nothing heavy is imported until the command
runs.
"""

from __future__ import annotations

import argparse
import logging
import time

from engine.cli.args import (
    add_engine_args,
    add_log_level_arg,
    add_model_arg,
    configure_logging,
    engine_config_from_args,
    int_at_least,
)

DEFAULT_BODY_LIMIT = 16 * 1024 * 1024


_positive_int = int_at_least(1)


def _string_list(text: str) -> list[str]:
    """A JSON list of strings, as vLLM takes --allowed-origins (``'["https://a.example"]'``),
    or one plain value."""
    import json

    if not text.lstrip().startswith("["):
        return [text]
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"invalid JSON list {text!r}: {e}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, got {text!r}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a TCP port in 0..65535, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in 0..65535, got {value}")
    return value


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The HTTP server's own flags, in two argument groups."""
    server = parser.add_argument_group("server")
    server.add_argument(
        "--host",
        default="127.0.0.1",
        help="Address to listen on; 0.0.0.0 for every interface (default: %(default)s).",
    )
    server.add_argument(
        "--port", type=_port, default=8000, help="Port to listen on (default: %(default)s)."
    )
    server.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="Require 'Authorization: Bearer KEY' on /v1 routes (repeat for several keys).",
    )
    server.add_argument(
        "--chat-template",
        default=None,
        help="A Jinja chat template (a file path or the template itself) for models whose "
        "tokenizer has none, or to override it.",
    )
    server.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="Render a request's own chat_template (off: such requests get 400, as in vLLM; a "
        "template is code the server runs).",
    )
    server.add_argument(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="Serve GET /tokenizer_info (the tokenizer's configuration and chat template, as "
        "vLLM does; lm-eval's remote tokenizer reads it). Off by default: it exposes them.",
    )
    server.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_BODY_LIMIT,
        help="Larger request bodies are refused with 413 (default: %(default)s = 16 MiB).",
    )
    server.add_argument(
        "--max-n",
        type=_positive_int,
        default=128,
        help="Largest n (completions per prompt) a request may ask for (default: %(default)s).",
    )
    server.add_argument(
        "--api-server-count",
        type=_positive_int,
        default=1,
        help="HTTP front-end processes sharing the port (SO_REUSEPORT) and the engine cores; "
        "more of them take tokenization, detokenization and streaming off one process's "
        "cores (default: %(default)s).",
    )
    server.add_argument(
        "--stream-interval",
        type=_positive_int,
        default=1,
        help="Tokens per streamed chunk: 1 sends every token as it comes; larger values send "
        "fewer, bigger chunks, at less cost per token (default: %(default)s).",
    )
    server.add_argument(
        "--root-path",
        default="",
        metavar="PREFIX",
        help="The path prefix a reverse proxy serves the API under (FastAPI's root_path), "
        "e.g. /llm.",
    )
    server.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="Report usage.prompt_tokens_details.cached_tokens: the prompt tokens served from "
        "the prefix cache.",
    )
    server.add_argument(
        "--max-stored-responses",
        type=int_at_least(0),
        default=1000,
        metavar="N",
        help="Responses API: how many responses each front-end process keeps in memory for "
        "GET /v1/responses/{id} and previous_response_id, the oldest dropped first; 0 keeps "
        "none (default: %(default)s).",
    )
    server.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="Add an X-Request-Id header to every response: the request's own, else a new one.",
    )
    server.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="On SIGTERM/SIGINT, seconds to let in-flight requests finish before aborting "
        "them; new requests get 503 meanwhile (default: %(default)s).",
    )

    web = parser.add_argument_group("CORS and TLS")
    web.add_argument(
        "--allowed-origins",
        type=_string_list,
        default=[],
        metavar="JSON",
        help="Origins browsers may call the API from, e.g. '[\"https://app.example\"]' or "
        "'[\"*\"]' (default: none, no CORS headers; vLLM allows every origin by default).",
    )
    web.add_argument(
        "--allowed-methods",
        type=_string_list,
        default=["*"],
        metavar="JSON",
        help="HTTP methods allowed from those origins (default: all).",
    )
    web.add_argument(
        "--allowed-headers",
        type=_string_list,
        default=["*"],
        metavar="JSON",
        help="Request headers allowed from those origins (default: all).",
    )
    web.add_argument(
        "--allow-credentials",
        action="store_true",
        help="Let browsers send cookies and credentials with cross-origin requests.",
    )
    web.add_argument(
        "--ssl-keyfile", default=None, metavar="FILE", help="TLS private key file (PEM)."
    )
    web.add_argument(
        "--ssl-certfile", default=None, metavar="FILE", help="TLS certificate file (PEM)."
    )
    web.add_argument(
        "--ssl-ca-certs",
        default=None,
        metavar="FILE",
        help="CA certificates to verify client certificates.",
    )
    web.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=0,
        choices=(0, 1, 2),
        help="Client certificates: 0 not asked, 1 optional, 2 required (Python's "
        "ssl.CERT_NONE/OPTIONAL/REQUIRED; default: %(default)s).",
    )

    lora = parser.add_argument_group("LoRA adapters (with --enable-lora)")
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        type=_lora_module,
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters to serve from the start, as name=path or as JSON "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\'; a request picks one by its '
        "`model`. With VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 adapters can also be loaded and "
        "unloaded at run time (/v1/load_lora_adapter, /v1/unload_lora_adapter).",
    )

    tools = parser.add_argument_group("tool calling")
    tools.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='Parse tool calls from chat output when a request has tools (tool_choice "auto", '
        "the default with tools); needs --tool-call-parser.",
    )
    tools.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="How the model writes tool calls: "
        + ", ".join(_tool_parser_names())
        + " (hermes: <tool_call>{...}</tool_call>, Hermes and Qwen models; llama3_json: "
        '{"name": ..., "parameters": ...} objects, Llama 3.x; mistral: [TOOL_CALLS] calls, '
        "Mistral and Mixtral models; pythonic: [f(x=1), g()] lists, Llama 3.2 / 4; "
        "qwen3_coder: <function=f><parameter=x>...</parameter></function>, Qwen3-Coder; "
        "openai: harmony messages to=functions.NAME, GPT-OSS), or "
        "module:Class of your own ToolParser. Needs --enable-auto-tool-choice.",
    )
    tools.add_argument(
        "--reasoning-parser",
        default=None,
        choices=_reasoning_parser_names(),
        help="Put the model's reasoning in the chat response's reasoning (and "
        "reasoning_content) field, out of content: deepseek_r1 (DeepSeek-R1 and its "
        "distills, QwQ, Qwen3 Thinking-2507: reasoning until </think>), qwen3 (hybrid Qwen3: "
        "reasoning only when the output opens <think>), openai_gptoss (GPT-OSS: the harmony "
        "format's analysis channel; final and preambles are content).",
    )
    tools.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help='Do not show the tools to the model when a request sets tool_choice "none" '
        "(default: the chat template still renders them).",
    )

    logs = parser.add_argument_group("logging")
    logs.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="Log each request's prompt, token ids and sampling parameters (off by default, as "
        "in vLLM: prompts are user data).",
    )
    # vLLM's old opt-out, removed there once logging became opt-in: still accepted (a warning
    # says it does nothing now) so that old launch scripts keep starting.
    logs.add_argument("--disable-log-requests", action="store_true", help=argparse.SUPPRESS)
    logs.add_argument(
        "--max-log-len",
        type=int,
        default=None,
        help="Log at most this many prompt characters and token ids per request.",
    )
    logs.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="Do not log the throughput/load line every --log-stats-interval seconds.",
    )
    logs.add_argument(
        "--log-stats-interval",
        type=float,
        default=10.0,
        help="Seconds between stats lines while busy (default: %(default)s).",
    )
    logs.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="Do not log one line per HTTP request.",
    )
    logs.add_argument(
        "--disable-access-log-for-endpoints",
        default="",
        metavar="PATHS",
        help="Comma-separated paths whose access-log lines are dropped, e.g. /health,/metrics.",
    )
    add_log_level_arg(logs)
    logs.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        help="Log level of the HTTP server (default: %(default)s).",
    )


def _lora_module(text: str) -> dict:
    """One ``--lora-modules`` value: ``name=path`` or a JSON object (vLLM's two forms)."""
    import json

    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"invalid JSON LoRA module {text!r}: {e}") from None
        if not isinstance(value, dict) or not value.get("name") or not value.get("path"):
            raise argparse.ArgumentTypeError(
                f'a JSON LoRA module needs "name" and "path", got {text!r}'
            )
        unknown = set(value) - {"name", "path", "base_model_name"}
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown LoRA module fields {sorted(unknown)} (name, path, base_model_name)"
            )
        return {k: value.get(k) for k in ("name", "path", "base_model_name")}
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"a LoRA module is name=path or JSON, got {text!r}")
    return {"name": name, "path": path, "base_model_name": None}


def _reasoning_parser_names() -> list[str]:
    from engine.server.reasoning import REASONING_PARSERS

    return sorted(REASONING_PARSERS)


def _tool_parser_names() -> list[str]:
    from engine.server.tools.parser import TOOL_PARSERS

    return sorted(TOOL_PARSERS)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``engine serve``."""
    parser = subparsers.add_parser(
        "serve",
        help="Serve a model over an OpenAI-compatible HTTP API.",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, /metrics, "
        "/version). Without MODEL, the embedded Gemma 3 270M is served.",
    )
    add_model_arg(parser, positional=True)
    add_server_args(parser)
    add_engine_args(parser)
    parser.set_defaults(func=run_serve, scheduler_usage="server")


def _check_tls_files(args: argparse.Namespace) -> None:
    """The TLS flags name files that exist, and a key comes with a certificate: checked before
    the port is taken (one line, not a traceback from the TLS library later)."""
    from pathlib import Path

    from engine.config import ConfigError

    for flag in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        value = getattr(args, flag)
        if value is not None and not Path(value).is_file():
            raise ConfigError(f"--{flag.replace('_', '-')} {value}: no such file")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ConfigError("HTTPS needs both --ssl-keyfile and --ssl-certfile")


def _read_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a path to a file, or the template text itself."""
    if value is None:
        return None
    from pathlib import Path

    path = Path(value)
    if "{" not in value and path.is_file():
        return path.read_text()
    if "{" not in value:
        from engine.config import ConfigError

        raise ConfigError(
            f"--chat-template {value}: no such file; pass the path of a Jinja template file or "
            "the template text itself"
        )
    return value


def log_requests(args: argparse.Namespace) -> bool:
    """Whether to log each request: only with ``--enable-log-requests``."""
    if args.disable_log_requests:
        logging.getLogger("engine.server").warning(
            "--disable-log-requests is deprecated and does nothing: requests are logged only "
            "with --enable-log-requests"
        )
    return bool(args.enable_log_requests)


def run_serve(args: argparse.Namespace) -> int:
    """Run the server until SIGTERM/SIGINT; return the exit status."""
    started_at = time.monotonic()
    configure_logging(args.log_level)
    from engine.server.app import ServerOptions
    from engine.server.launcher import ApiServer, LaunchOptions, listen_socket
    from engine.server.models import LoRAModulePath
    from engine.server.serving import ServerLimits, ServingOptions

    config = engine_config_from_args(args)  # validates flags before the port is taken
    lora_modules = [LoRAModulePath(**m) for m in args.lora_modules or []]
    if lora_modules and config.lora is None:
        from engine.config import ConfigError

        raise ConfigError("--lora-modules needs --enable-lora")
    names = [m.name for m in lora_modules]
    if len(set(names)) != len(names):
        from engine.config import ConfigError

        raise ConfigError(f"--lora-modules names an adapter twice: {names}")
    quiet = [p.strip() for p in args.disable_access_log_for_endpoints.split(",") if p.strip()]
    _check_tls_files(args)
    options = ServerOptions(
        api_keys=list(args.api_key or []),
        allowed_origins=args.allowed_origins,
        allowed_methods=args.allowed_methods,
        allowed_headers=args.allowed_headers,
        allow_credentials=args.allow_credentials,
        enable_request_id_headers=args.enable_request_id_headers,
        max_request_body_bytes=args.max_request_body_bytes,
        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        serving=ServingOptions(
            limits=ServerLimits(max_n=args.max_n, max_logprobs=args.max_logprobs),
            log_requests=log_requests(args),
            max_log_len=args.max_log_len,
            chat_template=_read_chat_template(args.chat_template),
            trust_request_chat_template=args.trust_request_chat_template,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            tool_call_parser=args.tool_call_parser,
            exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
            reasoning_parser=args.reasoning_parser,
            enable_prompt_tokens_details=args.enable_prompt_tokens_details,
            max_stored_responses=args.max_stored_responses,
            lora_modules=lora_modules,
        ),
    )
    if config.model.model is None:
        # The embedded default model; a missing package fails here, before the port is
        # taken, with the install hint (a ConfigError: one paragraph, exit status 2).
        try:
            from engine.default_model import resolve_model
        except ImportError as e:
            from engine.config import ConfigError

            raise ConfigError(
                f"no model was given and the embedded default model is unavailable ({e}); "
                "pass a model: a Hugging Face model directory, a Hugging Face Hub id "
                "(org/name), or a .gguf file"
            ) from None
        path, served_name = resolve_model(None)
        config.model.model = str(path)
        if config.model.served_model_name is None:
            config.model.served_model_name = served_name
    else:
        # A mistyped path fails now, in one line, rather than after the server started; a Hub
        # id is downloaded now, once, before the engine cores and front ends start.
        from engine.loader import locate_model

        locate_model(config.model)

    launch = LaunchOptions(
        host=args.host,
        port=args.port,
        shutdown_timeout=args.shutdown_timeout,
        log_stats_interval=0.0 if args.disable_log_stats else args.log_stats_interval,
        access_log=not args.disable_uvicorn_access_log,
        quiet_paths=quiet,
        log_level=args.uvicorn_log_level,
        started_at=started_at,
        stream_interval=args.stream_interval,
        api_server_count=args.api_server_count,
        root_path=args.root_path,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
    )
    if args.api_server_count > 1:
        from engine.server.multiproc import serve_multiprocess

        return serve_multiprocess(config, options, launch)

    def start_engine_cores():
        from engine.engine_core.async_client import AsyncMPClient

        return AsyncMPClient.launch(config, log_level=args.uvicorn_log_level)

    sock = listen_socket(args.host, args.port)
    return ApiServer(start_engine_cores, options, launch, sock=sock).run()
