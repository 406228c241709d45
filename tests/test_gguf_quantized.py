"""GGUF weights kept quantized (``engine.quantization.gguf``, ``gguf_linear``).

* The block decoding is bit-exact against ``gguf.quants.dequantize`` for every kept type.
* The bound CPU kernel and the torch reference agree with ``x @ dequantize(W)^T``.
* A tiny GGUF model (K-quants and legacy types, written with the ``gguf`` library) served
  kept quantized gives the same greedy tokens as the same file dequantized at load
  (``--quantization none``; that path equals transformers' GGUF load, test_gguf_loader.py), with
  fewer parameter bytes; Llama's permuted q/k rows come back right from the raw blocks.
* Tensor parallelism shards the blocks: ranks' products recombine to the whole; a split that
  cuts a block is refused.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from engine.kernels import gguf as gk
from engine.layers import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.cpu_packed_linear import packing_supported
from engine.models.context import ModelContext
from engine.parallel import ParallelContext
from engine.plugins import PluginManager
from engine.quantization.base import QuantizationError
from engine.quantization.gguf import GGUFConfig
from engine.testing.tiny_gguf import (
    MIXED_SHAPE,
    MIXED_TYPES,
    RANDOM_BLOCK_TYPES,
    random_blocks,
    write_tiny_gemma3_gguf,
)

TYPES = list(RANDOM_BLOCK_TYPES)


def _blocks(rows: int, cols: int, name: str, seed: int = 0) -> torch.Tensor:
    t = gk.gguf_type(name)
    raw = random_blocks(rows, cols, name, seed)
    return torch.from_numpy(raw).view(rows, cols // t.block_size, t.type_size)


def _library(blocks: torch.Tensor, name: str) -> torch.Tensor:
    raw = blocks.reshape(blocks.shape[0], -1).numpy()
    return torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType[name]).copy())


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_is_bit_exact_against_the_gguf_library(name):
    blocks = _blocks(8, 512, name)
    ours = gk.dequantize(blocks, name)
    want = _library(blocks, name)
    assert ours.dtype == torch.float32 and torch.equal(ours, want)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("m", [1, 5])
def test_gguf_linear_kernels_match_the_dequantized_product(name, m, torch_cpu_kernels):
    cpu = PluginManager.from_env().kernel_registry().resolve("cpu").gguf_linear
    n, k = 48, 512
    blocks = _blocks(n, k, name, seed=1)
    w = _library(blocks, name)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2))
    want = x @ w.T
    for op in {gk.gguf_linear, cpu}:
        packed = op.prepack(blocks, qtype=gk.gguf_type(name).ggml_type, dtype=torch.float32)
        got = op(x, packed, qtype=gk.gguf_type(name).ggml_type)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    bf = cpu.prepack(blocks, qtype=gk.gguf_type(name).ggml_type, dtype=torch.bfloat16)
    got = cpu(x.bfloat16(), bf, qtype=gk.gguf_type(name).ggml_type).float()
    torch.testing.assert_close(got, want, rtol=0.03, atol=0.03)


@pytest.mark.parametrize("name", ["Q5_0", "Q5_1", "Q8_0", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("m", [1, 16])
def test_cpu_wider_than_4_bits_runs_the_dense_bf16_product(name, m, torch_cpu_kernels):
    """5-, 6- and 8-bit weights are dequantized at load on the CPU in 16-bit dtypes and
    oneDNN-prepacked: the product equals ``F.linear`` on the dequantized bf16 weight bit for
    bit (the int4 kernel's two-plane form cost 2-8x the dense product from batch 4 up)."""
    cpu = PluginManager.from_env().kernel_registry().resolve("cpu").gguf_linear
    n, k = 48, 512
    blocks = _blocks(n, k, name, seed=3)
    qtype = gk.gguf_type(name).ggml_type
    packed = cpu.prepack(blocks, qtype=qtype, dtype=torch.bfloat16)
    assert set(packed) <= {"onednn", "dense", "out_features"}
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(4)).bfloat16()
    want = torch.nn.functional.linear(x, _library(blocks, name).bfloat16())
    assert torch.equal(cpu(x, packed, qtype=qtype), want)


@pytest.mark.parametrize("name", ["Q8_0", "Q6_K"])
def test_reference_embedding_dequantizes_only_the_rows_looked_up(name):
    blocks = _blocks(20, 256, name, seed=5)
    ids = torch.tensor([[3, 0], [19, 3]])
    packed = gk.gguf_linear.prepack(blocks, qtype=gk.gguf_type(name).ggml_type)
    rows = gk.gguf_linear.embedding(
        ids, packed, qtype=gk.gguf_type(name).ggml_type, dtype=torch.float32
    )
    assert torch.equal(rows, _library(blocks, name)[ids])


def _cpu_keeps_vocabulary(cpu) -> bool:
    return cpu.keeps_vocabulary(gk.gguf_type("Q8_0").ggml_type, torch.bfloat16)


@pytest.mark.parametrize("m", [1, 16])
def test_cpu_vocabulary_pack_is_exact_for_lookups_and_logits(m, torch_cpu_kernels):
    """A tied Q8_0 embedding / LM head on the CPU in bf16 keeps the file's int8 values and
    float16 block scales for lookups (the reference's rows bit for bit) and multiplies the
    dequantized bf16 matrix, oneDNN-prepacked (``F.linear`` on it bit for bit)."""
    cpu = PluginManager.from_env().kernel_registry().resolve("cpu").gguf_linear
    if not _cpu_keeps_vocabulary(cpu):
        pytest.skip("oneDNN cannot prepack bf16 on this CPU")
    qtype = gk.gguf_type("Q8_0").ggml_type
    assert not cpu.keeps_vocabulary(qtype, torch.float32)
    assert not cpu.keeps_vocabulary(gk.gguf_type("Q6_K").ggml_type, torch.bfloat16)
    blocks = _blocks(300, 256, "Q8_0", seed=6)
    packed = cpu.prepack(blocks, qtype=qtype, dtype=torch.bfloat16, vocabulary=True)
    assert packed["vocab_q"].dtype == torch.int8 and packed["vocab_d"].dtype == torch.float16
    dense = _library(blocks, "Q8_0")
    ids = torch.tensor([[0, 299, 7], [7, 150, 1]])
    rows = cpu.embedding(ids, packed, qtype=qtype, dtype=torch.bfloat16)
    assert torch.equal(rows, dense.bfloat16()[ids])
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(7)).bfloat16()
    assert torch.equal(cpu(x, packed, qtype=qtype), torch.nn.functional.linear(x, dense.bfloat16()))


def test_unknown_type_is_refused_with_the_kept_types():
    with pytest.raises(ValueError, match="Q4_K"):
        gk.gguf_type("IQ2_XS")


# ---- models --------------------------------------------------------------------------------
K_TYPES, K_SHAPE = MIXED_TYPES, MIXED_SHAPE


@pytest.fixture(scope="module")
def k_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf_k") / "tiny-k.gguf"
    return write_tiny_gemma3_gguf(path, seed=3, types=K_TYPES, **K_SHAPE)


def _param_bytes(model: torch.nn.Module) -> int:
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kept_quantized_model_matches_the_dequantized_one(k_gguf, dtype, torch_cpu_kernels):
    """float32: the CPU multiplies the kept layers densely (exact); bf16: the 4-bit layers
    through torch's int4 kernel, within bf16 rounding of the scales, the 5/6/8-bit layers dense
    (oneDNN-packed), in fewer bytes than the dequantized model."""
    from quant_helpers import build, compare, prefill_logits

    model, quant = build(k_gguf, dtype=dtype)
    assert isinstance(quant, GGUFConfig)
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.quant_method.name == "gguf Q4_K/Q6_K"
    assert layer.mlp.gate_up_proj.quant_method.name == "gguf Q4_0/Q5_0"
    ref, none = build(k_gguf, quantization="none", dtype=dtype)
    assert none is None
    got, want = prefill_logits(model), prefill_logits(ref)
    if dtype == "float32":
        compare(got, want, 2e-3)
        return
    compare(got, want, 0.05 * float(want.abs().max()))
    gate_up = [n for n, _ in layer.mlp.gate_up_proj.named_parameters()]
    # Q4_0 kept for the int4 kernel; Q5_0 dense, oneDNN-packed where the CPU has bf16 support
    # (AVX512-BF16/AMX), a plain tensor elsewhere (an AVX2-only CPU).
    dense = (
        "gguf1_onednn" if packing_supported(torch.bfloat16, torch.device("cpu")) else "gguf1_dense"
    )
    assert "gguf0_int4" in gate_up and dense in gate_up, gate_up

    def linear_bytes(m: torch.nn.Module) -> int:
        return sum(_param_bytes(p) for n, p in m.named_modules() if n.endswith("_proj"))

    # Linear weights: the 4-bit layers at 4 bits plus bf16 group scales, the others dense; the
    # embedding stays dequantized in both.
    assert linear_bytes(model) < linear_bytes(ref)
    assert _param_bytes(model) < _param_bytes(ref)


def test_cpu_bf16_keeps_the_tied_vocabulary_quantized_with_the_same_logits(
    k_gguf, monkeypatch, torch_cpu_kernels
):
    """The tied Q8_0 embedding / LM head of a bf16 model on the CPU stays 8-bit for lookups
    (no dense matrix in the model); the logits equal those of the model whose vocabulary is
    dequantized at load (the path before), bit for bit."""
    from quant_helpers import build, prefill_logits

    from engine_cpu.gguf import CpuGGUFLinear

    if not _cpu_keeps_vocabulary(CpuGGUFLinear()):
        pytest.skip("oneDNN cannot prepack bf16 on this CPU")
    model, _ = build(k_gguf, dtype="bfloat16")
    emb = model.model.embed_tokens
    assert emb.vocab_method is not None and model.lm_head.vocab_method is emb.vocab_method
    assert emb.weight.numel() == 0 and "gguf_vocab_q" in dict(emb.named_parameters())
    got = prefill_logits(model)
    with monkeypatch.context() as m:
        m.setattr(CpuGGUFLinear, "keeps_vocabulary", lambda self, qtype, dtype: False)
        before, _ = build(k_gguf, dtype="bfloat16")
    assert before.model.embed_tokens.vocab_method is None
    assert torch.equal(got, prefill_logits(before))
    # float32 (and other platforms) keep the dequantized vocabulary as before. (Only the
    # patch above is undone: monkeypatch.undo() also undid torch_cpu_kernels' ENGINE_CPU_NATIVE=0,
    # so that on an AVX2 CPU this build kept the vocabulary in the AVX2 kernels' layout.)
    f32, _ = build(k_gguf, dtype="float32")
    assert f32.model.embed_tokens.vocab_method is None


def test_engine_greedy_tokens_equal_the_dequantized_path(k_gguf):
    from engine import LLM, SamplingParams

    def run(**kw):
        llm = LLM(
            model=str(k_gguf),
            dtype="float32",
            block_size=4,
            max_num_seqs=4,
            max_model_len=128,
            num_gpu_blocks_override=64,
            attention_backend="torch",
            **kw,
        )
        prompts = [[2, 7, 9, 11], [2, 30, 31, 32, 33, 34, 35], [2, 100]]
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        )
        assert llm.llm_engine.num_used_blocks == 0
        return [o.outputs[0].token_ids for o in outs]

    assert run() == run(quantization="none")


def test_llama_permuted_rows_come_back_from_raw_blocks(tmp_path, torch_cpu_kernels):
    from quant_helpers import build, compare, prefill_logits
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.testing.tiny_gguf import tiny_vocab, write_tiny_llama_gguf

    cfg = LlamaConfig(
        vocab_size=len(tiny_vocab()[0]),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    path = write_tiny_llama_gguf(
        tmp_path / "llama.gguf", LlamaForCausalLM(cfg).eval(), types=K_TYPES
    )
    model, _ = build(path)
    assert model.model.layers[0].self_attn.qkv_proj.quant_method.name.startswith("gguf")
    ref, _ = build(path, quantization="none")
    compare(prefill_logits(model), prefill_logits(ref), 2e-3)


# ---- tensor parallelism --------------------------------------------------------------------
def _ctx(rank: int, size: int, config: GGUFConfig) -> ModelContext:
    return ModelContext(
        hf_config=None,
        dtype=torch.float32,
        kernels=None,
        attn_backend_cls=None,
        device=torch.device("cpu"),
        parallel=ParallelContext(tp_rank=rank, tp_size=size),
        quant_config=config,
    )


def _built(layer):
    layer.process_weights_after_loading()
    return layer


@pytest.mark.parametrize("tp", [1, 2])
def test_row_and_column_shards_recombine(tp):
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    w_blocks = _blocks(64, 512, "Q4_K", seed=4)
    w = _library(w_blocks, "Q4_K")
    config = GGUFConfig({"o": "Q4_K", "c": "Q4_K"})
    row_out = torch.zeros(3, 64)
    col_outs = []
    for r in range(tp):
        row = RowParallelLinear(512, 64, reduce_results=False, ctx=_ctx(r, tp, config), prefix="o")
        row.qweight.weight_loader(row.qweight, w_blocks)
        row_out += _built(row)(x.chunk(tp, dim=-1)[r])
        col = ColumnParallelLinear(512, 64, ctx=_ctx(r, tp, config), prefix="c")
        col.qweight.weight_loader(col.qweight, w_blocks)
        col_outs.append(_built(col)(x))
    torch.testing.assert_close(row_out, x @ w.T, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat(col_outs, -1), x @ w.T, rtol=1e-4, atol=1e-4)


def test_qkv_slices_of_different_types_load_per_shard():
    names = {"a.q_proj": "Q4_K", "a.k_proj": "Q4_K", "a.v_proj": "Q6_K"}
    config = GGUFConfig(names)
    layer = QKVParallelLinear(256, 64, 4, 2, ctx=_ctx(1, 2, config), prefix="a.qkv_proj")
    parts = {
        s: _blocks(n, 256, t, seed=i)
        for i, (s, n, t) in enumerate([("q", 256, "Q4_K"), ("k", 128, "Q4_K"), ("v", 128, "Q6_K")])
    }
    for shard, blocks in parts.items():
        layer.qweight.weight_loader(layer.qweight, blocks, shard)
    x = torch.randn(2, 256)
    y = _built(layer)(x)
    want = [
        x @ _library(parts[s], t).chunk(2)[1].T
        for s, t in zip("qkv", ["Q4_K"] * 2 + ["Q6_K"], strict=True)
    ]
    torch.testing.assert_close(y, torch.cat(want, -1), rtol=1e-4, atol=1e-4)


def test_a_split_that_cuts_a_block_is_refused():
    config = GGUFConfig({"o": "Q4_K"})
    with pytest.raises(QuantizationError, match="block boundary"):
        RowParallelLinear(512, 64, ctx=_ctx(0, 4, config), prefix="o")  # 128 of 256 per block


def test_flag_on_a_non_gguf_checkpoint_is_refused():
    with pytest.raises(QuantizationError, match="needs a .gguf model file"):
        GGUFConfig.from_flag()


def test_unkept_types_dequantize_at_load(tmp_path):
    from quant_helpers import build

    path = write_tiny_gemma3_gguf(tmp_path / "t.gguf", seed=0)  # attn_v F16, ffn_up BF16
    model, quant = build(path)
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.quant_method.name == "unquantized"
    assert layer.self_attn.o_proj.quant_method.name == "gguf Q4_0"
    assert quant._dequantized and np.all(
        ["qkv_proj" in p or "gate_up" in p for p in quant._dequantized]
    )
