"""The model loader: path / HF-cache resolution, dtype, sharded checkpoints, dummy weights, GGUF
dispatch, and clear ``ModelLoadError``s for bad input raised before weights are read."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.attention_backends.torch_ref import TorchReferenceBackend
from engine.config import ModelConfig
from engine.kernels import KernelRegistry
from engine.loader import ModelLoadError, load_hf_config, load_model, resolve_model_path
from engine.models import ModelRegistry
from engine.testing.tiny_models import save_tiny_model

KERNELS = KernelRegistry().resolve("cpu")


def load(path, **kw):
    return load_model(ModelConfig(model=str(path), **kw), KERNELS, TorchReferenceBackend)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_model("llama", tmp_path_factory.mktemp("llama"), num_hidden_layers=2)


def copy_with_weights(src, dst, edit):
    """Copy the model dir ``src`` to ``dst`` with ``edit(state_dict)`` applied to its weights."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    state = load_file(src / "model.safetensors")
    edit(state)
    save_file(state, dst / "model.safetensors")
    return dst


def test_loads_parameters_equal_to_checkpoint(llama_dir):
    model = load(llama_dir)
    state = load_file(llama_dir / "model.safetensors")
    params = dict(model.named_parameters())
    attn = "model.layers.1.self_attn."
    qkv = torch.cat([state[attn + f"{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(params[attn + "qkv_proj.weight"], qkv)
    mlp = "model.layers.0.mlp."
    gate_up = torch.cat([state[mlp + "gate_proj.weight"], state[mlp + "up_proj.weight"]])
    assert torch.equal(params[mlp + "gate_up_proj.weight"], gate_up)
    assert torch.equal(params["lm_head.weight"], state["lm_head.weight"])
    assert not any(p.requires_grad for p in model.parameters())


def test_missing_directory():
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_path("/nonexistent/model/dir")


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load(tmp_path)


def test_unreadable_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read"):
        load(tmp_path)


def test_unsupported_architecture_lists_supported(tmp_path):
    """No native class and an attention the transformers backend cannot replace: the error
    lists the native architectures and the backend's reason."""
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "falcon", "architectures": ["FalconForCausalLM"]})
    )
    mc = ModelConfig(model=str(tmp_path))
    with pytest.raises(ModelLoadError) as e:
        load_hf_config(mc)
    assert "FalconForCausalLM" in str(e.value)
    assert "LlamaForCausalLM" in str(e.value) and "Qwen3ForCausalLM" in str(e.value)
    assert "the transformers backend cannot serve it" in str(e.value)


def test_no_weights(tmp_path, llama_dir):
    (tmp_path / "config.json").write_text((llama_dir / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights"):
        load(tmp_path)


def test_missing_tensors_are_named(tmp_path, llama_dir):
    def drop(state):
        del state["model.layers.1.mlp.up_proj.weight"]
        del state["model.norm.weight"]

    bad = copy_with_weights(llama_dir, tmp_path / "m", drop)
    with pytest.raises(ModelLoadError) as e:
        load(bad)
    msg = str(e.value)
    assert "model.layers.1.mlp.up_proj.weight" in msg and "model.norm.weight" in msg
    assert "gate_proj" not in msg  # only what is actually missing


def test_misshaped_tensor_names_shapes(tmp_path, llama_dir):
    def shrink(state):
        state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)

    bad = copy_with_weights(llama_dir, tmp_path / "m", shrink)
    with pytest.raises(ModelLoadError) as e:
        load(bad)
    msg = str(e.value)
    assert "model.layers.0.self_attn.k_proj.weight" in msg
    assert "(32, 64)" in msg and "(16, 64)" in msg


def test_unknown_tensor_rejected_but_inv_freq_tolerated(tmp_path, llama_dir):
    def add_inv_freq(state):
        state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)

    ok = copy_with_weights(llama_dir, tmp_path / "ok", add_inv_freq)
    load(ok)

    def add_junk(state):
        state["model.layers.0.mystery.weight"] = torch.zeros(3)

    bad = copy_with_weights(llama_dir, tmp_path / "bad", add_junk)
    with pytest.raises(ModelLoadError, match="model.layers.0.mystery.weight"):
        load(bad)


def test_sharded_checkpoint_and_auto_dtype(tmp_path):
    path = save_tiny_model("qwen3", tmp_path / "m", dtype=torch.bfloat16)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    shards = list((tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    model = load(tmp_path / "sharded")
    assert next(model.parameters()).dtype == torch.bfloat16  # auto: the checkpoint's dtype
    model32 = load(tmp_path / "sharded", dtype="float32")
    assert next(model32.parameters()).dtype == torch.float32
    a = dict(model.named_parameters())["model.layers.0.self_attn.q_norm.weight"]
    b = hf.state_dict()["model.layers.0.self_attn.q_norm.weight"]
    assert torch.equal(a, b)


def test_auto_dtype_without_declared_dtype_is_float32(tmp_path, llama_dir):
    cfg = json.loads((llama_dir / "config.json").read_text())
    cfg.pop("dtype", None)
    cfg.pop("torch_dtype", None)
    d = copy_with_weights(llama_dir, tmp_path / "m", lambda s: s.update({}))
    (d / "config.json").write_text(json.dumps(cfg))
    assert next(load(d).parameters()).dtype == torch.float32


def test_auto_dtype_never_reads_the_deprecated_torch_dtype(tmp_path, llama_dir, monkeypatch):
    """transformers 5 warns `torch_dtype is deprecated!` on every read of the alias: the
    loader reads `dtype` (a checkpoint's torch_dtype key is mapped to it on load)."""
    from transformers import PretrainedConfig

    from engine.loader import resolve_dtype

    def deprecated(self):
        raise AssertionError("read the deprecated PretrainedConfig.torch_dtype")

    monkeypatch.setattr(PretrainedConfig, "torch_dtype", property(deprecated))
    cfg = json.loads((llama_dir / "config.json").read_text())
    cfg.pop("dtype", None)
    for declared, want in ((None, torch.float32), ("bfloat16", torch.bfloat16)):
        cfg.pop("torch_dtype", None)
        if declared:
            cfg["torch_dtype"] = declared  # what older checkpoints write
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        mc = ModelConfig(model=str(tmp_path))
        assert resolve_dtype(mc, load_hf_config(mc)) == want


def test_max_model_len_from_config(llama_dir):
    mc = ModelConfig(model=str(llama_dir))
    load_hf_config(mc)
    assert mc.max_model_len == 512 and mc.architecture == "LlamaForCausalLM"


def test_dummy_weights_deterministic_and_config_only(tmp_path, llama_dir):
    only_config = tmp_path / "cfg"
    only_config.mkdir()
    (only_config / "config.json").write_text((llama_dir / "config.json").read_text())
    a = load(only_config, load_format="dummy", seed=7)
    b = load(only_config, load_format="dummy", seed=7)
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), na
    w = dict(a.named_parameters())["model.layers.0.mlp.down_proj.weight"]
    assert 0.01 < float(w.std()) < 0.03


def test_dummy_uniform_init_is_vllms(tmp_path, llama_dir):
    """``{"dummy_init": "uniform"}`` draws vLLM's uniform(-1e-3, 1e-3) matrices (norm scales
    stay one, biases zero); the greedy output of such a model settles on one token, which
    the speculative-decoding benchmark relies on."""
    only_config = tmp_path / "cfg"
    only_config.mkdir()
    (only_config / "config.json").write_text((llama_dir / "config.json").read_text())
    extra = {"dummy_init": "uniform"}
    a = load(only_config, load_format="dummy", seed=7, model_loader_extra_config=extra)
    params = dict(a.named_parameters())
    w = params["model.layers.0.mlp.down_proj.weight"].float()
    assert float(w.abs().max()) <= 1e-3 and float(w.std()) > 4e-4  # uniform: std 5.8e-4
    assert torch.equal(params["model.norm.weight"], torch.ones_like(params["model.norm.weight"]))
    b = load(only_config, load_format="dummy", seed=7, model_loader_extra_config=extra)
    assert torch.equal(params["model.embed_tokens.weight"], b.model.embed_tokens.weight)


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"dummy_init": "zeros"}, "dummy_init='zeros' is not supported; choose one of normal"),
        (
            {"shard_pattern": "x"},
            "unknown keys \\['shard_pattern'\\]; the keys read are dummy_init",
        ),
        ("[1]", "must be a JSON object, got list"),
        ("{not json", "is not valid JSON"),
    ],
)
def test_model_loader_extra_config_rejects_what_it_does_not_read(extra, message):
    from engine.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        ModelConfig(model="m", load_format="dummy", model_loader_extra_config=extra)


def test_model_loader_extra_config_flag_reaches_the_config():
    import argparse

    from engine.cli.args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    add_engine_args(parser)
    args = parser.parse_args(["m", "--model-loader-extra-config", '{"dummy_init": "uniform"}'])
    config = engine_config_from_args(args)
    assert config.model.model_loader_extra_config == {"dummy_init": "uniform"}


def test_model_id_from_local_hf_cache(tmp_path, llama_dir, monkeypatch):
    """A model id resolves to its snapshot in the local HF cache, offline."""
    cache = tmp_path / "hub"
    repo = cache / "models--tiny-org--tiny-llama"
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    for f in llama_dir.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    assert resolve_model_path("tiny-org/tiny-llama") == snap
    with pytest.raises(ModelLoadError, match="not in the local Hugging Face cache"):
        resolve_model_path("tiny-org/not-there")


def test_plugin_registered_architecture(tmp_path, llama_dir, plugin_env):
    """A plugin's engine_models hook adds an architecture; without the plugin there is no
    native class, and the transformers backend does not serve a class name transformers does
    not have either (as vLLM's backend refuses it), though the model_type is known."""
    from plugin_helpers import install_fixtures

    from engine.plugins import PluginManager

    cfg = json.loads((llama_dir / "config.json").read_text())
    cfg["architectures"] = ["ExtraLlamaForCausalLM"]
    d = copy_with_weights(llama_dir, tmp_path / "m", lambda s: None)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="ExtraLlamaForCausalLM"):
        load_hf_config(ModelConfig(model=str(d), model_impl="native"))
    with pytest.raises(ModelLoadError, match="transformers has no class ExtraLlamaForCausalLM"):
        load_hf_config(ModelConfig(model=str(d)))
    install_fixtures(plugin_env, "engine-extra-model")
    plugins = PluginManager.from_env({"ENGINE_PLUGINS": "extramodel"})
    mc = ModelConfig(model=str(d))
    assert load_hf_config(mc, plugins=plugins) is mc.hf_config
    assert mc.architecture == "ExtraLlamaForCausalLM" and mc.implementation == "native"
    registry = ModelRegistry.with_plugins(plugins)
    model = load_model(mc, KERNELS, TorchReferenceBackend, registry=registry)
    assert type(model).__name__ == "LlamaForCausalLM"


def test_gguf_path_dispatches_to_gguf_loader(tmp_path, llama_dir, monkeypatch):
    """A .gguf path goes through engine.loader.gguf_loader's load_config/iter_weights (a fake
    stands in here; the real one is tested with the GGUF work)."""
    from transformers import AutoConfig

    calls = []
    fake = types.ModuleType("engine.loader.gguf_loader")

    def load_config(path):
        calls.append(("config", path))
        return AutoConfig.from_pretrained(llama_dir)

    def quantization_config(path):
        calls.append(("quantization", path))
        return {"quant_method": "gguf", "tensor_types": {}}

    def iter_weights(path, hf_config, dtype, stats=None, keep_quantized=None):
        calls.append(("weights", path, dtype))
        yield from load_file(llama_dir / "model.safetensors").items()

    fake.load_config = load_config
    fake.quantization_config = quantization_config
    fake.iter_weights = iter_weights
    fake.num_tensors = lambda path: len(
        load_file(llama_dir / "model.safetensors")
    )  # the bar's total
    monkeypatch.setitem(sys.modules, "engine.loader.gguf_loader", fake)
    import engine.loader

    monkeypatch.setattr(engine.loader, "gguf_loader", fake, raising=False)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    model = load(gguf, dtype="float32")
    assert [c[0] for c in calls] == ["config", "quantization", "weights"]
    assert calls[2][2] == torch.float32
    assert torch.equal(
        dict(model.named_parameters())["model.norm.weight"],
        load_file(llama_dir / "model.safetensors")["model.norm.weight"],
    )


def test_corrupt_shard_is_named(tmp_path, llama_dir):
    d = copy_with_weights(llama_dir, tmp_path / "m", lambda s: None)
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00not a header")
    with pytest.raises(ModelLoadError, match="cannot read safetensors file .*model.safetensors"):
        load(d)


def test_index_listing_a_missing_shard(tmp_path, llama_dir):
    d = copy_with_weights(llama_dir, tmp_path / "m", lambda s: None)
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors"):
        load(d)
