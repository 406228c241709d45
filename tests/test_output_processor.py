"""The front end's OutputProcessor on hand-made core outputs (no model): detokenization, stop
strings against the core's finish reasons, hold-back, output intervals, n > 1, logprobs and
the latencies it measures."""

from __future__ import annotations

import pytest

from engine.engine_core.messages import EngineCoreOutput
from engine.output_processor import FINAL_ONLY, OutputProcessor
from engine.outputs import Logprob
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer():
    from engine.benchmarks.workload import write_word_level_tokenizer

    return write_word_level_tokenizer(100)  # token i is the word "t<i>"


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def test_stop_string_across_steps_ends_the_sequence_and_asks_the_core(tokenizer):
    params = SamplingParams(max_tokens=20, stop=["t7 t8"])
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", None, [1, 2], params, 0.0)
    texts = []
    for token in (5, 6, 7):
        result = proc.process_outputs([EngineCoreOutput("r", [token])])
        assert result.sequences_to_finish == []
        texts += result.request_outputs[0].new_texts
    streamed = "".join(texts)
    assert not streamed.endswith("t7")  # held back: it may start the stop string
    result = proc.process_outputs([EngineCoreOutput("r", [8])])
    assert result.sequences_to_finish == [("r", 0)]
    (out,) = result.request_outputs
    assert out.finished and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == "t7 t8"
    assert out.outputs[0].text.strip() == "t5 t6"
    assert streamed + out.new_texts[0] == out.outputs[0].text
    assert out.outputs[0].token_ids == [5, 6, 7, 8]
    # The core may send one more step before it learns of the stop: it is dropped.
    assert proc.process_outputs([EngineCoreOutput("r", [9])]).request_outputs == []
    assert not proc.has_unfinished_requests()


def test_the_cores_eos_wins_over_a_stop_string_and_a_stop_string_over_length(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request("eos", None, [1], SamplingParams(max_tokens=5, stop=["t4"]), 0.0)
    proc.add_request("len", None, [1], SamplingParams(max_tokens=1, stop=["t4"]), 0.0)
    result = proc.process_outputs(
        [
            EngineCoreOutput("eos", [4], finish_reason="stop", stop_reason=None),
            EngineCoreOutput("len", [4], finish_reason="length"),
        ]
    )
    assert result.sequences_to_finish == []  # the core ended both already
    eos, length = result.request_outputs
    assert (eos.outputs[0].finish_reason, eos.outputs[0].stop_reason) == ("stop", None)
    assert eos.outputs[0].text.strip() == "t4"
    assert (length.outputs[0].finish_reason, length.outputs[0].stop_reason) == ("stop", "t4")
    assert length.outputs[0].text == ""


def test_min_tokens_delays_stop_strings(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", None, [1], SamplingParams(max_tokens=9, min_tokens=2, stop=["t3"]), 0)
    assert proc.process_outputs([EngineCoreOutput("r", [3])]).sequences_to_finish == []
    assert proc.process_outputs([EngineCoreOutput("r", [3])]).sequences_to_finish == [("r", 0)]


def test_output_intervals_final_only_and_n(tokenizer):
    proc = OutputProcessor(tokenizer)
    params = SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=1)
    proc.add_request("every3", None, [1], SamplingParams(max_tokens=8), 0.0, output_interval=3)
    proc.add_request("final", None, [1], SamplingParams(max_tokens=8), 0.0, FINAL_ONLY)
    proc.add_request("n2", None, [1], params, 0.0)
    seen = {"every3": [], "final": [], "n2": []}
    for step in range(8):
        outs = [EngineCoreOutput(rid, [10 + step]) for rid in ("every3", "final")]
        outs += [EngineCoreOutput("n2", [20 + step], index=i) for i in (0, 1)]
        if step == 7:
            for o in outs:
                o.finish_reason = "length"
        for out in proc.process_outputs(outs).request_outputs:
            seen[out.request_id].append([len(t) for t in out.new_token_ids])
    assert seen["every3"] == [[1], [3], [3], [1]]  # the first token at once, then every 3
    assert seen["final"] == [[8]]
    assert seen["n2"] == [[1, 1]] * 8
    assert not proc.has_unfinished_requests()


def test_logprobs_get_their_text_and_add_up(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", None, [1], SamplingParams(max_tokens=2, logprobs=1), 0.0)
    lp = [{5: Logprob(-0.5, 1), 6: Logprob(-2.0, 2)}]
    proc.process_outputs([EngineCoreOutput("r", [5], new_logprobs=lp)])
    lp2 = [{6: Logprob(-0.25, 1)}]
    (out,) = proc.process_outputs(
        [EngineCoreOutput("r", [6], new_logprobs=lp2, finish_reason="length")]
    ).request_outputs
    comp = out.outputs[0]
    assert comp.cumulative_logprob == pytest.approx(-0.75)
    assert [sorted(e) for e in comp.logprobs] == [[5, 6], [6]]
    assert comp.logprobs[0][6].decoded_token == "t6"


def test_latencies_for_the_server_metrics(tokenizer):
    proc = OutputProcessor(tokenizer, collect_stats=True)
    for rid in ("a", "b"):
        proc.add_request(rid, None, [1], SamplingParams(max_tokens=3), 1.0)
    s1 = proc.process_outputs([EngineCoreOutput(r, [5]) for r in "ab"], now=2.0).stats
    assert s1.first_token_latencies == [1.0, 1.0] and s1.previous_token_times == {}
    s2 = proc.process_outputs([EngineCoreOutput(r, [5]) for r in "ab"], now=2.5).stats
    assert s2.first_token_latencies == [] and s2.previous_token_times == {2.0: 2}
    last = [EngineCoreOutput(r, [5], finish_reason="length") for r in "ab"]
    s3 = proc.process_outputs(last, now=3.0).stats
    assert s3.previous_token_times == {2.5: 2}
    assert s3.finished == [(2.0, ["length"]), (2.0, ["length"])]
