"""Platform resolution and attention backend selection."""

from __future__ import annotations

from typing import ClassVar

import pytest
from plugin_helpers import EXAMPLE_VENDOR, install_fake_dist

from engine.attention_backends.interface import AttentionBackend, AttentionSpec
from engine.attention_backends.registry import AttentionBackendRegistry
from engine.attention_backends.selector import select_attention_backend
from engine.errors import AttentionBackendError, PlatformError
from engine.platforms.interface import Platform
from engine.platforms.resolve import PlatformEntry, resolve_platform
from engine.plugins import PluginInfo, PluginManager


def info(dist: str) -> PluginInfo:
    return PluginInfo(dist, dist, "1.0", f"{dist}.plugin", "1")


def platform(name: str, priority: int, reasons: list[str] | None = None, device: str = "cpu"):
    return type(
        f"P_{name}",
        (Platform,),
        {
            "name": name,
            "priority": priority,
            "device_type": device,
            "unavailable_reasons": classmethod(lambda cls: list(reasons or [])),
        },
    )


def entries(*specs) -> list[PlatformEntry]:
    return [PlatformEntry(cls, info(f"dist-{cls.name}")) for cls in specs]


def test_highest_available_priority_wins() -> None:
    es = entries(platform("cpu", 0), platform("acc", 100), platform("vendor", 200, ["no chip"]))
    assert resolve_platform(es, None, {}).name == "acc"


def test_ties_on_different_devices_are_errors_too() -> None:
    es = entries(platform("a", 100, device="cuda"), platform("b", 100, device="xla"))
    with pytest.raises(PlatformError, match="claim device types 'cuda' and 'xla'"):
        resolve_platform(es, None, {})


def test_unknown_platform_lists_valid_ones() -> None:
    es = entries(platform("cpu", 0), platform("acc", 100, ["no driver"]))
    with pytest.raises(PlatformError) as err:
        resolve_platform(es, "tpuu", {})
    msg = str(err.value)
    assert "Unknown platform 'tpuu' (asked for with --platform)" in msg
    assert "cpu (dist-cpu), acc (dist-acc)" in msg


def test_environment_variable_is_named_as_the_source() -> None:
    es = entries(platform("cpu", 0))
    with pytest.raises(PlatformError, match=r"asked for with ENGINE_PLATFORM"):
        resolve_platform(es, None, {"ENGINE_PLATFORM": "nope"})
    # --platform takes precedence over the variable.
    assert resolve_platform(es, "cpu", {"ENGINE_PLATFORM": "nope"}).name == "cpu"


def test_known_but_unavailable_platform_gives_its_reasons() -> None:
    es = entries(platform("cpu", 0), platform("acc", 100, ["no driver", "torch too old"]))
    with pytest.raises(PlatformError) as err:
        resolve_platform(es, "acc", {})
    msg = str(err.value)
    assert "'acc' (distribution dist-acc 1.0)" in msg
    assert "no driver; torch too old" in msg and "available platform: cpu" in msg


def test_detection_that_raises_is_reported_as_a_reason_naming_the_distribution() -> None:
    def boom(cls):
        raise OSError("driver exploded")

    bad = type("Bad", (Platform,), {"name": "bad", "unavailable_reasons": classmethod(boom)})
    (entry,) = entries(bad)
    assert entry.unavailable_reasons() == [
        "detection raised OSError: driver exploded (a bug in dist-bad 1.0)"
    ]


def test_real_plugins_on_this_machine(plugin_env) -> None:
    pm = PluginManager.from_env({"ENGINE_PLUGINS": "cpu,cuda,rocm,tpu,triton"})
    described = {e.name: e.describe() for e in pm.platforms()}
    assert set(described) == {"cpu", "cuda", "rocm", "tpu"}  # triton has no platform
    assert described["cpu"]["available"] and pm.resolve_platform().name == "cpu"
    for name in ("cuda", "rocm", "tpu"):
        # This CI machine has no accelerator: each says why, in words.
        assert not described[name]["available"] and described[name]["reasons"]


# ---- example vendor priority ----------------------------------------------------------------
def test_example_vendor_wins_only_when_its_device_is_present(plugin_env, monkeypatch) -> None:
    install_fake_dist(EXAMPLE_VENDOR, plugin_env)
    pm = PluginManager.from_env({"ENGINE_PLUGINS": "cpu,examplevendor"})
    assert pm.resolve_platform().name == "cpu"
    vendor = next(e for e in pm.platforms() if e.name == "examplevendor")
    assert vendor.unavailable_reasons() == [
        "no example vendor device (simulated: set EXAMPLE_VENDOR_DEVICE=1)"
    ]
    monkeypatch.setenv("EXAMPLE_VENDOR_DEVICE", "1")
    pm = PluginManager.from_env({"ENGINE_PLUGINS": "cpu,examplevendor"})
    assert pm.resolve_platform().name == "examplevendor"
    assert pm.resolve_platform("cpu").name == "cpu"  # --platform overrides priority
    assert "example" in pm.attention_backends()


# ---- attention backend selection -------------------------------------------------------------
class _Base(AttentionBackend):
    def forward(self, query, key, value, kv_cache, metadata):  # pragma: no cover
        return query


class Fast(_Base):
    name: ClassVar[str] = "fast"
    device_types: ClassVar[tuple[str, ...]] = ("cuda",)
    supported_block_sizes: ClassVar[tuple[int, ...] | None] = (16,)


class Portable(_Base):
    name: ClassVar[str] = "portable"
    device_types: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32",)


class Acc(Platform):
    name = "acc"
    device_type = "cuda"

    @classmethod
    def default_attention_backends(cls, config=None):
        return ["missing", "fast", "portable"]


def registry() -> AttentionBackendRegistry:
    reg = AttentionBackendRegistry()
    reg.add("fast", Fast, info("dist-fast"))
    reg.add("portable", f"{__name__}:Portable", info("dist-portable"))
    return reg


def test_auto_takes_the_first_backend_that_supports_the_spec() -> None:
    reg = registry()
    assert select_attention_backend("auto", AttentionSpec(block_size=16), Acc, reg) is Fast
    assert select_attention_backend(None, AttentionSpec(block_size=32), Acc, reg) is Portable


def test_auto_with_no_candidate_lists_every_candidate_and_reason() -> None:
    with pytest.raises(AttentionBackendError) as err:
        select_attention_backend(
            "auto", AttentionSpec(block_size=32, dtype="bfloat16"), Acc, registry()
        )
    msg = str(err.value)
    assert "missing: not installed" in msg
    assert "fast: block size 32 not supported (supported: 16)" in msg
    assert "portable: dtype bfloat16 not supported (supported: float32)" in msg


def test_explicit_backend_that_cannot_serve_gives_its_reasons() -> None:
    with pytest.raises(AttentionBackendError) as err:
        select_attention_backend("fast", AttentionSpec(block_size=8), Platform, registry())
    msg = str(err.value)
    assert "'fast' (from dist-fast)" in msg
    assert "runs on cuda devices, not cpu" in msg and "block size 8 not supported" in msg


def test_explicit_backend_outside_the_platform_order_is_allowed() -> None:
    class Cpu(Platform):
        name = "cpu"

    assert select_attention_backend("portable", AttentionSpec(), Cpu, registry()) is Portable


def test_unknown_backend_lists_valid_names() -> None:
    with pytest.raises(AttentionBackendError) as err:
        select_attention_backend("flashy", AttentionSpec(), Acc, registry())
    assert "Unknown attention backend 'flashy'. Valid names: auto, fast, portable" in str(err.value)


def test_registered_name_must_match_the_class_name() -> None:
    reg = AttentionBackendRegistry()
    reg.add("quick", Fast, info("dist-fast"))
    with pytest.raises(AttentionBackendError, match="registered as 'quick' but its class says"):
        reg.get("quick")
