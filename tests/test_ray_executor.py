"""The Ray executor on a local Ray cluster this module starts (one node, CPUs only).

Marked ``ray``: starting Ray takes ~10 s, so these run in their own tox env (``tox -e ray``),
not in the default suite. Ray registers the node under the host's own address (it replaces
127.0.0.1 on purpose), so the engine's sockets bind there; nothing else is reached.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

ray = pytest.importorskip("ray")

from engine import LLM, SamplingParams  # noqa: E402
from engine.executor import WorkerFailedError  # noqa: E402
from engine.testing.tiny_models import build_tiny_model  # noqa: E402

pytestmark = pytest.mark.ray

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 75)), [3]]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=4)


def greedy(llm: LLM, max_tokens: int = 10):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_ray_tp2_gives_the_tokens_of_one_process(cluster, llama_dir):
    reference = LLM(str(llama_dir), dtype="float32", max_model_len=128)
    want = greedy(reference)
    llm = LLM(
        str(llama_dir),
        dtype="float32",
        max_model_len=128,
        tensor_parallel_size=2,
        max_num_batched_tokens=16,  # chunked prefill
        distributed_executor_backend="ray",
    )
    try:
        assert llm.llm_engine.runner.name == "ray"
        assert greedy(llm) == want
        assert llm.llm_engine.num_used_blocks == 0
    finally:
        llm.llm_engine.shutdown()


def test_ray_worker_killed_mid_request_fails_within_two_seconds(cluster, llama_dir):
    llm = LLM(
        str(llama_dir),
        dtype="float32",
        max_model_len=512,
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
    )
    engine = llm.llm_engine
    pids = [w["pid"] for w in engine.runner.workers]
    error: list[BaseException] = []
    failed_at: list[float] = []

    def generate():
        try:
            greedy(llm, max_tokens=400)
        except BaseException as e:  # noqa: BLE001 - what the test checks
            failed_at.append(time.monotonic())
            error.append(e)

    thread = threading.Thread(target=generate)
    thread.start()
    try:
        while engine.get_stats().generation_tokens_total < 8:  # mid-request
            time.sleep(0.01)
        killed_at = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        thread.join(10)
        assert not thread.is_alive(), "generate did not return after a worker died"
        assert error and isinstance(error[0], WorkerFailedError), error
        assert "worker rank 1" in str(error[0])
        assert failed_at[0] - killed_at < 2.0
    finally:
        engine.shutdown()
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), "a Ray worker outlived the executor"


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
