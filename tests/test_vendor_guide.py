"""docs/plugins.md cannot rot: its walkthrough is executed.

* Every file of examples/engine-example-vendor is shown whole in the guide, verbatim (a
  ``<!-- file: PATH -->`` marker before its code block), and every such block matches its file.
* The plugin built from the guide's blocks alone — no file copied from examples/ — loads, is
  listed and chosen as the guide's console session says, and passes the conformance kit.
* Every "Exactly what you see" error of section 7 is, word for word, what its faulty fixture
  produces.
"""

from __future__ import annotations

import json
import re

import pytest
from plugin_helpers import EXAMPLE_VENDOR, REPO, install_fake_dist, install_fixtures

GUIDE = REPO / "docs" / "plugins.md"
FILE_BLOCK = re.compile(r"<!-- file: (?P<path>\S+) -->\n```\w*\n(?P<body>.*?)```\n", re.S)
ERROR_BLOCK = re.compile(
    r"<!-- error: (?P<fixtures>[^|]+)\| (?P<plugins>\S+) -->\n```text\n(?P<body>.*?)```", re.S
)


def guide_files() -> dict[str, str]:
    return {m["path"]: m["body"] for m in FILE_BLOCK.finditer(GUIDE.read_text())}


def test_the_guide_shows_every_example_file_verbatim() -> None:
    shown = guide_files()
    prefix = "examples/engine-example-vendor/"
    example = {
        f"{prefix}{p.relative_to(EXAMPLE_VENDOR)}": p.read_text()
        for p in sorted(EXAMPLE_VENDOR.rglob("*"))
        if p.is_file()
        and p.suffix in (".py", ".toml")
        # the sources, not what a build leaves beside them (build/, *.egg-info, __pycache__)
        and p.relative_to(EXAMPLE_VENDOR).parts[0] in ("pyproject.toml", "engine_example_vendor")
        and "__pycache__" not in p.parts
    }
    assert sorted(shown) == sorted(example), "the guide must show exactly the example's files"
    for path, text in example.items():
        assert shown[path] == text, f"docs/plugins.md's copy of {path} differs from the file"


@pytest.fixture
def guide_plugin(tmp_path, plugin_env):
    """The example vendor written from the guide's code blocks only, then installed."""
    source = tmp_path / "from-the-guide"
    for path, body in guide_files().items():
        out = source / path.removeprefix("examples/engine-example-vendor/")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(body)
    assert install_fake_dist(source, plugin_env) == "engine-example-vendor"
    assert not (plugin_env / "engine_example_vendor" / "README.md").exists()
    return plugin_env


def run_cli(capsys, monkeypatch, env: dict[str, str], *args: str) -> dict:
    from engine.cli.main import main

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    code = main(["plugins", "--json", *args])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


def test_the_guide_console_session(guide_plugin, capsys, monkeypatch) -> None:
    """Section 3: listed but unavailable without its device; chosen with it; --platform cpu
    overrides the priority."""
    env = {"ENGINE_PLUGINS": "cpu,examplevendor"}
    report = run_cli(capsys, monkeypatch, env)
    vendor = next(p for p in report["platforms"] if p["name"] == "examplevendor")
    assert not vendor["available"] and vendor["priority"] == 200
    assert vendor["reasons"] == [
        "no example vendor device (simulated: set EXAMPLE_VENDOR_DEVICE=1)"
    ]
    assert report["chosen_platform"] == "cpu"

    report = run_cli(capsys, monkeypatch, {**env, "EXAMPLE_VENDOR_DEVICE": "1"})
    assert report["chosen_platform"] == "examplevendor"  # 200 > cpu's 0
    assert report["auto_order"] == ["example", "torch"]
    comm = next(c for c in report["communicators"] if c["platform"] == "examplevendor")
    assert comm["provider"] == "engine-example-vendor" and "gloo" in comm["communicator"]

    report = run_cli(
        capsys, monkeypatch, {**env, "EXAMPLE_VENDOR_DEVICE": "1"}, "--platform", "cpu"
    )
    assert report["chosen_platform"] == "cpu"


def test_the_plugin_built_from_the_guide_passes_the_conformance_kit(
    guide_plugin, pytester, monkeypatch, tmp_path
) -> None:
    """Section 8's command, with a JSON report."""
    monkeypatch.setenv("PYTHONPATH", str(guide_plugin))
    monkeypatch.setenv("ENGINE_PLUGINS", "cpu,examplevendor")
    monkeypatch.setenv("EXAMPLE_VENDOR_DEVICE", "1")
    report = tmp_path / "report.json"
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--engine-conformance=examplevendor", "-m", "conformance",
        f"--engine-conformance-report={report}", "-v",
    )  # fmt: skip
    result.stdout.fnmatch_lines(
        [
            "*platform[[]examplevendor[]]::detection-is-cheap PASSED*",
            "*communicator[[]examplevendor[]]::2-ranks PASSED*",
            "*backend[[]example[]]::float32-H4/2-D64-B16 PASSED*",
            "*backend[[]example[]]::float32-H4/2-D64-B16-window8 PASSED*",
            "*backend[[]torch[]]::float32-H4/2-D64-B16-kv-float8_e4m3fn PASSED*",
        ]
    )
    assert result.ret == 0
    data = json.loads(report.read_text())
    assert data["plugin"]["distribution"] == "engine-example-vendor"
    assert data["plugin"]["api_version"] == "1.1"
    assert data["platform"]["name"] == "examplevendor"
    assert data["summary"]["failed"] == 0 and data["summary"]["passed"] == len(data["checks"])
    assert {c["suite"] for c in data["checks"]} == {"platform", "communicator", "backend"}
    by_id = {c["id"]: c for c in data["checks"]}
    assert by_id["communicator[examplevendor]::2-ranks"]["provider"] == "engine-example-vendor"


def _errors() -> list[tuple[list[str], str, str]]:
    found = [
        (m["fixtures"].split(), m["plugins"], " ".join(m["body"].split()))
        for m in ERROR_BLOCK.finditer(GUIDE.read_text())
    ]
    assert len(found) >= 8, "section 7 lost its error examples"
    return found


@pytest.mark.parametrize(("fixtures", "plugins", "promised"), _errors(), ids=lambda v: str(v)[:40])
def test_each_failure_gives_the_error_the_guide_promises(plugin_env, fixtures, plugins, promised):
    from engine.errors import PluginError
    from engine.plugins import PluginManager

    install_fixtures(plugin_env, *fixtures)
    with pytest.raises(PluginError) as err:
        PluginManager.from_env({"ENGINE_PLUGINS": plugins}).resolve_platform()
    assert " ".join(str(err.value).split()).startswith(promised)
