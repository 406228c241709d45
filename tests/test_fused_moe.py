"""The ``FusedMoE`` layer on the CPU: the torch reference kernels against a per-token loop,
expert placement and sharding (every rank's part sums to the whole), checkpoint forms, load
errors, expert-load counting, and the parallel styles over a real 2-rank gloo group."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import KernelRegistry
from engine.kernels import reference as ref
from engine.layers.fused_moe import (
    ExpertCheckpointMapping,
    FusedMoE,
    MoEParallel,
    enable_expert_load_counting,
    expert_load_summary,
    read_expert_load,
)
from engine.layers.weight_utils import ModelLoadError, load_named_weights

KERNELS = KernelRegistry().resolve("cpu")
E, K, H, INTER = 8, 2, 24, 16


def _weights(seed=0, e=E, h=H, i=INTER):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(e, i, h, generator=g) * h**-0.5,
        torch.randn(e, i, h, generator=g) * h**-0.5,
        torch.randn(e, h, i, generator=g) * i**-0.5,
    )


def _layer(weights, parallel=None, communicator=None, **kw):
    w1, w3, w2 = weights
    layer = FusedMoE(E, K, H, INTER, renormalize=True, kernels=KERNELS, parallel=parallel,
                     communicator=communicator, **kw)  # fmt: skip
    for e in range(E):
        layer.weight_loader(layer.w13_weight, w1[e], "w1", e)
        layer.weight_loader(layer.w13_weight, w3[e], "w3", e)
        layer.weight_loader(layer.w2_weight, w2[e], "w2", e)
    return layer


def _per_token(x, weights, topk_w, topk_ids):
    """The definition, one token and choice at a time."""
    w1, w3, w2 = weights
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(topk_w[t].tolist(), topk_ids[t].tolist(), strict=True):
            if e >= 0:
                out[t] += w * F.linear(F.silu(F.linear(x[t], w1[e])) * F.linear(x[t], w3[e]), w2[e])
    return out


class _Summing:
    """A stand-in communicator for ranks simulated in one process: collectives are left to the
    test (it sums the ranks' partial outputs itself)."""

    world_size = 2

    def all_reduce(self, t):
        return t


def test_reference_kernels_match_the_definition():
    weights = _weights()
    w1, w3, w2 = weights
    x = torch.randn(11, H)
    logits = torch.randn(11, E)
    topk_w, topk_ids = ref.moe_topk_softmax(logits, K, True)
    probs = torch.softmax(logits, -1)
    assert torch.allclose(topk_w.sum(-1), torch.ones(11))
    assert torch.equal(topk_ids.long(), probs.topk(K, -1).indices)
    topk_ids[3, 1] = -1  # held elsewhere
    w13 = torch.cat([w1, w3], dim=1)
    got = ref.fused_moe(x, w13, w2, topk_w, topk_ids)
    torch.testing.assert_close(got, _per_token(x, weights, topk_w, topk_ids), atol=1e-5, rtol=1e-5)
    empty = ref.fused_moe(x[:0], w13, w2, topk_w[:0], topk_ids[:0])
    assert empty.shape == (0, H)


@pytest.mark.parametrize("ep_size", [2, 3])
def test_expert_placement_covers_every_expert_once(ep_size):
    ranges = [MoEParallel(ep_rank=r, ep_size=ep_size).expert_range(E) for r in range(ep_size)]
    assert [e for r in ranges for e in r] == list(range(E))
    assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


@pytest.mark.parametrize("style", ["tp", "ep"])
def test_rank_parts_sum_to_the_whole(style):
    """Each rank's partial output (its experts, or its intermediate slice of every expert)
    sums to the single-device layer's output; the EP map sends others' experts to -1."""
    weights = _weights(1)
    x, logits = torch.randn(9, H), torch.randn(9, E)
    whole = _layer(weights)(x, logits)
    parts = []
    for rank in range(2):
        parallel = MoEParallel.for_group(rank, 2, enable_expert_parallel=style == "ep")
        layer = _layer(weights, parallel, _Summing())
        if style == "ep":
            assert layer.num_local_experts == E // 2
            assert layer.w13_weight.shape == (E // 2, 2 * INTER, H)
            assert layer.expert_map.tolist().count(-1) == E // 2
        else:
            assert layer.w13_weight.shape == (E, INTER, H)  # INTER / 2 gate + INTER / 2 up rows
        parts.append(layer(x, logits))
    torch.testing.assert_close(parts[0] + parts[1], whole, atol=1e-5, rtol=1e-5)


def test_checkpoint_forms_load_the_same_parameters():
    """Per-expert tensors (Qwen and Mixtral names), transformers 5's fused [E, 2I, H] / [E, H, INTER]
    parameters and GGUF-style stacked gate/up/down all fill the same stacked weights."""
    w1, w3, w2 = _weights(2)
    model = torch.nn.Module()
    model.experts = FusedMoE(E, K, H, INTER, renormalize=True, kernels=KERNELS)
    forms = {
        "qwen": [(f"experts.{e}.{p}.weight", w[e]) for e in range(E)
                 for p, w in (("gate_proj", w1), ("up_proj", w3), ("down_proj", w2))],
        "fused": [("experts.gate_up_proj", torch.cat([w1, w3], 1)), ("experts.down_proj", w2)],
        "stacked": [("experts.gate_proj.weight", w1), ("experts.up_proj.weight", w3),
                    ("experts.down_proj.weight", w2)],
    }  # fmt: skip
    results = {}
    for name, tensors in forms.items():
        model.experts.w13_weight.data.zero_()
        model.experts.w2_weight.data.zero_()
        mapping = ExpertCheckpointMapping(model)
        rest = list(mapping.filter(tensors + [("norm.weight", torch.ones(3))]))
        assert [n for n, _ in rest] == ["norm.weight"]  # everything else passes through
        assert mapping.loaded() == {"experts.w13_weight", "experts.w2_weight"}
        results[name] = (model.experts.w13_weight.clone(), model.experts.w2_weight.clone())
    assert torch.equal(results["qwen"][0], torch.cat([w1, w3], 1))
    for name in ("fused", "stacked"):
        assert all(torch.equal(a, b) for a, b in zip(results[name], results["qwen"], strict=True))


def test_load_errors_name_the_tensor():
    w1, w3, w2 = _weights(3)
    model = torch.nn.Module()
    model.experts = FusedMoE(E, K, H, INTER, renormalize=True, kernels=KERNELS)
    mapping = ExpertCheckpointMapping(model)
    tensors = [(f"experts.{e}.gate_proj.weight", w1[e]) for e in range(E)]
    tensors += [(f"experts.{e}.down_proj.weight", w2[e]) for e in range(E)]
    tensors += [(f"experts.{e}.up_proj.weight", w3[e]) for e in range(E) if e != 5]
    list(mapping.filter(tensors))
    with pytest.raises(ModelLoadError, match=r"missing 1 expert tensor\(s\): experts\.5\.up_proj"):
        mapping.loaded()
    with pytest.raises(
        ModelLoadError, match=r"'experts\.2\.up_proj\.weight'.*\(16, 24\).*\(16, 20\)"
    ):
        list(mapping.filter([("experts.2.up_proj.weight", torch.zeros(INTER, 20))]))
    with pytest.raises(ModelLoadError, match=r"unknown expert projection 'w9'"):
        list(mapping.filter([("experts.2.w9.weight", torch.zeros(INTER, H))]))
    with pytest.raises(ModelLoadError, match="expert 8 out of range"):
        list(mapping.filter([("experts.8.up_proj.weight", w3[0])]))


def test_bad_configurations_are_refused():
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size 3"):
        FusedMoE(E, K, H, INTER, renormalize=True, kernels=KERNELS, parallel=MoEParallel(0, 3),
                 communicator=_Summing())  # fmt: skip
    with pytest.raises(ValueError, match="needs a communicator"):
        FusedMoE(E, K, H, INTER, renormalize=True, kernels=KERNELS, parallel=MoEParallel(0, 2))
    with pytest.raises(ValueError, match="scoring function 'sigmoid' is not supported"):
        FusedMoE(E, K, H, INTER, renormalize=True, kernels=KERNELS, scoring_func="sigmoid")
    with pytest.raises(ValueError, match=r"top_k must be in \[1, num_experts=8\]"):
        FusedMoE(E, 9, H, INTER, renormalize=True, kernels=KERNELS)


def test_expert_load_counting():
    model = torch.nn.Module()
    model.a = _layer(_weights(4))
    model.b = _layer(_weights(5))
    x, logits = torch.randn(10, H), torch.randn(10, E)
    model.a(x, logits)
    assert read_expert_load(model) is None  # off by default: nothing counted
    assert enable_expert_load_counting(model) == 2
    model.a(x, logits)
    mask = torch.ones(10, dtype=torch.bool)
    mask[7:] = False  # padding rows are not counted
    model.b(x, logits, mask)
    counts = read_expert_load(model, reset=True)
    ids = ref.moe_topk_softmax(logits, K, True)[1].long()
    assert counts[0].tolist() == torch.bincount(ids.flatten(), minlength=E).tolist()
    assert counts[1].tolist() == torch.bincount(ids[:7].flatten(), minlength=E).tolist()
    assert read_expert_load(model).sum() == 0  # reset
    summary = expert_load_summary(counts)
    assert summary["layers"] == 2 and summary["routed_tokens"] == 10 * K + 7 * K
    assert summary["per_layer"][0]["max_over_mean"] == round(max(counts[0].tolist()) / (20 / E), 3)
    enable_expert_load_counting(model, False)
    assert read_expert_load(model) is None


@pytest.mark.timeout(180)
def test_parallel_styles_over_two_gloo_ranks():
    """TP=2, EP=2 (all-reduce) and EP=2 with each rank's own tokens (all-gather +
    reduce-scatter) through TorchDistributedCommunicator equal one rank."""
    from engine.testing.moe_parallel import run_moe_parallel_check

    run_moe_parallel_check(2)


def _sparse_block(rank, size, enable_ep, spec, tensors):
    """A SparseMoeBlock for rank ``rank`` of ``size`` built from a model context (as the
    tensor-parallel executor makes it) and loaded from checkpoint tensors under ``mlp.``."""
    import types

    from engine.models.llama import FUSED_WEIGHTS
    from engine.models.moe import SparseMoeBlock
    from engine.parallel import ParallelContext

    ctx = types.SimpleNamespace(
        hf_config=types.SimpleNamespace(hidden_size=H, hidden_act="silu"), dtype=torch.float32,
        kernels=KERNELS, parallel=ParallelContext(tp_rank=rank, tp_size=size, tp=_Summing()),
        enable_expert_parallel=enable_ep, quant_config=None,
    )  # fmt: skip
    root = torch.nn.Module()
    root.mlp = SparseMoeBlock(ctx, spec, prefix="mlp")
    mapping = ExpertCheckpointMapping(root)
    loaded = load_named_weights(root, mapping.filter(tensors), FUSED_WEIGHTS) | mapping.loaded()
    assert loaded == {name for name, _ in root.named_parameters()}
    return root.mlp


@pytest.mark.parametrize("enable_ep", [False, True])
def test_sparse_block_with_shared_expert_splits_over_ranks(enable_ep):
    """Qwen2-MoE's block from a model context: experts sharded (TP) or placed (EP) by the
    context's tensor-parallel rank, the shared expert column/row-parallel and left unreduced,
    so that the two ranks' outputs (one collective each) sum to the single-device block's."""
    from engine.models.moe import MoESpec

    spec = MoESpec(E, K, INTER, renormalize=False, shared_expert_intermediate_size=32)
    w1, w3, w2 = _weights(6)
    g = torch.Generator().manual_seed(7)
    tensors = [
        ("mlp.gate.weight", torch.randn(E, H, generator=g)),
        ("mlp.shared_expert_gate.weight", torch.randn(1, H, generator=g)),
    ]
    tensors += [
        (f"mlp.shared_expert.{p}.weight", torch.randn(*shape, generator=g) * 0.2)
        for p, shape in (("gate_proj", (32, H)), ("up_proj", (32, H)), ("down_proj", (H, 32)))
    ]
    tensors += [(f"mlp.experts.{e}.{p}.weight", w[e]) for e in range(E)
                for p, w in (("gate_proj", w1), ("up_proj", w3), ("down_proj", w2))]  # fmt: skip
    x = torch.randn(7, H)
    whole = _sparse_block(0, 1, enable_ep, spec, tensors)(x)
    ranks = [_sparse_block(r, 2, enable_ep, spec, tensors) for r in range(2)]
    if enable_ep:
        assert [b.experts.local_experts for b in ranks] == [range(0, 4), range(4, 8)]
    else:
        assert ranks[1].experts.w13_weight.shape == (E, INTER, H)
    assert ranks[1].shared_expert.down_proj.weight.shape == (H, 16)
    assert not ranks[1].shared_expert.down_proj.reduce_results
    torch.testing.assert_close(ranks[0](x) + ranks[1](x), whole, atol=1e-5, rtol=1e-5)
