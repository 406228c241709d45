"""``LLM(skip_tokenizer_init=True)`` / ``--skip-tokenizer-init``, as in vLLM: no tokenizer is
loaded, prompts are token ids, outputs carry token ids and empty text.

The models here have no tokenizer files at all: one folder holds config.json and random
safetensors weights written by transformers (so the tokens can be checked against it), the
other only config.json (a ``--load-format dummy`` benchmark of a shape).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParamsError, StructuredOutputsParams
from engine.testing.tiny_models import save_tiny_model
from engine.tokenizer import TokenizerLoadError

ENGINE_ARGS = dict(
    dtype="float32",
    max_model_len=128,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    block_size=8,
    skip_tokenizer_init=True,
)
PROMPTS = [[5, 17, 33, 9], [100, 3, 3, 3, 3, 8, 250], [42]]


@pytest.fixture(scope="module")
def weights_only(tmp_path_factory):
    """config.json + model.safetensors written by transformers, no tokenizer files."""
    path = save_tiny_model("llama", tmp_path_factory.mktemp("no-tokenizer"), seed=4)
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    return path


@pytest.fixture(scope="module")
def config_only(weights_only, tmp_path_factory):
    path = tmp_path_factory.mktemp("config-only")
    shutil.copy(weights_only / "config.json", path / "config.json")
    return path


@pytest.fixture(scope="module")
def llm(weights_only):
    return LLM(str(weights_only), **ENGINE_ARGS)


def hf_greedy(path, prompt: list[int], num_new: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=num_new,
            min_new_tokens=num_new,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def test_without_the_flag_a_folder_without_tokenizer_fails(weights_only):
    """The reproducer: the engine tries to load a tokenizer the folder does not have."""
    args = {k: v for k, v in ENGINE_ARGS.items() if k != "skip_tokenizer_init"}
    with pytest.raises(TokenizerLoadError):
        LLM(str(weights_only), **args)


def test_token_ids_in_token_ids_out_exact_against_transformers(llm, weights_only):
    assert llm.get_tokenizer() is None
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [PROMPTS[0], {"prompt_token_ids": PROMPTS[1]}, {"prompt_token_ids": PROMPTS[2]}]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.prompt is None and out.prompt_token_ids == prompt
        completion = out.outputs[0]
        assert completion.text == ""  # as vLLM: no detokenizer, so no text
        assert completion.token_ids == hf_greedy(weights_only, prompt, 6)
        assert completion.finish_reason == "length"
    assert llm.llm_engine.num_used_blocks == 0


def test_eos_comes_from_the_model_config(llm, weights_only):
    """Without a tokenizer, config.json's eos_token_id still ends generation."""
    eos = json.loads((weights_only / "config.json").read_text())["eos_token_id"]
    assert eos in llm.llm_engine.eos_token_ids
    params = SamplingParams(temperature=0.0, max_tokens=5, logit_bias={eos: 100.0})
    out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == ([eos], "stop")


def test_logprobs_carry_ids_and_no_decoded_text(llm):
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=2, prompt_logprobs=1)
    out = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0]
    entries = [e for e in out.prompt_logprobs if e is not None] + out.outputs[0].logprobs
    assert len(entries) == len(PROMPTS[1]) - 1 + 3
    for entry in entries:
        assert entry and all(lp.decoded_token is None for lp in entry.values())
    for token, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True):
        assert token in entry


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda llm: llm.generate("Hello", use_tqdm=False), InvalidRequestError, "text prompts"),
        (
            lambda llm: llm.generate([[1, 2], "Hello"], use_tqdm=False),
            InvalidRequestError,
            "text prompts",
        ),
        (
            lambda llm: llm.generate([PROMPTS[0]], SamplingParams(stop=["x"]), use_tqdm=False),
            SamplingParamsError,
            "stop strings",
        ),
        (
            lambda llm: llm.generate(
                [PROMPTS[0]],
                SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")),
                use_tqdm=False,
            ),
            SamplingParamsError,
            "structured outputs",
        ),
        (
            lambda llm: llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False),
            InvalidRequestError,
            "skip_tokenizer_init",
        ),
    ],
    ids=["text", "text-in-a-batch", "stop", "structured", "chat"],
)
def test_what_needs_a_tokenizer_is_a_clear_error(llm, call, error, match):
    with pytest.raises(error, match=match) as e:
        call(llm)
    assert "skip_tokenizer_init" in str(e.value)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.num_used_blocks == 0
    # The engine stays usable.
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    assert len(llm.generate([PROMPTS[2]], params, use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_config_only_folder_with_dummy_weights(config_only):
    """A --load-format dummy benchmark of a shape: config.json is all there is."""
    assert [p.name for p in config_only.iterdir()] == ["config.json"]
    llm = LLM(str(config_only), load_format="dummy", **ENGINE_ARGS)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4, 4]
    assert all(o.outputs[0].text == "" for o in outs)
    assert llm.llm_engine.num_used_blocks == 0


def test_cli_flag_bench_on_a_config_only_folder(config_only, tmp_path):
    from engine.cli.main import build_parser, main

    args = build_parser().parse_args(["serve", "--skip-tokenizer-init"])
    assert args.skip_tokenizer_init is True
    assert build_parser().parse_args(["serve"]).skip_tokenizer_init is False
    result = tmp_path / "r.json"
    argv = ["bench", "throughput", str(config_only), "--load-format", "dummy"]
    argv += ["--skip-tokenizer-init", "--no-warmup", "--num-prompts", "3", "--input-len", "8"]
    argv += ["--output-len", "4", "--max-model-len", "64", "--json", str(result)]
    assert main(argv) == 0
    assert json.loads(result.read_text())["output_tokens"] == 12
