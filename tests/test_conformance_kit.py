"""The conformance kit itself: a pytest11 plugin of the engine distribution that passes
conforming plugins, catches broken ones naming the property and the seed, and writes reports.
(The example vendor passing the whole kit is in test_vendor_guide.py, built from the guide.)

Every kit run here is a real ``pytest --engine-conformance=...`` in a subprocess, with no ``-p``
flag: the kit must be found through the entry point, as a vendor's pytest finds it.
"""

from __future__ import annotations

import re
import sys

import pytest
from plugin_helpers import REPO, install_fixtures

if sys.version_info >= (3, 12):
    from importlib import metadata
else:  # pragma: no cover
    import importlib_metadata as metadata

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

NO_CACHE = ("-p", "no:cacheprovider")


@pytest.fixture(autouse=True)
def _subprocess_sees_plugin_env(plugin_env, monkeypatch):
    """The pytest subprocesses see the fake distributions through PYTHONPATH."""
    monkeypatch.setenv("PYTHONPATH", str(plugin_env))
    monkeypatch.delenv("ENGINE_TEST_BUG", raising=False)


def kit(pytester, *args: str):
    return pytester.runpytest_subprocess(*NO_CACHE, "-m", "conformance", *args)


def seed_of(result) -> int:
    match = re.search(
        r"seed (\d+) \(replay with --engine-conformance-seed=\1\)", result.stdout.str()
    )
    assert match, result.stdout.str()
    return int(match.group(1))


def test_the_kit_is_a_pytest11_entry_point_of_the_engine_distribution() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["pytest11"] == {
        "engine-conformance": "engine.testing.conformance"
    }
    # As pytest looks for plugins: every installed distribution's entry points (a stale
    # engine.egg-info a source build leaves in the checkout may shadow the installed metadata
    # for metadata.entry_points(), not for pytest).
    installed = {
        (ep.name, dist.metadata["Name"])
        for dist in metadata.distributions()
        for ep in dist.entry_points
        if ep.group == "pytest11" and ep.value == "engine.testing.conformance"
    }
    assert installed == {("engine-conformance", "engine-llm")}


def test_kit_catches_a_kernel_that_differs_from_the_reference(plugin_env, pytester, monkeypatch):
    install_fixtures(plugin_env, "engine-kernel-override")
    monkeypatch.setenv("ENGINE_PLUGINS", "cpu,kerneloverride")
    ok = kit(pytester, "--engine-conformance=kerneloverride", "--engine-conformance-platform=cpu")
    ok.assert_outcomes(passed=2)  # its silu_and_mul in float32 and bfloat16, nothing else
    ok.stdout.fnmatch_lines(["*engine conformance: plugin kerneloverride*on platform cpu, seed*"])

    monkeypatch.setenv("ENGINE_TEST_WRONG_KERNEL", "1")
    bad = kit(pytester, "--engine-conformance=kerneloverride", "--engine-conformance-seed=1234")
    bad.assert_outcomes(failed=2)
    bad.stdout.fnmatch_lines(
        [
            "*kernel[[]silu_and_mul[]]::engine-kernel-override-float32 failed: kernel "
            "'silu_and_mul', property 'engine-kernel-override-float32', seed 1234 "
            "(replay with --engine-conformance-seed=1234)*",
            "*kernel silu_and_mul [[]T7-I48, float32, seed 1234[]] differs from the reference*",
        ]
    )


def test_kit_names_the_broken_property_and_the_seed(plugin_env, pytester, monkeypatch):
    """Four bugs at once (one kit run): each check fails on its own property, with the seed."""
    install_fixtures(plugin_env, "engine-buggy-vendor")
    monkeypatch.setenv("ENGINE_PLUGINS", "cpu,buggyvendor")
    monkeypatch.setenv("BUGGY_VENDOR_DEVICE", "1")
    monkeypatch.setenv("ENGINE_TEST_BUG", "heavy,config,prefix,gather")
    select = "cheap or check-config or buggy and float32-H4/2-D64-B16 or 2-ranks"
    result = kit(
        pytester, "--engine-conformance=buggyvendor", "--engine-conformance-seed=99", "-k", select
    )
    result.stdout.fnmatch_lines(
        [
            "*platform[[]buggyvendor[]]::detection-is-cheap failed*seed 99*",
            "*detecting platform buggyvendor imported torch*",
            "*platform[[]buggyvendor[]]::check-config failed*",
            "*check_config accepts unsupported dtype float16*",
            "*communicator[[]buggyvendor[]]::2-ranks failed*",
            "*communicator all_gather(dim=0) [[]all ranks, group rank * of 2, seed 99[]] is wrong*",
            "*backend[[]buggy[]]::float32-H4/2-D64-B16 failed*seed 99*",
            "*attention backend buggy [[]float32-H4/2-D64-B16, seed 99[]] differs from the "
            "reference at step 2*",
        ]
    )
    assert result.ret == 1


def test_the_buggy_vendor_conforms_without_its_bugs(plugin_env, pytester, monkeypatch):
    """The bugs above are the only reason for those failures."""
    install_fixtures(plugin_env, "engine-buggy-vendor")
    monkeypatch.setenv("ENGINE_PLUGINS", "cpu,buggyvendor")
    monkeypatch.setenv("BUGGY_VENDOR_DEVICE", "1")
    result = kit(
        pytester,
        "--engine-conformance=buggyvendor",
        "-k",
        "cheap or check-config or float32-H4",
    )
    # detection-is-cheap, check-config; GQA, window, soft-cap, sinks, window with sinks
    result.assert_outcomes(passed=7)


def test_seeds_are_fresh(plugin_env, pytester, monkeypatch):
    """Two runs, two seeds (--engine-conformance-seed replays one: see the tests above)."""
    install_fixtures(plugin_env, "engine-kernel-override")
    monkeypatch.setenv("ENGINE_PLUGINS", "cpu,kerneloverride")
    args = ("--engine-conformance=kerneloverride", "-k", "float32")
    assert seed_of(kit(pytester, *args)) != seed_of(kit(pytester, *args))


def test_markdown_report_and_bad_report_names(plugin_env, pytester, monkeypatch, tmp_path):
    install_fixtures(plugin_env, "engine-kernel-override")
    monkeypatch.setenv("ENGINE_PLUGINS", "cpu,kerneloverride")
    monkeypatch.setenv("ENGINE_TEST_WRONG_KERNEL", "1")
    report = tmp_path / "out" / "report.md"
    result = kit(pytester, "--engine-conformance=kerneloverride", "--engine-conformance-seed=5",
                 f"--engine-conformance-report={report}")  # fmt: skip
    result.assert_outcomes(failed=2)
    text = report.read_text()
    assert text.startswith("# Engine conformance report: kerneloverride")
    assert "| plugin | kerneloverride (engine-kernel-override 0.0.1) |" in text
    assert (
        "| seed | 5 (replay: `pytest --engine-conformance=kerneloverride --engine-conformance-seed=5`) |"
        in text
    )
    assert "| result | 0 passed, 2 failed, 0 skipped |" in text
    assert (
        "| silu_and_mul | engine-kernel-override-float32 | failed | kernel silu_and_mul [T7-I48, float32, seed 5] differs"
        in text
    )

    bad = pytester.runpytest_subprocess(
        *NO_CACHE, "--engine-conformance=cpu", "--engine-conformance-report=r.txt"
    )
    assert bad.ret == 4  # usage error
    bad.stderr.fnmatch_lines(
        ["*--engine-conformance-report=r.txt: the file name must end in .json, .md*"]
    )


def test_kit_reports_an_unavailable_platform_as_one_failure(plugin_env, pytester):
    result = kit(pytester, "--engine-conformance=tpu")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*engine-conformance[[]load[]]::load failed*",
            "*Platform 'tpu'*torch_xla is not installed*",
        ]
    )


def test_unknown_plugin_names_the_valid_ones(plugin_env, pytester):
    result = kit(pytester, "--engine-conformance=nosuch")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*--engine-conformance=nosuch: no loaded plugin or platform has that name. Loaded plugins: builtin, cpu, cuda, rocm, tpu, triton*"
        ]
    )


def test_a_plugin_without_a_platform_is_checked_on_the_chosen_one(
    plugin_env, pytester, monkeypatch
):
    """engine-triton registers kernels for cuda and rocm: on the cpu platform without
    --engine-conformance-platform they are skipped with the reason, never silently dropped."""
    monkeypatch.setenv("ENGINE_PLUGINS", "cpu,triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    result = kit(
        pytester,
        "--engine-conformance=triton",
        "-k",
        "rms_norm and float32 or backend and float32-H4",
        "-rs",
    )
    # 4 kernels (rms_norm, fused_add_rms_norm and their *_quant_fp8 forms), 4 backend cases
    # (GQA, window, soft-cap, fp8 KV cache)
    result.assert_outcomes(skipped=8)
    result.stdout.fnmatch_lines(
        [
            "*triton cannot serve float32-H4/2-D64-B16: runs on the CPU only under TRITON_INTERPRET=1*",
            "*registered for cuda, rocm, not cpu; pass --engine-conformance-platform=cpu to check it*",
        ]
    )


def test_every_named_kernel_has_conformance_inputs() -> None:
    """The registration point new kernels (the MoE ones too) fill in: without inputs the kit
    could not check a plugin's override of that kernel."""
    from engine.kernels.registry import KERNEL_NAMES
    from engine.testing.inputs import KERNEL_INPUTS

    missing = [n for n in KERNEL_NAMES if n not in KERNEL_INPUTS]
    assert not missing, (
        f"no conformance inputs for {missing}: register them with "
        "engine.testing.inputs.register_kernel_inputs (kind='moe' for MoE kernels)"
    )


def test_suites_are_listed_without_torch() -> None:
    import subprocess

    code = (
        "import sys\nfrom engine.testing.suites import describe_suites\n"
        "print([s['name'] for s in describe_suites()], 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['platform', 'communicator', 'backend', 'kernel'] False"


@pytest.mark.parametrize("name", ["rms_norm", "fused_add_rms_norm", "rotary_embedding",
                                  "qk_norm_rotary", "silu_and_mul", "gelu_tanh_and_mul",
                                  "write_kv_cache", "linear", "argmax", "moe_topk_softmax",
                                  "fused_moe", "add_lora_linear",
                                  "lora_expand_augmented"])  # fmt: skip
def test_reference_kernels_pass_their_own_check(name):
    import torch

    from engine.kernels.reference import REFERENCE_KERNELS
    from engine.testing.checks import check_kernel

    for dtype in ("float32", "bfloat16"):
        check_kernel(name, REFERENCE_KERNELS[name], torch.device("cpu"), dtype)
