"""engine-rocm in a simulated HIP environment (no AMD GPU here): detection through amdsmi, the
KFD topology and rocm-smi, the gfx architecture as the capability, the fp8 flavour, platform
and backend selection, the RCCL communicator and the per-gfx-family Triton tuning.

What this cannot show is that any of it runs on AMD hardware; docs/testing.md says so.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import types

import pytest

from engine.platforms.detect import TorchBuild
from engine_rocm import detect, gfx
from engine_rocm import platform as rocm_platform
from engine_rocm.platform import RocmPlatform
from engine_rocm.tuning import TUNING, tuning_for

HIP_BUILD = TorchBuild(True, "2.9.0+rocm6.4", None, "6.4.43482")


def kfd_topology(root, versions: list[int]):
    """A fake /sys/class/kfd/kfd/topology/nodes: node 0 a CPU, then one node per version."""
    nodes = root / "nodes"
    for i, version in enumerate([0, *versions]):
        node = nodes / str(i)
        node.mkdir(parents=True)
        (node / "properties").write_text(f"cpu_cores_count 0\ngfx_target_version {version}\n")
    return nodes


@pytest.fixture
def no_probes(monkeypatch, tmp_path):
    """No amdsmi, no KFD, no rocm-smi: each test switches on the one it wants."""
    monkeypatch.setitem(sys.modules, "amdsmi", None)  # import amdsmi -> ImportError
    monkeypatch.setattr(detect, "KFD_NODES", tmp_path / "absent" / "kfd" / "topology" / "nodes")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    for var in ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


@pytest.fixture
def simulated_hip(no_probes, monkeypatch):
    """A ROCm build of torch (as read from its version.py) and two MI300X (gfx942) in KFD."""
    monkeypatch.setattr(rocm_platform, "torch_build", lambda: HIP_BUILD)
    monkeypatch.setattr(detect, "KFD_NODES", kfd_topology(no_probes / "kfd", [90402, 90402]))
    return no_probes


def test_gfx_names() -> None:
    assert gfx.parse_gfx("gfx942:sramecc+:xnack-") == (9, 4, 2)
    assert gfx.parse_gfx("gfx90a") == (9, 0, 10)
    assert gfx.parse_gfx("gfx1100") == (11, 0, 0)
    assert [gfx.gfx_from_target_version(v) for v in (90402, 90010, 110000, 120001, 90500)] == [
        "gfx942", "gfx90a", "gfx1100", "gfx1201", "gfx950",
    ]  # fmt: skip
    assert gfx.capability("gfx942") == (9, 4) and gfx.capability("gfx1201") == (12, 0)
    assert gfx.family("gfx942") == "gfx94" and gfx.family("gfx90a") == "gfx90"
    with pytest.raises(ValueError, match="not an AMD gfx architecture name"):
        gfx.parse_gfx("sm_90")


def test_fp8_flavour_per_family() -> None:
    assert gfx.fp8_dtype("gfx942") == "float8_e4m3fnuz"  # MI300: the fnuz variant
    assert gfx.fp8_dtype("gfx950") == "float8_e4m3fn"  # MI350: OCP
    assert gfx.fp8_dtype("gfx1201") == "float8_e4m3fn"  # RDNA4
    assert gfx.fp8_dtype("gfx90a") is None  # MI250: no fp8 units


def test_kfd_topology_gives_count_and_architectures(no_probes, monkeypatch) -> None:
    monkeypatch.setattr(detect, "KFD_NODES", kfd_topology(no_probes / "kfd", [90402, 90010]))
    gpus = detect.amd_gpus()
    assert (gpus.count, gpus.archs) == (2, ["gfx942", "gfx90a"])
    assert gpus.how.endswith("nodes")


def test_amdsmi_is_asked_first(no_probes, monkeypatch) -> None:
    calls = []
    fake = types.SimpleNamespace(
        amdsmi_init=lambda: calls.append("init"),
        amdsmi_shut_down=lambda: calls.append("shut_down"),
        amdsmi_get_processor_handles=lambda: ["h0", "h1", "h2"],
        amdsmi_get_gpu_asic_info=lambda h: {"target_graphics_version": "gfx942"},
    )
    monkeypatch.setitem(sys.modules, "amdsmi", fake)
    gpus = detect.amd_gpus()
    assert (gpus.count, gpus.archs, gpus.how) == (3, ["gfx942"] * 3, "amdsmi")
    assert calls == ["init", "shut_down"]


def test_rocm_smi_when_nothing_else_answers(no_probes) -> None:
    bin_dir = no_probes / "bin"
    bin_dir.mkdir()
    report = {"card0": {"Card Series": "AMD Instinct MI300X", "GFX Version": "gfx942"},
              "card1": {"Card Series": "AMD Instinct MI300X", "GFX Version": "gfx942"},
              "system": {"Driver version": "6.10.5"}}  # fmt: skip
    smi = bin_dir / "rocm-smi"
    smi.write_text(f"#!{sys.executable}\nprint({json.dumps(json.dumps(report))})\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    gpus = detect.amd_gpus()
    assert (gpus.count, gpus.archs, gpus.how) == (2, ["gfx942", "gfx942"], "rocm-smi")


def test_no_probe_answers_every_failure_is_reported(no_probes, monkeypatch) -> None:
    monkeypatch.setattr(rocm_platform, "torch_build", lambda: HIP_BUILD)
    (reason,) = RocmPlatform.unavailable_reasons()
    assert reason.startswith("no AMD GPU found (amdsmi not installed; ")
    assert "absent (no amdgpu kernel driver loaded)" in reason and "rocm-smi not found" in reason


def test_simulated_hip_machine_detects_and_selects_rocm(simulated_hip, plugin_env) -> None:
    from engine.attention_backends.interface import AttentionSpec
    from engine.plugins import PluginManager

    assert RocmPlatform.unavailable_reasons() == []
    # torch is imported here but is not a HIP build: the architecture comes from the probes,
    # without a HIP context.
    assert RocmPlatform.gfx_arch(1) == "gfx942"
    assert RocmPlatform.device_capability(0) == (9, 4)
    assert RocmPlatform.fp8_dtype(0) == "float8_e4m3fnuz"

    pm = PluginManager.from_env({"ENGINE_PLUGINS": "cpu,cuda,rocm,triton"})
    entry = pm.resolve_platform_entry()
    assert entry.name == "rocm" and entry.plugin.distribution == "engine-llm-rocm"  # 100 > cpu's 0
    spec = AttentionSpec(dtype="bfloat16", head_size=128, num_heads=8, num_kv_heads=2)
    assert pm.select_attention_backend("auto", spec, entry.cls).name == "triton-rocm"
    comm = pm.communicator_entry(entry.cls)
    assert comm.provider == "engine-llm-rocm" and "RCCL" in comm.communicator.describe()


def test_hidden_gpus_and_cuda_builds_are_refused(simulated_hip, monkeypatch) -> None:
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "")
    assert RocmPlatform.unavailable_reasons() == ["HIP_VISIBLE_DEVICES hides every GPU"]
    monkeypatch.delenv("HIP_VISIBLE_DEVICES")
    cuda = TorchBuild(True, "2.11.0+cu130", "13.0", None)
    monkeypatch.setattr(rocm_platform, "torch_build", lambda: cuda)
    assert RocmPlatform.unavailable_reasons() == [
        "torch 2.11.0+cu130 (CUDA 13.0) is not a ROCm build; install a ROCm build of torch"
    ]


def test_rccl_communicator_refuses_a_torch_without_hip() -> None:
    from engine_rocm.communicator import RcclCommunicator

    with pytest.raises(RuntimeError, match=r"needs a ROCm build of torch.*torch.version.hip"):
        RcclCommunicator()._ready()


def test_tuning_tables_cover_every_regime_and_are_picked_by_family() -> None:
    for key, table in TUNING.items():
        assert set(table) == {"prefill", "decode", "decode_split", "decode_many_splits"}, key
        for cfg in table.values():
            assert cfg["num_warps"] in (1, 2, 4, 8) and cfg["num_stages"] in (1, 2), key
            assert all(cfg[k] & (cfg[k] - 1) == 0 for k in cfg if k.startswith("block_")), key
    assert tuning_for("gfx942") == ("gfx94", TUNING["gfx94"])
    assert tuning_for("gfx90a")[0] == "gfx90" and tuning_for("gfx1100")[0] == "gfx110"
    assert tuning_for("gfx803") == (None, {})  # no table: the kernels' defaults


def test_triton_rocm_passes_its_tuning_to_the_kernels(monkeypatch) -> None:
    """The backend hands the gfx family's table to engine-triton's launchers (spied on: the
    kernels themselves need a GPU or the interpreter, see tests/triton_kernels)."""
    pytest.importorskip("triton")
    import torch

    from engine.attention_backends.interface import BatchLayout
    from engine_rocm import attention
    from engine_triton.kernels import attention as kernels
    from engine_triton.kernels import kv_cache

    seen = {}
    monkeypatch.setattr(attention, "device_arch", lambda device: "gfx942")
    monkeypatch.setattr(kernels, "paged_decode", lambda *a, **k: seen.update(decode=k["configs"]))
    monkeypatch.setattr(kernels, "paged_prefill", lambda *a, **k: seen.update(prefill=k["config"]))
    monkeypatch.setattr(kv_cache, "write_kv_cache", lambda *a, **k: None)
    backend = attention.RocmTritonAttentionBackend(4, 64, 2, 0.125)
    layout = BatchLayout([1, 5], [9, 5], [[1], [2]], [17, 32, 33, 34, 35, 36], 16, 1)
    meta = backend.build_metadata(layout, torch.device("cpu"))
    q, k = torch.zeros(6, 4, 64), torch.zeros(6, 2, 64)
    backend.forward(q, k, k, torch.zeros(2, 4, 16, 2, 64), meta)
    assert seen == {"decode": TUNING["gfx94"], "prefill": TUNING["gfx94"]["prefill"]}


def test_rocm_detection_in_a_fresh_interpreter_imports_nothing_heavy() -> None:
    """The conformance kit's check, on this machine (rocm unavailable, still cheap)."""
    from engine.testing.checks import check_detection_is_cheap

    check_detection_is_cheap("rocm", dict(os.environ))
