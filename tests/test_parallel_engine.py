"""Tensor and pipeline parallelism end to end on the CPU: gloo, one worker process per rank.

Each layout (TP=2 with asynchronous scheduling, PP=2 with a micro-batch per stage in flight,
and TP=2 x PP=2 on Llama) runs a batch of mixed-length prompts with chunked prefill,
prefix-cache hits and preemption, and must give the greedy tokens of the same model on one
process (float32), with logprobs close to them; every rank of the last stage samples the same
tokens; no KV block leaks. The models: tiny random Llama (4 heads, 2 KV
heads), Qwen3 (q/k norms) and Gemma 3 (2 heads, 1 KV head: replicated over the ranks; sliding
and global layers split over the stages; tied embeddings on a last stage without the
embedding; served text-only there, images under TP=2 in their own test, refused under PP). Engines are module-scoped: starting worker processes is the slow part.
"""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.testing.tiny_models import build_tiny_gemma3_multimodal, build_tiny_model

ENGINE_KW = dict(
    dtype="float32",
    max_model_len=256,
    block_size=8,
    max_num_batched_tokens=48,  # long prompts are prefilled in chunks
    max_num_seqs=6,
    num_gpu_blocks_override=20,  # small enough that long requests preempt others
    enable_prefix_caching=True,
)
LAYOUTS = {
    # One step ahead: each rank feeds its own sampled tokens back on its device.
    "tp2": dict(tensor_parallel_size=2, async_scheduling=True),
    "pp2": dict(pipeline_parallel_size=2),  # asynchronous by default: a micro-batch per stage
}
NUM_NEW = 12


def build(kind: str, root) -> str:
    if kind == "gemma3":
        return str(build_tiny_gemma3_multimodal(root / kind, seed=1))
    return str(build_tiny_model(root / kind, kind, seed=1))


def prompts_for(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """A first batch of mixed lengths, and a second whose prompts extend the first's (so their
    prefixes come from the cache)."""
    rng = random.Random(7)
    first = [[rng.randrange(10, vocab - 10) for _ in range(n)] for n in (1, 5, 17, 60, 3, 33)]
    second = [first[3] + [rng.randrange(10, vocab - 10) for _ in range(4)], first[5][:24] + [11]]
    return first, second


def greedy(llm: LLM, prompts: list[list[int]], logprobs: int | None = None):
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=logprobs)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma3"])
def reference(request, tmp_path_factory):
    """One model, its single-process engine and its outputs."""
    path = build(request.param, tmp_path_factory.mktemp("models"))
    llm = LLM(path, **ENGINE_KW)
    vocab = llm.llm_engine.runner.vocab_size
    first, second = prompts_for(vocab)
    expected = [greedy(llm, first), greedy(llm, second), greedy(llm, first[:3], logprobs=3)]
    yield request.param, path, (first, second), expected
    llm.llm_engine.shutdown()


def run_and_compare(llm: LLM, kind: str, prompts, expected) -> None:
    engine = llm.llm_engine
    engine.runner.collective_rpc("record_samples", True)
    in_flight: list[int] = []
    step = engine.step

    def recording_step():
        out = step()
        in_flight.append(len(engine.core._in_flight))
        return out

    engine.step = recording_step
    first, second = prompts
    got = [greedy(llm, first), greedy(llm, second), greedy(llm, first[:3], logprobs=3)]
    # Pipeline stages had one micro-batch each in flight; otherwise one step ahead.
    assert max(in_flight) == llm.config.parallel.pipeline_parallel_size
    for batch, want in zip(got, expected, strict=True):
        for out, ref in zip(batch, want, strict=True):
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids, out.request_id
    # The same prefix-cache hits as on one process; the second batch reuses the first's
    # prompts (except Gemma 3's, whose sliding-window blocks the small cache evicts first).
    hits = [o.num_cached_tokens for o in got[1]]
    assert hits == [o.num_cached_tokens for o in expected[1]]
    assert sum(hits) > 0 or kind == "gemma3"
    # Logits close to the single-process model's (not only the argmax).
    for out, ref in zip(got[2], expected[2], strict=True):
        for lp, ref_lp in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs, strict=True):
            assert set(lp) == set(ref_lp)
            for token, entry in lp.items():
                assert abs(entry.logprob - ref_lp[token].logprob) < 1e-4
    assert engine.num_used_blocks == 0 and not engine.has_unfinished_requests()
    assert engine.scheduler.num_preemptions > 0  # the small cache made requests preempt
    # Every rank of the last stage sampled the same tokens.
    digests = [d for d in engine.runner.collective_rpc("samples_digest") if d is not None]
    world = llm.config.parallel
    assert len(digests) == world.tensor_parallel_size and len(set(digests)) == 1


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_layout_matches_one_process(reference, layout):
    kind, path, prompts, expected = reference
    # Gemma 3 served text-only here (images: test_images_under_tensor_parallelism).
    text_only = {"limit_mm_per_prompt": {"image": 0}} if kind == "gemma3" else {}
    llm = LLM(path, **ENGINE_KW, **LAYOUTS[layout], **text_only)
    try:
        assert llm.llm_engine.runner.name == "mp"
        assert llm.llm_engine.image_input_spec is None
        run_and_compare(llm, kind, prompts, expected)
    finally:
        llm.llm_engine.shutdown()


def _image(seed: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (40, 70, 3), dtype=np.uint8))


def test_images_under_tensor_parallelism(tmp_path):
    """Gemma 3 with images on two ranks: the step message carries each new request's images
    and the encoder-cache plan, every rank runs its shard of the vision tower, and the greedy
    tokens equal the single process's (which tests/test_gemma3_vision.py checks against
    transformers); a repeated image is encoded once on every rank; nothing leaks."""
    path = str(build_tiny_gemma3_multimodal(tmp_path / "gemma3", seed=1))
    kw = {**ENGINE_KW, "num_gpu_blocks_override": 80}
    prompts = [
        {
            "prompt": "Compare <start_of_image> with <start_of_image> please",
            "multi_modal_data": {"image": [_image(1), _image(2)]},
        },
        "A text prompt about the quick brown fox",
        {"prompt": "Again: <start_of_image>", "multi_modal_data": {"image": _image(1)}},
    ]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    reference = LLM(path, **kw)
    want = [o.outputs[0].token_ids for o in reference.generate(prompts, params, use_tqdm=False)]
    reference.llm_engine.shutdown()
    llm = LLM(path, **kw, tensor_parallel_size=2)
    try:
        engine = llm.llm_engine
        assert engine.runner.name == "mp" and engine.image_input_spec is not None
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want
        assert engine.num_used_blocks == 0
        assert engine.scheduler.encoder_cache.num_held == 0
        stats = engine.get_stats()
        assert (stats.encoder_cache_queries, stats.encoder_cache_hits) == (3, 1)
        encoded = engine.runner.collective_rpc("num_images_encoded")
        assert encoded == [2, 2]  # two distinct images, on each rank
    finally:
        llm.llm_engine.shutdown()


def test_images_under_pipeline_parallelism_are_refused_at_start(tmp_path):
    """Image embeddings would have to replace token embeddings on the first stage: refused
    before any worker starts, with what to do instead."""
    from engine.config import ConfigError

    path = build_tiny_gemma3_multimodal(tmp_path / "gemma3", seed=1)
    with pytest.raises(ConfigError) as e:
        LLM(str(path), **ENGINE_KW, pipeline_parallel_size=2)
    message = str(e.value)
    assert "image inputs are not supported with pipeline_parallel_size=2" in message
    assert "--limit-mm-per-prompt '{\"image\": 0}'" in message


def test_tp2_x_pp2_on_four_processes(reference):
    kind, path, prompts, expected = reference
    if kind != "llama":
        pytest.skip("four processes once (Llama) keep the suite fast")
    llm = LLM(path, **ENGINE_KW, tensor_parallel_size=2, pipeline_parallel_size=2)
    try:
        info = llm.llm_engine.runner.collective_rpc("describe")
        assert [(i["tp_rank"], i["pp_rank"]) for i in info] == [(0, 0), (1, 0), (0, 1), (1, 1)]
        assert [i["num_attention_layers"] for i in info] == [1, 1, 1, 1]  # 2 layers, 2 stages
        run_and_compare(llm, kind, prompts, expected)
        # The benchmarks' collective timing: all-reduces in every TP group, the stage
        # boundary as one send (stage 0) and one recv (stage 1) per step.
        executor = llm.llm_engine.runner
        executor.collective_rpc("time_collectives", True)
        greedy(llm, prompts[0][:2])
        stats = executor.collective_rpc("collective_stats")
        executor.collective_rpc("time_collectives", False)
        for rank, s in enumerate(stats):
            assert s["all_reduce"]["calls"] > 0 and s["step_seconds"] > 0
            assert ("send" in s) == (rank < 2) and ("recv" in s) == (rank >= 2)
        sends = [s["send"]["calls"] for s in stats[:2]]
        recvs = [s["recv"]["calls"] for s in stats[2:]]
        assert sends == recvs and sends[0] >= NUM_NEW  # one per step, paired across stages
    finally:
        llm.llm_engine.shutdown()
