"""The linear-layer family under tensor parallelism: each rank loads exactly its shard, and the
ranks' partial results combine (concatenate for column-parallel, sum for row-parallel) into the
single-process result. Ranks are simulated in one process here (the combination is done by the
test); ``test_two_gloo_ranks_match_one_process`` runs the real collectives over gloo."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from engine.layers import (
    ColumnParallelLinear,
    LinearMethod,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    ShardLayout,
    VocabParallelEmbedding,
)
from engine.layers.linear import LinearBase, set_shard_layout
from engine.layers.weight_utils import ModelLoadError, new_parameter
from engine.models.context import ModelContext
from engine.parallel import ParallelContext


def _ctx(rank: int, size: int, quant_config=None) -> ModelContext:
    return ModelContext(
        hf_config=None,
        dtype=torch.float32,
        kernels=None,
        attn_backend_cls=None,
        device=torch.device("cpu"),
        parallel=ParallelContext(tp_rank=rank, tp_size=size),
        quant_config=quant_config,
    )


def _load(layer: LinearBase, name: str, tensor: torch.Tensor, shard=None) -> None:
    param = getattr(layer, name)
    if shard is None:
        param.weight_loader(param, tensor)
    else:
        param.weight_loader(param, tensor, shard)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_parallel_ranks_concatenate_to_the_full_product(tp):
    torch.manual_seed(0)
    w, b, x = torch.randn(8, 6), torch.randn(8), torch.randn(3, 6)
    outs = []
    for r in range(tp):
        layer = ColumnParallelLinear(6, 8, bias=True, ctx=_ctx(r, tp))
        _load(layer, "weight", w)
        _load(layer, "bias", b)
        assert torch.equal(layer.weight, w.chunk(tp)[r])
        outs.append(layer(x))
    torch.testing.assert_close(torch.cat(outs, -1), F.linear(x, w, b))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_row_parallel_ranks_sum_to_the_full_product_with_the_bias_once(tp):
    torch.manual_seed(1)
    w, b, x = torch.randn(5, 8), torch.randn(5), torch.randn(3, 8)
    total = torch.zeros(3, 5)
    for r in range(tp):
        layer = RowParallelLinear(8, 5, bias=True, reduce_results=False, ctx=_ctx(r, tp))
        _load(layer, "weight", w)
        _load(layer, "bias", b)
        assert torch.equal(layer.weight, w.chunk(tp, dim=1)[r])
        total += layer(x.chunk(tp, dim=-1)[r])  # input_is_parallel: each rank gets its part
    torch.testing.assert_close(total, F.linear(x, w, b))


@pytest.mark.parametrize(("tp", "kv_heads"), [(1, 2), (2, 2), (4, 2), (4, 1), (2, 4)])
def test_qkv_shards_by_head_and_replicates_kv_heads_over_ranks(tp, kv_heads):
    torch.manual_seed(2)
    heads, d, hidden = 4, 3, 5
    q, k, v = torch.randn(heads * d, hidden), torch.randn(kv_heads * d, hidden), None
    v = torch.randn(kv_heads * d, hidden)
    x = torch.randn(2, hidden)
    for r in range(tp):
        layer = QKVParallelLinear(hidden, d, heads, kv_heads, ctx=_ctx(r, tp))
        for shard, tensor in zip("qkv", (q, k, v), strict=True):
            _load(layer, "weight", tensor, shard)
        assert layer.num_heads == heads // tp
        assert layer.num_kv_heads == max(1, kv_heads // tp)
        kv_rank = r * kv_heads // tp if kv_heads < tp else r
        oq, ok, ov = layer.split(layer(x))
        q_rows = q.view(heads, d, hidden)[r * layer.num_heads : (r + 1) * layer.num_heads]
        kv_slice = slice(kv_rank * layer.num_kv_heads, (kv_rank + 1) * layer.num_kv_heads)
        torch.testing.assert_close(oq, x @ q_rows.reshape(-1, hidden).T)
        torch.testing.assert_close(
            ok, x @ k.view(kv_heads, d, hidden)[kv_slice].reshape(-1, hidden).T
        )
        torch.testing.assert_close(
            ov, x @ v.view(kv_heads, d, hidden)[kv_slice].reshape(-1, hidden).T
        )


def test_qkv_refuses_head_counts_the_ranks_cannot_split():
    with pytest.raises(ValueError, match=r"attention heads \(6\) cannot be split evenly over 4"):
        QKVParallelLinear(8, 2, 6, 2, ctx=_ctx(0, 4))
    with pytest.raises(ValueError, match="must be a multiple of the number of key/value heads"):
        QKVParallelLinear(8, 2, 6, 4, ctx=_ctx(0, 6))


def test_merged_column_splits_each_slice_and_a_fused_checkpoint_tensor():
    torch.manual_seed(3)
    gate, up, x = torch.randn(6, 4), torch.randn(6, 4), torch.randn(2, 4)
    for r in range(2):
        layer = MergedColumnParallelLinear(4, [6, 6], ctx=_ctx(r, 2))
        _load(layer, "weight", gate, 0)
        _load(layer, "weight", up, 1)
        g, u = layer.split(layer(x))
        torch.testing.assert_close(g, x @ gate.chunk(2)[r].T)
        torch.testing.assert_close(u, x @ up.chunk(2)[r].T)
        whole = MergedColumnParallelLinear(4, [6, 6], ctx=_ctx(r, 2))
        _load(whole, "weight", torch.cat([gate, up]))  # shard_id None: one fused tensor
        assert torch.equal(whole.weight, layer.weight)


class _PackedInt4Method(LinearMethod):
    """A made-up packed format, to check the loader follows ``ShardLayout``: a GPTQ-like
    ``qweight [in/8, out]`` int32, ``scales [in/group, out]``, a block scale
    ``[ceil(out/4), ceil(in/4)]`` and one scale per fused slice."""

    name = "test-packed"

    def create_weights(self, layer):
        out, inp = layer.output_size_per_partition, layer.input_size_per_partition
        qweight = new_parameter((inp // 8, out), torch.int32)
        layer.register_parameter(
            "qweight", set_shard_layout(qweight, ShardLayout(1, 0, input_pack=8))
        )
        scales = new_parameter((inp // 4, out), torch.float32)
        layer.register_parameter(
            "scales", set_shard_layout(scales, ShardLayout(1, 0, input_pack=4))
        )
        block = new_parameter((-(-out // 4), -(-inp // 4)), torch.float32)
        layer.register_parameter("block", set_shard_layout(block, ShardLayout(0, 1, 4, 4)))
        per_slice = new_parameter((len(layer.output_slices),), torch.float32)
        layer.register_parameter(
            "per_slice", set_shard_layout(per_slice, ShardLayout(None, None, per_slice=True))
        )

    def apply(self, layer, x, bias):
        raise AssertionError("not used")


class _Config:
    def get_linear_method(self, layer, prefix):
        return _PackedInt4Method() if "quantized" in prefix else None


def test_packed_parameters_are_sharded_along_their_layout():
    torch.manual_seed(4)
    inp, out = 32, 16
    qweight = torch.randint(-(2**31), 2**31 - 1, (inp // 8, out), dtype=torch.int32)
    scales, block = torch.randn(inp // 4, out), torch.randn(out // 4, inp // 4)
    for r in range(2):
        col = ColumnParallelLinear(inp, out, ctx=_ctx(r, 2, _Config()), prefix="quantized.col")
        row = RowParallelLinear(inp, out, ctx=_ctx(r, 2, _Config()), prefix="quantized.row")
        assert col.quant_method.name == row.quant_method.name == "test-packed"
        for layer in (col, row):
            _load(layer, "qweight", qweight)
            _load(layer, "scales", scales)
            _load(layer, "block", block)
        assert torch.equal(col.qweight, qweight.chunk(2, dim=1)[r])
        assert torch.equal(col.scales, scales.chunk(2, dim=1)[r])
        assert torch.equal(col.block, block.chunk(2, dim=0)[r])
        assert torch.equal(row.qweight, qweight.chunk(2, dim=0)[r])
        assert torch.equal(row.scales, scales.chunk(2, dim=0)[r])
        assert torch.equal(row.block, block.chunk(2, dim=1)[r])
    plain = ColumnParallelLinear(inp, out, ctx=_ctx(0, 2, _Config()), prefix="model.plain")
    assert plain.quant_method.name == "unquantized" and plain.weight.shape == (8, 32)


def test_per_slice_scales_and_rounded_up_block_scales():
    qkv = QKVParallelLinear(
        8, 4, 2, 1, ctx=_ctx(0, 1, _Config()), prefix="quantized.qkv_proj"
    )  # slices of 8, 4, 4 output features
    for i, shard in enumerate("qkv"):
        _load(qkv, "per_slice", torch.tensor(float(i + 1)), shard)
        _load(qkv, "block", torch.full((2 if shard == "q" else 1, 2), float(i)), shard)
    assert qkv.per_slice.tolist() == [1.0, 2.0, 3.0]
    assert qkv.block[:, 0].tolist() == [0.0, 0.0, 1.0, 2.0]
    odd = ColumnParallelLinear(8, 6, ctx=_ctx(0, 1, _Config()), prefix="quantized.odd")
    _load(odd, "block", torch.ones(2, 2))  # ceil(6 / 4) = 2 rows of scale blocks
    with pytest.raises(ModelLoadError, match="packed element boundary"):
        ColumnParallelLinear(8, 12, ctx=_ctx(1, 2, _Config()), prefix="quantized.x").weight_loader(
            ColumnParallelLinear(8, 12, ctx=_ctx(1, 2, _Config()), prefix="quantized.x").block,
            torch.ones(3, 2),
        )


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_vocab_rows_split_with_padding(tp):
    torch.manual_seed(5)
    vocab, hidden = 11, 4
    w, ids, h = torch.randn(vocab, hidden), torch.tensor([0, 5, 10, 3]), torch.randn(4, hidden)
    emb_sum, logits = torch.zeros(4, hidden), []
    for r in range(tp):
        ctx = _ctx(r, tp)
        emb = VocabParallelEmbedding(vocab, hidden, torch.float32, parallel=ctx.parallel)
        emb.weight.weight_loader(emb.weight, w)
        head = ParallelLMHead(vocab, hidden, torch.float32, parallel=ctx.parallel)
        head.tie(emb)
        if tp == 1:
            emb_sum = emb(ids)
        else:  # what the all-reduce sums: each rank's rows of the lookup
            mine = (ids >= emb.vocab_start) & (ids < emb.vocab_end)
            local = torch.where(mine, ids - emb.vocab_start, 0)
            emb_sum += F.embedding(local, emb.weight) * mine.unsqueeze(-1)
        logits.append(head.local_logits(h))
    torch.testing.assert_close(emb_sum, w[ids])
    torch.testing.assert_close(torch.cat(logits, -1)[:, :vocab], h @ w.T)


def test_replicated_linear_copies_whole():
    layer = ReplicatedLinear(4, 3, bias=True, ctx=_ctx(1, 2))
    w = torch.randn(3, 4)
    _load(layer, "weight", w)
    assert torch.equal(layer.weight, w) and layer.tp_size == 1


# ---- real collectives over gloo -----------------------------------------------------------
def _rank_main(rank: int, world: int, port: int, results: dict) -> None:
    import torch.distributed as dist

    from engine.distributed import TorchDistributedCommunicator

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)  # the same full tensors on every rank
        hidden, inter, vocab = 8, 12, 13
        w_gate, w_up = torch.randn(inter, hidden), torch.randn(inter, hidden)
        w_down, w_emb = torch.randn(hidden, inter), torch.randn(vocab, hidden)
        ids = torch.tensor([1, 12, 7])
        parallel = ParallelContext(
            tp_rank=rank, tp_size=world, tp=TorchDistributedCommunicator(None)
        )
        ctx = ModelContext(None, torch.float32, None, None, torch.device("cpu"), parallel=parallel)
        emb = VocabParallelEmbedding(vocab, hidden, torch.float32, parallel=parallel)
        emb.weight.weight_loader(emb.weight, w_emb)
        gate_up = MergedColumnParallelLinear(hidden, [inter, inter], ctx=ctx)
        _load(gate_up, "weight", w_gate, 0)
        _load(gate_up, "weight", w_up, 1)
        down = RowParallelLinear(inter, hidden, ctx=ctx)
        _load(down, "weight", w_down)
        head = ParallelLMHead(vocab, hidden, torch.float32, parallel=parallel)
        head.tie(emb)
        x = emb(ids)
        g, u = gate_up.split(gate_up(x))
        logits = head(down(F.silu(g) * u))
        ref_x = w_emb[ids]
        ref = F.linear(F.linear(F.silu(ref_x @ w_gate.T) * (ref_x @ w_up.T), w_down), w_emb)
        results[rank] = (torch.allclose(logits, ref, atol=1e-4, rtol=1e-4), tuple(logits.shape))
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_match_one_process():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_rank_main, args=(2, port, results), nprocs=2, join=True)
    assert dict(results) == {0: (True, (3, 13)), 1: (True, (3, 13))}
