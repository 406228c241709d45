"""The server with speculative decoding (n-gram): the same tokens as the plain offline engine,
streamed or not; vLLM's spec_decode counters in /metrics; n > 1 answered with a 400 naming
the parameter; the "SpecDecoding metrics" log line."""

from __future__ import annotations

import openai
import pytest
from server_harness import API_KEY, RunningServer, engine_config

from engine.server.app import ServerOptions

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


@pytest.fixture(scope="module")
def spec_server(tiny_model_dir):
    from engine.config import SpeculativeConfig
    from engine.engine_core.core import EngineCore

    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                             prompt_lookup_max=3)  # fmt: skip

    def factory():
        return EngineCore.from_config(engine_config(tiny_model_dir, speculative=spec))

    with RunningServer(factory, ServerOptions(api_keys=[API_KEY])) as running:
        yield running


@pytest.fixture()
def spec_client(spec_server):
    return openai.OpenAI(base_url=spec_server.base_url + "/v1", api_key=API_KEY, max_retries=0)


def test_completions_equal_the_plain_engine(spec_server, spec_client, offline):
    from engine import SamplingParams

    want = offline.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    got = spec_client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24,
                                         temperature=0.0, extra_body={"ignore_eos": True})  # fmt: skip
    assert got.choices[0].text == want.text
    stream = spec_client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24,
                                            temperature=0.0, stream=True,
                                            extra_body={"ignore_eos": True})  # fmt: skip
    assert "".join(c.choices[0].text for c in stream if c.choices) == want.text
    assert spec_server.engine.num_used_blocks == 0


def test_spec_decode_metrics(spec_server, spec_client):
    import httpx

    spec_client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0.0)
    stats = spec_server.engine.get_stats().spec_decoding
    assert stats.num_drafts > 0
    text = httpx.get(spec_server.base_url + "/metrics",
                     headers={"Authorization": f"Bearer {API_KEY}"}).text  # fmt: skip
    labels = '{engine="0",model_name="tiny"}'  # the engine core's data-parallel rank, as vLLM
    assert f"engine:spec_decode_num_drafts_total{labels} {float(stats.num_drafts)}" in text
    assert (f"engine:spec_decode_num_draft_tokens_total{labels} "
            f"{float(stats.num_draft_tokens)}") in text  # fmt: skip
    assert "engine:spec_decode_num_accepted_tokens_total{" in text
    for pos in range(3):
        assert (f'engine:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="tiny",'
                f'position="{pos}"}}') in text  # fmt: skip


def test_n_above_one_is_a_bad_request(spec_client):
    with pytest.raises(openai.BadRequestError) as e:
        spec_client.completions.create(model="tiny", prompt="x", max_tokens=2, n=2)
    assert e.value.body["param"] == "n"
    assert "speculative decoding" in e.value.body["message"]


def test_stats_log_line():
    from engine.engine_core.messages import EngineStats
    from engine.server.metrics import StatsLogger
    from engine.spec_decode.stats import SpecDecodingStats

    before = SpecDecodingStats(3)
    now = before.copy()
    now.observe(3, 3)
    now.observe(3, 1)
    log = StatsLogger(interval_s=1.0)
    assert log.maybe_log(EngineStats(num_running=1, spec_decoding=before), 0.0) is None
    line = log.maybe_log(EngineStats(num_running=1, generation_tokens_total=6,
                                     spec_decoding=now), 2.0)  # fmt: skip
    assert "SpecDecoding metrics: Mean acceptance length: 3.00" in line
    assert "Accepted: 4 tokens, Drafted: 6 tokens" in line
    assert "Per-position acceptance rate: 1.000, 0.500, 0.500" in line
    assert "Avg Draft acceptance rate: 66.7%" in line
