"""vLLM's ``/score`` and ``/rerank`` routes on an embedding model: scores equal to
sentence-transformers' ``util.cos_sim`` of its own embeddings of the same texts (a BERT model
with mean pooling, not normalised, so the cosine is not a plain dot product), every pairing,
ordering and ``top_n``, the route aliases, usage, the 400s, and no KV block left in use."""

from __future__ import annotations

import httpx
import pytest
from server_harness import MAX_MODEL_LEN, RunningServer, engine_config, error_of

from engine.testing.tiny_embedding_models import TEXTS, import_sentence_transformers, save_st_model

QUERY = "what is a sentence?"


@pytest.fixture(scope="module")
def st_dir(tmp_path_factory):
    return save_st_model(
        tmp_path_factory.mktemp("bert-embed"),
        "bert",
        "mean",
        normalize=False,
        max_position_embeddings=MAX_MODEL_LEN,
    )


@pytest.fixture(scope="module")
def st_model(st_dir):
    st = import_sentence_transformers()
    return st.SentenceTransformer(str(st_dir), device="cpu")


@pytest.fixture(scope="module")
def score_server(st_dir):
    from engine.engine_core.core import EngineCore

    with RunningServer(lambda: EngineCore.from_config(engine_config(st_dir))) as running:
        yield running


@pytest.fixture()
def shttp(score_server):
    with httpx.Client(base_url=score_server.base_url, timeout=60) as c:
        yield c


def cos_sim(st_model, a: list[str], b: list[str]):
    st = import_sentence_transformers()
    return st.util.cos_sim(
        st_model.encode(a, convert_to_tensor=True), st_model.encode(b, convert_to_tensor=True)
    )


def _scores(body: dict) -> list[float]:
    assert body["object"] == "list" and body["model"] == "tiny"
    assert [d["index"] for d in body["data"]] == list(range(len(body["data"])))
    assert all(d["object"] == "score" for d in body["data"])
    return [d["score"] for d in body["data"]]


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_one_against_many_equals_sentence_transformers(shttp, st_model, score_server, path):
    r = shttp.post(path, json={"model": "tiny", "text_1": QUERY, "text_2": TEXTS})
    assert r.status_code == 200, r.text
    want = cos_sim(st_model, [QUERY], TEXTS)[0].tolist()
    assert _scores(r.json()) == pytest.approx(want, abs=1e-5)
    tok = st_model.tokenizer
    n = sum(len(tok(t).input_ids) for t in [QUERY, *TEXTS])  # each text embedded once
    assert r.json()["usage"]["prompt_tokens"] == n
    assert score_server.engine.num_used_blocks == 0


def test_pairwise_and_one_to_one(shttp, st_model):
    firsts, seconds = TEXTS[:2], TEXTS[2:]
    r = shttp.post("/score", json={"text_1": firsts, "text_2": seconds}).json()
    want = cos_sim(st_model, firsts, seconds).diagonal().tolist()
    assert _scores(r) == pytest.approx(want, abs=1e-5)
    r = shttp.post("/score", json={"text_1": TEXTS[0], "text_2": TEXTS[0]}).json()
    assert _scores(r) == pytest.approx([1.0], abs=1e-5)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_the_documents(shttp, st_model, path):
    docs = [TEXTS[0], {"text": TEXTS[1]}, TEXTS[2], TEXTS[3]]
    r = shttp.post(path, json={"model": "tiny", "query": QUERY, "documents": docs})
    assert r.status_code == 200, r.text
    body = r.json()
    want = cos_sim(st_model, [QUERY], TEXTS)[0].tolist()
    order = sorted(range(len(TEXTS)), key=lambda i: -want[i])
    assert [x["index"] for x in body["results"]] == order
    for x in body["results"]:
        assert x["relevance_score"] == pytest.approx(want[x["index"]], abs=1e-5)
        assert x["document"] == {"text": TEXTS[x["index"]]}
    assert body["usage"]["total_tokens"] > 0 and body["model"] == "tiny"
    top = shttp.post(
        path, json={"query": QUERY, "documents": TEXTS, "top_n": 2, "return_documents": False}
    ).json()
    assert [x["index"] for x in top["results"]] == order[:2]
    assert all(x["document"] is None for x in top["results"])


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/score", {"text_1": TEXTS[:2], "text_2": TEXTS[:3]}, "text_2"),
        ("/score", {"text_1": [], "text_2": "x"}, "text_1"),
        ("/score", {"text_1": "", "text_2": "x"}, "text_1"),
        ("/rerank", {"query": "q", "documents": []}, "documents"),
        ("/rerank", {"query": "q", "documents": [{"txt": "x"}]}, "documents.0"),
        ("/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
    ],
)
def test_bad_requests_name_the_field(shttp, score_server, path, body, param):
    err = error_of(shttp.post(path, json=body), 400)
    assert err["param"] == param, err
    assert score_server.engine.num_used_blocks == 0


def test_a_generative_model_answers_400(http):
    """The chat fixture's model generates: the scoring routes name what it supports."""
    for path, body in [
        ("/score", {"text_1": "a", "text_2": "b"}),
        ("/rerank", {"query": "a", "documents": ["b"]}),
    ]:
        err = error_of(http.post(path, json=body), 400)
        assert "generative model" in err["message"] and err["param"] == "model"


def test_llm_score_equals_the_route(st_dir, st_model, shttp):
    """The offline ``LLM.score`` (vLLM's): the same scores, one output per pair, and the
    pairing rule's error."""
    from engine.errors import InvalidRequestError
    from engine.llm import LLM

    llm = LLM.from_engine_config(engine_config(st_dir))
    try:
        outs = llm.score(QUERY, TEXTS, use_tqdm=False)
        want = cos_sim(st_model, [QUERY], TEXTS)[0].tolist()
        assert [o.outputs.score for o in outs] == pytest.approx(want, abs=1e-5)
        tok = st_model.tokenizer
        assert outs[1].prompt_token_ids == tok(QUERY).input_ids + tok(TEXTS[1]).input_ids
        pairwise = llm.score(TEXTS[:2], TEXTS[2:], use_tqdm=False)
        served = shttp.post("/score", json={"text_1": TEXTS[:2], "text_2": TEXTS[2:]}).json()
        assert [o.outputs.score for o in pairwise] == pytest.approx(_scores(served), abs=1e-6)
        with pytest.raises(InvalidRequestError, match="1:N"):
            llm.score(TEXTS[:2], TEXTS[:3])
    finally:
        llm.shutdown()


# ------------------------------------------------------------ cross-encoders

PAIRS = [
    (QUERY, TEXTS[0]),
    (QUERY, TEXTS[1]),
    (QUERY, TEXTS[2]),
    (QUERY, TEXTS[3]),
]


def transformers_scores(model_dir, pairs) -> list[float]:
    """transformers' own sigmoid of the classification logit of each pair, as its tokenizer
    encodes the pair (token types included)."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return [
            torch.sigmoid(model(**tok(a, b, return_tensors="pt")).logits[0, 0]).item()
            for a, b in pairs
        ]


@pytest.fixture(scope="module", params=["bert", "xlm-roberta"])
def cross_dir(request, tmp_path_factory):
    from engine.testing.tiny_embedding_models import save_cross_encoder

    out = tmp_path_factory.mktemp(f"cross-{request.param}")
    return save_cross_encoder(out, request.param, max_len=MAX_MODEL_LEN)


def test_llm_score_with_a_cross_encoder_equals_transformers(cross_dir):
    """BERT (two token types: the second text is type 1) and XLM-RoBERTa (one type)
    sequence-classification rerankers: the sigmoid of the logit of each pair, as transformers
    computes it on the same weights; LLM.embed refuses a cross-encoder."""
    from engine.errors import InvalidRequestError
    from engine.llm import LLM

    llm = LLM.from_engine_config(engine_config(cross_dir))
    try:
        want = transformers_scores(cross_dir, PAIRS)
        got = llm.score(QUERY, [b for _, b in PAIRS], use_tqdm=False)
        assert [o.outputs.score for o in got] == pytest.approx(want, abs=1e-5)
        assert max(want) - min(want) > 1e-3  # the pairs score differently
        with pytest.raises(InvalidRequestError, match="sequence classifier"):
            llm.embed(["hello"], use_tqdm=False)
    finally:
        llm.shutdown()


def test_score_and_rerank_routes_with_a_cross_encoder(cross_dir):
    from engine.engine_core.core import EngineCore

    want = transformers_scores(cross_dir, PAIRS)
    docs = [b for _, b in PAIRS]
    factory = lambda: EngineCore.from_config(engine_config(cross_dir))  # noqa: E731
    with RunningServer(factory) as server, httpx.Client(base_url=server.base_url) as c:
        r = c.post("/v1/score", json={"text_1": QUERY, "text_2": docs}, timeout=60)
        assert r.status_code == 200, r.text
        assert _scores(r.json()) == pytest.approx(want, abs=1e-5)
        r = c.post("/v1/rerank", json={"query": QUERY, "documents": docs, "top_n": 3}, timeout=60)
        order = sorted(range(len(docs)), key=lambda i: -want[i])[:3]
        assert [x["index"] for x in r.json()["results"]] == order
        err = error_of(c.post("/v1/embeddings", json={"input": "hello"}, timeout=60), 400)
        assert "sequence classifier" in err["message"] and err["param"] == "model"
        assert server.engine.num_used_blocks == 0


# ------------------------------------------------------------ classifiers

LABELS = ["negative", "neutral", "positive"]


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    from engine.testing.tiny_embedding_models import save_cross_encoder

    out = tmp_path_factory.mktemp("classifier")
    return save_cross_encoder(out, "bert", max_len=MAX_MODEL_LEN, labels=LABELS)


def transformers_probs(model_dir, texts) -> list[list[float]]:
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return [
            torch.softmax(model(**tok(t, return_tensors="pt")).logits[0], -1).tolist()
            for t in texts
        ]


def test_llm_classify_equals_transformers(classifier_dir):
    """A 3-label classifier: softmax probabilities as transformers computes them; it neither
    embeds nor scores pairs (one label is needed)."""
    from engine.errors import InvalidRequestError
    from engine.llm import LLM

    llm = LLM.from_engine_config(engine_config(classifier_dir))
    try:
        got = llm.classify(TEXTS, use_tqdm=False)
        want = transformers_probs(classifier_dir, TEXTS)
        for g, w in zip(got, want, strict=True):
            assert g.outputs.num_classes == 3
            assert g.outputs.probs == pytest.approx(w, abs=1e-5)
        with pytest.raises(InvalidRequestError, match="3 labels"):
            llm.score("a", "b")
    finally:
        llm.shutdown()


def test_classify_route(classifier_dir, shttp):
    from engine.engine_core.core import EngineCore

    want = transformers_probs(classifier_dir, TEXTS)
    factory = lambda: EngineCore.from_config(engine_config(classifier_dir))  # noqa: E731
    with RunningServer(factory) as server, httpx.Client(base_url=server.base_url) as c:
        for path in ("/classify", "/v1/classify"):
            r = c.post(path, json={"model": "tiny", "input": TEXTS}, timeout=60)
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["object"] == "list" and body["usage"]["prompt_tokens"] > 0
            for i, d in enumerate(body["data"]):
                assert d["index"] == i and d["num_classes"] == 3
                assert d["probs"] == pytest.approx(want[i], abs=1e-5)
                assert d["label"] == LABELS[max(range(3), key=want[i].__getitem__)]
        err = error_of(c.post("/score", json={"text_1": "a", "text_2": "b"}, timeout=60), 400)
        assert "3 labels" in err["message"]
        paths = c.get("/openapi.json").json()["paths"]
        assert "/classify" in paths and "/v1/embeddings" not in paths and "/score" not in paths
        assert server.engine.num_used_blocks == 0
    # An embedding model does not classify.
    err = error_of(shttp.post("/classify", json={"input": "hello"}), 400)
    assert "embedding model" in err["message"] and err["param"] == "model"
    assert "/classify" not in shttp.get("/openapi.json").json()["paths"]


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_decoder_classifiers_equal_transformers(kind, tmp_path):
    """``Qwen3ForSequenceClassification`` / ``LlamaForSequenceClassification`` (reward models,
    classifiers): the last token's ``score`` logits, as transformers computes them; with one
    label (a reward model) ``LLM.score`` reads a pair as the tokenizer joins it."""
    import torch
    import transformers

    from engine.llm import LLM
    from engine.testing.tiny_embedding_models import save_decoder_classifier

    for labels in (LABELS, ["reward"]):
        model_dir = save_decoder_classifier(tmp_path / f"{kind}-{len(labels)}", kind, labels)
        tok = transformers.AutoTokenizer.from_pretrained(model_dir)
        ref = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
        llm = LLM.from_engine_config(engine_config(model_dir))
        try:
            with torch.no_grad():
                if len(labels) > 1:
                    want = [
                        torch.softmax(ref(**tok(t, return_tensors="pt")).logits[0], -1)
                        for t in TEXTS
                    ]
                    got = [o.outputs.probs for o in llm.classify(TEXTS, use_tqdm=False)]
                    for g, w in zip(got, want, strict=True):
                        assert g == pytest.approx(w.tolist(), abs=1e-5)
                else:
                    want = [
                        torch.sigmoid(ref(**tok(QUERY, t, return_tensors="pt")).logits[0, 0])
                        for t in TEXTS
                    ]
                    got = [o.outputs.score for o in llm.score(QUERY, TEXTS, use_tqdm=False)]
                    assert got == pytest.approx([w.item() for w in want], abs=1e-5)
        finally:
            llm.shutdown()


@pytest.mark.parametrize("tied", [False, True])
def test_a_reranker_made_from_the_lm_head_equals_transformers(tmp_path, tied):
    """Qwen3-Reranker as vLLM serves it: a causal LM with ``--hf-overrides
    '{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": [NO,
    YES], "is_original_qwen3_reranker": true}'`` scores a pair as the probability of YES in a
    softmax over the two tokens' next-token logits at the pair's last token (the LM head's rows,
    or the tied embedding's); without ``is_original_qwen3_reranker`` each token's logit is a
    label. Checked against transformers' causal LM on the same weights and token ids."""
    import torch
    import transformers

    from engine.llm import LLM
    from engine.loader.model_loader import ModelLoadError
    from engine.testing.tiny_embedding_models import save_tiny_decoder

    save_tiny_decoder(tmp_path, "qwen3", "ForCausalLM", tie_word_embeddings=tied)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).float().eval()
    vocab = tok.get_vocab()
    no, yes = sorted(t for t in vocab if t.isalpha() and len(t) > 2)[:2]  # two real tokens

    def last_logits(text: str) -> torch.Tensor:
        ids = tok(QUERY, text, return_tensors="pt")
        with torch.no_grad():
            return ref(**ids).logits[0, -1]

    reranker = {
        "architectures": ["Qwen3ForSequenceClassification"],
        "classifier_from_token": [no, yes],
        "is_original_qwen3_reranker": True,
    }
    cfg = engine_config(tmp_path)
    cfg.model.hf_overrides = reranker
    llm = LLM.from_engine_config(cfg)
    try:
        got = [o.outputs.score for o in llm.score(QUERY, TEXTS, use_tqdm=False)]
    finally:
        llm.shutdown()
    want = []
    for t in TEXTS:
        logits = last_logits(t)
        want.append(torch.softmax(logits[[vocab[no], vocab[yes]]], -1)[1].item())
    assert got == pytest.approx(want, abs=1e-5)
    assert max(want) - min(want) > 1e-3  # the texts score differently

    # Without is_original_qwen3_reranker: one label per token, their raw logits' softmax.
    cfg = engine_config(tmp_path)
    cfg.model.hf_overrides = {**reranker, "is_original_qwen3_reranker": False}
    llm = LLM.from_engine_config(cfg)
    try:
        probs = [o.outputs.probs for o in llm.classify(TEXTS[:2], use_tqdm=False)]
    finally:
        llm.shutdown()
    for p, t in zip(probs, TEXTS[:2], strict=True):
        with torch.no_grad():
            ids = tok(t, return_tensors="pt")
            logits = ref(**ids).logits[0, -1]
        assert p == pytest.approx(
            torch.softmax(logits[[vocab[no], vocab[yes]]], -1).tolist(), abs=1e-5
        )

    # A token the vocabulary does not have is refused at load, by name.
    cfg = engine_config(tmp_path)
    cfg.model.hf_overrides = {**reranker, "classifier_from_token": ["no-such-token!", yes]}
    with pytest.raises(ModelLoadError, match="no-such-token!"):
        LLM.from_engine_config(cfg)
