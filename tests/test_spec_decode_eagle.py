"""EAGLE and EAGLE-3 heads (random, in the published checkpoint layouts) on a tiny Llama:
the checkpoints load as published (PyTorch .bin with fc bias, safetensors with a draft
vocabulary and d2t), greedy outputs equal plain decoding through preemption and prefix hits,
every draft equals what the head computes from scratch on the target's hidden states (so
the mirrored KV, the shifted inputs and the hidden-state feed are right), and heads that
cannot serve are refused with reasons."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_spec_decode import copy_heavy_prompts, make_llm, tokens

from engine import SamplingParams
from engine.config import ConfigError
from engine.testing.tiny_models import build_tiny_eagle_head, build_tokenizer, save_tiny_model


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A 4-layer tiny Llama (EAGLE-3 reads three of its layers)."""
    path = tmp_path_factory.mktemp("eagle_target")
    tok = build_tokenizer(path)
    return save_tiny_model("llama", path, vocab_size=len(tok), num_hidden_layers=4,
                           bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id, initializer_range=0.05)  # fmt: skip


@pytest.fixture(scope="module")
def heads(tmp_path_factory, target):
    root = tmp_path_factory.mktemp("heads")
    return {
        # As yuhuili/EAGLE-*: pytorch_model.bin, here with an fc bias.
        "eagle": build_tiny_eagle_head(root / "e1", target, "eagle", fc_bias=True, fmt="bin"),
        # As yuhuili/EAGLE3-*: a 128-token draft vocabulary mapped by d2t.
        "eagle3": build_tiny_eagle_head(
            root / "e3", target, "eagle3", draft_vocab_size=128, aux_layer_ids=[1, 2, 3]
        ),  # fmt: skip
    }


@pytest.fixture(scope="module")
def plain(target):
    return make_llm(target)


def spec_llm(target, heads, method, **kw):
    spec = {"method": method, "model": str(heads[method]), "num_speculative_tokens": 3}
    return make_llm(target, spec, **kw)


def test_heads_load_as_published(target, heads):
    from safetensors.torch import load_file

    llm = spec_llm(target, heads, "eagle")
    head = llm.llm_engine.runner.proposer.model
    ckpt = torch.load(heads["eagle"] / "pytorch_model.bin", weights_only=True)
    assert torch.equal(head.fc.bias, ckpt["fc.bias"])
    norm = head.layers[0].post_attention_layernorm.weight
    assert torch.equal(norm, ckpt["layers.0.post_attention_layernorm.weight"])
    assert not hasattr(head.layers[0].input_layernorm, "weight")  # layer 0 has none
    llm3 = spec_llm(target, heads, "eagle3")
    head3 = llm3.llm_engine.runner.proposer.model
    ckpt3 = load_file(heads["eagle3"] / "model.safetensors")
    assert torch.equal(head3.layers[0].hidden_norm.weight, ckpt3["midlayer.hidden_norm.weight"])
    assert torch.equal(head3.d2t, ckpt3["d2t"])
    assert llm3.llm_engine.runner.proposer._aux.layer_ids == [1, 2, 3]
    # Logits over the target vocabulary: only the draft vocabulary's tokens are finite.
    logits = head3.compute_logits(torch.randn(2, head3.config.hidden_size))
    finite = torch.isfinite(logits[0]).nonzero().flatten()
    assert finite.tolist() == (torch.arange(128) + ckpt3["d2t"]).tolist()


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_greedy_equals_plain_decoding(target, heads, plain, method):
    llm = spec_llm(target, heads, method, num_gpu_blocks_override=70, max_num_batched_tokens=48)
    prompts = copy_heavy_prompts(plain, 20, seed=31)
    params = [SamplingParams(temperature=0.0, max_tokens=26 - i % 7, ignore_eos=True)
              for i in range(20)]  # fmt: skip
    assert tokens(llm, prompts, params) == tokens(plain, prompts, params)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_decoding.num_draft_tokens > 100
    assert llm.llm_engine.num_used_blocks == 0
    # Sampling runs too (the head samples its drafts with the request's settings).
    out = tokens(llm, prompts[:6], SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12,
                                                 seed=3, ignore_eos=True))  # fmt: skip
    assert all(len(t) == 12 for t in out)
    assert llm.llm_engine.num_used_blocks == 0


def _reference_drafts(proposer, hf, context: list[int], k: int, bs: int) -> list[int]:
    """The head's greedy drafts after ``context``, from scratch: the target's hidden states
    from transformers, the head over every position in a fresh paged cache, then k - 1
    single-token steps fed its own hidden states."""
    from engine.attention_backends.interface import BatchLayout
    from engine.attention_backends.torch_ref import TorchReferenceBackend as Ref

    head = proposer.model
    with torch.no_grad():
        states = hf(torch.tensor([context[:-1]]), output_hidden_states=True).hidden_states
    if proposer.eagle3:
        hidden = head.combine(torch.cat([states[i][0] for i in proposer._aux.layer_ids], -1))
    else:
        hidden = states[-1][0]
    layers = head.attention_layers()
    saved = [layer.kv_cache for layer in layers]
    n = len(context) - 1
    blocks = list(range(1, (n + k) // bs + 2))
    for layer in layers:
        layer.kv_cache = torch.zeros(Ref.kv_cache_shape(len(blocks) + 1, bs, layer.num_kv_heads,
                                                        layer.head_size))  # fmt: skip

    def forward(ids, start, h):
        pos = list(range(start, start + len(ids)))
        slots = [blocks[p // bs] * bs + p % bs for p in pos]
        md = Ref.build_metadata(BatchLayout([len(ids)], [start + len(ids)], [blocks], slots, bs,
                                            1 if len(ids) == 1 else 0), torch.device("cpu"))  # fmt: skip
        out, nxt = head(torch.tensor(ids), torch.tensor(pos), [md], h)
        return out[-1:], nxt[-1:]

    try:
        with torch.inference_mode():
            out, nxt = forward(context[1:], 0, hidden)
            drafts = []
            for j in range(k):
                drafts.append(int(head.compute_logits(out).argmax()))
                if j + 1 < k:
                    out, nxt = forward([drafts[-1]], n + j, nxt)
    finally:
        for layer, cache in zip(layers, saved, strict=True):
            layer.kv_cache = cache
    return drafts


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_drafts_equal_the_head_from_scratch(target, heads, plain, method):
    from transformers import AutoModelForCausalLM

    llm = spec_llm(target, heads, method, num_gpu_blocks_override=36, max_num_batched_tokens=24)
    engine = llm.llm_engine.core
    events = []
    real = engine._set_drafts

    def record(drafts):
        for rid, d in drafts.items():
            owner = engine._seq_owner.get(rid)
            if owner is not None:
                r = owner[1].request
                events.append((r.prompt_token_ids + r.output_token_ids, list(d)))
        real(drafts)

    engine._set_drafts = record
    prompts = copy_heavy_prompts(plain, 8, seed=5)
    prompts += [prompts[0] + [5, 6, 7], prompts[2] + [9]]  # prefix hits
    tokens(llm, prompts, SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True))
    stats = engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    proposer = engine.runner.proposer
    rng = np.random.default_rng(0)
    picked = rng.choice(len(events), size=min(60, len(events)), replace=False)
    for i in picked:
        context, drafts = events[i]
        want = _reference_drafts(proposer, hf, context, len(drafts), engine.config.cache.block_size)
        assert drafts == want, f"event {i}: context of {len(context)} tokens"


def test_heads_that_cannot_serve_are_refused(target, heads, tmp_path):
    with pytest.raises(ConfigError, match="use method 'eagle3' for an EAGLE-3 head"):
        make_llm(target, {"method": "eagle", "model": str(heads["eagle3"]),
                          "num_speculative_tokens": 2})  # fmt: skip
    with pytest.raises(ConfigError, match="this checkpoint is an EAGLE head: use method 'eagle'"):
        make_llm(target, {"method": "eagle3", "model": str(heads["eagle"]),
                          "num_speculative_tokens": 2})  # fmt: skip
    bad = build_tiny_eagle_head(tmp_path / "bad", target, "eagle3", aux_layer_ids=[1, 2, 4])
    with pytest.raises(ConfigError, match=r"reads target layers \[1, 2, 4\]; the target has 4"):
        make_llm(target, {"method": "eagle3", "model": str(bad), "num_speculative_tokens": 2})
    other = tmp_path / "other_target"
    save_tiny_model("llama", other, hidden_size=32, vocab_size=200)
    wrong = build_tiny_eagle_head(tmp_path / "wrong", other, "eagle")
    with pytest.raises(ConfigError) as e:
        make_llm(target, {"method": "eagle", "model": str(wrong), "num_speculative_tokens": 2})
    assert "hidden size 32 differs from the target's 64" in str(e.value)
    assert "vocabulary has 200 tokens, the target's 384" in str(e.value)


def test_eagle_on_a_transformers_backend_target(target, heads, plain):
    """EAGLE reads only the target's final hidden states, embedding and head, which the
    transformers backend has too: its greedy tokens equal plain decoding's. EAGLE-3 hooks the
    native decoder layers, so it is refused at start for such a target, saying why."""
    prompts = copy_heavy_prompts(plain, 6, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = spec_llm(target, heads, "eagle", model_impl="transformers")
    assert llm.llm_engine.config.model.implementation == "transformers"
    assert tokens(llm, prompts, params) == tokens(plain, prompts, params)
    assert llm.llm_engine.get_stats().spec_decoding.num_draft_tokens > 0
    assert llm.llm_engine.num_used_blocks == 0
    with pytest.raises(ConfigError, match="EAGLE-3 reads the target's inner layer hidden states"):
        spec_llm(target, heads, "eagle3", model_impl="transformers")
