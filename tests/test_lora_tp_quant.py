"""LoRA composed with quantization and tensor parallelism, end to end on the CPU.

* An AWQ 4-bit base with LoRA adapters gives the greedy tokens of its *dequantized reference*
  (the same model with every quantized weight replaced by its exact dequantized value, run
  unquantized) with the same adapters: ``LoRALinearMethod`` wraps the quantization method and
  adds the same ``x @ A @ B`` to its output.
* The same at TP=2 over the ``mp`` executor (two gloo worker processes): the step messages carry
  each new request's adapter key, every rank loads its shard of each adapter (column-parallel
  layers B's rows, row-parallel layers A's columns, summed by the layer's all-reduce) and maps
  it to its own slot; tokens equal TP=1's, for a batch mixing two adapters and the base model.
* An adapter a rank cannot serve (a rank above ``--max-lora-rank``) is refused with the
  ``LoRAAdapterError`` the rank gave, and the workers keep serving.
* LoRA with pipeline parallelism is refused at start (a stage holds only its layers).
"""

from __future__ import annotations

import random

import pytest

from engine import LLM, LoRARequest, SamplingParams
from engine.lora.errors import LoRAAdapterError
from engine.testing import quantized_models as qm
from engine.testing.lora import make_peft_adapter
from engine.testing.tiny_models import build_tokenizer, save_tiny_model

KW = dict(dtype="float32", block_size=4, max_num_batched_tokens=64, max_num_seqs=8,
          num_gpu_blocks_override=96, max_model_len=128, enable_lora=True, max_loras=2,
          max_lora_rank=8)  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_tp_quant")
    src = root / "src"
    tok = build_tokenizer(src)
    save_tiny_model("llama", src, vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, initializer_range=0.1, bos_token_id=tok.bos_token_id,
                    eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    build_tokenizer(src)
    awq, reference = qm.write_awq(src, root / "awq", root / "ref", group_size=32)
    adapters = {
        "all": make_peft_adapter(src, root / "all", rank=8, seed=1),
        "attn": make_peft_adapter(
            src, root / "attn", rank=4, seed=2, targets=["q_proj", "v_proj", "o_proj"]
        ),  # fmt: skip
        "too-big": make_peft_adapter(src, root / "big", rank=16, seed=3),
    }
    return awq, reference, adapters


def _run(llm: LLM, prompts, loras) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, lora_request=loras, use_tqdm=False
    )
    assert llm.llm_engine.num_used_blocks == 0
    return [list(o.outputs[0].token_ids) for o in outs]


def test_lora_on_a_quantized_base_at_two_ranks_matches_the_dequantized_reference(models):
    awq, reference, adapters = models
    rng = random.Random(11)
    prompts = [[rng.randrange(10, 250) for _ in range(n)] for n in (4, 13, 27, 6)]
    a = LoRARequest("all", 1, str(adapters["all"]))
    b = LoRARequest("attn", 2, str(adapters["attn"]))
    loras = [a, b, None, a]
    results = {}
    for name, path, extra in (
        ("reference", reference, {}),
        ("awq", awq, {}),
        ("awq-tp2", awq, {"tensor_parallel_size": 2}),
    ):
        llm = LLM(str(path), **KW, **extra)
        try:
            if extra:
                assert llm.llm_engine.runner.name == "mp"
            results[name] = _run(llm, prompts, loras)
            if extra:
                big = LoRARequest("too-big", 3, str(adapters["too-big"]))
                with pytest.raises(LoRAAdapterError, match=r"rank 16.*max.lora.rank.*8"):
                    llm.llm_engine.add_lora(big)
                assert 3 not in llm.llm_engine.list_loras()
                assert _run(llm, prompts[:2], loras[:2]) == results[name][:2]  # still serving
        finally:
            llm.llm_engine.shutdown()
    assert results["awq"] == results["reference"]
    assert results["awq-tp2"] == results["awq"]
    # The adapters changed the tokens (the base row and the adapter rows differ).
    assert results["reference"][0] != _base_tokens(reference, prompts[0])


def _base_tokens(path, prompt) -> list[int]:
    llm = LLM(str(path), **KW)
    try:
        return _run(llm, [prompt], None)[0]
    finally:
        llm.llm_engine.shutdown()


def test_lora_with_pipeline_parallelism_is_refused_at_start(models):
    from engine.config import ConfigError

    _, reference, _ = models
    with pytest.raises(
        ConfigError, match=r"--enable-lora with pipeline_parallel_size=2 is not supported yet"
    ):
        LLM(str(reference), pipeline_parallel_size=2, **KW)
