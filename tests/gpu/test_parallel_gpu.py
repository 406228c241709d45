"""Tensor and pipeline parallelism on several CUDA GPUs (NCCL), against one GPU.

Tiny float32 models, mixed-length prompts with chunked prefill and a prefix hit: greedy tokens
must equal the single-GPU engine's with decode CUDA graphs captured on every rank (the
embedding's and row-parallel layers' all-reduces inside the graphs) and asynchronous
scheduling on (the GPU default: each rank feeds its sampled tokens back inside its graph);
also eager, PP=2 and TP=2 x PP=2 (4 GPUs). The KV cache is sized by memory profiling on every
rank (the smallest wins). A worker killed mid-request fails the request within 2 s and leaves no
process. Each test skips when the host has fewer GPUs than it needs.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import threading
import time

import psutil
import pytest
import torch

from engine import LLM, SamplingParams
from engine.executor import WorkerFailedError
from engine.testing.tiny_models import build_tiny_gemma3_multimodal, build_tiny_model

# Every test here needs two GPUs or more: skipping the module up front keeps a one-GPU run
# from building the single-GPU reference fixtures for nothing.
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more CUDA GPUs"),
]
NUM_NEW = 24


def needs_gpus(n: int) -> None:
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA GPUs, this host has {torch.cuda.device_count()}")


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma3"])
def tiny_model(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "gemma3":
        return str(build_tiny_gemma3_multimodal(root, seed=1))
    return str(build_tiny_model(root, request.param, seed=1))


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    lengths = [1, 3, 7, 16, 17, 40, 64, 100, 129, 200]
    prompts = [[rng.randrange(10, 300) for _ in range(n)] for n in lengths]
    prompts.append(prompts[8][:96] + [rng.randrange(10, 300) for _ in range(5)])  # prefix hit
    return prompts


def _takes_images(path: str) -> bool:
    return os.path.exists(os.path.join(path, "preprocessor_config.json"))


def _run(path: str, **kwargs):
    if kwargs.get("pipeline_parallel_size", 1) > 1 and _takes_images(path):
        kwargs["limit_mm_per_prompt"] = {"image": 0}  # images are refused under PP
    llm = LLM(path, dtype="float32", block_size=16, max_num_batched_tokens=256, **kwargs)
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    try:
        outs = llm.generate(_prompts(), params, use_tqdm=False)
        engine = llm.llm_engine
        assert engine.num_used_blocks == 0
        info = engine.runner.collective_rpc("describe") if engine.runner.name != "uni" else []
        return [o.outputs[0].token_ids for o in outs], info
    finally:
        llm.llm_engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def one_gpu_tokens(tiny_model):
    return _run(tiny_model)[0]


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_tp2_matches_one_gpu(tiny_model, one_gpu_tokens, enforce_eager):
    needs_gpus(2)
    tokens, info = _run(tiny_model, tensor_parallel_size=2, enforce_eager=enforce_eager)
    assert tokens == one_gpu_tokens
    graphs = [i["graphs"] for i in info]
    if enforce_eager:
        assert graphs == [None, None]
    else:
        assert all(graphs) and graphs[0] == graphs[1]  # captured on both ranks alike
    blocks = {i["num_blocks"] for i in info}
    assert len(blocks) == 1 and blocks.pop() > 0  # profiled per rank, the smallest kept


def test_tp2_with_images_matches_one_gpu(tiny_model):
    """Gemma 3 with images on two GPUs: the step message carries the images, each rank runs
    its shard of the vision tower; greedy tokens equal one GPU's."""
    if not _takes_images(tiny_model):
        pytest.skip("a text model")
    needs_gpus(2)
    import numpy as np
    from PIL import Image

    def image(seed):
        rng = np.random.default_rng(seed)
        return Image.fromarray(rng.integers(0, 256, (40, 70, 3), dtype=np.uint8))

    prompts = [
        {"prompt": "Compare <start_of_image> with <start_of_image>",
         "multi_modal_data": {"image": [image(1), image(2)]}},
        "A text prompt about the quick brown fox",
        {"prompt": "Again: <start_of_image>", "multi_modal_data": {"image": image(1)}},
    ]  # fmt: skip
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    got = {}
    for tp in (1, 2):
        llm = LLM(tiny_model, dtype="float32", block_size=16, tensor_parallel_size=tp)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            got[tp] = [o.outputs[0].token_ids for o in outs]
            assert llm.llm_engine.num_used_blocks == 0
        finally:
            llm.llm_engine.shutdown()
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    assert got[2] == got[1]


def test_pp2_matches_one_gpu(tiny_model, one_gpu_tokens):
    needs_gpus(2)
    tokens, info = _run(tiny_model, pipeline_parallel_size=2)
    assert tokens == one_gpu_tokens
    assert [i["pp_rank"] for i in info] == [0, 1]


def test_tp2_x_pp2_matches_one_gpu(tiny_model, one_gpu_tokens):
    needs_gpus(4)
    tokens, _ = _run(tiny_model, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert tokens == one_gpu_tokens


def test_worker_killed_mid_request_fails_within_two_seconds(tiny_model):
    needs_gpus(2)
    llm = LLM(tiny_model, dtype="float32", max_model_len=1024, tensor_parallel_size=2)
    engine = llm.llm_engine
    pids = [w["pid"] for w in engine.runner.workers]
    errors: list[BaseException] = []
    failed_at: list[float] = []

    def generate():
        params = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
        try:
            llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 4, params, use_tqdm=False)
        except BaseException as e:  # noqa: BLE001 - what the test checks
            failed_at.append(time.monotonic())
            errors.append(e)

    thread = threading.Thread(target=generate)
    thread.start()
    try:
        while engine.get_stats().generation_tokens_total < 40:
            time.sleep(0.005)
        killed_at = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        thread.join(10)
        assert not thread.is_alive(), "generate hangs after a worker died"
        assert errors and isinstance(errors[0], WorkerFailedError), errors
        assert failed_at[0] - killed_at < 2.0
    finally:
        engine.shutdown()
    deadline = time.monotonic() + 2
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(psutil.pid_exists(p) for p in pids)
