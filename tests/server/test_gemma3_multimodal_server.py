"""Images through ``/v1/chat/completions`` on a tiny random ``Gemma3ForConditionalGeneration``,
checked with the official ``openai`` client: greedy tokens equal transformers' ``generate`` on
the processor's inputs; bad images, too many images, network URLs and ``file://`` URLs outside
``--allowed-local-media-path`` are 400s with OpenAI's error body; a model served text-only
(``--limit-mm-per-prompt '{"image": 0}'``) refuses images; nothing leaks (KV blocks, encoder
cache holds) and the server keeps serving.
"""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
import torch
from server_harness import RunningServer, engine_config, error_of

N = 8  # new tokens per request


def make_image(seed: int, size: tuple[int, int] = (48, 64)):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def data_url(image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from engine.testing.tiny_models import build_tiny_gemma3_multimodal

    return build_tiny_gemma3_multimodal(tmp_path_factory.mktemp("gemma3mm-server"), seed=3)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("media")
    make_image(7).save(path / "seven.png")
    return path


@pytest.fixture(scope="module")
def server(model_dir, media_dir):
    from engine.config import CacheConfig, MultiModalConfig
    from engine.engine_core.core import EngineCore

    def factory():
        config = engine_config(
            model_dir,
            multimodal=MultiModalConfig(
                limit_mm_per_prompt={"image": 2},
                allowed_local_media_path=str(media_dir),
                max_image_pixels=200 * 200,
                max_image_bytes=200_000,
            ),
        )
        config.cache = CacheConfig(block_size=4, cpu_kv_cache_gb=0.05, enable_prefix_caching=True)
        return EngineCore.from_config(config)

    with RunningServer(factory) as running:
        yield running


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(model_dir)


@pytest.fixture()
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=60)


def hf_chat(hf, text: str, images: list) -> tuple[list[int], int]:
    """transformers' greedy tokens for a user turn of ``text`` then ``images`` (the chat
    template places them), and the prompt length."""
    model, processor = hf
    content = [{"type": "text", "text": text}] + [{"type": "image"} for _ in images]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    inputs = processor(
        text=[prompt], images=[images] if images else None, return_tensors="pt",
        add_special_tokens=False,
    )  # fmt: skip
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=N, min_new_tokens=N, do_sample=False)
    n = inputs["input_ids"].shape[1]
    return out[0, n:].tolist(), n


def token_ids(choice) -> list[int]:
    """The sampled ids (``return_tokens_as_token_ids`` names each token ``token_id:N``)."""
    return [int(t.token.split(":", 1)[1]) for t in choice.logprobs.content]


def chat(client, text: str, urls: list[str]):
    content = [{"type": "text", "text": text}] + [
        {"type": "image_url", "image_url": {"url": u}} for u in urls
    ]
    return client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": content}],
        max_tokens=N,
        temperature=0,
        logprobs=True,
        extra_body={"min_tokens": N, "return_tokens_as_token_ids": True},
    )


def assert_idle(server) -> None:
    engine = server.engine
    assert engine.num_used_blocks == 0
    assert engine.scheduler.encoder_cache.num_held == 0
    assert set(engine.runner.mm.cache) == engine.scheduler.encoder_cache.cached_hashes()


def test_images_match_transformers(server, client, hf, media_dir):
    one = make_image(1)
    two = [make_image(2), make_image(3, (64, 32))]
    cases = [
        ("What is in this picture?", [one], [data_url(one)]),
        ("Compare these two.", two, [data_url(two[0], "JPEG"), data_url(two[1])]),
        ("And this file?", [make_image(7)], [(media_dir / "seven.png").as_uri()]),
        ("Only text this time.", [], []),
    ]
    for text, images, urls in cases:
        if any(u.startswith("data:image/jpeg") for u in urls):
            # JPEG is lossy: the reference sees the decoded pixels the server sees.
            from PIL import Image

            images = [
                Image.open(io.BytesIO(base64.b64decode(u.split(",", 1)[1]))).convert("RGB")
                for u in urls
            ]
        want, prompt_len = hf_chat(hf, text, images)
        resp = chat(client, text, urls)
        choice = resp.choices[0]
        assert token_ids(choice) == want, text
        assert resp.usage.prompt_tokens == prompt_len
        assert resp.usage.completion_tokens == N
    # The same image again: served from the encoder cache, the prefix cache reuses its blocks.
    encoded = server.engine.runner.mm.num_encoded
    resp = chat(client, "What is in this picture?", [data_url(one)])
    assert token_ids(resp.choices[0]) == hf_chat(hf, "What is in this picture?", [one])[0]
    assert server.engine.runner.mm.num_encoded == encoded
    assert_idle(server)


def test_streaming_with_an_image(server, client, hf):
    image = make_image(4)
    want, _ = hf_chat(hf, "Stream it.", [image])
    stream = client.chat.completions.create(
        model="tiny",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Stream it."},
                    {"type": "image_url", "image_url": {"url": data_url(image)}},
                ],
            }
        ],
        max_tokens=N,
        temperature=0,
        stream=True,
        logprobs=True,
        extra_body={"min_tokens": N, "return_tokens_as_token_ids": True},
    )
    got = []
    for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs and choice.logprobs.content:
                got.extend(int(t.token.split(":", 1)[1]) for t in choice.logprobs.content)
    assert got == want
    assert_idle(server)


def _post(server, content) -> httpx.Response:
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        return http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": content}], "max_tokens": 2},
        )


def _image_part(url):
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("data:image/png;base64," + base64.b64encode(b"not a png").decode(), "not an image"),
        ("data:image/png;base64,@@@", "not valid base64"),
        ("data:text/plain;base64,aGk=", "is not an image"),
        ("https://example.com/cat.png", "fetching image URLs over the network is off"),
        ("ftp://example.com/cat.png", "scheme 'ftp' is not supported"),
        ("file:///etc/passwd", "outside the allowed local media directory"),
    ],
)
def test_bad_image_urls_are_400(server, url, message):
    err = error_of(_post(server, [{"type": "text", "text": "Hi"}, _image_part(url)]), 400)
    assert err["type"] == "invalid_request_error"
    assert message in err["message"], err
    assert_idle(server)


def test_oversized_and_too_many_images_are_400(server):
    from PIL import Image

    flat = data_url(Image.new("RGB", (300, 300)))  # a few hundred bytes, too many pixels
    err = error_of(_post(server, [_image_part(flat)]), 400)
    assert "300 x 300 = 90000 pixels; at most 40000" in err["message"]
    assert err["param"] == "messages.0.content.0"
    noisy = data_url(make_image(5, (300, 300)))  # ~270 kB of PNG
    err = error_of(_post(server, [_image_part(noisy)]), 400)
    assert "bytes; at most 200000 bytes are allowed per image (--max-image-bytes)" in err["message"]
    small = data_url(make_image(6))
    err = error_of(_post(server, [_image_part(small)] * 3), 400)
    assert "3 images; at most 2 are allowed per prompt (--limit-mm-per-prompt)" in err["message"]
    assert err["param"] == "messages.0.content.2"
    err = error_of(_post(server, [{"type": "input_audio", "input_audio": {}}]), 400)
    assert "only text and image_url parts are supported" in err["message"]
    assert_idle(server)


def test_text_only_serving_refuses_images(model_dir):
    """``--limit-mm-per-prompt '{"image": 0}'``: the vision tower is not loaded, text chat
    works, an image is a 400 that says why."""
    from engine.config import MultiModalConfig
    from engine.engine_core.core import EngineCore

    def factory():
        return EngineCore.from_config(
            engine_config(model_dir, multimodal=MultiModalConfig(limit_mm_per_prompt={"image": 0}))
        )

    with RunningServer(factory) as running:
        err = error_of(_post(running, [_image_part(data_url(make_image(1)))]), 400)
        assert "this model takes no image inputs" in err["message"]
        ok = _post(running, [{"type": "text", "text": "Hi"}])
        assert ok.status_code == 200, ok.text
        assert running.engine.num_used_blocks == 0


def test_text_model_refuses_images(tiny_model_dir):
    from engine.engine_core.core import EngineCore

    with RunningServer(lambda: EngineCore.from_config(engine_config(tiny_model_dir))) as running:
        err = error_of(_post(running, [_image_part(data_url(make_image(1)))]), 400)
        assert "this model takes no image inputs" in err["message"]


def test_images_through_the_engine_core_process(model_dir, media_dir, hf, tmp_path):
    """``engine serve`` as users run it: the processed images cross the front end -> engine
    core transport (pixel arrays as bytes) and give transformers' tokens."""
    import openai
    from server_harness import ServeProcess

    flags = ("--limit-mm-per-prompt", '{"image": 2}', "--allowed-local-media-path", str(media_dir))
    with ServeProcess(model_dir, tmp_path / "server.log", *flags) as running:
        client = openai.OpenAI(
            base_url=running.base_url + "/v1", api_key="x", max_retries=0, timeout=60
        )
        two = [make_image(4), make_image(5, (64, 32))]
        cases = [
            ("Compare these two.", two, [data_url(two[0]), data_url(two[1], "JPEG")]),
            ("And this file?", [make_image(7)], [(media_dir / "seven.png").as_uri()]),
        ]
        for text, images, urls in cases:
            want, n = hf_chat(hf, text, images)
            r = chat(client, text, urls)
            assert token_ids(r.choices[0]) == want, text
            assert r.usage.prompt_tokens == n
