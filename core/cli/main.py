"""The ``engine`` command: argparse with one module per subcommand.

Each subcommand lives in ``engine.cli.<name>`` and exposes ``register(subparsers)``, which adds
its parser and sets ``func`` (a callable taking the parsed namespace and returning an exit code)
with ``set_defaults(func=...)``. Adding a subcommand is one line in ``SUBCOMMANDS``.

Subcommand modules must not import torch (or anything heavy) at module level: the parser is
built on every invocation, ``engine --version`` included, which must stay under half a second.

Errors caused by plugins, platforms, backends or configuration are printed as one paragraph on
stderr with exit status 2, without a traceback; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import textwrap
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


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
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
    """``engine: error: ...`` as one wrapped paragraph."""
    return textwrap.fill(
        f"engine: error: {exc}", width=100, break_long_words=False, break_on_hyphens=False
    )


def _user_errors() -> tuple[type[BaseException], ...]:
    from engine.config import ConfigError
    from engine.errors import PluginError

    errors: list[type[BaseException]] = [PluginError, ConfigError]
    kernels = sys.modules.get("engine.kernels.registry")
    if kernels is not None:  # only if imported: it is not worth importing to catch
        errors.append(kernels.KernelError)
    return tuple(errors)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``engine`` command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return EXIT_USAGE_ERROR
    try:
        from engine.cli.args import merge_model_args

        merge_model_args(args)  # `engine serve X` and `engine serve --model X` alike
        return int(func(args) or 0)
    except Exception as exc:
        if isinstance(exc, _user_errors()):
            print(format_error(exc), file=sys.stderr)
            return EXIT_USAGE_ERROR
        raise


if __name__ == "__main__":
    sys.exit(main())
