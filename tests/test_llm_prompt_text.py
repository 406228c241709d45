"""Offline prompts that no tokenizer can take are the caller's mistake: ``LLM.generate`` says
which prompt and why (an ``InvalidRequestError``), queues nothing, and keeps working."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError


@pytest.fixture(scope="module")
def llm(tiny_gemma3_gguf_file):
    return LLM(str(tiny_gemma3_gguf_file), platform="cpu", dtype="float32", max_model_len=64)


@pytest.mark.parametrize("prompt", ["a\ud800b", {"prompt": "\udfff"}])
def test_a_lone_surrogate_is_a_clear_error_and_nothing_is_queued(llm, prompt):
    params = SamplingParams(max_tokens=2, temperature=0.0)
    with pytest.raises(InvalidRequestError, match="lone UTF-16 surrogate") as info:
        llm.generate(["fine", prompt], params, use_tqdm=False)
    assert info.value.param == "prompts"
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and engine.num_used_blocks == 0
    # The engine still serves, and a paired surrogate (an emoji) is ordinary text.
    out = llm.generate(["fine \U0001f600"], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
