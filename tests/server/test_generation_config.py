"""The model's generation_config.json: its EOS ids end generation, and its sampling settings
are the defaults of requests that leave them unset (offline and through the server), as in
vLLM's ``--generation-config auto``; ``vllm`` keeps only the EOS ids."""

from __future__ import annotations

import json
import logging
import shutil

import httpx
import pytest
from server_harness import RunningServer, engine_config

from engine import LLM, SamplingParams
from engine.config import ConfigError
from engine.server.app import ServerOptions
from engine.server.serving import ServingOptions

PROMPT = {"prompt_token_ids": [5, 9, 14, 22, 31, 40]}
RECOMMENDED = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
               "max_new_tokens": 5}  # fmt: skip


def _with_generation_config(src, dst, **fields):
    shutil.copytree(src, dst)
    path = dst / "generation_config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))
    return dst


def _llm(path, **kw) -> LLM:
    return LLM(model=str(path), dtype="float32", max_model_len=256, cpu_kv_cache_gb=0.05, **kw)


@pytest.fixture(scope="module")
def greedy(tiny_model_dir):
    """The tiny model's greedy continuation of PROMPT, and the first step whose token is new."""
    out = (
        _llm(tiny_model_dir)
        .generate(
            [PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    step = next(i for i in range(2, len(out)) if out[i] not in out[:i] and out[i] != 2)
    return out, step


@pytest.mark.parametrize("option", ["auto", "vllm"])
def test_generation_config_eos_ids_end_generation(tiny_model_dir, tmp_path, greedy, option):
    tokens, step = greedy
    model = _with_generation_config(tiny_model_dir, tmp_path / "m", eos_token_id=[2, tokens[step]])
    llm = _llm(model, generation_config=option)
    assert tokens[step] in llm.llm_engine.eos_token_ids
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    completion = out[0].outputs[0]
    assert completion.finish_reason == "stop"
    assert completion.token_ids[:step] == tokens[:step] and len(completion.token_ids) <= step + 1


def test_sampling_defaults_offline(tiny_model_dir, tmp_path):
    model = _with_generation_config(tiny_model_dir, tmp_path / "m", **RECOMMENDED)
    defaults = _llm(model).get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.6, 0.9, 20)
    assert (defaults.repetition_penalty, defaults.max_tokens) == (1.1, 5)
    out = _llm(model).generate([PROMPT] * 3, use_tqdm=False)  # no params: the defaults
    for request in out:
        c = request.outputs[0]
        assert len(c.token_ids) == 5 or c.finish_reason == "stop"
        assert len(c.token_ids) <= 5
    plain = _llm(model, generation_config="vllm").get_default_sampling_params()
    assert plain == SamplingParams()


def test_override_generation_config(tiny_model_dir, tmp_path):
    """vLLM's --override-generation-config: defaults over the file's, in its names; with
    --generation-config vllm the only ones; bad fields and values refused before loading."""
    model = _with_generation_config(tiny_model_dir, tmp_path / "m", **RECOMMENDED)
    llm = _llm(model, override_generation_config={"temperature": 0.0, "max_new_tokens": 3})
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens, defaults.top_k) == (0.0, 3, 20)
    [out] = llm.generate([PROMPT], use_tqdm=False)  # no params: the defaults, greedy now
    assert len(out.outputs[0].token_ids) <= 3
    only = _llm(model, generation_config="vllm", override_generation_config={"top_p": 0.5})
    assert only.get_default_sampling_params() == SamplingParams(top_p=0.5)
    with pytest.raises(ConfigError, match="unknown fields \\['max_tokens'\\]"):
        _llm(model, override_generation_config={"max_tokens": 3})
    with pytest.raises(ConfigError, match="--override-generation-config: .*temperature"):
        _llm(model, override_generation_config={"temperature": -1})


def test_hf_overrides(tiny_model_dir, caplog):
    """vLLM's --hf-overrides: fields set on the transformers config after it is read (here
    the context length the engine derives from it), nested objects into sub-configs."""
    from transformers import Gemma3Config

    from engine.loader.model_loader import apply_hf_overrides

    with caplog.at_level(logging.INFO, logger="engine.loader.model_loader"):
        llm = _llm(tiny_model_dir, hf_overrides={"max_position_embeddings": 384})
    assert llm.llm_engine.config.model.hf_config.max_position_embeddings == 384
    assert "hf_overrides: max_position_embeddings = 384" in caplog.text
    with pytest.raises(ConfigError, match="maximum context length \\(200\\)"):
        _llm(tiny_model_dir, hf_overrides={"max_position_embeddings": 200})
    config = Gemma3Config()
    apply_hf_overrides(config, {"text_config": {"sliding_window": 64}, "image_token_index": 7})
    assert config.text_config.sliding_window == 64 and config.image_token_index == 7


def test_override_flags_on_the_command_line():
    import argparse

    from engine.cli.args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    add_engine_args(parser)
    args = parser.parse_args(
        ["m", "--override-generation-config", '{"temperature": 0.6}', "--hf-overrides",
         '{"rope_theta": 1e6}']
    )  # fmt: skip
    model = engine_config_from_args(args).model
    assert model.override_generation_config == {"temperature": 0.6}
    assert model.hf_overrides == {"rope_theta": 1e6}
    with pytest.raises(ConfigError, match="unknown fields"):
        engine_config_from_args(
            parser.parse_args(["m", "--override-generation-config", '{"temp": 1}'])
        )
    with pytest.raises(SystemExit):  # argparse: not a JSON object
        parser.parse_args(["m", "--hf-overrides", "[1]"])


def test_a_generation_config_elsewhere_and_bad_options(tiny_model_dir, tmp_path):
    other = _with_generation_config(tiny_model_dir, tmp_path / "other", top_k=7)
    assert (
        _llm(tiny_model_dir, generation_config=str(other)).get_default_sampling_params().top_k == 7
    )
    with pytest.raises(ConfigError, match="is not a directory"):
        _llm(tiny_model_dir, generation_config=str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no generation_config.json"):
        _llm(tiny_model_dir, generation_config=str(tmp_path / "empty"))


def test_server_requests_default_to_the_model_settings(tiny_model_dir, tmp_path, caplog):
    from engine.engine_core.core import EngineCore

    model = _with_generation_config(tiny_model_dir, tmp_path / "m", **RECOMMENDED)
    options = ServerOptions(serving=ServingOptions(log_requests=True))
    with RunningServer(lambda: EngineCore.from_config(engine_config(model)), options) as running:
        with httpx.Client(base_url=running.base_url, timeout=60) as c:
            with caplog.at_level(logging.INFO, logger="engine.server.requests"):
                r = c.post("/v1/completions", json={"prompt": "hello there", "seed": 1})
                set_ = c.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 9,
                              "temperature": 0, "top_k": 3, "ignore_eos": True})  # fmt: skip
                chat = c.post("/v1/chat/completions",
                              json={"messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert r.status_code == set_.status_code == chat.status_code == 200
    assert r.json()["usage"]["completion_tokens"] <= 5
    assert chat.json()["usage"]["completion_tokens"] <= 5
    assert set_.json()["usage"]["completion_tokens"] == 9
    logged = [rec.getMessage() for rec in caplog.records if rec.name == "engine.server.requests"]
    assert "temperature=0.6" in logged[0] and "top_k=20" in logged[0]
    assert "repetition_penalty=1.1" in logged[0] and "max_tokens=5" in logged[0]
    assert "temperature=0.0" in logged[1] and "top_k=3" in logged[1] and "top_p=0.9" in logged[1]
    assert running.engine.num_used_blocks == 0
