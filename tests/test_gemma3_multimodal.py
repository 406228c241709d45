"""``Gemma3ForConditionalGeneration`` checkpoints (the 4B/12B/27B layout) on text prompts.

A tiny random checkpoint with a SigLIP vision tower and the multimodal projector is written by
transformers (``engine.testing.tiny_models.build_tiny_gemma3_multimodal``). The engine must
read the text model out of the nested config and produce transformers' greedy tokens and
logprobs for text prompts, batched; served text-only (``limit_mm_per_prompt={"image": 0}``) it
loads only the language model's weights (the vision tensors are never read). Image inputs are
tested in ``test_gemma3_vision.py``.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.testing.tiny_models import build_tiny_gemma3_multimodal

NUM_NEW = 24
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import Gemma3ForConditionalGeneration

    path = build_tiny_gemma3_multimodal(tmp_path_factory.mktemp("gemma3mm"), seed=3)
    hf = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


def make_prompts(vocab: int) -> list[list[int]]:
    """Mixed lengths around the sliding window (8) and block size (4); the image token (the
    last id) and the specials are left out: these are text prompts."""
    rng = random.Random(0)
    lengths = [1, 3, 7, 8, 9, 16, 30, 61]
    prompts = [[1] + [rng.randrange(8, vocab - 3) for _ in range(n)] for n in lengths]
    prompts.append(prompts[6][:20] + [rng.randrange(8, vocab - 3) for _ in range(5)])
    return prompts


def hf_reference(hf, prompt: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their logprobs, one full forward per token (EOS
    allowed, as with ``ignore_eos``; ``generate(min_new_tokens=...)`` would forbid it)."""
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(NUM_NEW):
            logp = torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)
            ids.append(int(logp.argmax()))
            logprobs.append(float(logp[ids[-1]]))
    return ids[len(prompt) :], logprobs


def tiny_llm(path, **kw) -> LLM:
    args = dict(
        model=str(path),
        block_size=4,
        max_num_batched_tokens=32,
        max_num_seqs=6,
        max_model_len=128,
        num_gpu_blocks_override=200,
        enable_prefix_caching=True,
    )
    return LLM(**{**args, **kw})


def test_greedy_matches_transformers_and_skips_vision_weights(checkpoint, monkeypatch, caplog):
    import safetensors

    path, hf = checkpoint
    read: list[str] = []
    real_open = safetensors.safe_open

    class RecordingOpen:
        """``safe_open`` that records which tensors' data is read."""

        def __init__(self, *args, **kwargs):
            self._f = real_open(*args, **kwargs)

        def __enter__(self):
            self._inner = self._f.__enter__()
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

        def __getattr__(self, name):
            return getattr(self._inner if hasattr(self, "_inner") else self._f, name)

        def get_tensor(self, name):
            read.append(name)
            return self._inner.get_tensor(name)

        def get_slice(self, name):  # the loader's lazy tensors read through this
            return RecordingSlice(self._inner.get_slice(name), name)

    class RecordingSlice:
        """A slice whose data reads (indexing) are recorded; its header is free."""

        def __init__(self, inner, name):
            self._inner, self._name = inner, name

        def __getattr__(self, attr):
            return getattr(self._inner, attr)

        def __getitem__(self, index):
            read.append(self._name)
            return self._inner[index]

    monkeypatch.setattr(safetensors, "safe_open", RecordingOpen)
    with caplog.at_level(logging.WARNING, logger="engine.loader.model_loader"):
        llm = tiny_llm(path, limit_mm_per_prompt={"image": 0})
    monkeypatch.undo()

    # Only the language model's tensors were read; the log says what was skipped and why.
    checkpoint_names = {name for name, _ in hf.state_dict().items()}
    assert read, "the loader read no tensors at all"
    assert not [n for n in read if n.startswith(VISION_PREFIXES)]
    assert all(n.startswith("language_model.") for n in read)
    vision_in_model = [n for n in checkpoint_names if "vision_tower" in n or "projector" in n]
    assert vision_in_model, "the checkpoint should hold vision weights"
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        "skipping" in m and "vision_tower." in m and "image inputs are not accepted" in m
        for m in messages
    ), messages

    # The text model's config came from text_config: scale, windows, tied head, dtype.
    model = llm.llm_engine.runner.model
    assert [layer.sliding_window for layer in model.attention_layers()] == [8] * 5 + [None]
    assert model.model.layers[0].self_attn.attn.scale == 24**-0.5
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert llm.llm_engine.config.model.dtype == "float32"

    vocab = hf.config.text_config.vocab_size
    prompts = make_prompts(vocab)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        want_tokens, want_logprobs = hf_reference(hf, prompt)
        got = out.outputs[0]
        assert got.token_ids == want_tokens, f"prompt of {len(prompt)} tokens"
        got_lp = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]
        assert got_lp == pytest.approx(want_logprobs, abs=1e-4)
    assert llm.llm_engine.num_used_blocks == 0, "every block is free again when idle"


def test_transformers4_weight_names(checkpoint, tmp_path):
    """transformers 4.52-4.57 saved ``model.language_model.*`` and ``model.vision_tower.*``:
    the same weights under those names give the same tokens."""
    import shutil

    from safetensors.torch import load_file, save_file

    path, hf = checkpoint
    renamed = tmp_path / "v4"
    shutil.copytree(path, renamed)
    weights = load_file(renamed / "model.safetensors")
    v4 = {}
    for name, tensor in weights.items():
        if name.startswith("language_model.model."):
            name = "model.language_model." + name[len("language_model.model.") :]
        elif name.startswith(VISION_PREFIXES):
            name = "model." + name
        v4[name] = tensor
    assert any(n.startswith("model.vision_tower.") for n in v4)
    save_file(v4, renamed / "model.safetensors", metadata={"format": "pt"})

    prompts = make_prompts(hf.config.text_config.vocab_size)[:4]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    got = tiny_llm(renamed).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )
    for prompt, out in zip(prompts, got, strict=True):
        assert out.outputs[0].token_ids == hf_reference(hf, prompt)[0]


def test_dtype_auto_reads_the_top_level_config(tmp_path):
    """Multimodal configs declare ``dtype`` at the top level only: ``dtype=auto`` must find it
    (not fall back to float32), and ``max_model_len`` comes from ``text_config``."""
    path = build_tiny_gemma3_multimodal(tmp_path / "bf16", dtype="bfloat16")
    llm = tiny_llm(path, dtype="auto", max_model_len=None, num_gpu_blocks_override=300)
    config = llm.llm_engine.config.model
    assert config.dtype == "bfloat16"
    assert config.max_model_len == 512
    assert llm.llm_engine.runner.model.model.embed_tokens.weight.dtype == torch.bfloat16
    with pytest.raises(Exception, match="larger than the model's maximum context length"):
        tiny_llm(path, max_model_len=1024)
