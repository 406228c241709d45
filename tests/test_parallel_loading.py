"""Each tensor-parallel rank and pipeline stage loads exactly its part, and reads only that.

Every rank's parameters are compared with the matching slices of the single-process model
(q/k/v by head with KV heads replicated past their count, gate/up per slice, row-parallel
columns, vocabulary rows with padding), for safetensors and for GGUF (quantized, with
llama.cpp's q/k permutation undone per shard). The checkpoint bytes a rank materialises
(``ReadStats``) are exactly its parameters' bytes: about 1/TP of the checkpoint. A pipeline
stage reads only its layers (and the embedding or head it holds). No process groups are needed:
loading runs no collective.
"""

from __future__ import annotations

import pytest
import torch

from engine.attention_backends.torch_ref import TorchReferenceBackend
from engine.config import ModelConfig
from engine.kernels import KernelRegistry
from engine.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from engine.layers.linear import ColumnParallelLinear
from engine.loader import load_model
from engine.loader.lazy_tensor import ReadStats
from engine.parallel import ParallelContext
from engine.testing.tiny_gguf import write_tiny_llama_gguf
from engine.testing.tiny_models import save_tiny_model

KERNELS = KernelRegistry().resolve("cpu")


def load(path, parallel=None, stats=None, **kw):
    config = ModelConfig(model=str(path), dtype="float32", **kw)
    return load_model(config, KERNELS, TorchReferenceBackend, parallel=parallel, stats=stats)


def expected_parameters(module, full) -> dict[str, torch.Tensor]:
    """What ``module`` (one rank's layer) should hold, cut from ``full`` (the whole layer)."""
    own = dict(full.named_parameters(recurse=False))
    if isinstance(module, QKVParallelLinear):
        sizes = [
            module.total_num_heads * module.head_size,
            module.total_num_kv_heads * module.head_size,
            module.total_num_kv_heads * module.head_size,
        ]
        kv_rank = module.tp_rank // module.kv_replicas

        def rows(t):  # along the output features: weight rows and bias
            q, k, v = t.split(sizes)
            return torch.cat(
                [
                    q.chunk(module.tp_size)[module.tp_rank],
                    k.split(module.kv_size)[kv_rank],
                    v.split(module.kv_size)[kv_rank],
                ]
            )

        return {name: rows(t) for name, t in own.items()}
    if isinstance(module, MergedColumnParallelLinear):

        def rows(t):
            parts = t.split(module.output_full_sizes)
            return torch.cat([p.chunk(module.tp_size)[module.tp_rank] for p in parts])

        return {name: rows(t) for name, t in own.items()}
    if isinstance(module, ColumnParallelLinear):
        return {name: t.chunk(module.tp_size)[module.tp_rank] for name, t in own.items()}
    if isinstance(module, RowParallelLinear):  # the bias is whole on every rank
        out = dict(own)
        out["weight"] = full.weight.chunk(module.tp_size, dim=1)[module.tp_rank]
        return out
    if isinstance(module, (VocabParallelEmbedding, ParallelLMHead)):
        rows = torch.zeros_like(module.weight)
        n = module.vocab_end - module.vocab_start
        rows[:n] = full.weight[module.vocab_start : module.vocab_end]
        return {"weight": rows}
    return own


def check_is_shard(model, full_model) -> int:
    """Assert every parameter of ``model`` is its shard of ``full_model``; returns the
    checkpoint elements it holds (vocabulary padding excluded)."""
    full_modules = dict(full_model.named_modules())
    held = 0
    seen = set()
    for name, module in model.named_modules():
        own = dict(module.named_parameters(recurse=False))
        if not own:
            continue
        expected = expected_parameters(module, full_modules[name])
        for pname, param in own.items():
            if id(param) in seen:  # a tied head shares the embedding's
                continue
            seen.add(id(param))
            torch.testing.assert_close(
                param, expected[pname], atol=0, rtol=0, msg=f"{name}.{pname}"
            )
            held += param.numel()
            if isinstance(module, (VocabParallelEmbedding, ParallelLMHead)):
                held -= (module.rows_per_partition - (module.vocab_end - module.vocab_start)) * (
                    module.hidden_size
                )
    return held


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    # 4 heads, 2 KV heads, vocab 256 (not a multiple of 3: padding), 3 layers.
    return save_tiny_model("llama", tmp_path_factory.mktemp("llama"), seed=2)


@pytest.mark.parametrize("tp", [2, 4])
def test_safetensors_ranks_hold_their_shard_and_read_only_it(llama_dir, tp):
    full = load(llama_dir)
    total = sum(p.numel() for p in full.parameters()) * 4
    for rank in range(tp):
        stats = ReadStats()
        model = load(llama_dir, ParallelContext(tp_rank=rank, tp_size=tp), stats)
        held = check_is_shard(model, full)
        assert stats.offered == total
        assert stats.read == held * 4  # float32: exactly its own elements were read
        if tp == 2:  # no replicated KV heads: half the checkpoint, plus the norms
            assert 0.5 <= stats.read / stats.offered < 0.51
        else:  # 2 KV heads over 4 ranks: each rank reads one, so a bit more than a quarter
            assert 0.25 < stats.read / stats.offered < 0.35


def test_gguf_ranks_hold_their_shard_and_read_about_half(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.testing.tiny_gguf import tiny_vocab

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tiny_vocab()[0]),
        hidden_size=64,
        intermediate_size=128,  # 64 per rank: whole Q8_0 blocks of the down projection
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    hf = LlamaForCausalLM(cfg).eval()
    types = {"token_embd": "Q8_0", "attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "F16",
             "attn_output": "Q8_0", "ffn_gate": "Q4_0", "ffn_up": "BF16", "ffn_down": "Q8_0",
             "output": "Q8_0"}  # fmt: skip
    path = write_tiny_llama_gguf(tmp_path / "llama.gguf", hf, types=types)
    full_stats = ReadStats()
    full = load(path, stats=full_stats)
    assert full_stats.read == full_stats.offered  # one process reads everything once
    shares = []
    for rank in range(2):
        stats = ReadStats()
        model = load(path, ParallelContext(tp_rank=rank, tp_size=2), stats)
        check_is_shard(model, full)
        assert stats.offered == full_stats.offered
        shares.append(stats.read / stats.offered)
    assert all(0.49 < s < 0.52 for s in shares), shares


def test_pipeline_stages_load_and_read_only_their_layers(llama_dir):
    full = load(llama_dir)  # 3 layers: stage 0 gets 2, stage 1 gets 1
    total = sum(p.numel() for p in full.parameters()) * 4
    held = []
    for stage in range(2):
        stats = ReadStats()
        model = load(llama_dir, ParallelContext(pp_rank=stage, pp_size=2), stats)
        names = {n for n, _ in model.named_parameters()}
        layers = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}
        assert layers == ({0, 1} if stage == 0 else {2})
        assert ("model.embed_tokens.weight" in names) == (stage == 0)
        assert ("lm_head.weight" in names) == (stage == 1)
        assert ("model.norm.weight" in names) == (stage == 1)
        n = check_is_shard(model, full)
        assert stats.read == n * 4
        held.append(n * 4)
    assert sum(held) == total  # the stages partition the checkpoint


def test_last_stage_of_a_tied_model_loads_its_head_from_the_embedding(tmp_path):
    path = save_tiny_model("qwen2", tmp_path / "qwen2", seed=3)  # tie_word_embeddings=True
    full = load(path)
    last = load(path, ParallelContext(pp_rank=1, pp_size=2))
    assert "model.embed_tokens.weight" not in dict(last.named_parameters())
    torch.testing.assert_close(last.lm_head.weight, full.model.embed_tokens.weight, atol=0, rtol=0)


def test_lazy_tensors_read_their_window_and_work_where_a_tensor_is_expected(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from engine.loader.lazy_tensor import LazySafetensor

    full = torch.arange(48, dtype=torch.bfloat16).reshape(6, 8)
    save_file({"w": full}, tmp_path / "w.safetensors")
    with safe_open(tmp_path / "w.safetensors", framework="pt") as f:
        stats = ReadStats()
        lazy = LazySafetensor(f.get_slice("w"), stats)
        assert (lazy.shape, lazy.dtype, stats.offered, stats.read) == (
            (6, 8),
            torch.bfloat16,
            96,
            0,
        )
        window = lazy.narrow(0, 2, 3).narrow(1, 4, 4)
        assert window.shape == (3, 4) and stats.read == 0  # narrowing reads nothing
        assert torch.equal(window.materialize(), full[2:5, 4:8]) and stats.read == 24
        # A loader written for tensors: copy_, methods, indexing, torch functions.
        dst = torch.empty(3, 4, dtype=torch.float32)
        dst.copy_(window)
        assert torch.equal(dst, full[2:5, 4:8].float())
        assert torch.equal(window.float() + 1, full[2:5, 4:8].float() + 1)
        assert torch.equal(window[1], full[3, 4:8])
        assert torch.equal(torch.cat([window, window]), torch.cat([full[2:5, 4:8]] * 2))
        with pytest.raises(IndexError):
            window.narrow(0, 2, 2)  # outside the window


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: tied embeddings
def test_dummy_weights_are_the_same_model_in_every_layout(tmp_path, kind):
    """Random weights are drawn per parameter, whole, so TP=2 or a pipeline stage holds the
    shard of exactly the model TP=1 gets (what a benchmark's identity check needs)."""
    path = save_tiny_model(kind, tmp_path / kind, seed=5)
    full = load(path, load_format="dummy", seed=11)
    for rank in range(2):
        model = load(path, ParallelContext(tp_rank=rank, tp_size=2), load_format="dummy", seed=11)
        check_is_shard(model, full)
    last = load(path, ParallelContext(pp_rank=1, pp_size=2), load_format="dummy", seed=11)
    check_is_shard(last, full)
    if kind == "qwen2":  # a tied head on a stage without the embedding: the embedding's values
        torch.testing.assert_close(
            last.lm_head.weight, full.model.embed_tokens.weight, atol=0, rtol=0
        )
