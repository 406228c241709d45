"""Quantized checkpoints under tensor parallelism, end to end on the CPU (gloo, one worker
process per rank), against the same checkpoint on one process:

* GPTQ (4-bit, groups of 32, zero points), AWQ (groups of 32) and FP8 (per-tensor scales, one
  per fused slice) at TP=2 give the greedy tokens TP=1 gives: each rank holds its shard of the
  packed weights, scales and zero points (column-parallel layers by output feature, row-parallel
  ones by input feature and scale group), read from the checkpoint in that part only;
* layouts that cannot work are refused at start, before any worker starts, naming the layer
  and the sizes: a group size that does not divide a row-parallel layer's input features on a
  rank, FP8 scale blocks that a rank's output features would split, GPTQ act-order on a
  row-parallel layer; a quantized mixture-of-experts model (no quantized expert method yet).

The checkpoints are written by ``engine.testing.quantized_models`` (as test_quantized_models.py
does) from a tiny Llama: hidden 64, 4 query / 2 key-value heads of 16, intermediate 128.
"""

from __future__ import annotations

import json
import random

import pytest

from engine import LLM, SamplingParams
from engine.quantization import QuantizationError
from engine.testing import quantized_models as qm
from engine.testing.tiny_models import build_tiny_model, build_tokenizer, save_tiny_model

KW = dict(dtype="float32", block_size=4, max_num_batched_tokens=48, max_num_seqs=8,
          num_gpu_blocks_override=96, max_model_len=128)  # fmt: skip


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = save_tiny_model(
        "llama",
        tmp_path_factory.mktemp("quant_tp_src"),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        initializer_range=0.1,
    )
    build_tokenizer(path)
    return path


WRITERS = {
    "gptq": lambda s, q: qm.write_gptq(s, q, None, bits=4, group_size=32, sym=False),
    "awq": lambda s, q: qm.write_awq(s, q, None, group_size=32),
    "fp8": lambda s, q: qm.write_fp8(s, q, None),
}
# (parameter, shape on each of two ranks) after loading: the row-parallel o_proj reads 32 of
# its 64 input features on each rank (one group of 32 for GPTQ/AWQ, in the CPU kernel's
# [groups, N, 2] scales-and-zeros layout), the fused column-parallel qkv_proj computes 32 + 16
# + 16 of its 128 output features.
SHARDS = {
    "gptq": {
        "model.layers.0.self_attn.o_proj.wna16_scales_zeros": (1, 64, 2),
        "model.layers.0.self_attn.qkv_proj.wna16_scales_zeros": (2, 64, 2),
    },
    "fp8": {
        "model.layers.0.self_attn.o_proj.weight": (64, 32),
        "model.layers.0.self_attn.qkv_proj.weight": (64, 64),
        "model.layers.0.mlp.down_proj.weight": (64, 64),
    },
}
SHARDS["awq"] = SHARDS["gptq"]


def token_ids(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("kind", list(WRITERS))
def test_quantized_checkpoint_at_two_ranks_matches_one_process(kind, source, tmp_path):
    quantized, _ = WRITERS[kind](source, tmp_path / kind)
    rng = random.Random(7)
    prompts = [[rng.randrange(10, 250) for _ in range(n)] for n in (3, 11, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    single = LLM(str(quantized), **KW)
    try:
        want = token_ids(single, prompts, params)
    finally:
        single.llm_engine.shutdown()
    llm = LLM(str(quantized), tensor_parallel_size=2, **KW)
    try:
        engine = llm.llm_engine
        assert engine.runner.name == "mp"
        for rank in engine.runner.collective_rpc("describe"):
            for name, shape in SHARDS[kind].items():
                assert rank["parameters"][name] == shape, (rank["tp_rank"], name)
        assert token_ids(llm, prompts, params) == want
        assert engine.num_used_blocks == 0 and not engine.has_unfinished_requests()
    finally:
        llm.llm_engine.shutdown()


def test_quantized_layouts_that_cannot_work_are_refused_at_start(source, tmp_path):
    # Groups of 64 input features: o_proj's 64 inputs give each of two ranks 32, half a group.
    gptq64, _ = qm.write_gptq(source, tmp_path / "g64", None, bits=4, group_size=64)
    with pytest.raises(
        QuantizationError,
        match=r"'gptq' at tensor_parallel_size=2: model\.layers\.0\.self_attn\.o_proj: 32 "
        r"input features are not a multiple of the group size 64",
    ):
        LLM(str(gptq64), tensor_parallel_size=2, **KW)
    single = LLM(str(gptq64), **KW)  # one process holds whole groups
    try:
        assert token_ids(single, [[5, 6]], SamplingParams(max_tokens=2)) != [[]]
    finally:
        single.llm_engine.shutdown()
    # FP8 scale blocks of 32 output features: k_proj's 32 outputs give each rank 16.
    block, _ = qm.write_fp8(source, tmp_path / "block", None, block=(32, 32))
    with pytest.raises(
        QuantizationError,
        match=r"'fp8' at tensor_parallel_size=2: model\.layers\.0\.self_attn\.qkv_proj: a "
        r"fused output slice of 16 features is not a multiple of the 32-row FP8 weight blocks",
    ):
        LLM(str(block), tensor_parallel_size=2, **KW)
    # Act-order: a rank's input features of a row-parallel layer fall in any group.
    act, _ = qm.write_gptq(source, tmp_path / "act", None, bits=4, group_size=32, desc_act=True)
    with pytest.raises(
        QuantizationError,
        match=r"o_proj is row-parallel and the checkpoint is act-order \(desc_act\) with "
        r"group_size 32",
    ):
        LLM(str(act), tensor_parallel_size=2, **KW)


def test_a_mixture_of_experts_model_with_act_order_experts_is_refused_at_start(tmp_path):
    """GPTQ experts run (tests/test_wna16_moe.py), act-order ones too on one rank, but not
    split over tensor-parallel ranks: refused before any weight is read, saying why."""
    # 64-wide experts: each rank's 32 features are one whole group (only act-order splits).
    moe = build_tiny_model(tmp_path / "moe", "qwen3_moe", seed=2, moe_intermediate_size=64)
    gptq, _ = qm.write_gptq(moe, tmp_path / "gptq", None, bits=4, group_size=32, desc_act=True)
    assert "quantization_config" in json.loads((gptq / "config.json").read_text())
    with pytest.raises(
        QuantizationError,
        match=r"'gptq' at tensor_parallel_size=2: model\.layers\.0\.mlp\.experts: act-order "
        r"experts \(gptq 4-bit g32 act-order\) split over 2 tensor-parallel ranks",
    ):
        LLM(str(gptq), tensor_parallel_size=2, **KW)
