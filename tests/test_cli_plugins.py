"""``engine --version``, ``engine plugins`` and ``engine env``, including their error paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from plugin_helpers import EXAMPLE_VENDOR, install_fixtures

from engine.cli.main import SUBCOMMANDS, main
from engine.version import PLUGIN_API_VERSION, __version__


def engine_cmd() -> list[str]:
    script = Path(sys.executable).with_name("engine")
    return [str(script)] if script.exists() else [sys.executable, "-m", "engine.cli.main"]


def test_version_imports_no_torch() -> None:
    code = (
        "import sys\nfrom engine.cli.main import main\n"
        "try:\n    main(['--version'])\nexcept SystemExit as e:\n    assert e.code in (0, None)\n"
        "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == [
        f"engine {__version__} (plugin API {PLUGIN_API_VERSION})",
        "[]",
    ]


def test_console_script_version() -> None:
    out = subprocess.run([*engine_cmd(), "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith(f"engine {__version__}")


def test_subcommands_are_registered_from_an_explicit_list() -> None:
    assert SUBCOMMANDS[:2] == ["engine.cli.plugins", "engine.cli.env"]


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_plugins_json_lists_five_plugins_and_platform_reasons(plugin_env, capsys) -> None:
    code, out, err = run_main(capsys, "plugins", "--json")
    assert code == 0, err
    report = json.loads(out)
    plugins = {p["name"]: p for p in report["plugins"]}
    for name in ("cpu", "cuda", "rocm", "tpu", "triton"):
        assert plugins[name]["distribution"] == f"engine-llm-{name}"
        assert plugins[name]["version"] == "0.1.0"
        assert plugins[name]["entry_point"] == f"{name} = engine_{name}.plugin"
    platforms = {p["name"]: p for p in report["platforms"]}
    assert platforms["cpu"]["available"] and report["chosen_platform"] == "cpu"
    for name in ("cuda", "rocm", "tpu"):
        assert not platforms[name]["available"] and platforms[name]["reasons"]
    backends = {b["name"]: b for b in report["attention_backends"]}
    assert backends["torch"]["distribution"] == "engine-llm"
    assert backends["triton"]["distribution"] == "engine-llm-triton"
    assert backends["triton"]["auto_rank"] is None  # not in the CPU platform's auto order
    assert report["auto_order"] == ["cpu", "torch"]
    assert backends["cpu"]["distribution"] == "engine-llm-cpu"
    # Overrides: engine-llm-triton's (when triton is installed) target GPUs; the CPU's are
    # engine-llm-cpu's norms, activations, a MoE router's product and top-k softmax, argmax and
    # quantized matmuls.
    on_cpu = [
        (o["kernel"], o["provider"])
        for o in report["kernel_overrides"]
        if "cpu" in (o["platforms"] or ["cpu"])
    ]
    quantized = ["fp8_linear", "fp8_block_linear", "int8_linear", "wna16_linear", "gguf_linear"]
    norms = ["rms_norm", "fused_add_rms_norm", "qk_norm_rotary"]
    activations = ["silu_and_mul", "gelu_tanh_and_mul"]
    want = [*norms, *activations, "linear", "argmax", "moe_topk_softmax", *quantized]
    assert on_cpu == [(k, "engine-llm-cpu") for k in want], on_cpu
    methods = {m["name"]: m for m in report["quantization_methods"]}
    assert list(methods) == ["fp8", "compressed-tensors", "gptq", "awq", "gguf", "mxfp4"]
    assert all(m["usable"] and m["provider"] == "engine-llm" for m in methods.values())
    comms = {c["platform"]: c for c in report["communicators"]}
    assert comms["cpu"]["provider"] == "engine-llm-cpu" and "gloo" in comms["cpu"]["communicator"]
    assert (
        comms["rocm"]["provider"] == "engine-llm-rocm" and "RCCL" in comms["rocm"]["communicator"]
    )
    assert comms["tpu"]["communicator"].startswith("torch_xla xm collectives")
    suites = [s["name"] for s in report["conformance_suites"]]
    assert suites == ["platform", "communicator", "backend", "kernel"]


def test_plugins_text_lists_overrides(plugin_env, capsys, monkeypatch) -> None:
    install_fixtures(plugin_env, "engine-kernel-override")
    monkeypatch.setenv("ENGINE_PLUGINS", "cpu,kerneloverride")
    code, out, _ = run_main(capsys, "plugins")
    assert code == 0
    assert "* cpu" in out
    assert "silu_and_mul" in out and "engine-kernel-override" in out and "on cpu" in out
    assert "Communicators:" in out and "torch.distributed on gloo" in out
    assert "Conformance kit suites (pytest --engine-conformance=PLUGIN):" in out


def assert_one_paragraph_error(code: int, err: str, *needles: str) -> None:
    assert code == 2
    assert err.startswith("engine: error: ") and "Traceback" not in err
    assert "\n\n" not in err.strip()
    flat = " ".join(err.split())
    for needle in needles:
        assert needle in flat, (needle, flat)


@pytest.mark.parametrize(
    ("fixture", "entry_point", "needles"),
    [
        ("engine-broken-plugin", "broken", ["engine-broken-plugin", "RuntimeError", "libfoo.so"]),
        ("engine-wrong-signature", "wrongsig", ["engine-wrong-signature", "engine_kernels"]),
        ("engine-unknown-hook", "unknownhook", ["engine-unknown-hook", "engine_platfrom"]),
        ("engine-wrong-api", "wrongapi", ["engine-wrong-api", "versions that fit: 1 or 1.x"]),
    ],
)
def test_faulty_plugins_fail_the_cli_with_one_paragraph(
    plugin_env, capsys, monkeypatch, fixture, entry_point, needles
) -> None:
    install_fixtures(plugin_env, fixture)
    monkeypatch.setenv("ENGINE_PLUGINS", f"cpu,{entry_point}")
    code, _, err = run_main(capsys, "plugins")
    assert_one_paragraph_error(code, err, *needles)


def test_unknown_and_unavailable_platform_from_the_cli(plugin_env, capsys, monkeypatch) -> None:
    monkeypatch.setenv("ENGINE_PLUGINS", "cpu,cuda,rocm,tpu,triton")
    code, _, err = run_main(capsys, "plugins", "--platform", "cuad")
    assert_one_paragraph_error(code, err, "Unknown platform 'cuad'", "cpu (engine-llm-cpu), cuda")
    code, _, err = run_main(capsys, "plugins", "--platform", "tpu")
    assert_one_paragraph_error(code, err, "Platform 'tpu'", "torch_xla is not installed")
    monkeypatch.setenv("ENGINE_PLATFORM", "rocm")
    code, _, err = run_main(capsys, "env")
    assert_one_paragraph_error(code, err, "asked for with ENGINE_PLATFORM", "not a ROCm build")


def test_two_vendors_tie_from_the_cli(plugin_env, capsys, monkeypatch) -> None:
    install_fixtures(plugin_env, "engine-dup-vendor-a", "engine-dup-vendor-b")
    monkeypatch.setenv("ENGINE_PLUGINS", "cpu,dupvendora,dupvendorb")
    code, out, err = run_main(capsys, "plugins")
    assert "dupvendora" in out  # the listing is still printed, for diagnosis
    assert_one_paragraph_error(
        code, err, "engine-dup-vendor-a", "engine-dup-vendor-b", "--platform dupvendora"
    )
    code, _, _ = run_main(capsys, "plugins", "--platform", "dupvendorb")
    assert code == 0


def test_env_report(plugin_env, capsys, monkeypatch) -> None:
    monkeypatch.setenv("ENGINE_PLUGINS", "cpu,cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    code, out, _ = run_main(capsys, "env", "--json")
    assert code == 0
    report = json.loads(out)
    import torch

    assert report["engine"] == __version__
    assert report["python"] == sys.version.split()[0]
    assert report["torch"]["version"] == torch.__version__
    assert report["chosen_platform"] == "cpu"
    assert [p["name"] for p in report["plugins"]] == ["builtin", "cpu", "cuda"]
    assert report["env"]["ENGINE_PLUGINS"] == "cpu,cuda"
    assert report["env"]["CUDA_VISIBLE_DEVICES"] == "0"
    assert set(report["accelerator_stacks"]) == {"cuda_driver", "rocm_driver", "torch_xla"}


def _example_vendor_installed() -> bool:
    from engine.plugins import metadata

    try:
        metadata.distribution("engine-example-vendor")
    except metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.timeout(300)
def test_example_vendor_really_installed_with_pip(tmp_path) -> None:
    """pip-install the example vendor plugin into a target dir: it is listed and selectable;
    without that directory on the path it is gone."""
    import importlib.util

    target = tmp_path / "target"
    # Build with this environment's setuptools when it is new enough for the SPDX `license`
    # string (PEP 639, setuptools >= 77); otherwise let pip fetch one.
    isolation = []
    if importlib.util.find_spec("setuptools") is not None:
        import setuptools

        if int(setuptools.__version__.split(".")[0]) >= 77:
            isolation = ["--no-build-isolation"]
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", *isolation,
         "--target", str(target), str(EXAMPLE_VENDOR)],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )  # fmt: skip
    assert list(target.glob("engine_example_vendor-0.1.0.dist-info/entry_points.txt"))
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("ENGINE_")}
    base_env.pop("EXAMPLE_VENDOR_DEVICE", None)
    with_plugin = {**base_env, "PYTHONPATH": str(target), "EXAMPLE_VENDOR_DEVICE": "1"}

    out = subprocess.run(
        [*engine_cmd(), "plugins", "--json"], env=with_plugin, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    vendor = next(p for p in report["plugins"] if p["name"] == "examplevendor")
    assert vendor["distribution"] == "engine-example-vendor"
    assert report["chosen_platform"] == "examplevendor"  # priority 200 > cpu's 0
    assert report["auto_order"] == ["example", "torch"]
    assert "example" in {b["name"] for b in report["attention_backends"]}

    out = subprocess.run(
        [*engine_cmd(), "plugins", "--json", "--platform", "examplevendor"],
        env={**with_plugin, "EXAMPLE_VENDOR_DEVICE": "0"},
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "no example vendor device" in out.stderr

    if _example_vendor_installed():
        pytest.skip("engine-example-vendor is installed in this environment; cannot check removal")
    out = subprocess.run(
        [*engine_cmd(), "plugins", "--json", "--platform", "examplevendor"],
        env=base_env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    assert "Unknown platform 'examplevendor'" in " ".join(out.stderr.split())
    report = json.loads(out.stdout)
    assert "examplevendor" not in {p["name"] for p in report["plugins"]}


def test_unknown_and_unusable_attention_backend_from_the_cli(plugin_env, capsys, monkeypatch):
    install_fixtures(plugin_env, "engine-bad-backend")
    monkeypatch.setenv("ENGINE_PLUGINS", "cpu,badbackend")
    code, _, err = run_main(capsys, "plugins", "--attention-backend", "flashy")
    assert_one_paragraph_error(
        code, err, "Unknown attention backend 'flashy'", "auto, torch, bad, cpu"
    )
    code, _, err = run_main(capsys, "plugins", "--attention-backend", "bad")
    assert_one_paragraph_error(
        code, err, "Could not import attention backend 'bad'", "engine-bad-backend"
    )
    code, _, err = run_main(capsys, "plugins", "--attention-backend", "auto")
    from engine_cpu import native

    auto = "cpu" if native.load("avx2") is not None else "torch"  # cpu: its compiled kernels
    assert code == 0 and f"Selected attention backend: {auto}" in err


def test_malformed_entry_points_fail_the_cli_with_one_paragraph(plugin_env, capsys, monkeypatch):
    """An entry point naming a module that does not exist, and one whose value is not a valid
    ``module:attr`` reference at all."""
    for name, value in (("ghost", "engine_no_such_module"), ("garbled", "not a module!")):
        dist_info = plugin_env / f"engine_{name}-1.0.dist-info"
        dist_info.mkdir()
        (dist_info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: engine-{name}\nVersion: 1.0\n"
        )
        (dist_info / "entry_points.txt").write_text(f"[engine]\n{name} = {value}\n")
    monkeypatch.setenv("ENGINE_PLUGINS", "cpu,ghost")
    code, _, err = run_main(capsys, "plugins")
    assert_one_paragraph_error(
        code, err, "engine-ghost 1.0", "ghost = engine_no_such_module", "ModuleNotFoundError"
    )
    monkeypatch.setenv("ENGINE_PLUGINS", "cpu,garbled")
    code, _, err = run_main(capsys, "plugins")
    assert_one_paragraph_error(code, err, "engine-garbled 1.0", "garbled = not a module!")


def test_engine_plugins_names_stale_pre_rename_distributions(plugin_env, capsys) -> None:
    install_fixtures(plugin_env, "engine-stale-cpu")
    code, _, err = run_main(capsys, "plugins")
    assert_one_paragraph_error(
        code, err, "'cpu' by", "engine-cpu 0.0.9", "pip uninstall engine-cpu", "engine-llm-cpu"
    )
