"""The conformance kit: a pytest plugin, registered under the ``pytest11`` entry point of the
``engine`` distribution, so installing the engine is enough::

    pytest --engine-conformance=PLUGIN [--engine-conformance-report=report.md]

``PLUGIN`` is a plugin's entry-point name (``engine plugins`` lists them; a platform name works
too and means the plugin providing it). The kit adds one test item per check to whatever else
pytest collects (``-m conformance`` runs only the kit), built by the suites in
``engine.testing.suites`` from what the plugin registered:

* ``platform[NAME]::…`` — the plugin's platform (detection cheap in a fresh interpreter, memory
  profiling, ``check_config`` reasons, ...);
* ``communicator[NAME]::…`` — its communicator on one rank and on 2 processes;
* ``backend[NAME]::CASE`` — every attention backend against the torch reference;
* ``kernel[NAME]::…`` / ``moe[NAME]::…`` / ``lora[NAME]::…`` — every kernel override against
  its reference.

The checks run on the plugin's own platform; a plugin without one (engine-triton) is checked on
the platform the engine would choose, or on ``--engine-conformance-platform=NAME``. Inputs are
fresh random tensors every run: the seed is printed in the header, in every failure and in the
report, and ``--engine-conformance-seed=N`` replays a run. ``--engine-conformance-report=FILE``
writes a report a vendor can publish: JSON for ``*.json``, markdown for ``*.md``.

Plugins load as the engine loads them (``ENGINE_PLUGINS`` applies). Without
``--engine-conformance`` the plugin adds nothing but its options.
"""

from __future__ import annotations

import json
import os
import platform as host
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

MARKER = "conformance"
REPORT_FORMATS = {".json": "json", ".md": "markdown", ".markdown": "markdown"}

_TARGET = pytest.StashKey[Any]()
_SEED = pytest.StashKey[int]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("engine-conformance", "engine plugin conformance kit")
    group.addoption(
        "--engine-conformance",
        metavar="PLUGIN",
        default=None,
        help="check the named engine plugin (entry-point or platform name): its platform, "
        "communicator, attention backends and kernel overrides",
    )
    group.addoption(
        "--engine-conformance-platform",
        metavar="NAME",
        default=None,
        help="run the checks on this platform's device (default: the plugin's own platform, "
        "else the one the engine would choose)",
    )
    group.addoption(
        "--engine-conformance-seed",
        type=int,
        default=None,
        metavar="N",
        help="seed of the random inputs (default: a fresh one each run, printed)",
    )
    group.addoption(
        "--engine-conformance-ranks",
        type=int,
        default=2,
        metavar="N",
        help="processes for the communicator check (default 2; below 2 skips it)",
    )
    group.addoption(
        "--engine-conformance-report",
        metavar="FILE",
        default=None,
        help="write a report of the checks: JSON (*.json) or markdown (*.md)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARKER}: engine plugin conformance checks")
    report = config.getoption("--engine-conformance-report")
    if report and Path(report).suffix.lower() not in REPORT_FORMATS:
        raise pytest.UsageError(
            f"--engine-conformance-report={report}: the file name must end in "
            f"{', '.join(REPORT_FORMATS)} (JSON or markdown)"
        )
    if report and not config.getoption("--engine-conformance"):
        raise pytest.UsageError("--engine-conformance-report needs --engine-conformance=PLUGIN")
    seed = config.getoption("--engine-conformance-seed")
    config.stash[_SEED] = random.SystemRandom().randrange(2**31) if seed is None else seed
    if config.getoption("--engine-conformance"):
        config.pluginmanager.register(ConformanceRecorder(config), "engine-conformance-recorder")


def _target(config: pytest.Config) -> Any:
    """The ``ConformanceTarget`` (or the error message why there is none), built once."""
    if _TARGET not in config.stash:
        try:
            config.stash[_TARGET] = _build_target(config)
        except Exception as exc:  # reported as the one failing item, and in the header
            from engine.errors import PluginError

            if not isinstance(exc, PluginError):
                raise
            config.stash[_TARGET] = str(exc)
    return config.stash[_TARGET]


def _build_target(config: pytest.Config) -> Any:
    from engine.errors import PluginError
    from engine.plugins import PluginManager
    from engine.testing.suites import ConformanceTarget

    name = config.getoption("--engine-conformance")
    pm = PluginManager.from_env()
    plugins = {p.name: p for p in pm.plugins}
    platforms = pm.platforms()
    if name in plugins:
        plugin = plugins[name]
    else:
        owner = next((e.plugin for e in platforms if e.name == name), None)
        if owner is None:
            raise PluginError(
                f"--engine-conformance={name}: no loaded plugin or platform has that name. "
                f"Loaded plugins: {', '.join(plugins)}; platforms: "
                f"{', '.join(e.name for e in platforms) or 'none'}. Install the plugin (and "
                "check ENGINE_PLUGINS)."
            )
        plugin = owner
    own = [e for e in platforms if e.plugin.name == plugin.name]
    requested = config.getoption("--engine-conformance-platform")
    if requested:
        entry = pm.resolve_platform_entry(requested)
    elif own:
        if len(own) > 1 and name not in {e.name for e in own}:
            raise PluginError(
                f"{plugin.describe()} provides several platforms "
                f"({', '.join(e.name for e in own)}); choose one with "
                "--engine-conformance-platform=NAME"
            )
        chosen = next((e for e in own if e.name == name), own[0])
        entry = pm.resolve_platform_entry(chosen.name)  # refused with reasons if unavailable
    else:
        entry = pm.resolve_platform_entry(None)
    return ConformanceTarget(
        pm=pm,
        plugin=plugin,
        platform=entry,
        owns_platform=entry.plugin.name == plugin.name,
        platform_explicit=bool(requested),
        ranks=config.getoption("--engine-conformance-ranks"),
        environ=dict(os.environ),
    )


def pytest_report_header(config: pytest.Config) -> str | None:
    if not config.getoption("--engine-conformance"):
        return None
    target, seed = _target(config), config.stash[_SEED]
    if isinstance(target, str):
        return f"engine conformance: cannot start: {target}"
    return (
        f"engine conformance: plugin {target.plugin.name} ({target.plugin.distribution} "
        f"{target.plugin.version}) on platform {target.platform.name}, seed {seed} "
        f"(replay with --engine-conformance-seed={seed})"
    )


class ConformanceItem(pytest.Item):
    """One conformance check: calls ``check.run(seed)``; a ``pytest.skip`` inside skips it."""

    def __init__(self, *, check: Any, seed: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.check = check
        self.seed = seed
        self.add_marker(MARKER)

    def runtest(self) -> None:
        if self.check.skip:
            pytest.skip(self.check.skip)
        self.check.run(self.seed)

    def repr_failure(self, excinfo: Any, style: Any = None) -> str:
        c = self.check
        head = (
            f"{c.id} failed: {c.suite} {c.subject!r}, property {c.property!r}, seed {self.seed} "
            f"(replay with --engine-conformance-seed={self.seed})"
        )
        if isinstance(excinfo.value, AssertionError):
            return f"{head}\n{excinfo.value}"
        return f"{head}\n{super().repr_failure(excinfo, style)}"

    def reportinfo(self) -> tuple[Any, int, str]:
        return self.path, 0, f"engine conformance: {self.name}"


class ConformanceCollector(pytest.Collector):
    """Builds the items for the target from every registered suite."""

    def _item(self, check: Any) -> ConformanceItem:
        return ConformanceItem.from_parent(
            self, name=check.id, check=check, seed=self.config.stash[_SEED]
        )

    def collect(self) -> list[ConformanceItem]:
        from engine.testing.suites import ConformanceCheck, load_suites

        target = _target(self.config)
        if isinstance(target, str):
            message = target

            def fail(seed: int) -> None:
                raise AssertionError(message)

            return [self._item(ConformanceCheck("engine-conformance", "load", "load", fail))]
        return [self._item(check) for suite in load_suites() for check in suite.checks(target)]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    """Append the conformance items before ``-m``/``-k`` deselection runs."""
    name = config.getoption("--engine-conformance")
    if not name:
        return
    collector = ConformanceCollector.from_parent(
        session, name=f"engine-conformance[{name}]", nodeid=f"engine-conformance[{name}]"
    )
    # genitems reports the collection like pytest's own (so "collected N items" counts ours).
    items.extend(session.genitems(collector))


class ConformanceRecorder:
    """Registered while the kit runs: records each item's outcome and writes the report."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.results: dict[str, pytest.TestReport] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # The call phase, or the setup phase when the item did not get that far.
        if report.nodeid.startswith("engine-conformance[") and (
            report.when == "call" or (report.when == "setup" and not report.passed)
        ):
            self.results[report.nodeid] = report

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        path = self.config.getoption("--engine-conformance-report")
        if not path:
            return
        items = [i for i in session.items if isinstance(i, ConformanceItem)]
        data = build_report(self.config, items, self.results)
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        if REPORT_FORMATS[out.suffix.lower()] == "json":
            out.write_text(json.dumps(data, indent=2) + "\n")
        else:
            out.write_text(render_markdown(data))
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"engine conformance report: {out}")


def _outcome(report: pytest.TestReport | None) -> tuple[str, str]:
    if report is None:
        return "not run", ""
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        return "skipped", reason.removeprefix("Skipped: ")
    if report.failed:
        return "failed", str(report.longreprtext).strip()
    return "passed", ""


def build_report(
    config: pytest.Config, items: list[ConformanceItem], results: dict[str, pytest.TestReport]
) -> dict[str, Any]:
    """The report as a JSON-friendly dict (what ``--engine-conformance-report`` writes)."""
    from engine.version import PLUGIN_API_VERSION, __version__

    target = _target(config)
    seed = config.stash[_SEED]
    checks = []
    for item in items:
        report = results.get(item.nodeid)
        outcome, message = _outcome(report)
        c = item.check
        checks.append(
            {
                "id": c.id,
                "suite": c.suite,
                "subject": c.subject,
                "property": c.property,
                "provider": c.provider,
                "outcome": outcome,
                "duration_s": round(report.duration, 3) if report is not None else None,
                "message": message,
            }
        )
    summary = {
        k: sum(1 for c in checks if c["outcome"] == k) for k in ("passed", "failed", "skipped")
    }
    summary["not run"] = sum(1 for c in checks if c["outcome"] == "not run")
    name = config.getoption("--engine-conformance")
    data: dict[str, Any] = {
        "engine": {"version": __version__, "plugin_api": PLUGIN_API_VERSION},
        "target": name,
        "seed": seed,
        "replay": f"pytest --engine-conformance={name} --engine-conformance-seed={seed}",
        "environment": _environment(),
        "summary": summary,
        "checks": checks,
    }
    if isinstance(target, str):
        data["error"] = target
    else:
        data["plugin"] = target.plugin.as_dict()
        data["platform"] = {
            "name": target.platform.name,
            "distribution": target.platform.plugin.distribution,
            "device": _safe(lambda: target.platform.cls.device_name(0)),
            "device_count": _safe(lambda: target.platform.cls.device_count()),
        }
    return data


def _safe(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:
        return f"unknown ({type(exc).__name__}: {exc})"


def _environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "os": f"{host.system()} {host.release()} {host.machine()}",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        env["torch"] = torch.__version__
        env["torch_cuda"] = torch.version.cuda
        env["torch_hip"] = getattr(torch.version, "hip", None)
    for module in ("torch_xla", "triton"):
        mod = sys.modules.get(module)
        if mod is not None:
            env[module] = getattr(mod, "__version__", "?")
    return env


def render_markdown(data: dict[str, Any]) -> str:
    """The report as markdown: facts, summary, then one table per suite."""
    plugin = data.get("plugin", {})
    platform = data.get("platform", {})
    s = data["summary"]
    lines = [f"# Engine conformance report: {data['target']}", ""]
    facts = [
        ("plugin", f"{plugin.get('name', '?')} ({plugin.get('distribution', '?')} "
                   f"{plugin.get('version', '?')})"),
        ("platform", f"{platform.get('name', '?')} on {platform.get('device', '?')}"),
        ("engine", f"{data['engine']['version']} (plugin API {data['engine']['plugin_api']})"),
        ("environment", ", ".join(f"{k} {v}" for k, v in data["environment"].items())),
        ("seed", f"{data['seed']} (replay: `{data['replay']}`)"),
        ("result", f"{s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped"
                   + (f", {s['not run']} not run" if s["not run"] else "")),
    ]  # fmt: skip
    lines += ["| | |", "| --- | --- |"] + [f"| {k} | {_cell(v)} |" for k, v in facts]
    if "error" in data:
        lines += ["", f"**The kit could not start:** {_cell(data['error'])}"]
    suites: dict[str, list[dict[str, Any]]] = {}
    for check in data["checks"]:
        suites.setdefault(check["suite"], []).append(check)
    for suite, checks in suites.items():
        lines += ["", f"## {suite}", "", "| subject | property | outcome | note |"]
        lines.append("| --- | --- | --- | --- |")
        for c in checks:
            note = c["message"].splitlines()[-1] if c["message"] else ""
            if c["outcome"] == "failed":
                note = c["message"].splitlines()[1] if len(c["message"].splitlines()) > 1 else note
            lines.append(
                f"| {_cell(c['subject'])} | {_cell(c['property'])} | {c['outcome']} | "
                f"{_cell(note[:300])} |"
            )
    return "\n".join(lines) + "\n"


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")
