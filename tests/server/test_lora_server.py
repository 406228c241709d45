"""LoRA adapters through the HTTP server: ``--lora-modules`` adapters listed with their parent,
requests picking an adapter by ``model`` (tokens equal transformers with the adapter merged),
an unknown name a 404 listing every served name, run-time loading behind
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (a bad adapter a 400 with the reason, the server serving
on), and unloading with requests in flight (they finish first)."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from server_harness import API_KEY, RunningServer, engine_config

from engine.lora.config import LoRAConfig
from engine.server.app import ServerOptions, build_app
from engine.server.models import LoRAModulePath
from engine.server.serving import ServingOptions
from engine.testing.lora import hf_greedy, make_peft_adapter, merged_model

PROMPT = [1, 40, 41, 42, 43, 44, 45]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-adapters")
    return {
        "static": make_peft_adapter(tiny_model_dir, root / "static", rank=8, seed=11),
        "dyn": make_peft_adapter(
            tiny_model_dir, root / "dyn", rank=4, seed=12, targets=["q_proj", "down_proj"]
        ),
        "big": make_peft_adapter(
            tiny_model_dir, root / "big", rank=32, seed=13, targets=["o_proj"]
        ),
        "other": make_peft_adapter(tiny_model_dir, root / "other", rank=4, seed=14),
    }


@pytest.fixture(scope="module")
def lora_server(tiny_model_dir, adapters):
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    from engine.engine_core.core import EngineCore

    def factory():
        return EngineCore.from_config(
            engine_config(tiny_model_dir, lora=LoRAConfig(max_loras=2, max_lora_rank=16))
        )

    serving = ServingOptions(
        lora_modules=[LoRAModulePath("static", str(adapters["static"]), base_model_name="tiny")]
    )
    try:
        with RunningServer(factory, ServerOptions(api_keys=[API_KEY], serving=serving)) as s:
            yield s
    finally:
        mp.undo()


@pytest.fixture()
def lhttp(lora_server):
    with httpx.Client(
        base_url=lora_server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
    ) as client:
        yield client


def _tokens(http, model, max_tokens=8, prompt=PROMPT):
    r = http.post(
        "/v1/completions",
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]


def test_models_list_adapters_with_their_parent(lora_server, adapters):
    client = openai.OpenAI(base_url=lora_server.base_url + "/v1", api_key=API_KEY, max_retries=0)
    models = {m.id: m for m in client.models.list().data}
    assert list(models)[:2] == ["tiny", "static"]
    assert models["static"].model_extra["parent"] == "tiny"
    assert models["static"].model_extra["root"] == str(adapters["static"])
    assert models["tiny"].model_extra["parent"] is None


def test_requests_pick_the_adapter_by_model(lora_server, lhttp, tiny_model_dir, adapters):
    base = hf_greedy(merged_model(tiny_model_dir, None), PROMPT, 8)
    want = hf_greedy(merged_model(tiny_model_dir, adapters["static"]), PROMPT, 8)
    assert want != base
    assert _tokens(lhttp, "static") == want
    assert _tokens(lhttp, "tiny") == base
    # Chat picks it the same way (the reply's model names the adapter).
    r = lhttp.post(
        "/v1/chat/completions",
        json={"model": "static", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    )
    assert r.status_code == 200 and r.json()["model"] == "static"


def test_unknown_model_is_a_404_listing_every_served_name(lhttp):
    r = lhttp.post("/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "Served models: tiny, static" in err["message"]


def test_load_unload_at_run_time(lora_server, lhttp, tiny_model_dir, adapters, tmp_path):
    r = lhttp.post(
        "/v1/load_lora_adapter", json={"lora_name": "dyn", "lora_path": str(adapters["dyn"])}
    )
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'dyn' added successfully."
    assert "dyn" in [m["id"] for m in lhttp.get("/v1/models").json()["data"]]
    want = hf_greedy(merged_model(tiny_model_dir, adapters["dyn"]), PROMPT, 8)
    assert _tokens(lhttp, "dyn") == want
    r = lhttp.post(
        "/v1/load_lora_adapter", json={"lora_name": "dyn", "lora_path": str(adapters["dyn"])}
    )
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]

    r = lhttp.post("/v1/unload_lora_adapter", json={"lora_name": "dyn"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'dyn' removed successfully."
    r = lhttp.post("/v1/completions", json={"model": "dyn", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 404
    r = lhttp.post("/v1/unload_lora_adapter", json={"lora_name": "dyn"})
    assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]
    engine = lora_server.engine
    assert 1 in engine.list_loras() and len(engine.list_loras()) == 1  # only "static"


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("rank", "rank 32, more than --max-lora-rank 16"),
        ("module", "modules the model does not have as linear layers: qq_proj"),
        ("missing", "does not exist"),
        ("no-weights", "has no adapter_model.safetensors"),
    ],
)
def test_a_bad_adapter_is_a_400_with_the_reason_and_the_server_serves_on(
    lhttp, adapters, tmp_path, case, words
):
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path / case
    if case == "rank":
        path = adapters["big"]
    elif case == "module":
        shutil.copytree(adapters["other"], path)
        tensors = load_file(str(path / "adapter_model.safetensors"))
        save_file(
            {k.replace(".q_proj.", ".qq_proj."): v for k, v in tensors.items()},
            str(path / "adapter_model.safetensors"),
        )
    elif case == "no-weights":
        shutil.copytree(adapters["other"], path)
        (path / "adapter_model.safetensors").unlink()
    r = lhttp.post(
        "/v1/load_lora_adapter", json={"lora_name": f"bad-{case}", "lora_path": str(path)}
    )
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]
    assert f"bad-{case}" not in [m["id"] for m in lhttp.get("/v1/models").json()["data"]]
    assert len(_tokens(lhttp, "static", max_tokens=2)) == 2  # still serving


def test_unloading_finishes_requests_in_flight_first(lora_server, lhttp, tiny_model_dir, adapters):
    r = lhttp.post(
        "/v1/load_lora_adapter", json={"lora_name": "inflight", "lora_path": str(adapters["other"])}
    )
    assert r.status_code == 200
    want = hf_greedy(merged_model(tiny_model_dir, adapters["other"]), PROMPT, 200)
    engine = lora_server.engine
    # What the engine held when the unload reached it (it runs on the engine thread).
    seen = {}
    remove = engine.remove_lora

    def recording_remove(lora_int_id):
        seen["in_flight"] = engine.lora.in_flight(lora_int_id)
        return remove(lora_int_id)

    engine.remove_lora = recording_remove
    results: dict[str, list[int]] = {}

    def long_request():
        with httpx.Client(
            base_url=lora_server.base_url,
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=120,
        ) as c:
            results["tokens"] = _tokens(c, "inflight", max_tokens=200)

    thread = threading.Thread(target=long_request)
    try:
        thread.start()
        deadline = time.monotonic() + 30
        while not engine.scheduler.running and time.monotonic() < deadline:
            time.sleep(0.002)  # unload once the request runs on the adapter
        r = lhttp.post("/v1/unload_lora_adapter", json={"lora_name": "inflight"})
        assert r.status_code == 200
        thread.join(120)
    finally:
        engine.remove_lora = remove
    assert seen["in_flight"] == 1
    assert results["tokens"] == want  # finished on the adapter, to the last token
    assert len(engine.runner.lora.registered()) == 1  # unloaded after it: only "static" left
    assert engine.num_used_blocks == 0


def test_routes_need_the_environment_variable(monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    paths = {route.path for route in build_app(ServerOptions()).routes}
    assert "/v1/load_lora_adapter" not in paths and "/v1/models" in paths
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    paths = {route.path for route in build_app(ServerOptions()).routes}
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= paths


def test_serve_flags_parse_lora_modules_both_ways():
    from engine.cli.args import engine_config_from_args
    from engine.cli.main import build_parser
    from engine.config import ConfigError

    parser = build_parser()
    args = parser.parse_args(
        ["serve", "m", "--enable-lora", "--max-loras", "4", "--max-lora-rank", "64",
         "--max-cpu-loras", "8", "--lora-modules", "sql=/adapters/sql",
         '{"name": "chat", "path": "/adapters/chat", "base_model_name": "m"}']
    )  # fmt: skip
    assert args.lora_modules == [
        {"name": "sql", "path": "/adapters/sql", "base_model_name": None},
        {"name": "chat", "path": "/adapters/chat", "base_model_name": "m"},
    ]
    lora = engine_config_from_args(args).lora
    assert (lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras) == (4, 64, 8)
    for bad in ("sql", "=x", '{"name": "a"}', '{"name": "a", "path": "p", "rank": 3}', "{oops"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "m", "--enable-lora", "--lora-modules", bad])
    with pytest.raises(ConfigError, match="--max-loras need --enable-lora"):
        engine_config_from_args(parser.parse_args(["serve", "m", "--max-loras", "3"]))
    with pytest.raises(ConfigError, match="max_cpu_loras .2. must be >= max_loras .4."):
        engine_config_from_args(
            parser.parse_args(
                ["serve", "m", "--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"]
            )
        )
    assert engine_config_from_args(parser.parse_args(["serve", "m"])).lora is None
