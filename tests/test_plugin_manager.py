"""The plugin manager: discovery, ENGINE_PLUGINS, strict loading and its error messages."""

from __future__ import annotations

import pytest
from plugin_helpers import install_fixtures

from engine.errors import AttentionBackendError, PlatformError, PluginLoadError
from engine.plugins import PluginManager, parse_enabled_plugins
from engine.version import PLUGIN_API_VERSION

BUILTIN_PLUGINS = {"cpu", "cuda", "rocm", "tpu", "triton"}


def load(**env: str) -> PluginManager:
    return PluginManager.from_env(env)


def test_parse_enabled_plugins() -> None:
    assert parse_enabled_plugins({}) is None
    assert parse_enabled_plugins({"ENGINE_PLUGINS": ""}) == []
    assert parse_enabled_plugins({"ENGINE_PLUGINS": " cpu, triton ,"}) == ["cpu", "triton"]


def test_all_five_plugins_load_with_metadata(plugin_env) -> None:
    pm = load()
    by_name = {p.name: p for p in pm.plugins}
    assert BUILTIN_PLUGINS <= set(by_name)
    assert pm.plugins[0].name == "builtin" and pm.plugins[0].distribution == "engine-llm"
    for name in BUILTIN_PLUGINS:
        info = by_name[name]
        assert info.distribution == f"engine-llm-{name}"
        assert info.version == "0.1.0"
        assert info.value == f"engine_{name}.plugin"
        assert info.api_version == "1"


def test_engine_plugins_restricts_and_empty_loads_none(plugin_env) -> None:
    assert [p.name for p in load(ENGINE_PLUGINS="").plugins] == ["builtin"]
    assert [p.name for p in load(ENGINE_PLUGINS="cpu").plugins] == ["builtin", "cpu"]
    # The builtin torch reference backend exists whatever ENGINE_PLUGINS says.
    assert load(ENGINE_PLUGINS="").attention_backends().names() == ["torch"]


def test_engine_plugins_unknown_name_is_an_error(plugin_env) -> None:
    with pytest.raises(PluginLoadError) as err:
        load(ENGINE_PLUGINS="cpu,nosuch")
    msg = str(err.value)
    assert "'nosuch'" in msg and "ENGINE_PLUGINS" in msg and "cpu, cuda" in msg


def test_plugin_raising_on_import_names_distribution_entry_point_and_cause(plugin_env) -> None:
    install_fixtures(plugin_env, "engine-broken-plugin")
    with pytest.raises(PluginLoadError) as err:
        load()
    msg = str(err.value)
    assert "engine-broken-plugin 0.0.1" in msg
    assert "broken = engine_broken_plugin" in msg
    assert "RuntimeError: the vendor library libfoo.so could not be loaded" in msg
    assert "ENGINE_PLUGINS" in msg  # the way out
    # Excluding it is the documented fix, and it works:
    assert "broken" not in {p.name for p in load(ENGINE_PLUGINS="cpu").plugins}


def test_hook_with_wrong_signature_is_refused_at_load_time(plugin_env) -> None:
    install_fixtures(plugin_env, "engine-wrong-signature")
    with pytest.raises(PluginLoadError) as err:
        load(ENGINE_PLUGINS="wrongsig")
    msg = str(err.value)
    assert "engine-wrong-signature" in msg and "wrongsig = engine_wrong_signature" in msg
    assert "engine_kernels" in msg and "device" in msg


def test_unknown_hook_name_is_refused(plugin_env) -> None:
    install_fixtures(plugin_env, "engine-unknown-hook")
    with pytest.raises(PluginLoadError) as err:
        load(ENGINE_PLUGINS="unknownhook")
    msg = str(err.value)
    assert "engine-unknown-hook" in msg and "engine_platfrom" in msg
    assert "Valid hooks: engine_add_cli_args, engine_attention_backends" in msg


def test_hook_without_marker_is_refused(plugin_env) -> None:
    install_fixtures(plugin_env, "engine-undecorated-hook")
    with pytest.raises(PluginLoadError) as err:
        load(ENGINE_PLUGINS="undecorated")
    assert "engine_platform looks like a hook implementation" in str(err.value)
    assert "@engine.hookimpl" in str(err.value)


def test_plugin_for_another_api_major_is_refused_with_versions_that_fit(plugin_env) -> None:
    install_fixtures(plugin_env, "engine-wrong-api")
    with pytest.raises(PluginLoadError) as err:
        load(ENGINE_PLUGINS="wrongapi")
    msg = str(err.value)
    assert "engine-wrong-api 0.0.1" in msg
    assert "built for plugin API 2.0" in msg
    assert f"speaks plugin API {PLUGIN_API_VERSION}" in msg
    assert "versions that fit: 1 or 1.x" in msg


def test_plugin_for_a_newer_minor_api_is_refused_and_older_minors_load(plugin_env) -> None:
    install_fixtures(plugin_env, "engine-newer-api", "engine-kernel-override")
    with pytest.raises(PluginLoadError) as err:
        load(ENGINE_PLUGINS="newerapi")
    msg = str(err.value)
    assert "built for plugin API 1.99, newer than the plugin API" in msg
    assert "engine-newer-api 0.0.1" in msg and "Upgrade the engine" in msg
    # "1" (any minor) and the current or an older minor load.
    assert load(ENGINE_PLUGINS="kerneloverride").plugin("kerneloverride").api_version == "1"


def test_plugin_without_api_version_is_refused(plugin_env) -> None:
    install_fixtures(plugin_env, "engine-no-api")
    with pytest.raises(PluginLoadError) as err:
        load(ENGINE_PLUGINS="noapi")
    msg = str(err.value)
    assert "does not declare" in msg and 'ENGINE_PLUGIN_API = "1"' in msg
    assert "engine-no-api" in msg


def test_two_vendors_same_device_same_priority_is_an_error_naming_both(plugin_env) -> None:
    install_fixtures(plugin_env, "engine-dup-vendor-a", "engine-dup-vendor-b")
    pm = load(ENGINE_PLUGINS="cpu,dupvendora,dupvendorb")
    with pytest.raises(PlatformError) as err:
        pm.resolve_platform()
    msg = str(err.value)
    assert "engine-dup-vendor-a" in msg and "engine-dup-vendor-b" in msg
    assert "both claim device type 'cpu'" in msg and "same priority 200" in msg
    assert "--platform dupvendora" in msg and "ENGINE_PLATFORM" in msg
    # The override the message suggests resolves it, by flag or by environment.
    assert pm.resolve_platform("dupvendorb").name == "dupvendorb"
    pm_env = load(ENGINE_PLUGINS="cpu,dupvendora,dupvendorb", ENGINE_PLATFORM="dupvendora")
    assert pm_env.resolve_platform().name == "dupvendora"


def test_duplicate_backend_name_across_plugins_is_an_error(plugin_env) -> None:
    install_fixtures(plugin_env, "engine-dup-backend")
    pm = load(ENGINE_PLUGINS="dupbackend")
    with pytest.raises(AttentionBackendError) as err:
        pm.attention_backends()
    msg = str(err.value)
    assert "'torch' is provided twice" in msg
    assert "distribution engine-llm " in msg and "engine-dup-backend" in msg


def test_backend_that_fails_to_import_names_its_plugin(plugin_env) -> None:
    from engine.attention_backends.interface import AttentionSpec

    install_fixtures(plugin_env, "engine-bad-backend")
    pm = load(ENGINE_PLUGINS="cpu,badbackend")
    # Listing it costs nothing (qualified names are not imported)...
    assert "bad" in pm.attention_backends()
    # ...selecting it imports it, and the failure names the plugin.
    with pytest.raises(AttentionBackendError) as err:
        pm.select_attention_backend("bad", AttentionSpec(), pm.resolve_platform())
    msg = str(err.value)
    assert "engine-bad-backend" in msg and "engine_bad_backend_impl.does_not_exist" in msg
    assert "ModuleNotFoundError" in msg


def test_kernel_overrides_are_registered_and_credited_to_their_distribution(plugin_env) -> None:
    install_fixtures(plugin_env, "engine-kernel-override")
    pm = load(ENGINE_PLUGINS="cpu,kerneloverride")
    overrides = pm.kernel_registry().overrides()
    cpu_own = (
        "rms_norm",
        "fused_add_rms_norm",
        "qk_norm_rotary",
        "silu_and_mul",
        "gelu_tanh_and_mul",
        "linear",
        "moe_topk_softmax",
        "argmax",
        "fp8_linear",
        "fp8_block_linear",
        "int8_linear",
        "wna16_linear",
        "gguf_linear",
    )
    assert {(o.name, o.provider, o.platforms) for o in overrides} == {
        ("silu_and_mul", "engine-kernel-override", ("cpu",)),
        *((name, "engine-llm-cpu", ("cpu",)) for name in cpu_own),  # the cpu plugin's own
    }
    kernels = pm.kernel_registry().resolve("cpu")
    assert kernels.provider("silu_and_mul") == "engine-kernel-override"
    assert kernels.provider("gelu_tanh_and_mul") == "engine-llm-cpu"
    assert pm.kernel_registry().resolve("cuda").provider("silu_and_mul").startswith("engine-llm ")


def test_managers_are_independent(plugin_env) -> None:
    """No hidden global state: two managers with different settings coexist."""
    a, b = load(ENGINE_PLUGINS=""), load(ENGINE_PLUGINS="cpu")
    assert [p.name for p in a.plugins] == ["builtin"]
    assert [p.name for p in b.plugins] == ["builtin", "cpu"]
    with pytest.raises(PlatformError, match="no loaded plugin provides one"):
        a.resolve_platform()
    assert b.resolve_platform().name == "cpu"


# ---- stale distributions from before the engine-llm rename ----------------------------------------
def test_a_stale_pre_rename_distribution_is_named_for_uninstalling(plugin_env) -> None:
    """engine-cpu (the old name) next to engine-llm-cpu declares the same entry point, which
    fails every plugin lookup; the error names the old distributions, the stale core too, and
    says to reinstall the successors (uninstalling removes the files they share)."""
    install_fixtures(plugin_env, "engine-stale-cpu", "engine-stale-core")
    with pytest.raises(PluginLoadError) as err:
        load()
    msg = " ".join(str(err.value).split())
    assert "'cpu' by " in msg and "engine-cpu 0.0.9" in msg and "engine-llm-cpu 0.1.0" in msg
    assert "engine, engine-cpu are left over from before the packages were renamed" in msg
    assert "pip uninstall engine engine-cpu" in msg
    assert "pip install --force-reinstall --no-deps engine-llm engine-llm-cpu" in msg


def test_a_clash_without_a_stale_distribution_says_so() -> None:
    from engine.plugins import duplicate_entry_points_message

    msg = duplicate_entry_points_message(
        {"vendor": ["engine-vendor-a 1.0", "engine-vendor-b 2.0"]}, installed=["engine"]
    )
    assert "'vendor' by engine-vendor-a 1.0 and engine-vendor-b 2.0" in msg
    assert "renamed" not in msg and "Uninstall one of each" in msg
    msg = duplicate_entry_points_message({"tpu": ["engine-llm-tpu 0.1.0", "engine-tpu 0.0.9"]}, [])
    assert "engine-tpu is left over" in msg and "pip uninstall engine-tpu)" in msg
