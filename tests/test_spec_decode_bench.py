"""The speculative-decoding benchmark commands run end to end on a tiny model (so the GPU
commands in docs/benchmarks.md do not fail for the first time on the GPU): acceptance in the
records, fewer steps than tokens, identical tokens with and without speculation."""

from __future__ import annotations

import json

import pytest

from engine.testing.tiny_models import build_tokenizer, save_tiny_model

NGRAM = ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
         '"prompt_lookup_min": 2}')  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench_model")
    tok = build_tokenizer(path)
    return str(save_tiny_model("llama", path, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                               initializer_range=0.05))  # fmt: skip


def test_latency_self_continuation(model, tmp_path):
    from engine.benchmarks.latency import main

    out = tmp_path / "latency.json"
    args = ["--model", model, "--dtype", "float32", "--batch-sizes", "1,3", "--input-len", "12",
            "--output-len", "24", "--num-iters", "1", "--self-continuation",
            "--speculative-config", NGRAM, "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    record = json.loads(out.read_text())
    assert record["self_continuation"] and record["speculative_config"]["method"] == "ngram"
    for row in record["results"]:
        assert row["num_drafts"] > 0 and 0 < row["acceptance_rate"] <= 1
        assert row["decode_steps"] < 23 and row["tokens_per_step"] > 1  # several per step
        assert len(row["acceptance_per_position"]) == 4


def test_copy_task_benchmark(model, tmp_path):
    from engine.benchmarks.spec_decode import main

    out = tmp_path / "spec.json"
    args = ["--model", model, "--dtype", "float32", "--max-tokens", "24", "--num-iters", "1",
            "--max-model-len", "512", "--json", str(out)]  # fmt: skip
    assert main(args) == 0  # 0: both engines produced the same tokens
    record = json.loads(out.read_text())
    assert record["same_tokens"] and record["speculative"]["num_drafts"] > 0
