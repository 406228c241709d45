"""``engine serve ORG/NAME`` as with vLLM: the command downloads the model from the Hub once,
before its engine core and front end start, and serves it under the id it was given."""

from __future__ import annotations

import httpx
from hub_helpers import FakeHub, repo_files
from server_harness import ServeProcess

SHA = "c" * 40


def test_serve_a_hub_id(tiny_model_dir, tmp_path, monkeypatch):
    hub = FakeHub({"org/tiny": {SHA: {**repo_files(tiny_model_dir), "README.md": b"x"}}})
    cache = tmp_path / "cache"
    try:
        # The server's processes read these at import, as huggingface_hub does on any machine.
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        with ServeProcess(
            "org/tiny", tmp_path / "server.log", "--download-dir", str(cache), "--revision", SHA
        ) as server:
            models = httpx.get(server.base_url + "/v1/models", timeout=10).json()
            assert [m["id"] for m in models["data"]] == ["tiny"]  # --served-model-name
            r = httpx.post(
                server.base_url + "/v1/completions",
                json={"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0},
                timeout=60,
            )
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4
            log = server.log()
        assert "downloading model org/tiny at revision" in log
        # Downloaded once, by the command, before the engine core started.
        assert [p for m, p in hub.requests if m == "GET" and p.endswith("/model.safetensors")] == [
            f"/org/tiny/resolve/{SHA}/model.safetensors"
        ]
        assert (cache / "models--org--tiny" / "snapshots" / SHA / "config.json").is_file()
        assert "README.md" not in hub.downloaded()
    finally:
        hub.close()
