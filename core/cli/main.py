"""The ``engine`` command: argparse with one module per subcommand.

Each subcommand lives in ``engine.cli.<name>`` and exposes ``register(subparsers)``, which adds
its parser and sets ``func`` (a callable taking the parsed namespace and returning an exit code)
with ``set_defaults(func=...)``. Adding a subcommand is one line in ``SUBCOMMANDS``.

Subcommand modules must not import torch (or anything heavy) at module level: the parser is
built on every invocation, ``engine --version`` included, which must stay under half a second.

A user's mistake (a bad model path or flag value, a busy port, an unknown architecture, a
plugin that fails to load, a bad prompt: the exception types in ``USER_ERRORS``) is printed as
one line on stderr, ``engine: error: <what and why; what to do>``, with exit status 2 and no
traceback unless ``--log-level debug`` asks for it. Anything else is a bug and keeps its
traceback. Ctrl-C exits with status 130 and a closed pipe (``engine plugins | head``) with 1,
quietly.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from collections.abc import Sequence

from engine.version import PLUGIN_API_VERSION, __version__

# The subcommands, in the order ``engine --help`` lists them. Append yours here.
SUBCOMMANDS = [
    "engine.cli.plugins",
    "engine.cli.env",
    "engine.cli.serve",
    "engine.cli.generate",
    "engine.cli.bench",
]

EXIT_USAGE_ERROR = 2
EXIT_INTERRUPTED = 130

# The exceptions that report a user's mistake, as (module, class). Each message names what is
# wrong and what to do. A class is looked up only if its module was imported (an exception of a
# module never imported cannot have been raised), so catching costs no import.
USER_ERRORS = (
    ("engine.config", "ConfigError"),  # flag values, DefaultModelError, a busy port
    ("engine.errors", "PluginError"),  # plugins, platforms, attention backends
    ("engine.errors", "InvalidRequestError"),  # a prompt the engine will not run
    ("engine.sampling_params", "SamplingParamsError"),
    ("engine.layers.weight_utils", "ModelLoadError"),  # paths, architectures, checkpoints
    ("engine.loader.gguf_file", "GGUFLoadError"),
    ("engine.tokenizer", "TokenizerLoadError"),
    ("engine.kernels.registry", "KernelError"),
    ("engine.server.tools.parser", "ToolParserNotFound"),
)


class EngineArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line: what is wrong and where the help is (argparse's
    own error prints the whole usage first, 40 lines for ``engine serve``). Subcommand
    parsers are of this class too (``add_subparsers`` uses the parent's class)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_USAGE_ERROR, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    parser = EngineArgumentParser(
        prog="engine",
        description="An LLM inference and serving engine with pluggable hardware backends.",
    )
    parser.add_argument(
        "-V",
        "--version",
        action="version",
        version=f"engine {__version__} (plugin API {PLUGIN_API_VERSION})",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMANDS:
        importlib.import_module(module_name).register(subparsers)
    return parser


def format_error(exc: BaseException) -> str:
    """``engine: error: ...`` on one line (a message's own line breaks are joined)."""
    return "engine: error: " + " ".join(str(exc).split())


def is_user_error(exc: BaseException) -> bool:
    """Whether ``exc`` reports a user's mistake (``USER_ERRORS``) rather than a bug."""
    for module_name, class_name in USER_ERRORS:
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if cls is not None and isinstance(exc, cls):
            return True
    return False


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``engine`` command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return EXIT_USAGE_ERROR
    from engine.cpu_threads import prefer_passive_openmp

    prefer_passive_openmp()  # before torch is imported: see engine.cpu_threads
    try:
        from engine.cli.args import merge_model_args

        merge_model_args(args)  # `engine serve X` and `engine serve --model X` alike
        status = int(func(args) or 0)
        # Output still buffered when the reader has gone would otherwise fail in the
        # interpreter's final flush ("Exception ignored ... BrokenPipeError"), outside this
        # handler; flushing here brings that error into it (Python's note on SIGPIPE).
        sys.stdout.flush()
        return status
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`engine plugins | head`): nothing to report. Point stdout at
        # devnull so that the interpreter's final flush does not raise again.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as exc:
        if not is_user_error(exc):
            raise
        if getattr(args, "log_level", None) == "debug":
            traceback.print_exception(exc)
        print(format_error(exc), file=sys.stderr)
        return EXIT_USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())
