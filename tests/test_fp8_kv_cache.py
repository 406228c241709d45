"""``--kv-cache-dtype fp8``: e4m3 keys/values with per-layer scales, declared by the backends
that read them, about twice the tokens in the same memory."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.attention_backends.interface import AttentionBackend, AttentionSpec, BatchLayout
from engine.attention_backends.torch_ref import TorchReferenceBackend
from engine.config import CacheConfig, ConfigError
from engine.kernels.reference import to_cache_dtype
from engine.testing.inputs import _fp8_rows


def test_the_flag_is_validated_with_what_is_allowed():
    assert CacheConfig(cache_dtype="fp8_e4m3").cache_dtype == "fp8"
    with pytest.raises(ConfigError, match="kv_cache_dtype='fp8_e5m2' is not supported"):
        CacheConfig(cache_dtype="fp8_e5m2")


def test_backends_declare_fp8_caches_and_others_are_refused_with_the_reason():
    spec = AttentionSpec(device_type="cpu", dtype="bfloat16", kv_cache_dtype="fp8")
    assert TorchReferenceBackend.supports(spec) == []

    class PlainBackend(AttentionBackend):
        name = "plain"

        def forward(self, *args):  # pragma: no cover - never called
            raise NotImplementedError

    assert PlainBackend.supports(spec) == [
        "KV cache dtype fp8 (float8_e4m3fn) not supported (fp8 caches supported: none)"
    ]


def _batch(device="cpu"):
    """A prefill of 7 tokens, a chunked prefill with a 5-token prefix, and two decodes."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, d, bs = 4, 2, 32, 4
    query_lens, seq_lens = [1, 1, 7, 3], [6, 9, 7, 8]
    tables = [[0, 1], [2, 3, 4], [5, 6], [7, 8]]
    slots = []
    for table, q, n in zip(tables, query_lens, seq_lens, strict=True):
        slots += [table[p // bs] * bs + p % bs for p in range(n - q, n)]
    layout = BatchLayout(query_lens, seq_lens, tables, slots, bs, 2)
    t = sum(query_lens)
    q = torch.randn(t, heads, d, generator=gen)
    # Keys/values exact in e4m3 after the power-of-two scales: the dequantized reference below
    # is exact, whatever the rounding of an implementation.
    k = (_fp8_rows(t, kv_heads * d, gen).float() * 2.0**-6).view(t, kv_heads, d)
    v = (_fp8_rows(t, kv_heads * d, gen).float() * 2.0**-7).view(t, kv_heads, d)
    return layout, q, k, v, (heads, kv_heads, d, bs)


def _prefill_context(layout, k, v, backend, cache):
    """Write the cached prefix (positions before each request's new tokens) into ``cache``."""
    from engine.kernels.reference import write_kv_cache

    gen = torch.Generator().manual_seed(1)
    for table, q, n in zip(layout.block_tables, layout.query_lens, layout.seq_lens, strict=True):
        prefix = n - q
        if prefix:
            kp = (_fp8_rows(prefix, k.shape[1] * k.shape[2], gen).float() * 2.0**-6).view(
                prefix, *k.shape[1:]
            )
            vp = (_fp8_rows(prefix, v.shape[1] * v.shape[2], gen).float() * 2.0**-7).view(
                prefix, *v.shape[1:]
            )
            slots = torch.tensor([table[p // layout.block_size] * layout.block_size + p % 4
                                  for p in range(prefix)])  # fmt: skip
            write_kv_cache(kp, vp, cache, slots, backend.k_scale, backend.v_scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_over_an_fp8_cache_is_attention_over_its_dequantized_values(dtype):
    """The torch reference with an FP8 cache (scales 2^-6 / 2^-7) equals the reference with a
    float32 cache holding the same values dequantized."""
    layout, q, k, v, (heads, kv_heads, d, bs) = _batch()
    fp8 = TorchReferenceBackend(heads, d, kv_heads, d**-0.5)
    fp8.k_scale, fp8.v_scale = 2.0**-6, 2.0**-7
    plain = TorchReferenceBackend(heads, d, kv_heads, d**-0.5)
    cache8 = torch.zeros(TorchReferenceBackend.kv_cache_shape(9, bs, kv_heads, d)).to(
        torch.float8_e4m3fn
    )
    cache32 = torch.zeros(TorchReferenceBackend.kv_cache_shape(9, bs, kv_heads, d))
    _prefill_context(layout, k, v, fp8, cache8)
    _prefill_context(layout, k, v, plain, cache32)
    md = TorchReferenceBackend.build_metadata(layout, torch.device("cpu"))
    got = fp8.forward(q.to(dtype), k.to(dtype), v.to(dtype), cache8, md)
    want = plain.forward(q.to(dtype), k.to(dtype), v.to(dtype), cache32, md)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The cache holds value / scale in e4m3.
    assert cache8.dtype == torch.float8_e4m3fn
    written = cache8[0].view(-1, kv_heads, d)[md.slot_mapping]
    torch.testing.assert_close(written.float(), to_cache_dtype(k, cache8.dtype, 2.0**-6).float())


def test_fp8_cache_holds_about_twice_the_blocks(tmp_path):
    """The same KV budget gives twice the blocks of a bfloat16 cache, and the model generates
    with it."""
    from engine import LLM, SamplingParams
    from engine.testing.tiny_models import build_tiny_model

    path = build_tiny_model(tmp_path / "m", "llama", max_position_embeddings=4096)
    blocks = {}
    for kv in ("auto", "fp8"):
        llm = LLM(
            model=str(path),
            dtype="bfloat16",
            kv_cache_dtype=kv,
            cpu_kv_cache_gb=0.002,
            max_model_len=256,
            max_num_seqs=256,
        )
        runner = llm.llm_engine.runner
        blocks[kv] = runner.num_blocks
        assert runner.kv_caches[0].dtype == (torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16)
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": list(range(5, 40))}], params, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 8
        assert llm.llm_engine.num_used_blocks == 0
    assert blocks["fp8"] in (2 * blocks["auto"], 2 * blocks["auto"] + 1)  # floor of half


def test_kv_scales_come_from_the_checkpoint(tmp_path):
    """compressed-tensors' kv_cache_scheme stores ``self_attn.k_scale`` / ``v_scale``; the
    loader sets each layer's scales from them instead of refusing unknown tensors."""
    from quant_helpers import build

    from engine.testing.tiny_models import save_tiny_model

    path = save_tiny_model("llama", tmp_path / "m", num_hidden_layers=2)
    state = load_file(str(path / "model.safetensors"))
    state["model.layers.0.self_attn.k_scale"] = torch.tensor(0.25)
    state["model.layers.0.self_attn.v_scale"] = torch.tensor([0.5])
    state["model.layers.1.self_attn.k_proj.output_scale"] = torch.tensor(0.125)
    save_file(state, str(path / "model.safetensors"))
    model, _ = build(path)
    layers = model.attention_layers()
    assert (layers[0].impl.k_scale, layers[0].impl.v_scale) == (0.25, 0.5)
    assert (layers[1].impl.k_scale, layers[1].impl.v_scale) == (0.125, 1.0)
