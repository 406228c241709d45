"""``engine plugins [--json] [--platform NAME]``: what is installed and what can run here.

Lists every loaded plugin (distribution, version, entry point), every platform (available, or
why not), every attention backend (usable on the chosen platform for a generic spec, or the
reasons), each platform's communicator and who supplies it, every quantization method (the
checkpoint formats it reads; usable on the chosen platform, or the reasons), every kernel
override, and the conformance kit's suites (what ``pytest --engine-conformance=PLUGIN``
checks). When no platform can be chosen the listing is still printed,
then the error, and the exit status is 2.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from engine.version import PLUGIN_API_VERSION, __version__


def register(subparsers: Any) -> None:
    """Add the ``plugins`` subcommand."""
    parser = subparsers.add_parser(
        "plugins",
        help="list plugins, platforms, attention backends, quantization methods and kernel "
        "overrides",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument(
        "--platform",
        default=None,
        help="platform to check the backends against (default: ENGINE_PLATFORM, else auto)",
    )
    parser.add_argument(
        "--attention-backend",
        default=None,
        metavar="NAME",
        help="also select this backend (or 'auto') on the platform for a generic model, and "
        "fail with its reasons if it cannot serve",
    )
    parser.set_defaults(func=run)


def collect_report(pm: Any, platform: str | None = None) -> dict[str, Any]:
    """Everything ``engine plugins`` shows, as a JSON-friendly dict.

    ``platform_error`` holds the message when no platform could be chosen.
    """
    from engine.attention_backends.interface import AttentionSpec
    from engine.attention_backends.selector import spec_for_platform
    from engine.errors import PluginError
    from engine.testing.suites import describe_suites

    chosen = None
    platform_error = None
    try:
        chosen = pm.resolve_platform_entry(platform)
    except PluginError as exc:
        platform_error = str(exc)

    spec = AttentionSpec()
    auto_order: list[str] = []
    if chosen is not None:
        spec = spec_for_platform(spec, chosen.cls)
        auto_order = list(chosen.cls.default_attention_backends(None))
    backends = []
    for entry in pm.attention_backends():
        try:
            reasons = entry.supports(spec)
        except PluginError as exc:
            reasons = [str(exc)]
        backends.append(
            {
                "name": entry.name,
                "qualname": entry.qualname,
                "distribution": entry.plugin.distribution,
                "plugin": entry.plugin.name,
                "usable": not reasons,
                "reasons": reasons,
                "auto_rank": auto_order.index(entry.name) if entry.name in auto_order else None,
            }
        )

    communicators = []
    for entry in pm.platforms():
        try:
            comm = pm.communicator_entry(entry.cls)
            communicators.append(
                {
                    "platform": entry.name,
                    "communicator": comm.communicator.describe(),
                    "provider": comm.provider,
                }
            )
        except PluginError as exc:
            communicators.append({"platform": entry.name, "error": str(exc)})

    overrides = [
        {
            "kernel": impl.name,
            "provider": impl.provider,
            "platforms": list(impl.platforms) if impl.platforms is not None else None,
            "priority": impl.priority,
            "function": f"{getattr(impl.fn, '__module__', '?')}."
            f"{getattr(impl.fn, '__qualname__', repr(impl.fn))}",
        }
        for impl in pm.kernel_registry().overrides()
    ]
    return {
        "engine": {"version": __version__, "plugin_api": PLUGIN_API_VERSION},
        "quantization_methods": quantization_report(pm, chosen),
        "plugins": [info.as_dict() for info in pm.plugins],
        "platforms": [entry.describe() for entry in pm.platforms()],
        "chosen_platform": chosen.name if chosen is not None else None,
        "platform_error": platform_error,
        "attention_backends": backends,
        "auto_order": auto_order,
        "kernel_overrides": overrides,
        "communicators": communicators,
        "conformance_suites": describe_suites(),
    }


def quantization_report(pm: Any, chosen: Any) -> list[dict[str, Any]]:
    """Every quantization method, the checkpoint formats it reads and whether it can run on
    the chosen platform (with the reasons when not)."""
    from engine.quantization import QuantizationError, QuantizationSpec

    spec = QuantizationSpec()
    if chosen is not None:
        capability = None
        if chosen.cls.device_type != "cpu":
            try:
                capability = chosen.cls.device_capability(0)
            except Exception:  # a device that cannot be queried: capability unknown
                capability = None
        spec = QuantizationSpec(
            platform=chosen.name,
            device_type=chosen.cls.device_type,
            capability=capability,
            kernels=pm.kernel_registry().resolve(chosen.name),
        )
    rows = []
    for entry in pm.quantization_methods():
        try:
            cls = entry.load()
            reasons = cls.supports(spec)
            formats, description = list(cls.checkpoint_formats), cls.description
        except QuantizationError as exc:
            reasons, formats, description = [str(exc)], [], ""
        rows.append(
            {
                "name": entry.name,
                "provider": entry.provider,
                "qualname": entry.qualname,
                "checkpoint_formats": formats,
                "description": description,
                "usable": not reasons,
                "reasons": reasons,
            }
        )
    return rows


def render_text(report: dict[str, Any]) -> str:
    """The human-readable listing."""
    lines = [f"engine {report['engine']['version']} (plugin API {report['engine']['plugin_api']})"]

    lines += ["", "Plugins:"]
    for p in report["plugins"]:
        lines.append(
            f"  {p['name']:<12} {p['distribution'] + ' ' + p['version']:<26} "
            f"entry point: {p['entry_point']}"
        )

    chosen = report["chosen_platform"]
    lines += ["", f"Platforms (chosen: {chosen or 'none'}):"]
    for p in report["platforms"]:
        mark = "*" if p["name"] == chosen else " "
        state = "available" if p["available"] else "unavailable"
        lines.append(
            f"{mark} {p['name']:<12} {state:<12} priority {p['priority']:<4} "
            f"device {p['device_type']:<5} from {p['distribution']}"
        )
        lines += [f"      - {reason}" for reason in p["reasons"]]
    if not report["platforms"]:
        lines.append("  (no plugin provides a platform)")

    where = f"on {chosen}" if chosen else "(no platform chosen)"
    lines += ["", f"Attention backends {where}:"]
    for b in report["attention_backends"]:
        state = "usable" if b["usable"] else "not usable"
        rank = f"auto #{b['auto_rank'] + 1}" if b["auto_rank"] is not None else "explicit only"
        lines.append(
            f"  {b['name']:<12} {state:<11} {rank:<14} {b['qualname']} (from {b['distribution']})"
        )
        lines += [f"      - {reason}" for reason in b["reasons"]]
    if report["auto_order"]:
        lines.append(f"  auto order: {', '.join(report['auto_order'])}")

    lines += ["", "Communicators:"]
    for c in report["communicators"]:
        if "error" in c:
            lines.append(f"  {c['platform']:<12} error: {c['error']}")
        else:
            lines.append(f"  {c['platform']:<12} {c['communicator']} (from {c['provider']})")

    lines += ["", "Conformance kit suites (pytest --engine-conformance=PLUGIN):"]
    for suite in report["conformance_suites"]:
        lines.append(f"  {suite['name']:<12} {suite['description']}")
    lines += ["", f"Quantization methods {where}:"]
    for q in report["quantization_methods"]:
        state = "usable" if q["usable"] else "not usable"
        formats = ", ".join(q["checkpoint_formats"]) or "-"
        lines.append(
            f"  {q['name']:<19} {state:<11} reads {formats:<19} (from {q['provider']}) "
            f"{q['description']}"
        )
        lines += [f"      - {reason}" for reason in q["reasons"]]

    lines += ["", "Kernel overrides:"]
    for k in report["kernel_overrides"]:
        platforms = ", ".join(k["platforms"]) if k["platforms"] is not None else "all platforms"
        lines.append(
            f"  {k['kernel']:<21} {k['provider']:<16} priority {k['priority']:<4} "
            f"on {platforms}: {k['function']}"
        )
    if not report["kernel_overrides"]:
        lines.append("  (none: every kernel uses the torch reference)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Print the listing; exit 2 (after printing it) when no platform can be chosen."""
    import sys

    from engine.cli.main import EXIT_USAGE_ERROR, format_error
    from engine.plugins import PluginManager

    pm = PluginManager.from_env()
    report = collect_report(pm, args.platform)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(render_text(report))
    if report["platform_error"]:
        print(format_error(report["platform_error"]), file=sys.stderr)
        return EXIT_USAGE_ERROR
    if args.attention_backend:
        from engine.attention_backends.interface import AttentionSpec

        # Raises AttentionBackendError (unknown name, import failure, reasons): exit status 2.
        backend = pm.select_attention_backend(
            args.attention_backend, AttentionSpec(), pm.resolve_platform(args.platform)
        )
        print(f"\nSelected attention backend: {backend.name}", file=sys.stderr)
    return 0
