"""The built-in platform plugins: detection (cheap, with reasons), memory profiling, communicators."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from engine.platforms import detect


def test_torch_build_is_read_without_importing_torch() -> None:
    code = (
        "import sys; from engine.platforms.detect import torch_build; b = torch_build(); "
        "print(b.version, b.cuda, b.hip, 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    import torch

    assert out == [torch.__version__, str(torch.version.cuda), str(torch.version.hip), "False"]


def test_visible_devices_hidden() -> None:
    assert detect.visible_devices_hidden("X", {"X": ""})
    assert detect.visible_devices_hidden("X", {"X": "-1"})
    assert not detect.visible_devices_hidden("X", {"X": "0,1"})
    assert not detect.visible_devices_hidden("X", {})


def test_detection_of_all_platforms_imports_nothing_heavy() -> None:
    code = (
        "import sys\n"
        "from engine.plugins import PluginManager\n"
        "pm = PluginManager.from_env()\n"
        "reasons = [e.unavailable_reasons() for e in pm.platforms()]\n"
        "heavy = [m for m in ('torch', 'torch_xla', 'triton', 'psutil') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---- CPU ------------------------------------------------------------------------------------
def test_cpu_platform_memory_profiling() -> None:
    import torch

    from engine_cpu.platform import CpuPlatform

    assert CpuPlatform.is_available() and CpuPlatform.priority == 0
    total, free = CpuPlatform.total_memory(), CpuPlatform.free_memory()
    assert 0 < free <= total
    CpuPlatform.reset_peak_memory()
    before = CpuPlatform.peak_memory()
    block = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB, touched
    after = CpuPlatform.peak_memory()
    assert after >= before and after >= block.numel() * 4
    assert CpuPlatform.default_attention_backends() == ["cpu", "torch"]
    assert CpuPlatform.dist_backend == "gloo"
    assert CpuPlatform.supported_dtypes == ("float32", "bfloat16")
    assert CpuPlatform.torch_device() == torch.device("cpu")


def test_cpu_check_config_rejects_float16() -> None:
    from engine.config import EngineConfig, ModelConfig
    from engine_cpu.platform import CpuPlatform

    assert CpuPlatform.check_config(EngineConfig(ModelConfig("m", dtype="bfloat16"))) == []
    (reason,) = CpuPlatform.check_config(EngineConfig(ModelConfig("m", dtype="float16")))
    assert "float16 is not supported on cpu" in reason


# ---- CUDA / ROCm detection ---------------------------------------------------------------------
def test_cuda_reasons_on_a_cpu_machine(monkeypatch) -> None:
    from engine_cuda import detect as cuda_detect
    from engine_cuda.platform import CudaPlatform

    monkeypatch.setattr(detect, "torch_build", lambda: detect.TorchBuild(True, "2.13.0+cpu"))
    monkeypatch.setattr("engine_cuda.platform.torch_build", detect.torch_build)
    monkeypatch.setattr(cuda_detect, "PROC_GPUS", cuda_detect.PROC_GPUS.with_name("nope"))
    monkeypatch.setattr(cuda_detect.shutil, "which", lambda name: None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    reasons = CudaPlatform.unavailable_reasons()
    assert reasons[0] == (
        "torch 2.13.0+cpu (CPU-only build) has no CUDA support; install a CUDA build of torch"
    )
    assert reasons[1].startswith("no NVIDIA GPU found (") and "nvidia-smi not found" in reasons[1]


def test_cuda_detection_counts_gpus_from_nvidia_smi_and_honours_visibility(monkeypatch) -> None:
    from engine_cuda import detect as cuda_detect
    from engine_cuda.platform import CudaPlatform

    monkeypatch.setattr(
        "engine_cuda.platform.torch_build", lambda: detect.TorchBuild(True, "2.11.0", cuda="12.8")
    )
    monkeypatch.setattr(cuda_detect, "_nvml_count", lambda: (None, "pynvml not installed"))
    monkeypatch.setattr(cuda_detect, "PROC_GPUS", cuda_detect.PROC_GPUS.with_name("nope"))
    monkeypatch.setattr(cuda_detect.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    listing = "GPU 0: NVIDIA H200 (UUID: GPU-1)\nGPU 1: NVIDIA H200 (UUID: GPU-2)\n"
    monkeypatch.setattr(
        cuda_detect.subprocess,
        "run",
        lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=listing, stderr=""),
    )
    assert cuda_detect.nvidia_gpu_count() == (2, "nvidia-smi")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert CudaPlatform.unavailable_reasons() == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert CudaPlatform.unavailable_reasons() == ["CUDA_VISIBLE_DEVICES hides every GPU"]


def test_cuda_refuses_a_rocm_build_and_rocm_refuses_a_cuda_build(monkeypatch) -> None:
    from engine_cuda.platform import CudaPlatform
    from engine_rocm.platform import RocmPlatform

    hip = detect.TorchBuild(True, "2.11.0+rocm6.4", hip="6.4")
    cuda = detect.TorchBuild(True, "2.11.0+cu128", cuda="12.8")
    monkeypatch.setattr("engine_cuda.platform.torch_build", lambda: hip)
    monkeypatch.setattr("engine_rocm.platform.torch_build", lambda: cuda)
    assert "is a ROCm build (use the rocm platform)" in CudaPlatform.unavailable_reasons()[0]
    assert "is not a ROCm build" in RocmPlatform.unavailable_reasons()[0]


def test_rocm_counts_gpus_from_the_kfd_topology(monkeypatch, tmp_path) -> None:
    from engine_rocm import detect as rocm_detect

    for node, version in (("0", "0"), ("1", "90402"), ("2", "90402")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "properties").write_text(
            f"cpu_cores_count 8\ngfx_target_version {version}\n"
        )
    monkeypatch.setattr(rocm_detect, "KFD_NODES", tmp_path)
    monkeypatch.setitem(sys.modules, "amdsmi", None)  # not installed
    assert rocm_detect.amd_gpu_count() == (2, str(tmp_path))


# ---- TPU ------------------------------------------------------------------------------------
def test_tpu_reasons(monkeypatch) -> None:
    from engine_tpu import platform as tpu

    monkeypatch.setattr(tpu, "module_available", lambda name: False)
    monkeypatch.setattr(tpu, "_tpu_present", lambda: False)
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    reasons = tpu.TpuPlatform.unavailable_reasons()
    assert reasons[0].startswith("torch_xla is not installed")
    assert reasons[1].startswith("no PJRT device")
    monkeypatch.setattr(tpu, "module_available", lambda name: name == "torch_xla")
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    assert tpu.TpuPlatform.unavailable_reasons() == []
    monkeypatch.setenv("PJRT_DEVICE", "CUDA")
    assert "not a TPU or CPU PJRT device" in tpu.TpuPlatform.unavailable_reasons()[0]


@pytest.fixture
def fake_torch_xla(monkeypatch):
    """A stand-in for torch_xla that records how the communicator calls xm (torch_xla cannot be
    installed beside this torch); it checks the argument mapping, not XLA itself."""
    calls = []
    xm = types.SimpleNamespace(REDUCE_SUM="sum", REDUCE_MAX="max", REDUCE_MIN="min")
    xm.all_reduce = lambda op, t, groups=None: calls.append(("all_reduce", op, groups)) or t * 2
    xm.all_gather = lambda t, dim=0, groups=None: calls.append(("all_gather", dim, groups)) or t
    xm.reduce_scatter = lambda op, t, **kw: calls.append(("reduce_scatter", op, kw)) or t
    xm.collective_broadcast = lambda ts, root_ordinal=0, groups=None: calls.append(
        ("broadcast", root_ordinal, groups)
    )
    xm.all_to_all = lambda t, **kw: calls.append(("all_to_all", kw)) or t
    xm.send = lambda t, channel: calls.append(("send", channel))
    xm.recv = lambda t, channel: calls.append(("recv", channel)) or t
    xr = types.SimpleNamespace(world_size=lambda: 4, global_ordinal=lambda: 1)
    core = types.SimpleNamespace(xla_model=xm)
    pkg = types.ModuleType("torch_xla")
    pkg.core, pkg.runtime = core, xr
    monkeypatch.setitem(sys.modules, "torch_xla", pkg)
    monkeypatch.setitem(sys.modules, "torch_xla.core", core)
    monkeypatch.setitem(sys.modules, "torch_xla.core.xla_model", xm)
    monkeypatch.setitem(sys.modules, "torch_xla.runtime", xr)
    return calls


def test_tpu_communicator_maps_onto_xm(fake_torch_xla) -> None:
    import torch

    from engine_tpu.communicator import XlaCommunicator

    comm = XlaCommunicator()
    assert (comm.world_size, comm.rank) == (4, 1)
    t = torch.ones(4)
    assert torch.equal(comm.all_reduce(t), t * 2)
    comm.all_reduce(t, op="max")
    comm.all_gather(t, dim=0)
    comm.reduce_scatter(t, dim=0)
    comm.broadcast(t, src=2)
    comm.all_to_all(t, dim=0)
    comm.send(t, dst=3)
    comm.recv(t, src=3)
    assert fake_torch_xla == [
        ("all_reduce", "sum", None),
        ("all_reduce", "max", None),
        ("all_gather", 0, None),
        (
            "reduce_scatter",
            "sum",
            {"scale": 1.0, "scatter_dim": 0, "shard_count": 4, "groups": None},
        ),
        ("broadcast", 2, None),
        (
            "all_to_all",
            {"split_dimension": 0, "concat_dimension": 0, "split_count": 4, "groups": None},
        ),
        ("send", 1 + 1 * 4 + 3),
        ("recv", 1 + 3 * 4 + 1),
    ]
    fake_torch_xla.clear()
    grouped = XlaCommunicator([[0, 2], [1, 3]])  # this replica (ordinal 1) is group rank 0
    assert (grouped.world_size, grouped.rank) == (2, 0)
    grouped.broadcast(t, src=1)  # group rank 1 of [1, 3] is replica 3
    assert fake_torch_xla == [("broadcast", 3, [[0, 2], [1, 3]])]


def test_a_directory_named_like_a_package_is_not_the_package(tmp_path, monkeypatch) -> None:
    """A tests/triton/ folder on sys.path must not make engine-llm-triton think triton is installed."""
    (tmp_path / "surely_not_installed_pkg").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not detect.module_available("surely_not_installed_pkg")
    assert detect.module_available("json")
