"""Pooling models (``--runner pooling``, ``LLM.embed``): embeddings equal to
sentence-transformers' on the same tiny random weights, batched with mixed lengths; the
scheduler's pooling rules (whole prompt in one step, no prefix hits); matryoshka dimensions;
the errors for the wrong kind of request; the compact wire encoding of a pooled vector."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, PoolingParams, SamplingParams
from engine.errors import InvalidRequestError
from engine.testing.tiny_embedding_models import TEXTS, save_st_model, st_embeddings

ATOL = 1e-5


def _embed(llm: LLM, prompts, params=None) -> torch.Tensor:
    outs = llm.embed(prompts, params, use_tqdm=False)
    return torch.tensor([o.outputs.embedding for o in outs], dtype=torch.float32)


@pytest.fixture(scope="module")
def bert_mean(tmp_path_factory):
    return save_st_model(tmp_path_factory.mktemp("bert"), "bert", "mean", normalize=True)


@pytest.fixture(scope="module")
def xlmr_cls(tmp_path_factory):
    return save_st_model(tmp_path_factory.mktemp("xlmr"), "xlm-roberta", "cls", normalize=False)


@pytest.fixture(scope="module")
def qwen3_last(tmp_path_factory):
    return save_st_model(
        tmp_path_factory.mktemp("qwen3"),
        "qwen3",
        "lasttoken",
        normalize=True,
        config_extra={"matryoshka_dimensions": [8, 16, 32]},
    )


@pytest.fixture(scope="module")
def qwen3_llm(qwen3_last):
    llm = LLM(str(qwen3_last), dtype="float32", max_num_batched_tokens=64, max_num_seqs=3)
    yield llm
    llm.shutdown()


def test_bert_mean_normalized_equals_sentence_transformers(bert_mean):
    llm = LLM(str(bert_mean), dtype="float32")  # auto: BertModel has no LM head
    assert llm.config.model.runner_type == "pooling"
    assert llm.config.model.pooler_config.pooling_type == "MEAN"
    outs = llm.embed(TEXTS, use_tqdm=False)
    got = torch.tensor([o.outputs.embedding for o in outs])
    torch.testing.assert_close(got, st_embeddings(bert_mean, TEXTS), atol=ATOL, rtol=0)
    assert [len(o.prompt_token_ids) for o in outs] == [
        len(llm.get_tokenizer()(t).input_ids) for t in TEXTS
    ]
    assert outs[0].outputs.hidden_size == 32
    assert llm.llm_engine.num_used_blocks == 0  # no KV block leaked
    llm.shutdown()


def test_xlm_roberta_cls_unnormalized_equals_sentence_transformers(xlmr_cls):
    llm = LLM(str(xlmr_cls), dtype="float32", task="embed")  # vLLM's older flag
    cfg = llm.config.model.pooler_config
    assert (cfg.pooling_type, cfg.normalize) == ("CLS", False)  # no Normalize module
    got = _embed(llm, TEXTS)
    torch.testing.assert_close(got, st_embeddings(xlmr_cls, TEXTS), atol=ATOL, rtol=0)
    # normalize=True on request: the same vectors, unit length.
    unit = _embed(llm, TEXTS, PoolingParams(normalize=True))
    torch.testing.assert_close(unit, torch.nn.functional.normalize(got, dim=-1), atol=ATOL, rtol=0)
    llm.shutdown()


def test_qwen3_last_token_equals_sentence_transformers(qwen3_last, qwen3_llm):
    assert qwen3_llm.config.model.pooler_config.pooling_type == "LAST"
    # More prompts than max_num_seqs and tokens than one step's budget: several steps.
    texts = TEXTS * 3
    got = _embed(qwen3_llm, texts)
    torch.testing.assert_close(got, st_embeddings(qwen3_last, texts), atol=ATOL, rtol=0)
    # Token-id prompts embed the same as their text.
    ids = [qwen3_llm.get_tokenizer()(t).input_ids for t in TEXTS]
    torch.testing.assert_close(_embed(qwen3_llm, ids), got[: len(TEXTS)], atol=0, rtol=0)
    assert qwen3_llm.llm_engine.num_used_blocks == 0


def test_decoder_checkpoint_served_for_pooling(qwen3_last, tmp_path):
    """A Qwen3ForCausalLM checkpoint (Qwen3-Embedding's own config) with --runner pooling:
    the same trunk without its LM head, the same vectors."""
    import json
    import shutil

    path = tmp_path / "causal"
    shutil.copytree(qwen3_last, path)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(path / "model.safetensors"))
    weights = {f"model.{k}": v for k, v in weights.items()}
    weights["lm_head.weight"] = torch.zeros_like(weights["model.embed_tokens.weight"])
    save_file(weights, str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    for f in ("modules.json",):  # without sentence-transformers files: --runner decides
        (path / f).unlink()
    llm = LLM(str(path), dtype="float32", runner="pooling")
    got = _embed(llm, TEXTS)
    torch.testing.assert_close(got, st_embeddings(qwen3_last, TEXTS), atol=ATOL, rtol=0)
    llm.shutdown()


def test_matryoshka_dimensions_truncate_and_renormalize(qwen3_last, qwen3_llm):
    full = _embed(qwen3_llm, TEXTS, PoolingParams(normalize=False))
    got = _embed(qwen3_llm, TEXTS, PoolingParams(dimensions=16))
    assert got.shape == (len(TEXTS), 16)
    torch.testing.assert_close(
        got, torch.nn.functional.normalize(full[:, :16], dim=-1), atol=ATOL, rtol=0
    )
    with pytest.raises(InvalidRequestError, match="supports \\[8, 16, 32\\]"):
        qwen3_llm.embed(TEXTS, PoolingParams(dimensions=12), use_tqdm=False)
    assert qwen3_llm.llm_engine.num_used_blocks == 0


def test_dimensions_refused_without_matryoshka(bert_mean):
    llm = LLM(str(bert_mean), dtype="float32")
    with pytest.raises(InvalidRequestError, match="matryoshka"):
        llm.embed(TEXTS, PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="positive integer"):
        PoolingParams(dimensions=0)
    llm.shutdown()


def test_wrong_kind_of_request_is_a_clear_error(qwen3_llm, tmp_path):
    with pytest.raises(InvalidRequestError, match="embedding .*model.*not generation"):
        qwen3_llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not qwen3_llm.llm_engine.has_unfinished_requests()
    from engine.testing.tiny_models import build_tokenizer, save_tiny_model

    save_tiny_model("qwen3", tmp_path)
    build_tokenizer(tmp_path)
    gen = LLM(str(tmp_path), dtype="float32")
    assert gen.config.model.runner_type == "generate"
    with pytest.raises(InvalidRequestError, match="generative model.*not embeddings"):
        gen.embed(["hello"], use_tqdm=False)
    gen.shutdown()


def test_too_long_input_is_refused(qwen3_llm):
    with pytest.raises(ValueError, match="pooling request runs whole"):
        qwen3_llm.embed([[5] * 65], use_tqdm=False)  # > max_num_batched_tokens=64
    assert qwen3_llm.llm_engine.num_used_blocks == 0


def test_embeddings_through_an_engine_core_process(qwen3_last):
    """The vector crosses the process boundary as raw float32 bytes and comes back equal."""
    from engine.llm_engine import LLMEngine

    inproc = LLM(str(qwen3_last), dtype="float32")
    want = _embed(inproc, TEXTS)
    config = inproc.config
    inproc.shutdown()
    from engine.config import EngineConfig, ModelConfig

    mp = LLM.from_engine_config(
        EngineConfig(model=ModelConfig(str(qwen3_last), dtype="float32")), multiprocess=True
    )
    try:
        assert isinstance(mp.llm_engine, LLMEngine)
        assert mp.config.model.runner_type == "pooling"
        torch.testing.assert_close(_embed(mp, TEXTS), want, atol=0, rtol=0)
        assert mp.llm_engine.num_used_blocks == 0
    finally:
        mp.shutdown()
    assert config.model.runner_type == "pooling"


# ------------------------------------------------------------------ device-free pieces
def test_pooled_vector_wire_encoding_is_raw_float32():
    from engine.engine_core.messages import Codec, EngineCoreOutput, EngineCoreOutputs

    vector = np.arange(1024, dtype="<f4") / 7
    codec = Codec()
    msg = EngineCoreOutputs(
        [EngineCoreOutput("r", [], finish_reason="stop", pooled=vector.tobytes())]
    )
    wire = codec.encode(msg)
    assert len(wire) < 4 * 1024 + 64  # 4 bytes a value plus the tag and a small header
    back = codec.from_core.decode(wire)
    np.testing.assert_array_equal(np.frombuffer(back.outputs[0].pooled, "<f4"), vector)


def _scheduler(chunked: bool = True, budget: int = 16):
    from engine.config import CacheConfig, SchedulerConfig
    from engine.kv_cache_manager import KVCacheGroupSpec
    from engine.scheduler import Scheduler

    return Scheduler(
        SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=budget, enable_chunked_prefill=chunked
        ),
        CacheConfig(block_size=4, enable_prefix_caching=True),
        64,
        64,
        [KVCacheGroupSpec()],
    )


def _pooling_request(rid: str, n: int):
    from engine.request import Request

    return Request(rid, list(range(1, n + 1)), max_tokens=0, pooling_params=PoolingParams())


@pytest.mark.parametrize("chunked", [True, False])
def test_scheduler_runs_pooling_prompts_whole(chunked):
    from engine.request import RequestStatus
    from engine.scheduler import RequestRejectedError

    sched = _scheduler(chunked)
    sched.add_request(_pooling_request("a", 10))
    sched.add_request(_pooling_request("b", 10))  # does not fit what "a" leaves: next step
    out = sched.schedule()
    assert [(s.request.request_id, s.start, s.num_new_tokens) for s in out.scheduled] == [
        ("a", 0, 10)
    ]
    entry = out.scheduled[0]
    assert entry.pools and not entry.samples
    sched.update_from_output(out, {})
    sched.finish_request("a", RequestStatus.FINISHED_STOPPED)
    out = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens, s.pools) for s in out.scheduled] == [
        ("b", 10, True)
    ]
    sched.update_from_output(out, {})
    sched.finish_request("b", RequestStatus.FINISHED_STOPPED)
    # The same prompt again: no prefix-cache hit (its hidden states must be recomputed).
    sched.add_request(_pooling_request("c", 10))
    out = sched.schedule()
    assert (out.scheduled[0].start, out.scheduled[0].num_new_tokens) == (0, 10)
    sched.update_from_output(out, {})
    sched.finish_request("c", RequestStatus.FINISHED_STOPPED)
    assert sched.num_used_blocks == 0
    with pytest.raises(RequestRejectedError, match="max_num_batched_tokens=16"):
        sched.add_request(_pooling_request("long", 17))


def test_asynchronous_scheduling_gives_the_same_vectors(qwen3_last, qwen3_llm):
    """With a step in flight while the next is scheduled (the GPU default), a pooling request
    is accounted when scheduled, gets no placeholder token and finishes once."""
    want = _embed(qwen3_llm, TEXTS * 2)
    llm = LLM(str(qwen3_last), dtype="float32", async_scheduling=True, max_num_batched_tokens=64)
    torch.testing.assert_close(_embed(llm, TEXTS * 2), want, atol=0, rtol=0)
    assert llm.llm_engine.num_used_blocks == 0 and not llm.llm_engine.has_unfinished_requests()
    llm.shutdown()


def test_runner_and_pooler_resolution(qwen3_last, tmp_path):
    import json

    from engine.config import ConfigError, ModelConfig
    from engine.pooling import resolve_pooler_config, resolve_runner

    # A generative architecture with sentence-transformers files is an embedding model.
    assert resolve_runner("auto", ["Qwen3ForCausalLM"], qwen3_last)[0] == "pooling"
    assert resolve_runner("auto", ["Qwen3ForCausalLM"], tmp_path)[0] == "generate"
    assert resolve_runner("auto", ["XLMRobertaModel"], None)[0] == "pooling"
    assert resolve_runner("generate", ["BertModel"], None)[0] == "generate"
    assert ModelConfig("m", task="embed").runner == "pooling"
    with pytest.raises(ConfigError, match="contradicts"):
        ModelConfig("m", task="embed", runner="generate")
    with pytest.raises(ConfigError, match="runner="):
        ModelConfig("m", runner="classify")

    class Cfg:
        hidden_size = 32

    (tmp_path / "modules.json").write_text(
        json.dumps([{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}])
    )
    (tmp_path / "1_Pooling").mkdir()
    pooling = tmp_path / "1_Pooling" / "config.json"
    pooling.write_text(json.dumps({"pooling_mode_weightedmean_tokens": True}))
    with pytest.raises(ValueError, match="weightedmean"):
        resolve_pooler_config(tmp_path, Cfg(), ["BertModel"])
    pooling.write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    cfg = resolve_pooler_config(tmp_path, Cfg(), ["BertModel"])
    assert (cfg.pooling_type, cfg.normalize, cfg.is_matryoshka) == ("MEAN", False, False)
