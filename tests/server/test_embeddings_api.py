"""``POST /v1/embeddings`` (OpenAI's shapes) on a pooling model: every input form, float and
base64 encodings, ``dimensions``, usage, the 400s of the wrong kind of model or route, no KV
block left in use, and the same vectors through ``engine serve``'s engine-core process."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
from server_harness import MAX_MODEL_LEN, RunningServer, ServeProcess, engine_config, error_of

from engine.testing.tiny_embedding_models import TEXTS, save_st_model


@pytest.fixture(scope="module")
def embed_dir(tmp_path_factory):
    return save_st_model(
        tmp_path_factory.mktemp("qwen3-embed"),
        "qwen3",
        "lasttoken",
        normalize=True,
        config_extra={"matryoshka_dimensions": [8, 16, 32]},
        max_position_embeddings=MAX_MODEL_LEN,
    )


@pytest.fixture(scope="module")
def offline_embed(embed_dir):
    from engine.llm import LLM

    llm = LLM.from_engine_config(engine_config(embed_dir))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def embed_server(embed_dir):
    from engine.engine_core.core import EngineCore

    with RunningServer(lambda: EngineCore.from_config(engine_config(embed_dir))) as running:
        yield running


@pytest.fixture()
def ehttp(embed_server):
    with httpx.Client(base_url=embed_server.base_url, timeout=60) as c:
        yield c


def _vectors(body: dict) -> list[list[float]]:
    assert body["object"] == "list" and body["model"] == "tiny"
    assert [d["index"] for d in body["data"]] == list(range(len(body["data"])))
    assert all(d["object"] == "embedding" for d in body["data"])
    return [d["embedding"] for d in body["data"]]


def test_every_input_form_equals_offline(ehttp, offline_embed, embed_server):
    want = [o.outputs.embedding for o in offline_embed.embed(TEXTS, use_tqdm=False)]
    tok = offline_embed.get_tokenizer()
    ids = [tok(t).input_ids for t in TEXTS]
    total = sum(len(i) for i in ids)
    forms = [
        (TEXTS[0], want[:1], len(ids[0])),
        (TEXTS, want, total),
        (ids[1], want[1:2], len(ids[1])),
        (ids, want, total),
    ]
    for value, expected, n in forms:
        r = ehttp.post("/v1/embeddings", json={"input": value, "model": "tiny"})
        assert r.status_code == 200, r.text
        body = r.json()
        np.testing.assert_allclose(_vectors(body), expected, rtol=0, atol=1e-6)
        assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}
    assert embed_server.engine.num_used_blocks == 0


def test_base64_decodes_to_the_float_vectors(ehttp):
    floats = ehttp.post("/v1/embeddings", json={"input": TEXTS}).json()
    b64 = ehttp.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "base64"})
    assert b64.status_code == 200, b64.text
    for f, d in zip(floats["data"], b64.json()["data"], strict=True):
        decoded = np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded, np.asarray(f["embedding"], dtype=np.float32))


def test_dimensions_truncate_and_renormalise(ehttp):
    full = ehttp.post("/v1/embeddings", json={"input": TEXTS, "normalize": False}).json()
    r = ehttp.post("/v1/embeddings", json={"input": TEXTS, "dimensions": 8})
    assert r.status_code == 200, r.text
    for f, d in zip(_vectors(full), _vectors(r.json()), strict=True):
        head = np.asarray(f[:8])
        np.testing.assert_allclose(d, head / np.linalg.norm(head), rtol=0, atol=1e-6)
    err = error_of(ehttp.post("/v1/embeddings", json={"input": "x", "dimensions": 12}), 400)
    assert err["param"] == "dimensions" and "[8, 16, 32]" in err["message"]
    err = error_of(ehttp.post("/v1/embeddings", json={"input": "x", "dimensions": 0}), 400)
    assert err["type"] == "invalid_request_error"


def test_bad_inputs_are_400s(ehttp, embed_server):
    for body in (
        {"input": []},
        {"input": ""},
        {"input": [10**9]},
        {"input": "x", "encoding_format": "int8"},
    ):
        error_of(ehttp.post("/v1/embeddings", json=body), 400)
    error_of(ehttp.post("/v1/embeddings", json={"input": "x", "model": "nope"}), 404)
    assert embed_server.engine.num_used_blocks == 0


def test_the_schema_states_that_input_strings_are_not_empty(ehttp):
    """The route refuses an empty string; the OpenAPI document says so (minLength), so that a
    request valid by the document is served (schemathesis' positive_data_acceptance)."""
    schemas = ehttp.get("/openapi.json").json()["components"]["schemas"]
    forms = schemas["EmbeddingRequest"]["properties"]["input"]["oneOf"]
    strings = [f for f in forms if f.get("type") == "string"]
    string_lists = [f["items"] for f in forms if f.get("items", {}).get("type") == "string"]
    assert [f["minLength"] for f in strings + string_lists] == [1, 1]
    err = error_of(ehttp.post("/v1/embeddings", json={"input": ["a", ""]}), 400)
    assert err["param"] == "input.1"


def test_the_schema_states_the_matryoshka_dimensions(ehttp):
    """Only the declared dimensions are served, and the document lists them (any other
    integer was valid by it and refused with a 400)."""
    schemas = ehttp.get("/openapi.json").json()["components"]["schemas"]
    forms = schemas["EmbeddingRequest"]["properties"]["dimensions"]["anyOf"]
    assert [f.get("enum") for f in forms if f.get("type") == "integer"] == [[8, 16, 32]]
    for dims in (8, 32):
        r = ehttp.post("/v1/embeddings", json={"input": "hi", "dimensions": dims})
        assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == dims
    assert error_of(ehttp.post("/v1/embeddings", json={"input": "hi", "dimensions": 1}), 400)


def test_generation_routes_on_a_pooling_model_are_400s(ehttp):
    paths = ehttp.get("/openapi.json").json()["paths"]
    assert "/v1/embeddings" in paths and "/tokenize" in paths
    assert not {"/v1/completions", "/v1/chat/completions", "/v1/messages"} & set(paths)
    err = error_of(ehttp.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}), 400)
    assert "embedding" in err["message"] and "not generation" in err["message"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    err = error_of(ehttp.post("/v1/chat/completions", json=chat), 400)
    assert "embedding" in err["message"]


def test_embeddings_on_a_generative_model_are_400s(http, server):
    err = error_of(http.post("/v1/embeddings", json={"input": "hello"}), 400)
    assert "generative model" in err["message"] and "--runner pooling" in err["message"]
    assert server.engine.num_used_blocks == 0


def test_openai_client_reads_the_response(embed_server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=embed_server.base_url + "/v1", api_key="x")
    res = client.embeddings.create(model="tiny", input=TEXTS[:2])  # base64 by default
    assert len(res.data) == 2 and len(res.data[0].embedding) == 32
    assert res.usage.prompt_tokens == res.usage.total_tokens > 0


def test_through_the_engine_core_process(embed_dir, offline_embed, tmp_path):
    """``engine serve --runner pooling``: the vector crosses the ZMQ boundary as raw float32
    bytes and the front end returns the same numbers."""
    want = [o.outputs.embedding for o in offline_embed.embed(TEXTS, use_tqdm=False)]
    with ServeProcess(embed_dir, tmp_path / "serve.log", "--runner", "pooling") as proc:
        r = httpx.post(proc.base_url + "/v1/embeddings", json={"input": TEXTS}, timeout=60)
        assert r.status_code == 200, r.text
        np.testing.assert_array_equal(
            np.asarray(_vectors(r.json()), dtype=np.float32), np.asarray(want, dtype=np.float32)
        )
        r = httpx.post(proc.base_url + "/v1/completions", json={"prompt": "hi"}, timeout=60)
        assert "embedding" in error_of(r, 400)["message"]
        # The front end learns the pooler from the core (it was None there, so the document
        # allowed any dimensions under engine serve while the core refused all but these).
        schemas = httpx.get(proc.base_url + "/openapi.json", timeout=60).json()["components"]
        forms = schemas["schemas"]["EmbeddingRequest"]["properties"]["dimensions"]["anyOf"]
        assert [f.get("enum") for f in forms if f.get("type") == "integer"] == [[8, 16, 32]]
