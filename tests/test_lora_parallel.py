"""LoRA on the linear-layer family under tensor parallelism.

Each rank loads its shard of an adapter through the real path (a PEFT directory read by
``LoRAModelManager``): column-parallel layers hold B's rows of their output features (a
replicated KV head takes its KV rank's rows) and A whole; row-parallel layers hold A's columns
of their input features and B whole, and add ``(x_r A_r^T) B^T`` to their partial product, so
the base all-reduce alone sums the adapter too. Ranks are simulated in one process (the test
concatenates / sums what the collectives would), then two gloo ranks run the real all-reduce.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from engine.layers import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.lora.config import LoRAConfig
from engine.lora.model_manager import LoRAModelManager
from engine.lora.request import LoRARequest
from engine.models.context import ModelContext
from engine.parallel import ParallelContext

HIDDEN, HEAD, HEADS, INTER = 16, 4, 4, 24


class _Block(nn.Module):
    """An attention + MLP block's projections, named as a model's decoder names them."""

    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self, parallel: ParallelContext, kv_heads: int) -> None:
        super().__init__()
        ctx = ModelContext(None, torch.float32, None, None, torch.device("cpu"), parallel=parallel)
        self.model = nn.Module()
        m = self.model
        m.qkv_proj = QKVParallelLinear(
            HIDDEN, HEAD, HEADS, kv_heads, ctx=ctx, prefix="model.qkv_proj"
        )
        m.o_proj = RowParallelLinear(HEADS * HEAD, HIDDEN, ctx=ctx, reduce_results=False)
        m.gate_up_proj = MergedColumnParallelLinear(HIDDEN, [INTER, INTER], ctx=ctx)
        m.down_proj = RowParallelLinear(INTER, HIDDEN, ctx=ctx)


def _full_weights(kv_heads: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "q_proj": (HEADS * HEAD, HIDDEN),
        "k_proj": (kv_heads * HEAD, HIDDEN),
        "v_proj": (kv_heads * HEAD, HIDDEN),
        "o_proj": (HIDDEN, HEADS * HEAD),
        "gate_proj": (INTER, HIDDEN),
        "up_proj": (INTER, HIDDEN),
        "down_proj": (HIDDEN, INTER),
    }
    return {k: torch.randn(s, generator=g) / s[1] ** 0.5 for k, s in shapes.items()}


def _write_adapter(
    path: Path, weights: dict[str, torch.Tensor], rank: int, alpha: float, seed: int
):
    """A PEFT directory adapting every projection; returns its (A, B, scaling) by module."""
    g = torch.Generator().manual_seed(seed)
    tensors, modules = {}, {}
    for name, w in weights.items():
        a = torch.randn(rank, w.shape[1], generator=g) / w.shape[1] ** 0.5
        b = torch.randn(w.shape[0], rank, generator=g) / rank**0.5
        tensors[f"base_model.model.model.{name}.lora_A.weight"] = a
        tensors[f"base_model.model.model.{name}.lora_B.weight"] = b
        modules[name] = (a, b, alpha / rank)
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(
        json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(weights)}
        )
    )
    return modules


def _load_block(block: _Block, weights: dict[str, torch.Tensor]) -> None:
    m = block.model
    for shard in "qkv":
        m.qkv_proj.weight.weight_loader(m.qkv_proj.weight, weights[f"{shard}_proj"], shard)
    m.o_proj.weight.weight_loader(m.o_proj.weight, weights["o_proj"])
    m.gate_up_proj.weight.weight_loader(m.gate_up_proj.weight, weights["gate_proj"], 0)
    m.gate_up_proj.weight.weight_loader(m.gate_up_proj.weight, weights["up_proj"], 1)
    m.down_proj.weight.weight_loader(m.down_proj.weight, weights["down_proj"])


def _lora_block(parallel, kv_heads, weights, adapter_dirs, slots_of_tokens, fused=False):
    """A rank's block with the adapters in slots and a step's token mapping set (``fused``:
    the shrink in each layer's base GEMM)."""
    block = _Block(parallel, kv_heads)
    _load_block(block, weights)
    manager = LoRAModelManager(
        block,
        LoRAConfig(max_loras=len(adapter_dirs), max_lora_rank=8, fused_shrink=fused),
        None,
        torch.device("cpu"),
        16,
    )
    for key, path in enumerate(adapter_dirs, start=1):
        manager.add_adapter(key, LoRARequest(f"a{key}", key, str(path)))
    # One "request" per token, keyed by adapter (0: none).
    scheduled = [
        SimpleNamespace(request=SimpleNamespace(lora_id=k), num_new_tokens=1)
        for k in slots_of_tokens
    ]
    manager.prepare(scheduled)
    return block


def _reference(x, w, modules, keys, name):
    """x W^T plus each token's own adapter on module ``name`` (key 0: none)."""
    y = F.linear(x, w[name])
    for t, key in enumerate(keys):
        if key:
            a, b, s = modules[key - 1][name]
            y[t] += s * (x[t] @ a.T) @ b.T
    return y


@pytest.mark.parametrize("fused", [False, True], ids=["separate-shrink", "shrink-in-gemm"])
@pytest.mark.parametrize(("tp", "kv_heads"), [(1, 2), (2, 2), (4, 2), (2, 4)])
def test_sharded_adapters_combine_to_the_single_process_result(tmp_path, tp, kv_heads, fused):
    torch.manual_seed(0)
    weights = _full_weights(kv_heads)
    modules = [
        _write_adapter(tmp_path / "a1", weights, rank=4, alpha=8.0, seed=1),
        _write_adapter(tmp_path / "a2", weights, rank=8, alpha=4.0, seed=2),
    ]
    keys = [1, 0, 2, 2, 1, 0]
    x = torch.randn(len(keys), HIDDEN)
    x_attn, x_mlp = torch.randn(len(keys), HEADS * HEAD), torch.randn(len(keys), INTER)
    ref = {n: _reference(x, weights, modules, keys, n) for n in ("q_proj", "k_proj", "v_proj")}
    ref.update({n: _reference(x, weights, modules, keys, n) for n in ("gate_proj", "up_proj")})
    ref["o_proj"] = _reference(x_attn, weights, modules, keys, "o_proj")
    ref["down_proj"] = _reference(x_mlp, weights, modules, keys, "down_proj")
    o_sum = torch.zeros(len(keys), HIDDEN)
    down_sum = torch.zeros(len(keys), HIDDEN)
    for r in range(tp):
        block = _lora_block(
            ParallelContext(tp_rank=r, tp_size=tp),
            kv_heads,
            weights,
            [tmp_path / "a1", tmp_path / "a2"],
            keys,
            fused,
        )
        m = block.model
        assert all(
            (layer.quant_method.augmented is not None) == fused
            for layer in (m.qkv_proj, m.o_proj, m.gate_up_proj, m.down_proj)
        )
        q, k, v = m.qkv_proj.split(m.qkv_proj(x))
        qs = ref["q_proj"].shape[1] // tp
        kv_rank = r // max(1, tp // kv_heads)
        kvs = k.shape[1]
        torch.testing.assert_close(q, ref["q_proj"][:, r * qs : (r + 1) * qs])
        torch.testing.assert_close(k, ref["k_proj"][:, kv_rank * kvs : (kv_rank + 1) * kvs])
        torch.testing.assert_close(v, ref["v_proj"][:, kv_rank * kvs : (kv_rank + 1) * kvs])
        g, u = m.gate_up_proj.split(m.gate_up_proj(x))
        inter = INTER // tp
        torch.testing.assert_close(g, ref["gate_proj"][:, r * inter : (r + 1) * inter])
        torch.testing.assert_close(u, ref["up_proj"][:, r * inter : (r + 1) * inter])
        # Row-parallel: each rank's input part; the all-reduce (here: the sum) adds the ranks.
        attn_part = HEADS * HEAD // tp
        o_sum += m.o_proj(x_attn[:, r * attn_part : (r + 1) * attn_part])
        if tp == 1:
            down_sum += m.down_proj(x_mlp)
        else:
            m.down_proj.reduce_results = False
            down_sum += m.down_proj(x_mlp[:, r * inter : (r + 1) * inter])
    torch.testing.assert_close(o_sum, ref["o_proj"])
    torch.testing.assert_close(down_sum, ref["down_proj"])


# ---- real collectives over gloo -----------------------------------------------------------
def _rank_main(rank: int, world: int, port: int, root: str, results: dict) -> None:
    import torch.distributed as dist

    from engine.distributed import TorchDistributedCommunicator

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        weights = _full_weights(2)
        parallel = ParallelContext(
            tp_rank=rank, tp_size=world, tp=TorchDistributedCommunicator(None)
        )
        keys = [1, 0, 1]
        block = _lora_block(parallel, 2, weights, [Path(root) / "a1"], keys, fused=rank == 1)
        m = block.model
        torch.manual_seed(5)
        x = torch.randn(len(keys), HIDDEN)
        g, u = m.gate_up_proj.split(m.gate_up_proj(x))
        out = m.down_proj(F.silu(g) * u)  # row-parallel: LoRA partials summed by its all-reduce
        modules = [torch.load(Path(root) / "modules.pt")]
        rg = _reference(x, weights, modules, keys, "gate_proj")
        ru = _reference(x, weights, modules, keys, "up_proj")
        ref = _reference(F.silu(rg) * ru, weights, modules, keys, "down_proj")
        results[rank] = bool(torch.allclose(out, ref, atol=1e-5, rtol=1e-5))
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_match_one_process(tmp_path):
    import socket

    import torch.multiprocessing as mp

    modules = _write_adapter(tmp_path / "a1", _full_weights(2), rank=4, alpha=8.0, seed=1)
    torch.save(modules, tmp_path / "modules.pt")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_rank_main, args=(2, port, str(tmp_path), results), nprocs=2, join=True)
    assert dict(results) == {0: True, 1: True}
