"""Gemma 3 with images (``Gemma3ForConditionalGeneration``) against transformers.

A tiny random Gemma 3 vision model (2-layer SigLIP on 56 px images, 4 soft tokens per image,
the 6-layer text model with a sliding window of 8) and its ``Gemma3Processor`` are written by
transformers (``build_tiny_gemma3_multimodal``). Greedy tokens must equal
``Gemma3ForConditionalGeneration.generate`` on the processor's inputs (which include the
bidirectional mask over each image's tokens) for: one image, two images in a prompt, a batch
mixing image and text requests, chunk boundaries that would split an image, a repeated image
(encoded once), the prefix cache (same text with another image must not hit), preemption,
n-gram speculation, and ``LLM.chat`` with ``image_url`` parts. Nothing leaks: KV blocks and encoder-cache holds are
zero when idle, and the runner's cache holds exactly what the scheduler's mirror says.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.testing.tiny_models import build_tiny_gemma3_multimodal

N = 10  # new tokens per request


def make_image(seed: int, size: tuple[int, int] = (40, 70)):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    path = build_tiny_gemma3_multimodal(tmp_path_factory.mktemp("gemma3v"), seed=5)
    hf = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf, AutoProcessor.from_pretrained(path)


def hf_generate(model, prompt: str, images: list) -> tuple[list[int], list[int]]:
    """transformers' greedy tokens (EOS suppressed, as ``min_tokens`` does) and the prompt."""
    _, hf, processor = model
    inputs = processor(text=[prompt], images=[images] if images else None, return_tensors="pt")
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=N, min_new_tokens=N, do_sample=False)
    prompt_ids = inputs["input_ids"][0].tolist()
    return out[0, len(prompt_ids) :].tolist(), prompt_ids


def tiny_llm(path, **kw) -> LLM:
    args = dict(
        model=str(path),
        block_size=4,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        max_model_len=256,
        num_gpu_blocks_override=200,
        enable_prefix_caching=True,
    )
    return LLM(**{**args, **kw})


PARAMS = SamplingParams(temperature=0.0, max_tokens=N, min_tokens=N)


def run(llm: LLM, prompts: list[tuple[str, list]]):
    return llm.generate(
        [{"prompt": p, "multi_modal_data": {"image": imgs}} if imgs else p for p, imgs in prompts],
        PARAMS,
        use_tqdm=False,
    )


def assert_idle_and_consistent(llm: LLM) -> None:
    """No KV block held, no image held by a request, runner cache == the scheduler's mirror,
    within its budget."""
    engine = llm.llm_engine
    assert engine.num_used_blocks == 0
    mirror = engine.scheduler.encoder_cache
    runner = engine.runner.mm
    assert mirror.num_held == 0
    assert set(runner.cache) == mirror.cached_hashes()
    assert runner.cache_bytes == mirror.used_bytes <= mirror.capacity


def test_one_image_matches_transformers(model):
    path, hf, _ = model
    llm = tiny_llm(path)
    prompt = "<start_of_turn>user\nWhat is in <start_of_image> this picture?"
    want, prompt_ids = hf_generate(model, prompt, [make_image(1)])
    out = run(llm, [(prompt, [make_image(1)])])[0]
    assert out.prompt_token_ids == prompt_ids  # the processor placed the image tokens
    assert out.outputs[0].token_ids == want
    # Prompt logprobs equal transformers' forward with its bidirectional image mask, and
    # differ from the same forward with causal image tokens: the mask is what is tested.
    _, hf_model, processor = model
    inputs = processor(text=[prompt], images=[[make_image(1)]], return_tensors="pt")
    with torch.no_grad():
        bidir = torch.log_softmax(hf_model(**inputs).logits[0].float(), -1)
        causal_inputs = {k: v for k, v in inputs.items() if k != "token_type_ids"}
        causal = torch.log_softmax(hf_model(**causal_inputs).logits[0].float(), -1)
    scored = llm.generate(
        {"prompt": prompt, "multi_modal_data": {"image": make_image(1)}},
        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
        use_tqdm=False,
    )[0]
    nxt = torch.tensor(prompt_ids[1:])
    want_lp = bidir[:-1].gather(1, nxt[:, None])[:, 0]
    causal_lp = causal[:-1].gather(1, nxt[:, None])[:, 0]
    got_lp = torch.tensor(
        [
            entry[t].logprob
            for entry, t in zip(scored.prompt_logprobs[1:], prompt_ids[1:], strict=True)
        ]
    )
    torch.testing.assert_close(got_lp, want_lp, atol=1e-4, rtol=0)
    assert (got_lp - causal_lp).abs().max() > 1e-3
    assert llm.llm_engine.runner.mm.num_encoded == 1
    assert_idle_and_consistent(llm)


def test_two_images_and_a_mixed_batch(model):
    path, _, _ = model
    llm = tiny_llm(path, max_num_batched_tokens=64)
    prompts = [
        ("Compare <start_of_image> with <start_of_image> please", [make_image(2), make_image(3)]),
        ("A text prompt about the quick brown fox", []),
        ("<start_of_image>", [make_image(4, (80, 20))]),
        ("Numbers 0123456789 and more text before <start_of_image> then after", [make_image(5)]),
        ("Another text one", []),
    ]
    outs = run(llm, prompts)
    for (prompt, images), out in zip(prompts, outs, strict=True):
        want, prompt_ids = hf_generate(model, prompt, images)
        assert out.prompt_token_ids == prompt_ids
        assert out.outputs[0].token_ids == want, prompt
    assert llm.llm_engine.runner.mm.num_encoded == 4
    assert_idle_and_consistent(llm)


def test_chunk_boundaries_never_split_an_image(model, monkeypatch):
    """A step budget that would end a chunk inside an image: the chunk stops before the image
    (whose tokens attend to each other both ways) and the next one computes it whole."""
    path, _, processor = model
    llm = tiny_llm(path, max_num_batched_tokens=16)
    prompt = "The quick brown fox jumps over the lazy dog <start_of_image> and <start_of_image>."
    images = [make_image(6), make_image(7)]
    want, prompt_ids = hf_generate(model, prompt, images)
    token = llm.llm_engine.image_input_spec.placeholder_token_id
    runs = [i for i, t in enumerate(prompt_ids) if t == token]
    first = runs[0]
    assert first % 16 > 12, "the first image must straddle a 16-token step boundary"

    scheduler = llm.llm_engine.scheduler
    chunks = []
    real = scheduler.schedule

    def spy():
        out = real()
        chunks.extend((s.start, s.start + s.num_new_tokens) for s in out.scheduled)
        return out

    monkeypatch.setattr(scheduler, "schedule", spy)
    out = run(llm, [(prompt, images)])[0]
    assert out.outputs[0].token_ids == want
    spans = [(f0, f0 + 4) for f0 in (runs[0], runs[4])]
    for start, end in chunks:
        for s, e in spans:
            assert not (start < e and s < end) or (start <= s and e <= end), (start, end, s, e)
    # The second chunk's budget would have ended it at 32, inside the first image: it stops
    # where the image starts and the next chunk takes the image whole.
    assert chunks[:2] == [(0, 16), (16, first)]
    assert_idle_and_consistent(llm)


def test_repeated_image_is_encoded_once(model):
    path, _, _ = model
    llm = tiny_llm(path)
    image = make_image(8)
    prompt = "Look: <start_of_image>"
    want, _ = hf_generate(model, prompt, [image])
    # Twice in one batch, once more later, and twice within one prompt.
    outs = run(llm, [(prompt, [image]), ("Again <start_of_image>", [make_image(8)])])
    assert outs[0].outputs[0].token_ids == want
    assert outs[1].outputs[0].token_ids == hf_generate(model, "Again <start_of_image>", [image])[0]
    both = "Twice <start_of_image> and <start_of_image>"
    out = run(llm, [(both, [image, image])])[0]
    assert out.outputs[0].token_ids == hf_generate(model, both, [image, image])[0]
    engine = llm.llm_engine
    assert engine.runner.mm.num_encoded == 1
    stats = engine.get_stats()
    assert stats.encoder_cache_queries == 4 and stats.encoder_cache_hits == 3
    assert_idle_and_consistent(llm)


def test_prefix_cache_keys_blocks_by_image(model):
    """The same prompt text with another image must not reuse the first image's KV; with
    the same image it does, past the image."""
    path, _, _ = model
    llm = tiny_llm(path)
    prefix = "A long shared prefix about paged KV caches and blocks, then the image "
    prompt = prefix + "<start_of_image> and a question about it?"
    a, b = make_image(9), make_image(10)
    first = run(llm, [(prompt, [a])])[0]
    other = run(llm, [(prompt, [b])])[0]
    same = run(llm, [(prompt, [a])])[0]
    token = llm.llm_engine.image_input_spec.placeholder_token_id
    offset = first.prompt_token_ids.index(token)
    assert first.outputs[0].token_ids == hf_generate(model, prompt, [a])[0]
    assert other.outputs[0].token_ids == hf_generate(model, prompt, [b])[0]
    assert same.outputs[0].token_ids == first.outputs[0].token_ids
    # Another image: only blocks wholly before the image are shared.
    assert other.num_cached_tokens <= offset
    assert other.num_cached_tokens > 0  # the text prefix still hits
    # The same image: blocks past the image are reused too.
    assert same.num_cached_tokens > offset + 4
    assert_idle_and_consistent(llm)


def test_preemption_recomputes_images(model):
    """A KV cache too small for the batch preempts requests; they resume (the image is
    re-acquired, usually from the encoder cache) and still match transformers."""
    path, _, _ = model
    llm = tiny_llm(path, num_gpu_blocks_override=40, max_num_batched_tokens=48)
    prompts = [
        (f"Request {i} looks at <start_of_image> closely", [make_image(20 + i)]) for i in range(4)
    ]
    outs = run(llm, prompts)
    assert llm.llm_engine.get_stats().num_preemptions > 0
    for (prompt, images), out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_generate(model, prompt, images)[0]
    assert_idle_and_consistent(llm)


def test_encoder_cache_budget_evicts_and_stays_in_sync(model):
    """A cache for two images with five distinct ones: entries are evicted (the runner drops
    what the scheduler evicts) and results stay exact."""
    path, _, _ = model
    per_image = 4 * 64 * 4  # tokens x hidden x float32
    llm = tiny_llm(path, mm_encoder_cache_gb=2.5 * per_image / 2**30)
    prompts = [(f"Image {i}: <start_of_image>", [make_image(30 + i)]) for i in range(5)]
    for prompt, images in prompts:
        out = run(llm, [(prompt, images)])[0]
        assert out.outputs[0].token_ids == hf_generate(model, prompt, images)[0]
        assert_idle_and_consistent(llm)
    assert len(llm.llm_engine.runner.mm.cache) == 2


def test_chat_with_image_url_parts(model, tmp_path):
    path, _, processor = model
    image = make_image(11)
    image.save(tmp_path / "cat.png")
    llm = tiny_llm(path, allowed_local_media_path=str(tmp_path))
    for url in (data_url(image), (tmp_path / "cat.png").as_uri()):
        messages = [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ]
        out = llm.chat(messages, PARAMS, use_tqdm=False)[0]
        hf_messages = [
            {
                "role": "user",
                "content": [{"type": "text", "text": "What is this?"}, {"type": "image"}],
            }
        ]
        prompt = processor.apply_chat_template(
            hf_messages, add_generation_prompt=True, tokenize=False
        )
        _, _, hf_proc = model
        inputs = hf_proc(
            text=[prompt], images=[[image]], return_tensors="pt", add_special_tokens=False
        )
        with torch.no_grad():
            ref = model[1].generate(**inputs, max_new_tokens=N, min_new_tokens=N, do_sample=False)
        assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
        assert out.outputs[0].token_ids == ref[0, inputs["input_ids"].shape[1] :].tolist()
    assert_idle_and_consistent(llm)


def test_bad_image_inputs_are_clear_errors(model, tmp_path):
    from engine.errors import InvalidRequestError

    path, _, _ = model
    llm = tiny_llm(path, limit_mm_per_prompt={"image": 1}, max_image_pixels=100 * 100)
    with pytest.raises(InvalidRequestError, match="at most 1 are allowed per prompt"):
        run(llm, [("<start_of_image><start_of_image>", [make_image(1), make_image(2)])])
    with pytest.raises(InvalidRequestError, match="names 0 image"):
        run(llm, [("no placeholder", [make_image(1)])])
    with pytest.raises(InvalidRequestError, match="pixels; at most 10000"):
        run(llm, [("<start_of_image>", [make_image(1, (200, 200))])])
    with pytest.raises(InvalidRequestError, match="file:// image URLs are not allowed"):
        llm.chat(
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": (tmp_path / "x.png").as_uri()}}
                    ],
                }
            ],
            PARAMS,
            use_tqdm=False,
        )
    with pytest.raises(InvalidRequestError, match="not an image"):
        llm.chat(
            [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image_url",
                            "image_url": {
                                "url": "data:image/png;base64,"
                                + base64.b64encode(b"hello").decode()
                            },
                        }
                    ],
                }
            ],
            PARAMS,
            use_tqdm=False,
        )
    assert llm.llm_engine.num_used_blocks == 0
    assert not llm.llm_engine.has_unfinished_requests()


def test_text_only_serving_skips_the_vision_tower(model, caplog):
    """``limit_mm_per_prompt={"image": 0}``: no vision tower, its tensors unread, text
    generation as before, images refused."""
    import logging

    from engine.errors import InvalidRequestError

    path, hf, _ = model
    with caplog.at_level(logging.WARNING, logger="engine.loader.model_loader"):
        llm = tiny_llm(path, limit_mm_per_prompt={"image": 0})
    assert not hasattr(llm.llm_engine.runner.model, "vision_tower")
    assert llm.llm_engine.image_input_spec is None
    assert any(
        "vision_tower." in r.getMessage() and "text-only" in r.getMessage() for r in caplog.records
    )
    want, _ = hf_generate(model, "Just text here", [])
    assert run(llm, [("Just text here", [])])[0].outputs[0].token_ids == want
    with pytest.raises(InvalidRequestError, match="takes no image inputs"):
        run(llm, [("<start_of_image>", [make_image(1)])])


def test_ngram_speculation_with_images(model):
    """Prompt-lookup drafts over a prompt with images (its placeholder run repeats one id):
    verification keeps the tokens exact."""
    path, _, _ = model
    llm = tiny_llm(
        path,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 2,
            "prompt_lookup_min": 1,
        },
    )
    prompts = [
        ("Look at <start_of_image> and <start_of_image> again", [make_image(40), make_image(41)]),
        ("A text prompt a text prompt a text prompt", []),
    ]
    outs = run(llm, prompts)
    for (prompt, images), out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_generate(model, prompt, images)[0], prompt
    assert llm.llm_engine.get_stats().spec_decoding.num_draft_tokens > 0  # it did speculate
    assert_idle_and_consistent(llm)
