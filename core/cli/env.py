"""``engine env [--json] [--platform NAME]``: what a bug report needs.

Python, OS, engine and plugin versions, the torch build, which accelerator stacks are present,
the chosen platform (or why none could be chosen) and the environment variables that change the
engine's behaviour. Cheap: torch is not imported (its build is read from its version file).
"""

from __future__ import annotations

import argparse
import json
import os
import platform as _platform
import sys
from typing import Any

from engine.version import PLUGIN_API_VERSION, __version__

# Packages whose versions matter in bug reports (present or not).
RELEVANT_PACKAGES = (
    "torch",
    "transformers",
    "safetensors",
    "pluggy",
    "triton",
    "torch_xla",
    "nvidia-ml-py",
    "amdsmi",
    "gguf",
)

# Environment variables that affect plugin loading, platform choice or device visibility.
RELEVANT_ENV_PREFIXES = ("ENGINE_",)
RELEVANT_ENV_VARS = (
    "CUDA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "PJRT_DEVICE",
    "TPU_VISIBLE_CHIPS",
    "TRITON_INTERPRET",
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "OMP_NUM_THREADS",
)


def register(subparsers: Any) -> None:
    """Add the ``env`` subcommand."""
    parser = subparsers.add_parser(
        "env",
        help="print the environment for a bug report",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument(
        "--platform", default=None, help="platform to resolve (default: ENGINE_PLATFORM, else auto)"
    )
    parser.set_defaults(func=run)


def _package_version(name: str) -> str | None:
    from engine.plugins import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def collect_env(platform: str | None = None) -> dict[str, Any]:
    """The report as a dict. Plugin problems are reported in it rather than raised."""
    from engine.errors import PluginError
    from engine.platforms.detect import torch_build

    build = torch_build()
    report: dict[str, Any] = {
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "os": _platform.platform(),
        "machine": _platform.machine(),
        "engine": __version__,
        "plugin_api": PLUGIN_API_VERSION,
        "torch": {
            "version": build.version,
            "cuda": build.cuda,
            "hip": build.hip,
            "build": build.describe(),
        },
        "packages": {name: _package_version(name) for name in RELEVANT_PACKAGES},
        "accelerator_stacks": {
            "cuda_driver": os.path.isdir("/proc/driver/nvidia"),
            "rocm_driver": os.path.isdir("/sys/class/kfd"),
            "torch_xla": _package_version("torch_xla") is not None,
        },
        "env": {
            key: value
            for key, value in sorted(os.environ.items())
            if key in RELEVANT_ENV_VARS or key.startswith(RELEVANT_ENV_PREFIXES)
        },
        "plugins": [],
        "platforms": [],
        "chosen_platform": None,
        "error": None,
    }
    try:
        from engine.plugins import PluginManager

        pm = PluginManager.from_env()
        report["plugins"] = [info.as_dict() for info in pm.plugins]
        report["platforms"] = [
            {k: p[k] for k in ("name", "distribution", "available", "reasons")}
            for p in (entry.describe() for entry in pm.platforms())
        ]
        report["chosen_platform"] = pm.resolve_platform_entry(platform).name
    except PluginError as exc:
        report["error"] = str(exc)
    return report


def render_text(report: dict[str, Any]) -> str:
    lines = [
        f"engine:            {report['engine']} (plugin API {report['plugin_api']})",
        f"python:            {report['python']} ({report['python_executable']})",
        f"os:                {report['os']} ({report['machine']})",
        f"torch:             {report['torch']['build']}",
        "accelerator stacks: "
        + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in report["accelerator_stacks"].items()),
        f"chosen platform:   {report['chosen_platform'] or 'none'}",
        "",
        "packages:",
    ]
    lines += [f"  {k:<14} {v or 'not installed'}" for k, v in report["packages"].items()]
    lines += ["", "plugins:"]
    lines += [
        f"  {p['name']:<12} {p['distribution']} {p['version']} ({p['entry_point']})"
        for p in report["plugins"]
    ]
    lines += ["", "platforms:"]
    for p in report["platforms"]:
        state = "available" if p["available"] else "unavailable: " + "; ".join(p["reasons"])
        lines.append(f"  {p['name']:<12} {state}")
    lines += ["", "environment:"]
    lines += [f"  {k}={v}" for k, v in report["env"].items()] or ["  (none set)"]
    if report["error"]:
        lines += ["", f"error: {report['error']}"]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Print the report; exit 2 (after printing it) when plugins or the platform failed."""
    from engine.cli.main import EXIT_USAGE_ERROR, format_error

    report = collect_env(args.platform)
    print(json.dumps(report, indent=2) if args.json else render_text(report))
    if report["error"]:
        print(format_error(report["error"]), file=sys.stderr)
        return EXIT_USAGE_ERROR
    return 0
