"""The GGUF loader on small synthetic files written with ``gguf.GGUFWriter``: config and weights
equal to what transformers loads from the same file, llama.cpp's conventions undone (Gemma's
``+1`` norms, Llama's q/k row permutation), the tokenizer cache, and clear errors for bad files."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from engine.layers.weight_utils import materialize
from engine.loader.gguf_file import GGUFFile, GGUFLoadError, supported_types
from engine.loader.gguf_loader import (
    GEMMA_CHAT_TEMPLATE,
    iter_weights,
    load_config,
    load_tokenizer,
)
from engine.testing.tiny_gguf import tiny_gemma3_hf, write_tiny_gemma3_gguf, write_tiny_llama_gguf


@pytest.fixture(scope="module")
def gemma_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma") / "tiny-gemma3.gguf"
    return write_tiny_gemma3_gguf(path, seed=0)


@pytest.fixture(scope="module")
def hf_from_gguf(gemma_gguf):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        gemma_gguf.parent, gguf_file=gemma_gguf.name, dtype=torch.float32
    ).eval()


def _write(path, arch="gemma3", tensors=(), kv=None):
    """A minimal GGUF: ``tensors`` are (name, array, raw_dtype or None)."""
    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    for key, value in (kv or {}).items():
        w.add_uint32(key, value)
    for name, array, raw in tensors:
        w.add_tensor(name, array, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- config --------------------------------------------------------------------------------


def test_config_matches_transformers_gguf_config(gemma_gguf, hf_from_gguf):
    ours = load_config(gemma_gguf)
    ref = hf_from_gguf.config
    assert type(ours).__name__ == "Gemma3TextConfig"
    assert ours.architectures == ["Gemma3ForCausalLM"]
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "sliding_window",
        "layer_types",
        "max_position_embeddings",
        "query_pre_attn_scalar",
        "tie_word_embeddings",
        "bos_token_id",
        "pad_token_id",
        "final_logit_softcapping",
        "attn_logit_softcapping",
    ):
        assert getattr(ours, key) == getattr(ref, key), key
    assert ours.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert np.float32(ours.rms_norm_eps) == np.float32(ref.rms_norm_eps)
    if hasattr(ref, "rope_parameters"):  # transformers 5
        assert ours.rope_parameters["full_attention"]["rope_theta"] == 1_000_000.0
        assert ours.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0
    # <end_of_turn> (id 5 in the tiny vocabulary) also ends generation, as in Gemma's
    # generation_config; <eos> stays first.
    assert ours.eos_token_id == [1, 5]


def test_header_reader_agrees_with_gguf_reader(gemma_gguf):
    from gguf import GGUFReader

    reader = GGUFReader(gemma_gguf)
    with GGUFFile(gemma_gguf) as f:
        assert f.architecture == "gemma3"
        assert f.arch_get("block_count") == 6
        assert f.strings("tokenizer.ggml.tokens", stop=3) == ["<pad>", "<eos>", "<bos>"]
        assert list(f.tensors) == [t.name for t in reader.tensors]
        for t in reader.tensors:
            info = f.tensors[t.name]
            assert info.ggml_type == t.tensor_type
            assert info.offset == t.data_offset and info.n_bytes == t.n_bytes
            assert info.shape == tuple(reversed([int(d) for d in t.shape]))


# ---- weights -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_equal_transformers_gguf_loading(gemma_gguf, dtype):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        gemma_gguf.parent, gguf_file=gemma_gguf.name, dtype=dtype
    )
    expected = hf.state_dict()
    seen = set()
    for name, lazy in iter_weights(gemma_gguf, load_config(gemma_gguf), dtype):
        tensor = materialize(lazy)
        assert tensor.dtype == dtype, name
        torch.testing.assert_close(tensor, expected[name], atol=0, rtol=0, msg=name)
        seen.add(name)
    assert seen == set(expected) - {"lm_head.weight"}  # tied to the embedding


def test_gemma_norms_come_back_in_hf_convention(tmp_path):
    """llama.cpp stores 1 + w; the loader yields w again (F32 norms round-trip exactly)."""
    hf = tiny_gemma3_hf(seed=3)
    path = write_tiny_gemma3_gguf(tmp_path / "g.gguf", hf_model=hf)
    original = hf.state_dict()
    for name, lazy in iter_weights(path, load_config(path), torch.float32):
        if name.endswith("norm.weight"):
            torch.testing.assert_close(materialize(lazy), original[name], atol=1e-6, rtol=0)


def test_llama_q_k_rows_are_unpermuted(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.testing.tiny_gguf import tiny_vocab

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tiny_vocab()[0]),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    hf = LlamaForCausalLM(cfg).eval()
    path = write_tiny_llama_gguf(tmp_path / "llama.gguf", hf, types={})  # all F32: exact
    config = load_config(path)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    original = hf.state_dict()
    loaded = {name: materialize(t) for name, t in iter_weights(path, config, torch.float32)}
    assert set(loaded) == set(original)
    for name, tensor in loaded.items():
        torch.testing.assert_close(tensor, original[name], atol=0, rtol=0, msg=name)


# ---- dequantization ------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", ["Q8_0", "F16", "BF16", "F32", "Q5_0", "Q4_0"])
def test_chunked_dequantization_is_bit_exact(tmp_path, qtype, monkeypatch):
    """Our torch fast paths and row chunking give exactly gguf.quants.dequantize's values."""
    import engine.loader.gguf_file as gguf_file

    monkeypatch.setattr(gguf_file, "DEQUANT_CHUNK_ELEMENTS", 3 * 64)  # several chunks
    rng = np.random.default_rng(0)
    values = rng.standard_normal((37, 64)).astype(np.float32)
    t = GGMLQuantizationType[qtype]
    if t == GGMLQuantizationType.F16:
        array, raw = values.astype(np.float16), None
    elif t == GGMLQuantizationType.F32:
        array, raw = values, None
    else:
        array, raw = quantize(values, t), t
    path = _write(tmp_path / "q.gguf", tensors=[("token_embd.weight", array, raw)])
    with GGUFFile(path) as f:
        got = f.load("token_embd.weight", torch.float32)
        expected = dequantize(f.raw("token_embd.weight"), t).reshape(37, 64)
    assert got.shape == (37, 64)
    assert torch.equal(got, torch.from_numpy(np.array(expected)))


# ---- bad input -----------------------------------------------------------------------------


def test_truncated_file_names_the_tensor(gemma_gguf, tmp_path):
    data = gemma_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(GGUFLoadError, match=r"cut\.gguf.*truncated.*tensor 'blk\.5\."):
        load_config(cut)
    head = tmp_path / "head.gguf"
    head.write_bytes(data[:5000])  # inside the token list
    with pytest.raises(GGUFLoadError, match="head.gguf: truncated or corrupted GGUF header"):
        load_config(head)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(GGUFLoadError, match="model.gguf: not a GGUF file"):
        load_config(bad)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFLoadError, match="empty file"):
        load_config(empty)
    with pytest.raises(GGUFLoadError, match="cannot open"):
        load_config(tmp_path / "missing.gguf")


def test_unsupported_architecture_lists_supported(tmp_path):
    path = _write(tmp_path / "m.gguf", arch="mamba", kv={"mamba.embedding_length": 64})
    with pytest.raises(
        GGUFLoadError, match=r"architecture 'mamba' is not supported; supported: gemma3, llama"
    ):
        load_config(path)


def test_unsupported_tensor_type_names_tensor_and_supported_types(gemma_gguf, tmp_path):
    assert GGMLQuantizationType.I32 not in supported_types()
    path = _write(
        tmp_path / "i32.gguf",
        tensors=[("blk.0.attn_q.weight", np.zeros((4, 32), dtype=np.int32), None)],
    )
    with GGUFFile(path) as f:
        with pytest.raises(
            GGUFLoadError,
            match=r"tensor 'blk.0.attn_q.weight' uses GGML type I32.*supported types: F32, F16.*Q4_K",
        ):
            f.load("blk.0.attn_q.weight", torch.float32)


def test_unknown_type_id_and_unknown_tensor_name(gemma_gguf, tmp_path):
    data = bytearray(gemma_gguf.read_bytes())
    with GGUFFile(gemma_gguf) as f:
        name = "output_norm.weight"
        n_dims = len(f.tensors[name].shape)
    # The tensor directory entry: name, n_dims, dims, type id, offset.
    key = struct.pack("<Q", len(name)) + name.encode()
    at = data.index(key) + len(key) + 4 + 8 * n_dims
    data[at : at + 4] = struct.pack("<I", 250)
    bad = tmp_path / "badtype.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(
        GGUFLoadError, match="tensor 'output_norm.weight' has unknown GGML type id 250"
    ):
        load_config(bad)

    odd = _write(
        tmp_path / "odd.gguf",
        tensors=[("blk.0.mystery.weight", np.zeros((4, 32), dtype=np.float32), None)],
    )
    with pytest.raises(GGUFLoadError, match="tensor 'blk.0.mystery.weight' has no known place"):
        next(iter_weights(odd, None, torch.float32))


# ---- tokenizer -----------------------------------------------------------------------------


def test_tokenizer_is_converted_once_and_cached(gemma_gguf, tmp_path):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(gemma_gguf.parent, gguf_file=gemma_gguf.name)
    first = load_tokenizer(gemma_gguf, tmp_path / "cache")
    cached = list((tmp_path / "cache" / "tokenizers").iterdir())
    assert len(cached) == 1 and cached[0].name.startswith("tiny-gemma3-")
    second = load_tokenizer(gemma_gguf, tmp_path / "cache")
    text = "the quick brown fox, hello world"
    assert first(text)["input_ids"] == ref(text)["input_ids"] == second(text)["input_ids"]
    assert second.chat_template == GEMMA_CHAT_TEMPLATE
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": [{"type": "text", "text": "world"}]},
        {"role": "user", "content": "again"},
    ]
    rendered = second.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<bos><start_of_turn>user\nBe brief.\n\nhello<end_of_turn>\n"
        "<start_of_turn>model\nworld<end_of_turn>\n"
        "<start_of_turn>user\nagain<end_of_turn>\n<start_of_turn>model\n"
    )


# ---- oneDNN prepacking (bf16 CPU fast path) -------------------------------------------------


def test_packed_linears_are_bit_identical_to_f_linear():
    from engine.layers import ParallelLMHead, QKVParallelLinear, ReplicatedLinear
    from engine.layers.cpu_packed_linear import pack_linears, packing_supported

    if not packing_supported(torch.bfloat16, torch.device("cpu")):
        pytest.skip("this CPU/torch build cannot pack bf16 weights")
    torch.manual_seed(0)
    model = torch.nn.ModuleList(
        [
            ReplicatedLinear(64, 96, bias=True, dtype=torch.bfloat16),
            QKVParallelLinear(64, 16, 4, 2, dtype=torch.bfloat16),
            ParallelLMHead(300, 64, dtype=torch.bfloat16, final_logit_softcap=30.0),
        ]
    )
    for p in model.parameters():
        p.data.normal_()
    xs = [torch.randn(n, 64, dtype=torch.bfloat16) for n in (1, 7, 33)]
    before = [[m(x) for x in xs] for m in model]
    assert pack_linears(model) == 3
    assert model[0].weight.numel() == 0  # the plain copy is released
    assert model[2].weight.shape == (300, 64)  # an LM head may be tied: kept
    after = [[m(x) for x in xs] for m in model]
    for b, a in zip(before, after, strict=True):
        for x, y in zip(b, a, strict=True):
            assert torch.equal(x, y)
    q, k, v = model[1].split(after[1][0])
    assert (q.shape[-1], k.shape[-1], v.shape[-1]) == (64, 32, 32)
    assert pack_linears(model) == 0  # idempotent
