"""Failures of multi-process engines: noticed within 2 seconds, loud, nothing left running.

* a worker killed (SIGKILL) while the engine is idle: the failure callback fires, the engine's
  health check raises, the other worker is killed and reaped;
* a worker that raises in a step: the step raises ``WorkerFailedError`` with its message;
* the engine process killed: the kernel kills its workers (``PR_SET_PDEATHSIG``);
* the HTTP server: a worker killed mid-stream ends the stream with an error and turns
  ``/health`` to 503 (the engine's dead-engine path);
* layouts that cannot run fail at start, before any worker starts, saying what is allowed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import psutil
import pytest

from engine import LLM, SamplingParams
from engine.config import ConfigError, ParallelConfig
from engine.executor import WorkerFailedError
from engine.runtime import check_parallel_config, tensor_parallel_sizes
from engine.testing.tiny_models import build_tiny_model, tiny_config

DEADLINE_S = 2.0  # the bound for noticing a dead worker


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def worker_pids(llm: LLM) -> list[int]:
    return [w["pid"] for w in llm.llm_engine.runner.workers]


def _states(pids: list[int]) -> dict[int, str]:
    """Each pid's process status, or "gone"."""
    states = {}
    for pid in pids:
        try:
            states[pid] = psutil.Process(pid).status()
        except psutil.NoSuchProcess:
            states[pid] = "gone"
    return states


def wait_gone(pids: list[int], timeout: float = DEADLINE_S, *, orphans: bool = False) -> list[int]:
    """The pids still alive after up to ``timeout`` seconds. Zombies count as alive, except
    for ``orphans``: once their parent is dead, reaping them falls to the machine's init
    process, which neither the engine nor the test controls (a busy CI machine's PID 1 left
    one unreaped past the deadline), so there a zombie counts as exited."""
    deadline = time.monotonic() + timeout
    while True:
        if orphans:
            alive = [p for p, s in _states(pids).items() if s not in ("gone", psutil.STATUS_ZOMBIE)]
        else:
            alive = [p for p in pids if psutil.pid_exists(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.02)


def test_worker_killed_while_idle_is_noticed_and_nothing_is_left(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", max_model_len=128, tensor_parallel_size=2)
    engine = llm.llm_engine
    pids = worker_pids(llm)
    noticed = threading.Event()
    engine.set_failure_callback(noticed.set)
    engine.check_health()  # healthy
    try:
        killed_at = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        assert noticed.wait(DEADLINE_S), "the failure was not noticed within 2 s"
        assert time.monotonic() - killed_at < DEADLINE_S
        with pytest.raises(
            WorkerFailedError, match=r"worker rank 1 \(pid \d+\) was killed by SIGKILL"
        ):
            engine.check_health()
        assert wait_gone(pids) == []  # the other rank is killed too, and both are reaped
        with pytest.raises(WorkerFailedError):  # and the engine refuses work at once
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2))
    finally:
        engine.shutdown()


def test_worker_exception_in_a_step_fails_the_request_with_its_message(llama_dir):
    llm = LLM(
        str(llama_dir),
        dtype="float32",
        max_model_len=128,
        tensor_parallel_size=1,
        distributed_executor_backend="mp",  # one worker process
    )
    engine = llm.llm_engine
    pids = worker_pids(llm)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        engine.add_request("r", None, params, prompt_token_ids=[5, 6, 7, 8])
        engine.step()  # the request is running
        engine.runner.collective_rpc("inject_step_failure")
        start = time.monotonic()
        with pytest.raises(WorkerFailedError, match="a failure injected into rank 0's step"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - start < DEADLINE_S
        assert wait_gone(pids) == []
    finally:
        engine.shutdown()


def test_killing_the_engine_process_kills_its_workers(llama_dir, tmp_path):
    script = tmp_path / "engine_proc.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import json, sys, time
            from engine import LLM
            llm = LLM({str(llama_dir)!r}, dtype="float32", max_model_len=128,
                      tensor_parallel_size=2)
            print(json.dumps([w["pid"] for w in llm.llm_engine.runner.workers]), flush=True)
            time.sleep(600)
            """
        )
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        pids = json.loads(proc.stdout.readline())
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
        proc.kill()
        proc.wait()
        left = wait_gone(pids, orphans=True)
        assert left == [], f"workers outlived their engine: {_states(left)}"
    finally:
        proc.kill()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_worker_killed_mid_stream_errors_and_the_server_exits_1(llama_dir, tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "w+")
    cmd = [
        sys.executable,
        "-c",
        "from engine.cli.main import main; raise SystemExit(main())",
        "serve",
        str(llama_dir),
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--tensor-parallel-size",
        "2",
        "--served-model-name",
        "tiny",
    ]
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, "the server exited during start-up"
            assert time.monotonic() < deadline, "the server did not become ready"
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        pids = [
            p.pid
            for p in psutil.Process(server.pid).children(recursive=True)
            if "engine.executor" in " ".join(p.cmdline())
        ]
        assert len(pids) == 2
        body = {
            "model": "tiny",
            "prompt": [5, 6, 7, 8],
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        lines: list[str] = []
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as response:
            assert response.status_code == 200
            killed_at = None
            for line in response.iter_lines():
                lines.append(line)
                if killed_at is None and line.startswith("data: {"):
                    killed_at = time.monotonic()  # tokens are flowing: kill a worker now
                    os.kill(pids[1], signal.SIGKILL)
            ended_at = time.monotonic()
        assert killed_at is not None and ended_at - killed_at < DEADLINE_S
        errors = [json.loads(x[6:]) for x in lines if x.startswith("data: {") and '"error"' in x]
        assert errors and "worker rank 1" in errors[-1]["error"]["message"]
        # The engine core reported the failure and exited; the server answers 503 while it
        # flushes the failed responses, then exits 1 (docs/serving.md, "Failures").
        try:
            assert httpx.get(base + "/health", timeout=5).status_code == 503
        except httpx.TransportError:
            pass  # already gone
        assert server.wait(30) == 1
        assert wait_gone(pids) == []
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.seek(0)
        text = log.read()
    assert wait_gone(pids) == [], text[-3000:]


# ---- layouts refused at start ---------------------------------------------------------------
def test_tensor_parallel_size_that_does_not_split_the_heads_fails_at_start(llama_dir):
    before = set(psutil.Process().children(recursive=True))
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3 .*sizes that work: 1, 2, 4$"):
        LLM(str(llama_dir), dtype="float32", tensor_parallel_size=3)
    assert set(psutil.Process().children(recursive=True)) == before  # no worker started


def test_more_stages_than_layers_fails_at_start(llama_dir):
    with pytest.raises(
        ConfigError, match="pipeline_parallel_size=3 is more stages than the model's 2 layers"
    ):
        LLM(str(llama_dir), dtype="float32", pipeline_parallel_size=3)


class FakeGpuPlatform:
    name = "cuda"
    device_type = "cuda"

    @classmethod
    def device_count(cls) -> int:
        return 2


def test_more_ranks_than_devices_fails_with_what_fits():
    from engine.config import EngineConfig, ModelConfig

    hf = tiny_config("llama", num_attention_heads=8, num_key_value_heads=8)
    config = EngineConfig(model=ModelConfig(model=None), parallel=ParallelConfig(4, 1))
    with pytest.raises(
        ConfigError,
        match=r"4 ranks need 4 cuda devices, but this host has 2.*tensor_parallel_size=2.*ray",
    ):
        check_parallel_config(config, hf, FakeGpuPlatform)
    config.parallel = ParallelConfig(2, 1)
    check_parallel_config(config, hf, FakeGpuPlatform)  # fits
    config.parallel = ParallelConfig(4, 1, distributed_executor_backend="ray")
    # Ray may use other hosts' devices (Ray itself need not be installed for this check to
    # pass: pretend it is, as `tox -e ray` has it).
    real_find_spec = importlib.util.find_spec
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            importlib.util,
            "find_spec",
            lambda name, *a: object() if name == "ray" else real_find_spec(name, *a),
        )
        check_parallel_config(config, hf, FakeGpuPlatform)


def test_allowed_tensor_parallel_sizes_follow_heads_kv_heads_and_mlp():
    assert tensor_parallel_sizes(tiny_config("llama"), limit=8) == [1, 2, 4]  # 4 heads, 2 kv
    hf = tiny_config("llama", num_attention_heads=8, num_key_value_heads=2, intermediate_size=24)
    assert tensor_parallel_sizes(hf, limit=16) == [1, 2, 4, 8]
    hf = tiny_config(
        "llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=96
    )
    assert tensor_parallel_sizes(hf, limit=16) == [1, 3, 6]


def test_uni_executor_with_several_ranks_is_refused():
    with pytest.raises(ConfigError, match="'uni' runs one rank in this process"):
        ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ConfigError, match="choose one of uni, mp, ray"):
        ParallelConfig(distributed_executor_backend="threads")


def test_ray_backend_without_ray_says_how_to_install_it(monkeypatch):
    import importlib.util

    from engine.config import EngineConfig, ModelConfig

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a)
    )
    config = EngineConfig(
        model=ModelConfig(model=None),
        parallel=ParallelConfig(2, 1, distributed_executor_backend="ray"),
    )
    with pytest.raises(ConfigError, match=r"pip install 'engine-llm\[ray\]'"):
        check_parallel_config(config, tiny_config("llama"), FakeGpuPlatform)
