"""``engine serve`` on a CUDA GPU: the engine core in its own process on the device, outputs
through the process boundary identical to the offline engine's, a clean stop."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from engine import LLM, SamplingParams
from engine.testing.tiny_models import build_tiny_model

pytestmark = pytest.mark.gpu


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("api_servers", [1, 2])
def test_served_greedy_tokens_equal_offline_on_the_gpu(tmp_path, api_servers):
    model = str(build_tiny_model(tmp_path / "m", "qwen3"))
    # Caches sized by block count: test files run side by side on one GPU (run_all.sh).
    flags = ["--dtype", "float32", "--max-model-len", "512", "--num-gpu-blocks-override", "512"]
    prompts = [[10 + (7 * i + j) % 290 for j in range(5 + 9 * i)] for i in range(8)]
    offline = LLM(model, dtype="float32", max_model_len=512, num_gpu_blocks_override=512)
    want = [
        o.outputs[0].token_ids
        for o in offline.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
            use_tqdm=False,
        )
    ]
    del offline
    port = _free_port()
    cmd = [sys.executable, "-c", "from engine.cli.main import main; raise SystemExit(main())",
           "serve", model, "--port", str(port), "--api-server-count", str(api_servers), *flags]  # fmt: skip
    log = open(tmp_path / "serve.log", "w+")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None and time.monotonic() < deadline, open(log.name).read()
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        for prompt, tokens in zip(prompts, want, strict=True):
            body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                    "logprobs": 0, "return_tokens_as_token_ids": True}  # fmt: skip
            got = []
            with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True},
                              timeout=60) as r:  # fmt: skip
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        for t in json.loads(line[6:])["choices"][0]["logprobs"]["tokens"]:
                            got.append(int(t.removeprefix("token_id:")))
            assert got == tokens
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
