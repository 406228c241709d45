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
from engine.kernels.registry import PREPACKED_KERNELS
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


# Modules detection must not import: frameworks and device runtimes (driver management
# libraries such as pynvml and amdsmi are the cheap way and are allowed).
HEAVY_MODULES = (
    "torch",
    "torch_xla",
    "triton",
    "jax",
    "jaxlib",
    "tensorflow",
    "cupy",
    "pycuda",
    "cuda",
    "numba",
)
# Shared libraries that mean a device runtime was loaded (a context is one call away); NVML
# (libnvidia-ml) and amdsmi's library are management libraries and allowed.
DEVICE_RUNTIME_LIBRARIES = (
    "libcuda.so",
    "libcudart.so",
    "libamdhip64.so",
    "libhsa-runtime64.so",
    "libtpu.so",
)

_DETECTION_PROBE = """
import json, sys
from engine.plugins import PluginManager
pm = PluginManager.from_env()
entry = next(e for e in pm.platforms() if e.name == NAME)
reasons = entry.unavailable_reasons()
result = {"reasons": reasons, "modules": [m for m in HEAVY if m in sys.modules], "libraries": []}
torch = sys.modules.get("torch")
if torch is not None and getattr(torch, "cuda", None) is not None:
    result["cuda_initialized"] = bool(torch.cuda.is_initialized())
try:
    maps = open("/proc/self/maps").read()
except OSError:
    maps = ""
result["libraries"] = sorted({lib for lib in LIBS if lib in maps})
print("RESULT " + json.dumps(result))
"""


def check_detection_is_cheap(
    platform_name: str,
    env: dict[str, str] | None = None,
    heavy_modules: tuple[str, ...] = HEAVY_MODULES,
) -> None:
    """In a fresh interpreter, loading the plugins and running ``platform_name``'s detection
    imports no framework or device runtime (``heavy_modules``), initialises no CUDA context
    (checked through ``torch.cuda.is_initialized()`` if torch was imported anyway) and maps no
    device runtime library (``/proc/self/maps``, on Linux)."""
    import json

    code = (
        f"NAME = {platform_name!r}\nHEAVY = {tuple(heavy_modules)!r}\n"
        f"LIBS = {DEVICE_RUNTIME_LIBRARIES!r}\n" + _DETECTION_PROBE
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, f"the detection probe failed: {out.stderr.strip()[-2000:]}"
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, f"the detection probe printed no result: {out.stdout[-2000:]}"
    result = json.loads(line[len("RESULT ") :])
    problems = []
    if result["modules"]:
        problems.append(f"imported {', '.join(result['modules'])}")
    if result.get("cuda_initialized"):
        problems.append("initialised a CUDA context (torch.cuda.is_initialized() is True)")
    if result["libraries"]:
        problems.append(f"loaded device runtime libraries {', '.join(result['libraries'])}")
    assert not problems, (
        f"detecting platform {platform_name} {'; '.join(problems)}: answer "
        "unavailable_reasons() with a driver management library (NVML, amdsmi), /proc, /sys or "
        "/dev entries, or importlib.util.find_spec, and import the runtime only on use"
    )


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
    for dtype in sorted(set(KNOWN_DTYPES) - set(platform.supported_dtypes)):
        reasons = platform.check_config(EngineConfig(ModelConfig("conformance", dtype=dtype)))
        assert isinstance(reasons, list) and reasons, (
            f"check_config accepts unsupported dtype {dtype}"
        )
        assert all(isinstance(r, str) and r.strip() for r in reasons), (
            f"check_config's reasons for dtype {dtype} must be non-empty strings: {reasons!r}"
        )
        assert any(dtype in r for r in reasons), (
            f"check_config refuses dtype {dtype} without naming it: {reasons!r}"
        )


def check_fp8_dtype(platform: type[Platform]) -> None:
    """``fp8_dtype()`` names a float8 torch dtype (or None: no fp8 on this platform)."""
    from engine.testing.inputs import FP8_DTYPES

    name = platform.fp8_dtype()
    assert name is None or name in FP8_DTYPES, (
        f"fp8_dtype() = {name!r}; expected None or one of {', '.join(FP8_DTYPES)}"
    )


def check_decode_graphs_class(platform: type[Platform]) -> None:
    """``decode_graphs_class()`` is None or ``engine.cuda_graphs.DecodeGraphs`` (a subclass
    replays its own way through ``_execute``), the same class each time."""
    from engine.cuda_graphs import DecodeGraphs

    first, second = platform.decode_graphs_class(), platform.decode_graphs_class()
    assert first is second, f"decode_graphs_class() is not stable: {first} then {second}"
    assert first is None or (isinstance(first, type) and issubclass(first, DecodeGraphs)), (
        f"decode_graphs_class() = {first!r}; expected None or a subclass of "
        "engine.cuda_graphs.DecodeGraphs"
    )


def check_default_backends(platform: type[Platform], pm: Any) -> None:
    """The platform names backends, and ``auto`` finds one for each supported dtype."""
    names = platform.default_attention_backends(None)
    assert isinstance(names, list) and names and all(isinstance(n, str) for n in names), names
    for dtype in platform.supported_dtypes:
        spec = AttentionSpec(dtype=dtype, head_size=64, num_heads=4, num_kv_heads=2, block_size=16)
        backend = pm.select_attention_backend("auto", spec, platform)
        assert issubclass(backend, AttentionBackend)


def check_single_rank_communicator(platform: type[Platform], pm: Any) -> None:
    """Without a process group the platform's communicator (from ``engine_communicator``, else
    the platform default) has one rank, and every collective is an identity."""
    comm = pm.communicator(platform, None)
    assert isinstance(comm, Communicator), f"the communicator is {comm!r}"
    assert (comm.world_size, comm.rank) == (1, 0), (
        f"without a process group world_size/rank are ({comm.world_size}, {comm.rank}), not (1, 0)"
    )
    t = torch.arange(8, dtype=torch.float32, device=platform.torch_device(0))
    ops = {
        "all_reduce": comm.all_reduce,
        "all_gather": comm.all_gather,
        "reduce_scatter": comm.reduce_scatter,
        "broadcast": comm.broadcast,
        "all_to_all": comm.all_to_all,
    }
    for name, op in ops.items():
        out = op(t)
        assert tuple(out.shape) == (8,), f"{name} on one rank changed the shape to {out.shape}"
        torch.testing.assert_close(
            out.cpu(), torch.arange(8, dtype=torch.float32), msg=f"{name} on one rank"
        )


# ---- kernels --------------------------------------------------------------------------------
def _cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        # fp8 tensors (an fp8 KV cache) are compared by value.
        fp8 = value.dtype.is_floating_point and value.element_size() == 1
        return value.float() if fp8 else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cpu(v) for v in value)
    return value


def check_kernel(
    name: str, fn: Callable[..., Any], device: torch.device, dtype: str, seed: int = 0
) -> None:
    """``fn`` matches ``engine.kernels.reference.<name>`` on random inputs in ``dtype``
    (inputs from ``engine.testing.inputs.KERNEL_INPUTS``), to the dtype's tolerance, or to the
    one the kernel states for itself (``fn.conformance_tolerance(dtype) -> (rtol, atol)`` or
    None: a kernel whose arithmetic is deliberately coarser, e.g. one that quantizes its
    activations, says by how much; the kit holds it to that)."""
    from engine.testing.inputs import KERNEL_INPUTS

    reference = REFERENCE_KERNELS[name]
    stated = getattr(fn, "conformance_tolerance", None)
    stated = stated(dtype) if callable(stated) else None
    rtol, atol = stated or KERNEL_TOLERANCE[dtype]
    gen = torch.Generator().manual_seed(seed)
    in_place = KERNEL_INPUTS[name].in_place if name in KERNEL_INPUTS else ()
    for case_id, args in kernel_cases(name, DTYPES[dtype], gen):
        ref_args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        dev_args = tuple(to_device(a, device) for a in args)
        expected = call_kernel(name, reference, ref_args)
        got = call_kernel(name, fn, dev_args)
        if in_place:  # in place: compare the arguments it writes
            expected = tuple(ref_args[i] for i in in_place)
            got = tuple(dev_args[i] for i in in_place)
        try:
            torch.testing.assert_close(_cpu(got), _cpu(expected), rtol=rtol, atol=atol)
        except AssertionError as exc:
            raise AssertionError(
                f"kernel {name} [{case_id}, {dtype}, seed {seed}] differs from the reference: {exc}"
            ) from None


def call_kernel(name: str, fn: Callable[..., Any], args: tuple) -> Any:
    """Call kernel ``name`` on its conformance args. A kernel with its own weight layout
    (``wna16_linear``, ``gguf_linear``) gets the canonical tensors through its ``prepack``
    first."""
    if name not in PREPACKED_KERNELS:
        return fn(*args)
    if name == "gguf_linear":
        x, blocks, qtype, bias = args
        packed = fn.prepack(blocks, qtype=qtype, dtype=x.dtype)
        return fn(x, packed, qtype=qtype, bias=bias)
    x, qweight, scales, zeros, bits, group_size, perm, bias = args
    packed = fn.prepack(
        qweight, scales, zeros, bits=bits, group_size=group_size, perm=perm, dtype=x.dtype
    )
    return fn(x, packed, bits=bits, group_size=group_size, bias=bias)


# ---- attention ------------------------------------------------------------------------------
def _pick(supported: tuple[int, ...] | None, preferred: int) -> int:
    return preferred if supported is None or preferred in supported else supported[0]


def attention_cases(
    backend: type[AttentionBackend], platform: type[Platform]
) -> list[AttentionCase]:
    """The configurations to check ``backend`` on: GQA in each dtype both support, MQA, then
    sliding window, soft-capping, each fp8 KV-cache dtype and attention sinks (alone and, as
    GPT-OSS's sliding layers have them, with a window) when the backend declares them. Every
    case runs the four-step plan of ``default_plan`` (prefill, chunked prefill, a cached
    prefix, decodes, an odd number of blocks)."""
    head = _pick(backend.supported_head_sizes, 64)
    block = _pick(backend.supported_block_sizes, 16)
    dtypes = [d for d in platform.supported_dtypes if d in backend.supported_dtypes] or list(
        platform.supported_dtypes
    )
    base = {"head_size": head, "block_size": block}
    cases = [AttentionCase(d, **base) for d in dtypes]
    cases.append(AttentionCase(dtypes[0], num_heads=8, num_kv_heads=1, **base))
    if backend.supports_sliding_window:
        cases.append(AttentionCase(dtypes[0], sliding_window=8, **base))
    if backend.supports_logit_softcap:
        cases.append(AttentionCase(dtypes[0], logit_softcap=5.0, **base))
    for kv_dtype in backend.supported_kv_cache_dtypes:
        cases.append(AttentionCase(dtypes[0], kv_cache_dtype=kv_dtype, **base))
    if backend.supports_attention_sinks:
        cases.append(AttentionCase(dtypes[0], attention_sinks=True, **base))
        if backend.supports_sliding_window:
            cases.append(AttentionCase(dtypes[0], sliding_window=8, attention_sinks=True, **base))
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
        kv_cache_dtype=case.kv_cache_dtype,
        attention_sinks=case.attention_sinks,
    )


def check_attention_backend(
    backend: type[AttentionBackend],
    reference: type[AttentionBackend],
    case: AttentionCase,
    device: torch.device,
    seed: int = 0,
) -> None:
    """Run the four-step paged batch of ``default_plan`` (prefill, chunked prefill, a cached
    prefix shared from another request, decodes; GQA; shuffled blocks, an odd pool) through
    ``backend`` on ``device`` and through ``reference`` on the CPU in float32; outputs must
    match within the dtype's tolerance at every step. Later steps read what earlier ones wrote,
    so cache writes are checked too. With an fp8 KV cache the reference attends over the keys
    and values rounded to that dtype (what the cache holds). With attention sinks both get the
    same random float32 sinks (``engine.testing.inputs.attention_sinks``) as ``impl.sinks``, on
    their devices, as the ``Attention`` layer sets them."""
    from engine.testing.inputs import FP8_DTYPES, attention_sinks

    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPES[case.dtype]
    cache_dtype = FP8_DTYPES[case.kv_cache_dtype] if case.kv_cache_dtype else dtype
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
    if case.attention_sinks:  # drawn only here, so the other cases' inputs stay as they were
        sinks = attention_sinks(case.num_heads, gen)
        impl.sinks, ref.sinks = sinks.to(device), sinks
    shape = backend.kv_cache_shape(
        plan.num_blocks, case.block_size, case.num_kv_heads, case.head_size
    )
    ref_shape = reference.kv_cache_shape(
        plan.num_blocks, case.block_size, case.num_kv_heads, case.head_size
    )
    cache = torch.zeros(shape, dtype=cache_dtype, device=device)
    ref_cache = torch.zeros(ref_shape, dtype=torch.float32)
    rtol, atol = ATTENTION_TOLERANCE[case.dtype]
    where = f"attention backend {backend.name} [{case.id}, seed {seed}]"
    for step, layout in enumerate(plan.layouts()):
        t = sum(layout.query_lens)
        q = torch.randn(t, case.num_heads, case.head_size, generator=gen).to(dtype)
        k = torch.randn(t, case.num_kv_heads, case.head_size, generator=gen).to(dtype)
        v = torch.randn(t, case.num_kv_heads, case.head_size, generator=gen).to(dtype)
        meta = backend.build_metadata(layout, device)
        out = impl.forward(q.to(device), k.to(device), v.to(device), cache, meta)
        stored_k, stored_v = k.to(cache_dtype).float(), v.to(cache_dtype).float()
        expected = ref.forward(
            q.float(),
            stored_k,
            stored_v,
            ref_cache,
            reference.build_metadata(layout, torch.device("cpu")),
        )
        context = (
            f"step {step + 1} (query_lens {layout.query_lens}, seq_lens {layout.seq_lens}, "
            f"{layout.num_decodes} decodes)"
        )
        assert tuple(out.shape) == (t, case.num_heads, case.head_size), (
            f"{where}: output shape {tuple(out.shape)} at {context}"
        )
        assert out.dtype == dtype, f"{where}: output dtype {out.dtype}, expected {dtype}"
        try:
            torch.testing.assert_close(out.detach().cpu().float(), expected, rtol=rtol, atol=atol)
        except AssertionError as exc:
            raise AssertionError(
                f"{where} differs from the reference at {context}: {exc}"
            ) from None
