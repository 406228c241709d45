"""Run-time LoRA loads with several front ends and several engine cores (``engine serve
--api-server-count 2 --data-parallel-size 2``): the cores' adapters are what every front end
serves, and a load that some cores refuse is undone on the others.

Which front end answers is the kernel's choice (``SO_REUSEPORT``), so the test opens
keep-alive connections until two different front-end processes own one each (``psutil``
tells which process holds the server side of a connection), then drives each front end
through its own connection.

The partial-load failure is injected honestly, without a hook in the product: the server runs
with a ``sitecustomize.py`` on ``PYTHONPATH`` that, only in the process ``engine-core-1``,
makes the registry refuse adapters whose directory holds a file ``REFUSE_ON_CORE_1`` (as a
core whose disk lacks a file would). Core 0 loads them.
"""

from __future__ import annotations

import http.client
import json
import time

import psutil
import pytest
from server_harness import ServeProcess, metric_values

from engine.testing.lora import hf_greedy, make_peft_adapter, merged_model

PROMPTS = [[1, 40, 41, 42, 43, 44, 45], [1, 50, 51, 52], [1, 7, 8, 9, 10, 11]]
NEW = 6

SITECUSTOMIZE = """
import sys

if sys.argv[-1:] == ["engine-core-1"]:  # the spawned engine core 1 only (its ps name)
    import os

    import engine.lora.registry as registry
    from engine.lora.errors import LoRAAdapterError

    _add = registry.LoRARegistry.add

    def add(self, request, unique_name=False):
        if os.path.exists(os.path.join(request.lora_path, "REFUSE_ON_CORE_1")):
            raise LoRAAdapterError(f"injected: core 1 cannot read {request.lora_path}")
        return _add(self, request, unique_name)

    registry.LoRARegistry.add = add
"""


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-fe-adapters")
    out = {
        "dyn": make_peft_adapter(tiny_model_dir, root / "dyn", rank=4, seed=31),
        "other": make_peft_adapter(
            tiny_model_dir, root / "other", rank=8, seed=32, targets=["q_proj", "down_proj"]
        ),
        "refused": make_peft_adapter(tiny_model_dir, root / "refused", rank=4, seed=33),
    }
    (out["refused"] / "REFUSE_ON_CORE_1").write_text("")
    return out


@pytest.fixture(scope="module")
def want(tiny_model_dir, adapters):
    """transformers' greedy tokens (adapter merged) per adapter and prompt; None: base."""
    out = {}
    for name in (None, "dyn", "other"):
        model = merged_model(tiny_model_dir, adapters[name] if name else None)
        out[name] = [hf_greedy(model, p, NEW) for p in PROMPTS]
    return out


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    inject = tmp_path_factory.mktemp("inject")
    (inject / "sitecustomize.py").write_text(SITECUSTOMIZE)
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    mp.setenv("PYTHONPATH", str(inject))
    log = tmp_path_factory.mktemp("serve-lora-fe") / "server.log"
    flags = (
        "--api-server-count", "2", "--data-parallel-size", "2",
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
    )  # fmt: skip
    try:
        with ServeProcess(tiny_model_dir, log, *flags) as s:
            yield s
    finally:
        mp.undo()


class FrontEnd:
    """One keep-alive connection, owned by one front-end process."""

    def __init__(self, conn: http.client.HTTPConnection, pid: int) -> None:
        self.conn, self.pid = conn, pid

    def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": "application/json"}
        self.conn.request(method, path, body=data, headers=headers)
        r = self.conn.getresponse()
        text = r.read().decode()
        try:
            return r.status, json.loads(text)
        except json.JSONDecodeError:
            return r.status, {"text": text}

    def models(self) -> list[str]:
        status, body = self.request("GET", "/v1/models")
        assert status == 200, body
        return [m["id"] for m in body["data"]]

    def tokens(self, model: str, prompt: list[int]) -> tuple[int, list[int] | dict]:
        status, body = self.request(
            "POST",
            "/v1/completions",
            {
                "model": model,
                "prompt": prompt,
                "max_tokens": NEW,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": 0,
                "return_tokens_as_token_ids": True,
            },
        )
        if status != 200:
            return status, body
        toks = body["choices"][0]["logprobs"]["tokens"]
        return status, [int(t.removeprefix("token_id:")) for t in toks]

    def all_tokens(self, model: str) -> list[list[int]]:
        got = []
        for p in PROMPTS:
            status, toks = self.tokens(model, p)
            assert status == 200, toks
            got.append(toks)
        return got


def _owner(server: ServeProcess, local_port: int) -> int | None:
    for proc in server.descendants():
        try:
            for c in proc.net_connections(kind="tcp"):
                if c.laddr and c.laddr.port == server.port and c.raddr:
                    if c.raddr.port == local_port:
                        return proc.pid
        except psutil.Error:
            continue
    return None


@pytest.fixture(scope="module")
def front_ends(server):
    """Two connections, one to each front-end process."""
    by_pid: dict[int, FrontEnd] = {}
    extra = []
    for _ in range(64):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        conn.connect()
        pid = _owner(server, conn.sock.getsockname()[1])
        if pid is None or pid in by_pid:
            extra.append(conn)
            continue
        by_pid[pid] = FrontEnd(conn, pid)
        if len(by_pid) == 2:
            break
    for conn in extra:
        conn.close()
    assert len(by_pid) == 2, "never reached the second front end"
    yield list(by_pid.values())
    for fe in by_pid.values():
        fe.conn.close()


def _assert_idle_without_leaked_blocks(fe: FrontEnd, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        fe.conn.request("GET", "/metrics")
        text = fe.conn.getresponse().read().decode()
        busy = sum(metric_values(text, "engine:num_requests_running").values()) + sum(
            metric_values(text, "engine:num_requests_waiting").values()
        )
        usage = metric_values(text, "engine:kv_cache_usage_perc")
        if (busy == 0 and not any(usage.values())) or time.monotonic() > deadline:
            assert busy == 0 and len(usage) == 2 and not any(usage.values()), text
            return
        time.sleep(0.05)


def test_a_load_through_one_front_end_is_served_by_every_front_end(front_ends, adapters, want):
    a, b = front_ends
    assert want["dyn"] != want[None]
    status, body = a.request(
        "POST", "/v1/load_lora_adapter", {"lora_name": "dyn", "lora_path": str(adapters["dyn"])}
    )
    assert status == 200, body
    # Right after A answered, B serves it (B did not know the name: it asks the cores).
    assert b.all_tokens("dyn") == want["dyn"]
    assert a.all_tokens("dyn") == want["dyn"]
    assert "dyn" in a.models() and "dyn" in b.models()
    # Unloaded through B: A, which still has the name cached, gets 404 from the cores.
    status, body = b.request("POST", "/v1/unload_lora_adapter", {"lora_name": "dyn"})
    assert status == 200, body
    status, body = a.tokens("dyn", PROMPTS[0])
    assert status == 404 and body["error"]["code"] == "model_not_found", body
    assert "dyn" not in a.models() and "dyn" not in b.models()
    status, body = a.request("POST", "/v1/unload_lora_adapter", {"lora_name": "dyn"})
    assert status == 404, body
    # Loaded again through B from another directory (a new id): A serves the new adapter
    # although its cached entry has the old id and path.
    status, body = a.request(
        "POST", "/v1/load_lora_adapter", {"lora_name": "dyn", "lora_path": str(adapters["dyn"])}
    )
    assert status == 200, body
    status, body = b.request("POST", "/v1/unload_lora_adapter", {"lora_name": "dyn"})
    assert status == 200, body
    status, body = b.request(
        "POST", "/v1/load_lora_adapter", {"lora_name": "dyn", "lora_path": str(adapters["other"])}
    )
    assert status == 200, body
    assert a.all_tokens("dyn") == want["other"]
    # Loading a name another front end loaded is refused, as through one front end.
    status, body = a.request(
        "POST", "/v1/load_lora_adapter", {"lora_name": "dyn", "lora_path": str(adapters["dyn"])}
    )
    assert status == 400 and "already been loaded" in body["error"]["message"], body
    assert b.all_tokens("tiny") == want[None]
    status, body = a.request("POST", "/v1/unload_lora_adapter", {"lora_name": "dyn"})
    assert status == 200, body
    _assert_idle_without_leaked_blocks(a)


def test_a_load_refused_by_one_core_is_undone_on_the_others(server, front_ends, adapters, want):
    a, b = front_ends
    status, body = a.request(
        "POST",
        "/v1/load_lora_adapter",
        {"lora_name": "part", "lora_path": str(adapters["refused"])},
    )
    assert status == 400, body
    message = body["error"]["message"]
    assert "engine core 1 (of 2) refused it" in message and "injected" in message, message
    assert "unloaded from them again" in message, message
    for fe in (a, b):
        assert "part" not in fe.models()
        status, body = fe.tokens("part", PROMPTS[0])
        assert status == 404, body
    # Core 0 really dropped it: the name loads again from a good directory on both cores
    # (core 0 would refuse a name it still held under the failed load's id).
    status, body = b.request(
        "POST", "/v1/load_lora_adapter", {"lora_name": "part", "lora_path": str(adapters["dyn"])}
    )
    assert status == 200, body
    assert a.all_tokens("part") == want["dyn"]
    # An in-place reload refused by core 1: core 0 goes back to the adapter it had.
    status, body = a.request(
        "POST",
        "/v1/load_lora_adapter",
        {"lora_name": "part", "lora_path": str(adapters["refused"]), "load_inplace": True},
    )
    assert status == 400 and "previous adapter" in body["error"]["message"], body
    for fe in (a, b):
        assert fe.all_tokens("part") == want["dyn"]
    status, body = b.request("POST", "/v1/unload_lora_adapter", {"lora_name": "part"})
    assert status == 200, body
    _assert_idle_without_leaked_blocks(b)
    assert server.proc.poll() is None
