"""Conformance checks for a platform, its attention backends and kernel overrides.

Each ``check_*`` function raises ``AssertionError`` with a message saying what is wrong, so it
can be called from the pytest plugin (``engine.testing.conformance``) or from a vendor's own
tests. Backends are compared with the torch reference backend, kernels with
``engine.kernels.reference``, on seeded random inputs.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch

from engine.attention_backends.interface import AttentionBackend, AttentionSpec
from engine.distributed import Communicator
from engine.kernels.reference import REFERENCE_KERNELS
from engine.platforms.interface import Platform
from engine.testing.inputs import (
    ATTENTION_TOLERANCE,
    DTYPES,
    KERNEL_TOLERANCE,
    AttentionCase,
    default_plan,
    kernel_cases,
    to_device,
)

KNOWN_DTYPES = tuple(DTYPES)
# Kernels that write into some of their arguments: the positions of those arguments.
IN_PLACE_ARGS = {"write_kv_cache": (2,), "qk_norm_rotary": (1, 2), "add_lora_linear": (0,)}


# ---- platform -------------------------------------------------------------------------------
def check_platform_attributes(platform: type[Platform], expected_name: str) -> None:
    """Class attributes have the documented types and values."""
    assert platform.name == expected_name, f"name is {platform.name!r}, expected {expected_name!r}"
    assert isinstance(platform.device_type, str) and platform.device_type, "device_type is empty"
    assert isinstance(platform.dist_backend, str) and platform.dist_backend, "dist_backend is empty"
    dtypes = tuple(platform.supported_dtypes)
    assert dtypes and set(dtypes) <= set(KNOWN_DTYPES), (
        f"supported_dtypes {dtypes} not in {KNOWN_DTYPES}"
    )
    assert isinstance(platform.priority, int), "priority must be an int"
    assert isinstance(platform.supports_graph_capture, bool), (
        "supports_graph_capture must be a bool"
    )


def check_platform_detection(platform: type[Platform]) -> None:
    """``unavailable_reasons`` returns a list of strings, consistently; the platform is
    available here (conformance runs on the device)."""
    first, second = platform.unavailable_reasons(), platform.unavailable_reasons()
    assert isinstance(first, list) and all(isinstance(r, str) for r in first), first
    assert first == second, f"detection is not stable: {first} then {second}"
    assert not first, f"platform {platform.name} is not available here: {'; '.join(first)}"
    assert platform.is_available() is True


def check_detection_is_cheap(platform_name: str, env: dict[str, str] | None = None) -> None:
    """In a fresh interpreter, loading plugins and detecting ``platform_name`` imports neither
    torch nor any device runtime."""
    code = (
        "import sys\n"
        "from engine.plugins import PluginManager\n"
        "pm = PluginManager.from_env()\n"
        f"[e.unavailable_reasons() for e in pm.platforms() if e.name == {platform_name!r}]\n"
        "heavy = ('torch', 'torch_xla', 'triton', 'jax', 'tensorflow')\n"
        "print(','.join(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    imported = out.stdout.strip()
    assert not imported, f"detecting {platform_name} imported {imported}: keep detection cheap"


def check_device_facts(platform: type[Platform]) -> None:
    count = platform.device_count()
    assert isinstance(count, int) and count >= 1, f"device_count() = {count!r}"
    name = platform.device_name(0)
    assert isinstance(name, str) and name, f"device_name(0) = {name!r}"
    capability = platform.device_capability(0)
    assert capability is None or (
        len(capability) == 2 and all(isinstance(c, int) for c in capability)
    ), f"device_capability(0) = {capability!r}"
    device = platform.torch_device(0)
    assert isinstance(device, torch.device) and device.type == platform.device_type, device


def check_memory_profiling(platform: type[Platform], probe_bytes: int = 64 << 20) -> None:
    """total/free are sane, and the peak after ``reset_peak_memory`` covers a fresh
    ``probe_bytes`` allocation on the device."""
    total, free = platform.total_memory(0), platform.free_memory(0)
    assert isinstance(total, int) and total > 0, f"total_memory() = {total!r}"
    assert isinstance(free, int) and 0 <= free <= total, f"free_memory() = {free} of {total}"
    platform.reset_peak_memory(0)
    probe = torch.ones(probe_bytes // 4, dtype=torch.float32, device=platform.torch_device(0))
    platform.synchronize(0)
    peak = platform.peak_memory(0)
    assert isinstance(peak, int), f"peak_memory() = {peak!r}"
    assert peak >= probe.numel() * 4, f"peak_memory() = {peak} after allocating {probe_bytes} bytes"
    del probe


def check_config_validation(platform: type[Platform]) -> None:
    from engine.config import EngineConfig, ModelConfig

    for dtype in platform.supported_dtypes:
        reasons = platform.check_config(EngineConfig(ModelConfig("conformance", dtype=dtype)))
        assert reasons == [], f"check_config refuses supported dtype {dtype}: {reasons}"
    for dtype in set(KNOWN_DTYPES) - set(platform.supported_dtypes):
        reasons = platform.check_config(EngineConfig(ModelConfig("conformance", dtype=dtype)))
        assert reasons and all(isinstance(r, str) for r in reasons), (
            f"check_config accepts unsupported dtype {dtype}"
        )


def check_default_backends(platform: type[Platform], pm: Any) -> None:
    """The platform names backends, and ``auto`` finds one for each supported dtype."""
    names = platform.default_attention_backends(None)
    assert isinstance(names, list) and names and all(isinstance(n, str) for n in names), names
    for dtype in platform.supported_dtypes:
        spec = AttentionSpec(dtype=dtype, head_size=64, num_heads=4, num_kv_heads=2, block_size=16)
        backend = pm.select_attention_backend("auto", spec, platform)
        assert issubclass(backend, AttentionBackend)


def check_single_rank_communicator(platform: type[Platform]) -> None:
    """Without a process group every collective is an identity."""
    comm = platform.communicator(None)
    assert isinstance(comm, Communicator), f"communicator() returned {comm!r}"
    assert comm.world_size == 1 and comm.rank == 0
    t = torch.arange(8, dtype=torch.float32, device=platform.torch_device(0))
    for op in (comm.all_reduce, comm.all_gather, comm.reduce_scatter, comm.broadcast):
        torch.testing.assert_close(op(t).cpu(), torch.arange(8, dtype=torch.float32))


# ---- kernels --------------------------------------------------------------------------------
def _cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (tuple, list)):
        return type(value)(_cpu(v) for v in value)
    return value


def check_kernel(
    name: str, fn: Callable[..., Any], device: torch.device, dtype: str, seed: int = 0
) -> None:
    """``fn`` matches ``engine.kernels.reference.<name>`` on random inputs in ``dtype``."""
    reference = REFERENCE_KERNELS[name]
    rtol, atol = KERNEL_TOLERANCE[dtype]
    gen = torch.Generator().manual_seed(seed)
    for case_id, args in kernel_cases(name, DTYPES[dtype], gen):
        ref_args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        dev_args = tuple(to_device(a, device) for a in args)
        expected = reference(*ref_args)
        got = fn(*dev_args)
        if name in IN_PLACE_ARGS:  # in place: compare the arguments it writes
            expected = tuple(ref_args[i] for i in IN_PLACE_ARGS[name])
            got = tuple(dev_args[i] for i in IN_PLACE_ARGS[name])
        try:
            torch.testing.assert_close(_cpu(got), expected, rtol=rtol, atol=atol)
        except AssertionError as exc:
            raise AssertionError(
                f"kernel {name} [{case_id}, {dtype}] differs from the reference: {exc}"
            ) from None


# ---- attention ------------------------------------------------------------------------------
def attention_cases(
    backend: type[AttentionBackend], platform: type[Platform]
) -> list[AttentionCase]:
    """The configurations to check ``backend`` on: each dtype both support, plus sliding window
    and soft-capping when the backend declares them."""
    head = (
        64
        if backend.supported_head_sizes is None or 64 in backend.supported_head_sizes
        else backend.supported_head_sizes[0]
    )
    block = (
        16
        if backend.supported_block_sizes is None or 16 in backend.supported_block_sizes
        else backend.supported_block_sizes[0]
    )
    dtypes = [d for d in platform.supported_dtypes if d in backend.supported_dtypes] or list(
        platform.supported_dtypes
    )
    cases = [AttentionCase(d, head_size=head, block_size=block) for d in dtypes]
    if backend.supports_sliding_window:
        cases.append(AttentionCase(dtypes[0], head_size=head, block_size=block, sliding_window=8))
    if backend.supports_logit_softcap:
        cases.append(AttentionCase(dtypes[0], head_size=head, block_size=block, logit_softcap=5.0))
    return cases


def spec_for_case(case: AttentionCase, device_type: str) -> AttentionSpec:
    return AttentionSpec(
        device_type=device_type,
        dtype=case.dtype,
        head_size=case.head_size,
        num_heads=case.num_heads,
        num_kv_heads=case.num_kv_heads,
        block_size=case.block_size,
        sliding_window=case.sliding_window is not None,
        logit_softcap=case.logit_softcap is not None,
    )


def check_attention_backend(
    backend: type[AttentionBackend],
    reference: type[AttentionBackend],
    case: AttentionCase,
    device: torch.device,
    seed: int = 0,
) -> None:
    """Run a three-step paged batch (prefill, chunked prefill, decodes; GQA; shuffled blocks)
    through ``backend`` on ``device`` and through ``reference`` on the CPU in float32; outputs
    must match within the dtype's tolerance at every step (later steps read the cache written by
    earlier ones, so cache writes are checked too)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPES[case.dtype]
    plan = default_plan(case.block_size, gen)
    args = (
        case.num_heads,
        case.head_size,
        case.num_kv_heads,
        case.scale,
        case.sliding_window,
        case.logit_softcap,
    )
    impl, ref = backend(*args), reference(*args)
    shape = backend.kv_cache_shape(
        plan.num_blocks, case.block_size, case.num_kv_heads, case.head_size
    )
    ref_shape = reference.kv_cache_shape(
        plan.num_blocks, case.block_size, case.num_kv_heads, case.head_size
    )
    cache = torch.zeros(shape, dtype=dtype, device=device)
    ref_cache = torch.zeros(ref_shape, dtype=torch.float32)
    rtol, atol = ATTENTION_TOLERANCE[case.dtype]
    for step, layout in enumerate(plan.layouts()):
        t = sum(layout.query_lens)
        q = torch.randn(t, case.num_heads, case.head_size, generator=gen).to(dtype)
        k = torch.randn(t, case.num_kv_heads, case.head_size, generator=gen).to(dtype)
        v = torch.randn(t, case.num_kv_heads, case.head_size, generator=gen).to(dtype)
        meta = backend.build_metadata(layout, device)
        out = impl.forward(q.to(device), k.to(device), v.to(device), cache, meta)
        expected = ref.forward(
            q.float(),
            k.float(),
            v.float(),
            ref_cache,
            reference.build_metadata(layout, torch.device("cpu")),
        )
        assert tuple(out.shape) == (t, case.num_heads, case.head_size), (
            f"step {step}: output shape {tuple(out.shape)}"
        )
        assert out.dtype == dtype, f"step {step}: output dtype {out.dtype}, expected {dtype}"
        try:
            torch.testing.assert_close(out.detach().cpu().float(), expected, rtol=rtol, atol=atol)
        except AssertionError as exc:
            raise AssertionError(
                f"attention backend {backend.name} [{case.id}] differs from the reference at step {step} "
                f"(query_lens {layout.query_lens}, seq_lens {layout.seq_lens}): {exc}"
            ) from None
