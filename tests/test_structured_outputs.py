"""Structured outputs (xgrammar) through the offline ``LLM`` API on a tiny random Llama.

The model's vocabulary is padded past its tokenizer's (as many real models are), so the tests
also check that padded ids are never sampled. Greedy structured decoding is compared with an
independent computation: transformers' logits, an xgrammar matcher driven here, and the
argmax over the allowed tokens.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from test_llm_vs_hf import hf_greedy

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.sampling_params import SamplingParamsError
from engine.testing.tiny_models import build_tiny_model, build_tokenizer

PAD = 40  # lm_head rows past the tokenizer's vocabulary

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "ok", "color", "tags"],
}
PROMPTS = ["The quick brown fox", "Numbers 0123456789", "A paged KV cache", "def main():"]


def check_schema(value) -> None:
    """What SCHEMA requires, checked with plain Python."""
    assert isinstance(value, dict) and set(value) == set(SCHEMA["required"]), value
    assert isinstance(value["name"], str) and len(value["name"]) <= 6
    assert type(value["age"]) is int and 0 <= value["age"] <= 120
    assert type(value["ok"]) is bool
    assert value["color"] in ("red", "green", "blue")
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 2
    assert all(t in ("a", "b") for t in value["tags"])


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_structured")
    vocab = len(build_tokenizer(path))
    return build_tiny_model(path, "llama", vocab_size=vocab + PAD)


def make_llm(path, **kw) -> LLM:
    settings = dict(
        model=str(path),
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        num_gpu_blocks_override=200,
        async_scheduling=False,
    )
    settings.update(kw)
    return LLM(**settings)


@pytest.fixture(scope="module")
def llm(model_path):
    return make_llm(model_path)


@pytest.fixture(scope="module")
def hf(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def structured(max_tokens=120, temperature=0.0, seed=None, **constraint) -> SamplingParams:
    return SamplingParams(
        temperature=temperature,
        seed=seed,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(**constraint),
    )


def run(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


# ---------------------------------------------------------------------- parameters


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({}, "exactly one of json, json_object, regex, choice, grammar; got none"),
        ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
        ({"json": "{nope"}, "not valid JSON"),
        ({"json": [1, 2]}, "must be a JSON schema"),
        ({"regex": ""}, "non-empty string"),
        ({"choice": []}, "non-empty list of non-empty strings"),
        ({"choice": ["a", 3]}, "non-empty list of non-empty strings"),
        ({"json_object": "yes"}, "json_object must be true"),
    ],
)
def test_params_need_exactly_one_valid_constraint(kwargs, fragment):
    with pytest.raises(SamplingParamsError, match=re.escape(fragment)) as info:
        StructuredOutputsParams(**kwargs)
    assert info.value.param == "structured_outputs"


def test_sampling_params_take_a_dict_and_refuse_min_tokens():
    p = SamplingParams(structured_outputs={"regex": "[ab]+"})
    assert p.structured_outputs == StructuredOutputsParams(regex="[ab]+")
    assert p.reads_output_tokens  # the synchronous path, like penalties
    with pytest.raises(SamplingParamsError, match="unknown field.*regexp") as info:
        SamplingParams(structured_outputs={"regexp": "a"})
    assert info.value.param == "structured_outputs"
    with pytest.raises(SamplingParamsError, match="min_tokens cannot be combined") as info:
        SamplingParams(min_tokens=2, structured_outputs={"regex": "a+"})
    assert info.value.param == "min_tokens"
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(structured_outputs="json")
    assert info.value.param == "structured_outputs"


def test_xgrammar_is_imported_only_when_used():
    code = (
        "import sys, engine, engine.engine_core.core, engine.llm_engine, engine.llm, engine.sampler,"
        " engine.server.app;"
        "assert 'xgrammar' not in sys.modules, 'xgrammar imported at startup'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------- outputs


def test_json_schema_outputs_parse_and_satisfy_the_schema(llm):
    params = [
        structured(json=SCHEMA, disable_any_whitespace=True),
        structured(json=json.dumps(SCHEMA), disable_any_whitespace=True, temperature=1.0, seed=3),
        structured(json=SCHEMA, disable_any_whitespace=True, temperature=0.8, seed=4),
        structured(json=SCHEMA, disable_any_whitespace=True, temperature=1.2, seed=5),
    ]
    for out in run(llm, PROMPTS, params):
        comp = out.outputs[0]
        assert comp.finish_reason == "stop", comp.text
        check_schema(json.loads(comp.text))
        assert comp.token_ids[-1] == llm.get_tokenizer().eos_token_id


def test_regex_choice_and_grammar(llm):
    regex = r"[a-z]{3}-\d{2,4}"
    choices = ["alpha", "beta", "gamma delta", 'quote " and \\ backslash']
    grammar = 'root ::= "(" [0-9] [0-9]? ("+" [0-9] [0-9]?)? ")"'
    params = [
        structured(regex=regex),
        structured(regex=regex, temperature=1.0, seed=1),
        structured(choice=choices),
        structured(choice=choices, temperature=1.0, seed=2),
        structured(grammar=grammar),
        structured(grammar=grammar, temperature=1.0, seed=3),
    ]
    outs = run(llm, PROMPTS[:2] * 3, params)
    texts = [o.outputs[0].text for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), texts
    assert re.fullmatch(regex, texts[0]) and re.fullmatch(regex, texts[1])
    assert texts[2] in choices and texts[3] in choices
    assert re.fullmatch(r"\(\d\d?(\+\d\d?)?\)", texts[4])
    assert re.fullmatch(r"\(\d\d?(\+\d\d?)?\)", texts[5])


def _allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Unpack an xgrammar bitmask row by hand (bit t % 32 of word t // 32)."""
    bits = (bitmask[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].bool()


def masked_greedy_reference(hf, tokenizer, prompt_ids, params, eos_id, max_new):
    """Greedy decoding over transformers' logits restricted to what an xgrammar matcher
    (built here, independently of the engine) allows; stops after the EOS."""
    import xgrammar as xgr

    vocab = hf.config.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[eos_id])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    if params.regex is not None:
        compiled = compiler.compile_regex(params.regex)
    else:
        compiled = compiler.compile_json_schema(
            json.dumps(params.json), any_whitespace=not params.disable_any_whitespace
        )
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, vocab)
    ids, tokens = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(max_new):
            logits = hf(input_ids=torch.tensor([ids])).logits[0, -1].float()
            matcher.fill_next_token_bitmask(mask)
            allowed = _allowed(mask[0], vocab)
            token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
            assert matcher.accept_token(token)
            tokens.append(token)
            ids.append(token)
            if matcher.is_terminated():
                break
    return tokens


@pytest.mark.parametrize(
    "constraint",
    [
        {"json": SCHEMA, "disable_any_whitespace": True},
        {"json": SCHEMA},  # any whitespace: may not finish in 16 tokens; the prefix must match
        {"regex": r"(ab|[0-9]+|x{2,3})\.[a-z]{2,5}"},
    ],
)
def test_greedy_is_the_argmax_over_the_allowed_tokens_of_transformers(llm, hf, constraint):
    tokenizer = llm.get_tokenizer()
    params = StructuredOutputsParams(**constraint)
    for prompt in PROMPTS[:2]:
        prompt_ids = tokenizer(prompt).input_ids
        want = masked_greedy_reference(
            hf, tokenizer, prompt_ids, params, tokenizer.eos_token_id, 16
        )
        got = run(
            llm,
            {"prompt_token_ids": prompt_ids},
            SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=params),
        )[0].outputs[0]
        assert got.token_ids == want
        assert got.finish_reason == ("stop" if want[-1] == tokenizer.eos_token_id else "length")


def test_mixed_batch_leaves_unconstrained_requests_exact(llm, hf):
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    params = [
        plain,
        structured(json=SCHEMA, disable_any_whitespace=True),
        plain,
        structured(choice=["yes", "no"], temperature=0.9, seed=7),
    ]
    outs = run(llm, [{"prompt_token_ids": p} for p in prompts], params)
    for i in (0, 2):
        assert outs[i].outputs[0].token_ids == hf_greedy(hf, prompts[i], 12)[0]
    check_schema(json.loads(outs[1].outputs[0].text))
    assert outs[3].outputs[0].text in ("yes", "no")
    assert llm.llm_engine.num_used_blocks == 0


def test_masking_composes_with_logit_bias_penalties_and_logprobs(llm):
    tokenizer = llm.get_tokenizer()
    close = tokenizer.convert_tokens_to_ids("}")
    forbidden = tokenizer.convert_tokens_to_ids("[")
    # A huge bias on a token the grammar forbids changes nothing; one on an allowed token wins.
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=20,
            logit_bias={close: 100.0},
            structured_outputs=StructuredOutputsParams(json_object=True),
        ),
        SamplingParams(
            temperature=0.7,
            seed=1,
            top_p=0.9,
            top_k=20,
            max_tokens=40,
            logit_bias={forbidden: 100.0},
            repetition_penalty=1.3,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            logprobs=2,
            prompt_logprobs=1,
            structured_outputs=StructuredOutputsParams(regex=r"[a-z]{1,4}(-[a-z]{1,4}){0,2}"),
        ),
    ]
    a, b = run(llm, PROMPTS[:2], params)
    assert a.outputs[0].text == "{}" and a.outputs[0].finish_reason == "stop"
    comp = b.outputs[0]
    assert re.fullmatch(r"[a-z]{1,4}(-[a-z]{1,4}){0,2}", comp.text), comp.text
    assert forbidden not in comp.token_ids and comp.finish_reason == "stop"
    assert len(comp.logprobs) == len(comp.token_ids)
    assert all(t in lp for t, lp in zip(comp.token_ids, comp.logprobs, strict=True))
    assert b.prompt_logprobs is not None and len(b.prompt_logprobs) == len(b.prompt_token_ids)


def test_padded_vocabulary_ids_are_never_sampled(llm):
    tokenizer_vocab = len(llm.get_tokenizer())
    padded = tokenizer_vocab + PAD // 2
    assert llm.llm_engine.runner.vocab_size == tokenizer_vocab + PAD
    bias = {padded: 100.0}
    free = SamplingParams(temperature=0.0, max_tokens=4, logit_bias=bias)
    # Unconstrained, the bias makes the padded id win: the constraint below is what stops it.
    assert run(llm, PROMPTS[0], free)[0].outputs[0].token_ids[0] == padded
    for temperature in (0.0, 1.5):
        params = SamplingParams(
            temperature=temperature,
            seed=0,
            max_tokens=40,
            logit_bias=bias,
            structured_outputs=StructuredOutputsParams(regex=r"[0-9]{1,8}"),
        )
        comp = run(llm, PROMPTS[0], params)[0].outputs[0]
        assert all(t < tokenizer_vocab for t in comp.token_ids)
        assert re.fullmatch(r"[0-9]{1,8}", comp.text)


def test_finishes_when_the_grammar_ends_even_with_ignore_eos(llm):
    params = SamplingParams(
        temperature=0.0,
        max_tokens=50,
        ignore_eos=True,
        structured_outputs=StructuredOutputsParams(choice=["first", "second"]),
    )
    comp = run(llm, PROMPTS[2], params)[0].outputs[0]
    assert comp.text in ("first", "second") and comp.finish_reason == "stop"
    assert comp.stop_reason is None and comp.token_ids[-1] == llm.get_tokenizer().eos_token_id


def test_n_children_fork_their_own_grammar_state(llm):
    regex = r"[a-z]{2,5}\.[0-9]{1,3}"
    params = SamplingParams(
        n=4,
        temperature=1.2,
        seed=11,
        max_tokens=30,
        structured_outputs=StructuredOutputsParams(regex=regex),
    )
    out = run(llm, PROMPTS[1], params)[0]
    texts = [c.text for c in out.outputs]
    assert len(texts) == 4 and len(set(texts)) > 1, texts
    for c in out.outputs:
        assert re.fullmatch(regex, c.text) and c.finish_reason == "stop", texts
    assert llm.llm_engine.num_used_blocks == 0


# ---------------------------------------------------------------------- engine state


def many_structured_requests(tokenizer):
    prompts = [tokenizer(p * (1 + i % 3)).input_ids for i, p in enumerate(PROMPTS * 2)]
    params = []
    for i in range(len(prompts)):
        if i % 3 == 0:
            params.append(structured(json=SCHEMA, disable_any_whitespace=True, max_tokens=70))
        elif i % 3 == 1:
            params.append(structured(regex=r"[a-z ]{4,20}\.", temperature=0.9, seed=i))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    return [{"prompt_token_ids": p} for p in prompts], params


@pytest.fixture(scope="module")
def reference(llm):
    """Mixed structured and plain requests, and their outputs on a roomy synchronous engine."""
    inputs, params = many_structured_requests(llm.get_tokenizer())
    return inputs, params, run(llm, inputs, params)


def test_preemption_by_recompute_keeps_the_grammar_state(model_path, reference):
    """A cache so small that requests are preempted and their prefill re-run: the matcher
    must not re-accept the tokens the recompute feeds again, so the outputs are those of a
    roomy cache."""
    small = make_llm(model_path, num_gpu_blocks_override=44, max_num_seqs=8)
    inputs, params, want = reference
    got = run(small, inputs, params)
    assert small.llm_engine.get_stats().num_preemptions > 0, "the small cache must preempt"
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
    assert sum(w.outputs[0].finish_reason == "stop" for w in want) >= 4
    assert small.llm_engine.num_used_blocks == 0


def test_async_scheduling_gives_the_same_tokens(model_path, reference):
    async_llm = make_llm(model_path, async_scheduling=True)
    assert async_llm.llm_engine.core._async
    inputs, params, want = reference
    got = run(async_llm, inputs, params)
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].text == w.outputs[0].text
    assert async_llm.llm_engine.num_used_blocks == 0


def test_bad_constraints_fail_at_add_request_and_the_engine_keeps_going(llm):
    engine = llm.llm_engine
    bad = [
        ({"json": {"type": "objec"}}, "invalid JSON schema"),
        ({"regex": "[a-"}, "invalid regex"),
        ({"grammar": "root ::= missing_rule"}, "invalid grammar"),
        ({"grammar": 'start ::= "a"'}, "invalid grammar"),
    ]
    for constraint, fragment in bad:
        params = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint))
        with pytest.raises(SamplingParamsError, match=fragment) as info:
            engine.add_request("bad", "hello", params)
        assert info.value.param == "structured_outputs"
        assert "/project/" not in str(info.value)  # xgrammar's source location is dropped
    assert not engine.has_unfinished_requests() and engine.num_used_blocks == 0
    out = run(llm, PROMPTS[0], structured(choice=["fine"]))[0].outputs[0]
    assert out.text == "fine"


def test_compiled_grammars_are_cached(llm):
    manager = llm.llm_engine.structured_outputs
    a = manager.compile(StructuredOutputsParams(json={"type": "object", "required": []}))
    b = manager.compile(StructuredOutputsParams(json='{"required": [], "type": "object"}'))
    c = manager.compile(StructuredOutputsParams(json={"type": "object"}))
    assert a is b and a is not c


def test_abort_and_finish_release_matchers_and_blocks(llm):
    engine = llm.llm_engine
    engine.add_request("keep", "hello", structured(regex=r"[a-z]{20,30}", max_tokens=40))
    engine.add_request("done", "hello", structured(choice=["x"]))
    kept = engine.core._seq_owner["keep"][1]
    done = engine.core._seq_owner["done"][1]
    assert kept.matcher is not None and done.matcher is not None
    finished = []
    for _ in range(4):
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["done"] and done.matcher is None
    engine.abort_request("keep")
    assert kept.matcher is None
    assert not engine.has_unfinished_requests() and engine.num_used_blocks == 0
