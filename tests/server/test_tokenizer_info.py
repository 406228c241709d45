"""``GET /tokenizer_info`` (vLLM's route, issue 11 item 10): what lm-evaluation-harness's
remote tokenizer reads from a server (``tokenizer_backend=remote``): the special tokens, the
chat template, then ``/tokenize`` and ``/detokenize`` for the rest."""

from __future__ import annotations

import httpx
import pytest
from server_harness import RunningServer, engine_config, error_of

from engine.server.app import ServerOptions


@pytest.fixture(scope="module")
def info_server(tiny_model_dir):
    from engine.engine_core.core import EngineCore

    options = ServerOptions(enable_tokenizer_info_endpoint=True)
    with RunningServer(lambda: EngineCore.from_config(engine_config(tiny_model_dir)), options) as s:
        with httpx.Client(base_url=s.base_url, timeout=60) as http:
            yield s, http


def test_tokenizer_info_has_what_lm_eval_reads(info_server):
    server, http = info_server
    tokenizer = server.server.state.ctx.tokenizer
    r = http.get("/tokenizer_info")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    info = r.json()
    assert info["eos_token"] == "</s>" and info["bos_token"] == "<s>"
    assert info["pad_token"] == "<pad>" and info["unk_token"] == "<unk>"
    assert info["chat_template"] == tokenizer.chat_template
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert not {"vocab_file", "merges_file", "tokenizer_file"} & set(info)
    # The added tokens come as their text, keyed by id.
    assert info["added_tokens_decoder"]["2"] == "</s>"


def test_remote_tokenizer_round_trip(info_server):
    """lm-eval's RemoteTokenizer: eos_token_id is /tokenize of the eos text (no specials), the
    chat template renders locally with jinja, and must give the server's own prompt."""
    import jinja2

    _, http = info_server
    info = http.get("/tokenizer_info").json()
    assert "eos_token" in info  # lm-eval's check_remote_tokenizer_support
    eos = http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False})
    assert eos.json()["tokens"] == [2]
    messages = [{"role": "user", "content": "Hi there"}]
    local = jinja2.Environment().from_string(info["chat_template"])
    text = local.render(messages=messages, add_generation_prompt=True)
    ids = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    served = http.post("/tokenize", json={"messages": messages}).json()
    assert ids["tokens"] == served["tokens"]
    assert http.post("/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"] == text


def test_tokenizer_info_is_off_by_default(http):
    err = error_of(http.get("/tokenizer_info"), 404)
    assert "--enable-tokenizer-info-endpoint" in err["message"]
    assert "/tokenizer_info" not in http.get("/openapi.json").json()["paths"]


def test_enable_tokenizer_info_endpoint_flag():
    from engine.cli.main import build_parser

    assert build_parser().parse_args(["serve", "/m"]).enable_tokenizer_info_endpoint is False
    args = build_parser().parse_args(["serve", "/m", "--enable-tokenizer-info-endpoint"])
    assert args.enable_tokenizer_info_endpoint is True
