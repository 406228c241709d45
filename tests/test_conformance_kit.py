"""The conformance kit itself: it passes conforming plugins and catches broken ones."""

from __future__ import annotations

import pytest
from plugin_helpers import EXAMPLE_VENDOR, install_fake_dist, install_fixtures

KIT = ("-p", "engine.testing.conformance", "-p", "no:cacheprovider")


@pytest.fixture(autouse=True)
def _subprocess_sees_plugin_env(plugin_env, monkeypatch):
    """The pytest subprocesses see the fake distributions through PYTHONPATH."""
    monkeypatch.setenv("PYTHONPATH", str(plugin_env))


def test_kit_catches_a_kernel_that_differs_from_the_reference(plugin_env, pytester, monkeypatch):
    install_fixtures(plugin_env, "engine-kernel-override")
    monkeypatch.setenv("ENGINE_PLUGINS", "cpu,kerneloverride")
    only = "kernel and silu_and_mul"  # not engine-cpu's own argmax override
    ok = pytester.runpytest_subprocess(*KIT, "--engine-conformance=cpu", "-k", only)
    ok.assert_outcomes(passed=2)  # silu_and_mul in float32 and bfloat16
    ok.stdout.fnmatch_lines(["*engine conformance: platform cpu*"])

    monkeypatch.setenv("ENGINE_TEST_WRONG_KERNEL", "1")
    bad = pytester.runpytest_subprocess(*KIT, "--engine-conformance=cpu", "-k", only)
    bad.assert_outcomes(failed=2)
    bad.stdout.fnmatch_lines(
        ["*kernel silu_and_mul [[]T7-I48, float32[]] differs from the reference*"]
    )


def test_kit_checks_the_example_vendor_backend(plugin_env, pytester, monkeypatch):
    install_fake_dist(EXAMPLE_VENDOR, plugin_env)
    monkeypatch.setenv("ENGINE_PLUGINS", "cpu,examplevendor")
    monkeypatch.setenv("EXAMPLE_VENDOR_DEVICE", "1")
    result = pytester.runpytest_subprocess(
        *KIT, "--engine-conformance=examplevendor", "-k", "backend", "-v"
    )
    result.stdout.fnmatch_lines(["*backend[[]example[]]::float32-H4/2-D64-B16 PASSED*"])
    result.assert_outcomes(passed=len([line for line in result.outlines if "PASSED" in line]))
    assert result.ret == 0


def test_kit_reports_an_unavailable_platform_as_one_failure(plugin_env, pytester):
    result = pytester.runpytest_subprocess(*KIT, "--engine-conformance=tpu")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*platform::load: Platform 'tpu'*torch_xla is not installed*"])


@pytest.mark.parametrize("name", ["rms_norm", "fused_add_rms_norm", "rotary_embedding",
                                  "qk_norm_rotary", "silu_and_mul", "gelu_tanh_and_mul",
                                  "write_kv_cache", "linear", "argmax", "moe_topk_softmax",
                                  "fused_moe", "add_lora_linear"])  # fmt: skip
def test_reference_kernels_pass_their_own_check(name):
    import torch

    from engine.kernels.reference import REFERENCE_KERNELS
    from engine.testing.checks import check_kernel

    for dtype in ("float32", "bfloat16"):
        check_kernel(name, REFERENCE_KERNELS[name], torch.device("cpu"), dtype)
