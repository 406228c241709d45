"""LoRA adapters through ``engine serve`` as users run it: two engine-core processes
(``--data-parallel-size 2``) behind ZMQ. The request's ``LoRARequest`` crosses the front
end -> core transport, ``--lora-modules`` and run-time loads (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``)
reach both cores, and every core serves an adapter with transformers' tokens (adapter merged)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_harness import ServeProcess, metric_values

from engine.testing.lora import hf_greedy, make_peft_adapter, merged_model

PROMPTS = [[1, 40, 41, 42, 43, 44, 45], [1, 50, 51, 52], [1, 7, 8, 9, 10, 11], [1, 60, 61]]
NEW = 6


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-dp-adapters")
    return {
        "static": make_peft_adapter(tiny_model_dir, root / "static", rank=8, seed=21),
        "dyn": make_peft_adapter(
            tiny_model_dir, root / "dyn", rank=4, seed=22, targets=["q_proj", "down_proj"]
        ),
    }


@pytest.fixture(scope="module")
def want(tiny_model_dir, adapters):
    """transformers' greedy tokens per (adapter, prompt); None: the base model."""
    out = {}
    for name in (None, "static", "dyn"):
        model = merged_model(tiny_model_dir, adapters[name] if name else None)
        out[name] = [hf_greedy(model, p, NEW) for p in PROMPTS]
    return out


@pytest.fixture(scope="module")
def server(tiny_model_dir, adapters, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    log = tmp_path_factory.mktemp("serve-lora-dp") / "server.log"
    flags = (
        "--data-parallel-size", "2",
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
        "--lora-modules", f"static={adapters['static']}",
    )  # fmt: skip
    try:
        with ServeProcess(tiny_model_dir, log, *flags) as s:
            yield s
    finally:
        mp.undo()


def _tokens(base: str, model: str, prompt: list[int]) -> list[int]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": NEW,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    r = httpx.post(base + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return [int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]]


def _idle_metrics(base: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(base + "/metrics", timeout=10).text
        busy = sum(metric_values(text, "engine:num_requests_running").values()) + sum(
            metric_values(text, "engine:num_requests_waiting").values()
        )
        if busy == 0 or time.monotonic() > deadline:
            assert busy == 0, text
            return text
        time.sleep(0.05)


def _on_both_cores(base: str, model: str, want: list[list[int]]) -> None:
    """Concurrent requests (8 of them: the router spreads them over both cores) all give
    ``want``'s tokens, and both cores generated some of them."""
    before = metric_values(_idle_metrics(base), "engine:generation_tokens_total")
    jobs = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: _tokens(base, model, p), jobs))
    assert got == [want[i % len(PROMPTS)] for i in range(8)]
    after = metric_values(_idle_metrics(base), "engine:generation_tokens_total")
    assert len(after) == 2 and all(after[k] > before.get(k, 0) for k in after), (before, after)


def test_models_lists_the_lora_modules(server, adapters):
    data = httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"]
    by_id = {m["id"]: m for m in data}
    assert list(by_id) == ["tiny", "static"]
    assert by_id["static"]["parent"] == "tiny" and by_id["static"]["root"] == str(
        adapters["static"]
    )


def test_lora_modules_serve_on_every_core_with_transformers_tokens(server, want):
    assert want["static"] != want[None]
    _on_both_cores(server.base_url, "static", want["static"])
    _on_both_cores(server.base_url, "tiny", want[None])


def test_runtime_load_and_unload_reach_every_core(server, adapters, want):
    base = server.base_url
    r = httpx.post(
        base + "/v1/load_lora_adapter",
        json={"lora_name": "dyn", "lora_path": str(adapters["dyn"])},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert "dyn" in [m["id"] for m in httpx.get(base + "/v1/models").json()["data"]]
    _on_both_cores(base, "dyn", want["dyn"])
    # A bad adapter is refused by the cores with the reason; the server serves on.
    r = httpx.post(
        base + "/v1/load_lora_adapter",
        json={"lora_name": "bad", "lora_path": str(adapters["dyn"].parent / "missing")},
        timeout=60,
    )
    assert r.status_code == 400 and "does not exist" in r.json()["error"]["message"], r.text
    assert "bad" not in [m["id"] for m in httpx.get(base + "/v1/models").json()["data"]]
    r = httpx.post(base + "/v1/unload_lora_adapter", json={"lora_name": "dyn"}, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(
        base + "/v1/completions", json={"model": "dyn", "prompt": "x", "max_tokens": 2}, timeout=60
    )
    assert r.status_code == 404
    # Loaded again under the same name, both cores serve it again (the unload reached both:
    # a core still holding the old adapter would refuse the new id... or serve stale weights).
    r = httpx.post(
        base + "/v1/load_lora_adapter",
        json={"lora_name": "dyn", "lora_path": str(adapters["dyn"])},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    _on_both_cores(base, "dyn", want["dyn"])
    assert server.proc.poll() is None
