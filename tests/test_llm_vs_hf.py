"""End to end through the offline ``LLM`` API on CPU, token-exact against Hugging Face.

Many mixed-length prompts go in together with a tiny block size, a small token budget and a small
KV cache, so chunked prefill, prefix reuse and preemption all happen in the same run; the tests
check that they did.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.testing.tiny_models import build_tiny_model

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
NUM_NEW = 32


@pytest.fixture(scope="module", params=ARCHS)
def arch_model(request, tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, path


def hf_greedy(model, prompt_ids: list[int], num_new: int) -> tuple[list[int], list[float]]:
    """Greedy decoding with transformers' own forward and KV cache; returns the tokens and each
    chosen token's logprob."""
    ids = torch.tensor([prompt_ids])
    past = None
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(num_new):
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
            token = int(logp.argmax())
            tokens.append(token)
            logprobs.append(float(logp[token]))
            ids = torch.tensor([[token]])
    return tokens, logprobs


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 3, 5, 8, 13, 17, 31, 40, 64, 77, 100, 128, 150, 200, 256, 300]
    prompts = [[rng.randrange(10, vocab) for _ in range(n)] for n in lengths]
    # Shared prefixes so the prefix cache is exercised: two prompts extend prompt 11.
    prompts.append(prompts[11] + [rng.randrange(10, vocab) for _ in range(9)])
    prompts.append(prompts[11][:96] + [rng.randrange(10, vocab) for _ in range(20)])
    return prompts


def test_greedy_matches_transformers(arch_model):
    from transformers import AutoModelForCausalLM

    arch, path = arch_model
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(
        model=str(path),
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        num_gpu_blocks_override=160,
        enable_prefix_caching=True,
    )
    prompts = make_prompts(hf.config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    for prompt, out in zip(prompts, outputs, strict=True):
        want_tokens, want_logprobs = hf_greedy(hf, prompt, NUM_NEW)
        completion = out.outputs[0]
        assert out.prompt_token_ids == prompt
        assert completion.token_ids == want_tokens, f"{arch}: prompt of {len(prompt)} tokens"
        assert completion.finish_reason == "length"
        got = [completion.logprobs[i][t].logprob for i, t in enumerate(completion.token_ids)]
        assert got == pytest.approx(want_logprobs, abs=1e-4)
        for step in completion.logprobs:  # the sampled token plus the top-2
            assert 1 <= len(step) <= 3

    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0, "the small cache should have forced preemption"
    assert stats.prefix_cache_hits > 0, "shared prefixes should have hit the prefix cache"
    assert llm.llm_engine.num_used_blocks == 0, "every block is free again when idle"
    assert llm.llm_engine.scheduler.stats().num_running == 0


@pytest.fixture(scope="module")
def llama_llm(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("llama_api"), "llama")
    return LLM(
        model=str(path),
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=48,
        num_gpu_blocks_override=256,
        enable_prefix_caching=False,
    )


def test_seeded_sampling_is_batch_independent(llama_llm):
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llama_llm.generate("The quick brown fox", params, use_tqdm=False)[0]
    others = [
        SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24),
        SamplingParams(temperature=0.7, seed=7, max_tokens=24, ignore_eos=True),
    ]
    batch = llama_llm.generate(
        ["A paged KV cache", "Numbers 0123", "The quick brown fox", "café 東京"],
        [others[0], others[1], params, others[2]],
        use_tqdm=False,
    )
    assert batch[2].outputs[0].token_ids == alone.outputs[0].token_ids
    assert len(alone.outputs[0].token_ids) == 24


def test_n4_shares_prompt_blocks_and_matches_greedy(llama_llm):
    engine = llama_llm.llm_engine
    prompt = list(range(20, 30))  # 10 tokens = 2 full blocks + a partial one (block size 4)
    engine.add_request(
        "n4",
        None,
        SamplingParams(n=4, temperature=0.0, max_tokens=8, ignore_eos=True),
        prompt_token_ids=prompt,
    )
    engine.step()  # prefill, sample 4 first tokens, fork
    assert engine.num_used_blocks == 3, "the prompt's blocks must be allocated once"
    outputs = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs = out
    assert engine.num_used_blocks == 0
    single = (
        llama_llm.generate(
            {"prompt_token_ids": prompt},
            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    assert [c.index for c in outputs.outputs] == [0, 1, 2, 3]
    for completion in outputs.outputs:  # copy-on-write kept every child's KV right
        assert completion.token_ids == single


def test_n_seeded_children_differ_and_are_reproducible(llama_llm):
    params = SamplingParams(n=3, temperature=1.0, seed=99, max_tokens=12, ignore_eos=True)
    first = llama_llm.generate("Continuous batching", params, use_tqdm=False)[0]
    second = llama_llm.generate("Continuous batching", params, use_tqdm=False)[0]
    tokens = [c.token_ids for c in first.outputs]
    assert tokens == [c.token_ids for c in second.outputs]
    assert len({tuple(t) for t in tokens}) > 1


def test_stop_strings_and_stop_tokens(llama_llm):
    base = llama_llm.generate(
        "The quick", SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )[0]
    text, ids = base.outputs[0].text, base.outputs[0].token_ids
    assert len(text) > 4
    stop = text[2:4]
    out = llama_llm.generate(
        "The quick",
        SamplingParams(temperature=0.0, max_tokens=16, stop=stop, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    out = llama_llm.generate(
        "The quick",
        SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[ids[3]], ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == ids[: ids.index(ids[3]) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == ids[3]


def test_chat_applies_template(llama_llm):
    out = llama_llm.chat(
        [{"role": "user", "content": "hi"}],
        SamplingParams(temperature=0.0, max_tokens=4),
        use_tqdm=False,
    )[0]
    tok = llama_llm.get_tokenizer()
    want = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert out.prompt_token_ids == tok(want, add_special_tokens=False).input_ids


def test_chat_passes_tools_and_template_options(llama_llm):
    """tools, chat_template_kwargs and continue_final_message reach the template (vLLM's
    LLM.chat); the prompt is exactly what the template renders from them."""
    from engine.errors import InvalidRequestError

    template = (
        "{% if tools %}tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}|"
        "{% endif %}{% if style %}style={{ style }}|{% endif %}"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
        "{% if not loop.last or not continue_final_message %}|{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The"}]
    tok = llama_llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=2)
    out = llama_llm.chat(messages, params, use_tqdm=False, chat_template=template, tools=tools,
                         chat_template_kwargs={"style": "terse"}, add_generation_prompt=False,
                         continue_final_message=True)[0]  # fmt: skip
    text = "tools: get_weather|style=terse|user: hi|assistant: The"
    assert tok.decode(out.prompt_token_ids, skip_special_tokens=True) == text
    plain = llama_llm.chat(messages[:1], params, use_tqdm=False, chat_template=template)[0]
    assert tok.decode(plain.prompt_token_ids, skip_special_tokens=True) == "user: hi|assistant:"
    with pytest.raises(InvalidRequestError, match="add_generation_prompt=False"):
        llama_llm.chat(messages, params, chat_template=template, continue_final_message=True)


def test_bad_input_is_rejected_before_work(llama_llm, tmp_path):
    from engine.errors import InvalidRequestError, PromptTooLongError
    from engine.sampling_params import SamplingParamsError

    engine = llama_llm.llm_engine
    too_long = [5] * engine.max_model_len
    with pytest.raises(PromptTooLongError, match="maximum context length"):
        llama_llm.generate(
            ["fine", {"prompt_token_ids": too_long}], SamplingParams(max_tokens=2), use_tqdm=False
        )
    assert not engine.has_unfinished_requests() and engine.num_used_blocks == 0
    for kwargs, field in [
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"logprobs": 1000}, "logprobs"),
    ]:
        with pytest.raises(SamplingParamsError) as err:
            SamplingParams(**kwargs)
        assert err.value.param == field and field in str(err.value)
    with pytest.raises(InvalidRequestError, match="token ids"):
        llama_llm.generate({"prompt_token_ids": [10**9]}, use_tqdm=False)
    # Still serving afterwards.
    assert (
        llama_llm.generate("ok", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )


def test_missing_model_dir_is_a_clear_error(tmp_path):
    with pytest.raises(Exception, match="does-not-exist"):
        LLM(model=str(tmp_path / "does-not-exist"))
