"""Gemma 3 with images on a CUDA GPU: the tiny random ``Gemma3ForConditionalGeneration`` (float32),
a batch mixing image and text prompts with chunked prefill and CUDA-graph decode, must give the
greedy tokens of the same engine on the CPU (which ``tests/test_gemma3_vision.py`` checks against
transformers) and of transformers on the GPU; a repeated image is encoded once, the prefix
cache keys blocks by image, and nothing leaks."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.testing.tiny_models import build_tiny_gemma3_multimodal

pytestmark = pytest.mark.gpu
N = 12


def make_image(seed: int, size=(40, 70)):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


PROMPTS = [
    ("Compare <start_of_image> with <start_of_image> please", [1, 2]),
    ("A text prompt about the quick brown fox", []),
    ("Numbers 0123456789 and more text before <start_of_image> then after", [3]),
    ("Again: <start_of_image>", [1]),  # the first prompt's first image
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_gemma3_multimodal(tmp_path_factory.mktemp("gemma3v-gpu"), seed=5)


def _run(path, **kwargs):
    llm = LLM(
        str(path),
        dtype="float32",
        block_size=16,
        max_num_batched_tokens=32,
        max_model_len=256,
        num_gpu_blocks_override=256,
        enable_prefix_caching=True,
        **kwargs,
    )
    params = SamplingParams(temperature=0.0, max_tokens=N, min_tokens=N)
    inputs = [
        {"prompt": p, "multi_modal_data": {"image": [make_image(s) for s in seeds]}} if seeds else p
        for p, seeds in PROMPTS
    ]
    outs = llm.generate(inputs, params, use_tqdm=False)
    again = llm.generate(inputs[:1], params, use_tqdm=False)[0]
    engine = llm.llm_engine
    result = (
        [o.outputs[0].token_ids for o in outs],
        again.outputs[0].token_ids,
        again.num_cached_tokens,
        engine.runner.mm.num_encoded,
    )
    assert engine.num_used_blocks == 0
    assert engine.scheduler.encoder_cache.num_held == 0
    assert set(engine.runner.mm.cache) == engine.scheduler.encoder_cache.cached_hashes()
    del llm, engine
    gc.collect()
    torch.cuda.empty_cache()
    return result


def test_images_on_cuda_match_cpu_and_transformers(model_dir):
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    cpu = _run(model_dir, platform="cpu", attention_backend="torch")
    gpu = _run(model_dir, platform="cuda")
    assert gpu[0] == cpu[0]
    assert gpu[1] == cpu[0][0]  # the repeated prompt: same tokens
    assert gpu[2] > 0  # its blocks came from the prefix cache
    assert gpu[3] == 3  # three distinct images, each encoded once

    hf = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    hf = hf.to("cuda").eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    for (prompt, seeds), got in zip(PROMPTS, gpu[0], strict=True):
        images = [[make_image(s) for s in seeds]] if seeds else None
        inputs = processor(text=[prompt], images=images, return_tensors="pt").to("cuda")
        with torch.no_grad():
            out = hf.generate(**inputs, max_new_tokens=N, min_new_tokens=N, do_sample=False)
        assert got == out[0, inputs["input_ids"].shape[1] :].tolist(), prompt
