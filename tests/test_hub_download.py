"""Models, tokenizers and LoRA adapters named by Hugging Face Hub id: downloaded into the cache
(only the files the engine reads, at the asked revision) unless already there, and clear errors
for unknown repositories and revisions and for HF_HUB_OFFLINE without a cached copy. A local
HTTP server plays the Hub (``hub_helpers.FakeHub``); huggingface_hub downloads from it as from
huggingface.co."""

from __future__ import annotations

import pytest
from hub_helpers import FakeHub, repo_files, use_fake_hub
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.loader import ModelLoadError, resolve_model_path
from engine.testing.tiny_models import build_tiny_model

SHA_A = "a" * 40
SHA_B = "b" * 40


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture
def hub(model_dir, tmp_path, monkeypatch):
    """org/tiny-llama at two commits (main = SHA_A; SHA_B has other weights), with files the
    engine never reads beside the model's; org/tokenizer-only holds just the tokenizer."""
    files = repo_files(model_dir)
    other = tmp_path / "other"
    other.mkdir()
    state = load_file(model_dir / "model.safetensors")
    save_file({k: v * 0.5 for k, v in state.items()}, other / "model.safetensors")
    extra = {"README.md": b"# tiny", "original/consolidated.00.pth": b"\0" * 64}
    tokenizer = {k: v for k, v in files.items() if k.startswith(("tokenizer", "special_tokens"))}
    server = FakeHub(
        {
            "org/tiny-llama": {
                SHA_A: {**files, **extra},
                SHA_B: {**files, "model.safetensors": (other / "model.safetensors").read_bytes()},
            },
            "org/tokenizer-only": {SHA_A: tokenizer},
            "org/gguf-only": {SHA_A: {"model.Q4_K_M.gguf": b"GGUF", "README.md": b"x"}},
            "org/gated": "gated",
        }
    )
    use_fake_hub(monkeypatch, server, tmp_path / "hub-cache")
    yield server
    server.close()


def _greedy(llm: LLM) -> list[int]:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [5, 17, 42, 9]}], params, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def test_a_hub_id_downloads_what_the_engine_reads_and_serves_like_the_directory(hub, model_dir):
    llm = LLM(model="org/tiny-llama", max_model_len=128, num_gpu_blocks_override=32)
    got = _greedy(llm)
    assert llm.llm_engine.config.model.served_model_name == "org/tiny-llama"
    del llm
    want = _greedy(LLM(model=str(model_dir), max_model_len=128, num_gpu_blocks_override=32))
    assert got == want
    fetched = set(hub.downloaded())
    assert "model.safetensors" in fetched and "config.json" in fetched
    assert "tokenizer_config.json" in fetched
    assert not fetched & {"README.md", "original/consolidated.00.pth"}


def test_revision_pins_a_commit_and_a_cached_snapshot_needs_no_hub(hub):
    main = resolve_model_path("org/tiny-llama")
    pinned = resolve_model_path("org/tiny-llama", revision=SHA_B)
    assert main.name == SHA_A and pinned.name == SHA_B
    a = load_file(main / "model.safetensors")
    b = load_file(pinned / "model.safetensors")
    name = next(iter(a))
    assert bool((b[name] == a[name] * 0.5).all())
    hub.requests.clear()
    assert resolve_model_path("org/tiny-llama", revision=SHA_B) == pinned
    assert hub.requests == []  # complete in the cache: the Hub is not asked


def test_download_dir_and_dummy_weights(hub, tmp_path):
    target = tmp_path / "models"
    path = resolve_model_path("org/tiny-llama", download_dir=str(target), weights=False)
    assert path.is_relative_to(target)
    assert (path / "config.json").is_file()
    assert "model.safetensors" not in hub.downloaded()  # --load-format dummy reads no weights
    # A snapshot without weights is completed when weights are needed.
    again = resolve_model_path("org/tiny-llama", download_dir=str(target))
    assert again == path and (path / "model.safetensors").is_file()


def test_unknown_repository_and_revision_fail_with_the_reason(hub):
    with pytest.raises(ModelLoadError, match="no model 'org/nope' on the Hugging Face Hub"):
        resolve_model_path("org/nope")
    with pytest.raises(ModelLoadError, match="has no revision 'v9'"):
        resolve_model_path("org/tiny-llama", revision="v9")
    with pytest.raises(ModelLoadError, match="'org/gated' is gated.*HF_TOKEN"):
        resolve_model_path("org/gated")
    with pytest.raises(ModelLoadError, match="has no config.json and \\*.safetensors weights"):
        resolve_model_path("org/gguf-only")


def test_a_downloaded_model_restarts_offline(hub, monkeypatch):
    """main (SHA_A) holds files the engine never fetches (README.md, original/): the cached
    snapshot is still complete for it, with the Hub out of reach."""
    from huggingface_hub import constants

    path = resolve_model_path("org/tiny-llama")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub.requests.clear()
    assert resolve_model_path("org/tiny-llama") == path
    assert hub.requests == []


def test_offline_downloads_nothing_and_says_so(hub, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="not in the local Hugging Face cache.*HF_HUB_OFFLINE"):
        resolve_model_path("org/tiny-llama")
    assert hub.requests == []


def test_a_tokenizer_from_another_repository(hub, model_dir):
    from engine.tokenizer import load_tokenizer

    tok = load_tokenizer(ModelConfig(model=str(model_dir), tokenizer="org/tokenizer-only"))
    assert tok.encode("hello world") == load_tokenizer(ModelConfig(model=str(model_dir))).encode(
        "hello world"
    )
    assert "model.safetensors" not in hub.downloaded()


def test_a_lora_adapter_by_hub_id(model_dir, tmp_path, monkeypatch):
    from engine.lora.peft import resolve_adapter_path
    from engine.testing.lora import make_peft_adapter

    adapter = make_peft_adapter(model_dir, tmp_path / "adapter", rank=4)
    server = FakeHub({"org/sql-lora": {SHA_A: {**repo_files(adapter), "README.md": b"x"}}})
    try:
        use_fake_hub(monkeypatch, server, tmp_path / "hub-cache")
        path = resolve_adapter_path("org/sql-lora")
        assert (path / "adapter_config.json").is_file()
        assert any(path.glob("*.safetensors"))
        assert "README.md" not in server.downloaded()
    finally:
        server.close()


def test_cli_flags_reach_the_model_config():
    import argparse

    from engine.cli.args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    add_engine_args(parser)
    args = parser.parse_args(
        ["org/m", "--revision", "v1", "--tokenizer-revision", "t1", "--download-dir", "/d"]
    )
    config = engine_config_from_args(args).model
    assert (config.revision, config.tokenizer_revision, config.download_dir) == ("v1", "t1", "/d")


def test_a_snapshot_missing_shards_is_completed(model_dir, tmp_path, monkeypatch):
    """A download cut off between shards leaves a snapshot with some of them: the next start
    fetches the rest instead of failing in the loader."""
    import json

    from safetensors.torch import load_file, save_file

    state = load_file(model_dir / "model.safetensors")
    names = sorted(state)
    half = len(names) // 2
    shard_dir = tmp_path / "sharded"
    shard_dir.mkdir()
    parts = {"model-00001-of-00002.safetensors": names[:half],
             "model-00002-of-00002.safetensors": names[half:]}  # fmt: skip
    for file, keys in parts.items():
        save_file({k: state[k] for k in keys}, shard_dir / file)
    index = {"weight_map": {k: f for f, keys in parts.items() for k in keys}}
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    files = {k: v for k, v in repo_files(model_dir).items() if k != "model.safetensors"}
    files.update(repo_files(shard_dir))
    server = FakeHub({"org/sharded": {SHA_A: files}})
    try:
        use_fake_hub(monkeypatch, server, tmp_path / "hub-cache")
        path = resolve_model_path("org/sharded")
        shard = path / "model-00002-of-00002.safetensors"
        shard.resolve().unlink()  # the blob and its link: as if the download was cut off
        shard.unlink()
        server.requests.clear()
        assert resolve_model_path("org/sharded") == path
        assert server.downloaded() == ["model-00002-of-00002.safetensors"]
        assert shard.is_file()
    finally:
        server.close()
