"""The conformance kit's own suites: platform, communicator, attention backends, kernels.

Each discovers what the plugin under test registered through the plugin manager and yields one
``ConformanceCheck`` per property; the checks themselves are in ``engine.testing.checks``
(imported when a check runs, so listing the suites imports no torch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, ClassVar

from engine.testing.suites import ConformanceCheck, ConformanceSuite, ConformanceTarget


def _checks() -> Any:
    from engine.testing import checks

    return checks


class PlatformSuite(ConformanceSuite):
    """The plugin's platform, when it provides the one under test."""

    name: ClassVar[str] = "platform"
    description: ClassVar[str] = (
        "attributes, detection (stable, available, cheap in a fresh interpreter: no heavy "
        "import, no device context), device facts, memory profiling, check_config reasons, "
        "auto backend selection, fp8 flavour, the decode-graphs class"
    )

    def checks(self, target: ConformanceTarget) -> Iterator[ConformanceCheck]:
        if not target.owns_platform:
            return
        entry, platform, pm = target.platform, target.platform.cls, target.pm
        env = dict(target.environ)
        props: dict[str, Callable[[int], None]] = {
            "attributes": lambda seed: _checks().check_platform_attributes(platform, entry.name),
            "detection": lambda seed: _checks().check_platform_detection(platform),
            "detection-is-cheap": lambda seed: _checks().check_detection_is_cheap(entry.name, env),
            "device-facts": lambda seed: _checks().check_device_facts(platform),
            "memory-profiling": lambda seed: _checks().check_memory_profiling(platform),
            "check-config": lambda seed: _checks().check_config_validation(platform),
            "default-backends": lambda seed: _checks().check_default_backends(platform, pm),
            "fp8-dtype": lambda seed: _checks().check_fp8_dtype(platform),
            "decode-graphs": lambda seed: _checks().check_decode_graphs_class(platform),
        }
        for prop, run in props.items():
            yield ConformanceCheck(self.name, entry.name, prop, run, provider=entry.plugin.name)


# Distributed backends whose ranks the device runtime itself starts, which the kit's launcher
# (one process per rank joined by torch.distributed over a TCP rendezvous) cannot create.
RUNTIME_LAUNCHED_BACKENDS = {
    "xla": "XLA replicas are started by torch_xla's runtime (xmp.spawn over PJRT), not by "
    "torch.distributed over TCP",
}


class CommunicatorSuite(ConformanceSuite):
    """The platform's communicator: one rank, then a real process group."""

    name: ClassVar[str] = "communicator"
    description: ClassVar[str] = (
        "the platform's communicator (engine_communicator hook, else the platform default): "
        "identities on one rank; every operation on --engine-conformance-ranks processes"
    )

    def checks(self, target: ConformanceTarget) -> Iterator[ConformanceCheck]:
        platform, pm = target.platform.cls, target.pm
        try:
            entry = pm.communicator_entry(platform)
        except Exception as exc:
            message = str(exc)

            def fail(seed: int) -> None:
                raise AssertionError(message)

            yield ConformanceCheck(self.name, target.platform.name, "load", fail)
            return
        if not (target.owns_platform or entry.plugin == target.plugin.name):
            return  # neither the plugin's platform nor its communicator
        subject = target.platform.name
        yield ConformanceCheck(
            self.name,
            subject,
            "one-rank",
            lambda seed: _checks().check_single_rank_communicator(platform, pm),
            provider=entry.provider,
        )
        ranks = target.ranks
        skip = None
        if ranks < 2:
            skip = f"--engine-conformance-ranks={ranks}: no multi-process check"
        elif platform.dist_backend in RUNTIME_LAUNCHED_BACKENDS:
            skip = (
                f"dist_backend {platform.dist_backend!r}: "
                f"{RUNTIME_LAUNCHED_BACKENDS[platform.dist_backend]}; check it with the "
                "runtime's launcher"
            )
        elif platform.device_type != "cpu" and platform.device_count() < ranks:
            skip = f"needs {ranks} devices, {platform.device_count()} present"

        def run(seed: int) -> None:
            from engine.testing.distributed import run_communicator_check

            run_communicator_check(target.platform.name, ranks, seed)

        yield ConformanceCheck(
            self.name, subject, f"{ranks}-ranks", run, skip=skip, provider=entry.provider
        )


class AttentionSuite(ConformanceSuite):
    """Every attention backend the plugin provides, or its platform lists for ``auto``."""

    name: ClassVar[str] = "backend"
    description: ClassVar[str] = (
        "every attention backend the plugin provides or its platform lists, against the torch "
        "reference on fresh random paged batches: prefill, chunked prefill, a cached prefix, "
        "decodes, GQA and MQA, an odd block pool; sliding window, soft-cap, fp8 KV caches and "
        "attention sinks when declared"
    )

    def checks(self, target: ConformanceTarget) -> Iterator[ConformanceCheck]:
        from engine.errors import PluginError

        registry = target.pm.attention_backends()
        platform = target.platform.cls
        names = [b.name for b in registry if target.provides(b.plugin.name)]
        if target.owns_platform:
            names += [n for n in platform.default_attention_backends(None) if n in registry]
        for name in dict.fromkeys(names):
            entry = registry.entry(name)
            try:
                backend = entry.load()
                reference = registry.get("torch")
            except PluginError as exc:
                message = str(exc)

                def fail(seed: int, message: str = message) -> None:
                    raise AssertionError(message)

                yield ConformanceCheck(self.name, name, "import", fail)
                continue
            for case in _checks().attention_cases(backend, platform):
                reasons = backend.supports(_checks().spec_for_case(case, platform.device_type))
                skip = f"{name} cannot serve {case.id}: {'; '.join(reasons)}" if reasons else None

                def run(seed: int, backend=backend, reference=reference, case=case) -> None:
                    device = platform.torch_device(0)
                    _checks().check_attention_backend(backend, reference, case, device, seed)

                yield ConformanceCheck(
                    self.name, name, case.id, run, skip=skip, provider=entry.plugin.distribution
                )


class KernelSuite(ConformanceSuite):
    """Kernel overrides (MoE kernels included) against the torch references."""

    name: ClassVar[str] = "kernel"
    description: ClassVar[str] = (
        "every kernel override the plugin registers (and every one serving its platform), per "
        "supported dtype, against engine.kernels.reference on fresh random inputs; MoE "
        "kernels report under 'moe', LoRA kernels under 'lora'"
    )

    def checks(self, target: ConformanceTarget) -> Iterator[ConformanceCheck]:
        from engine.testing.inputs import KERNEL_INPUTS

        platform = target.platform.cls
        name = target.platform.name
        for impl in target.pm.kernel_registry().overrides():
            mine = target.provides(impl.provider)
            serves = impl.serves(name)
            if not (mine or (target.owns_platform and serves)):
                continue
            skip = None
            if not serves and not target.platform_explicit:
                skip = (
                    f"registered for {', '.join(impl.platforms or ())}, not {name}; pass "
                    f"--engine-conformance-platform={name} to check it on this device anyway"
                )
            inputs = KERNEL_INPUTS.get(impl.name)
            suite = inputs.kind if inputs is not None else self.name
            for dtype in platform.supported_dtypes:

                def run(seed: int, impl=impl, dtype=dtype) -> None:
                    device = platform.torch_device(0)
                    _checks().check_kernel(impl.name, impl.fn, device, dtype, seed)

                yield ConformanceCheck(
                    suite, impl.name, f"{impl.provider}-{dtype}", run, skip=skip,
                    provider=impl.provider,
                )  # fmt: skip
