"""Multi-LoRA on a CUDA GPU: the Triton kernels inside captured decode graphs.

The graphs are captured once with the LoRA kernels in them; every replay reads the step's
token-to-slot mapping from the fixed device buffers the runner fills, so replays of one graph
serve different adapter mixes, slots reloaded between replays, and rows without an adapter.
Greedy tokens must equal transformers with each adapter merged (PEFT ``merge_and_unload``), in
float32, with asynchronous scheduling on and off, and the eager path; the kernels are checked
against the torch reference at the Llama-3.1-8B projection shapes, eagerly and in a graph.
"""

from __future__ import annotations

import gc
import random

import numpy as np
import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from engine.kernels.reference import add_lora_linear as reference
from engine.lora.mapping import group_by_slot
from engine.testing.lora import hf_greedy, make_peft_adapter, merged_model
from engine.testing.tiny_models import build_tiny_model

pytestmark = pytest.mark.gpu
NUM_NEW = 16


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"gpu-lora-{request.param}")
    path = build_tiny_model(root / "m", request.param)
    adapters = {
        "a8": make_peft_adapter(path, root / "a8", rank=8, seed=1),
        "a4": make_peft_adapter(path, root / "a4", rank=4, seed=2, targets=["q_proj", "down_proj"]),
        "a16": make_peft_adapter(path, root / "a16", rank=16, seed=3, use_rslora=True),
    }
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 300) for _ in range(n)] for n in (1, 5, 17, 33, 64, 9, 100, 3)]
    refs = {}
    for name in [None, *adapters]:
        model = merged_model(path, adapters[name] if name else None)
        refs[name] = [hf_greedy(model, p, NUM_NEW) for p in prompts]
    return str(path), adapters, prompts, refs


def _run(setup, assignment, **kwargs):
    path, adapters, prompts, refs = setup
    loras = {n: LoRARequest(n, i, str(p)) for i, (n, p) in enumerate(adapters.items(), 1)}
    llm = LLM(path, dtype="float32", platform="cuda", attention_backend="triton", block_size=16,
              max_num_batched_tokens=128, num_gpu_blocks_override=512, enable_lora=True,
              max_lora_rank=16, **kwargs)  # fmt: skip
    runner = llm.llm_engine.runner
    replays = []
    if runner.graphs is not None:
        run = runner.graphs.run

        def counting(scheduled, *args, **kwargs):
            hidden = run(scheduled, *args, **kwargs)
            if hidden is not None:
                replays.append({s.request.lora_id for s in scheduled})
            return hidden

        runner.graphs.run = counting
    outs = llm.generate(
        prompts,
        SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True),
        use_tqdm=False,
        lora_request=[loras[a] if a else None for a in assignment],
    )
    for i, (out, name) in enumerate(zip(outs, assignment, strict=True)):
        assert out.outputs[0].token_ids == refs[name][i], f"prompt {i} with adapter {name}"
    assert llm.llm_engine.num_used_blocks == 0
    info = (runner.graphs is not None, replays, runner.lora.num_slot_loads)
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()
    return info


ASSIGNMENT = ["a8", None, "a4", "a16", "a8", "a4", None, "a16"]


@pytest.mark.parametrize("fused", [True, False], ids=["shrink-in-gemm", "separate-shrink"])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_graph_replays_serve_mixed_adapters(setup, async_scheduling, fused):
    graphs, replays, _ = _run(
        setup,
        ASSIGNMENT,
        max_loras=3,
        async_scheduling=async_scheduling,
        lora_fused_shrink=fused,
    )
    assert graphs and replays, "no decode step replayed a captured graph"
    assert any(len(r - {0}) == 3 for r in replays)  # three adapters in one replayed step


def test_slots_reloaded_between_replays(setup):
    """Two slots for three adapters: the scheduler rotates them and the runner copies
    adapters into slots between replays of the same graphs."""
    graphs, replays, loads = _run(setup, ASSIGNMENT, max_loras=2)
    assert graphs and replays and loads > 3
    assert all(len(r - {0}) <= 2 for r in replays)


def test_eager_matches_too(setup):
    graphs, replays, _ = _run(setup, ASSIGNMENT, max_loras=3, enforce_eager=True)
    assert not graphs and not replays


# ---- kernels at the Llama-3.1-8B shapes ------------------------------------------------------
PROJECTIONS = {
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}


def _inputs(t, k, sizes, rank, slots, seed_mapping):
    n = sum(sizes)
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(t, k, device=dev).to(dt)
    a = (torch.randn(slots, len(sizes) * rank, k, device=dev) * k**-0.5).to(dt)
    b = (torch.randn(slots, n, rank, device=dev) * rank**-0.5).to(dt)
    y = torch.randn(t, n, device=dev).to(dt)
    mapping = np.array(seed_mapping, dtype=np.int32)
    st, ss = group_by_slot(mapping, slots)
    return y, x, a, b, *(torch.from_numpy(v).to(dev) for v in (mapping, st, ss))


@pytest.mark.parametrize("t", [1, 7, 256, 1000])
@pytest.mark.parametrize("name", list(PROJECTIONS))
def test_kernels_at_llama_8b_shapes(name, t, seed):
    from engine_triton.kernels.lora import add_lora_linear

    k, sizes = PROJECTIONS[name]
    rng = random.Random(seed)
    mapping = [rng.randrange(-1, 8) for _ in range(t)]
    y, x, a, b, ts, st, ss = _inputs(t, k, sizes, 16, 8, mapping)
    expected = reference(y.clone().float(), x.float(), a.float(), b.float(), ts, st, ss, sizes)
    got = add_lora_linear(y, x, a, b, ts, st, ss, sizes)
    # One bf16 rounding of y + delta (|.| ~ 1.5), plus the shrunk values rounded to bf16.
    torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=2e-2, msg=f"seed={seed}")


@pytest.mark.parametrize("t", [1, 7, 256])
@pytest.mark.parametrize("name", list(PROJECTIONS))
def test_augmented_expand_at_llama_8b_shapes(name, t, seed):
    """The shrink-in-the-GEMM path: ``x @ [W; A]^T`` by the engine's linear, then the expand."""
    from engine.kernels.reference import lora_expand_augmented as expand_reference
    from engine_triton.kernels.linear import linear
    from engine_triton.kernels.lora import lora_expand_augmented

    k, sizes = PROJECTIONS[name]
    rng = random.Random(seed)
    mapping = [rng.randrange(-1, 8) for _ in range(t)]
    y, x, a, b, ts, st, ss = _inputs(t, k, sizes, 16, 8, mapping)
    w = (torch.randn(sum(sizes), k, device="cuda") * k**-0.5).to(torch.bfloat16)
    y_aug = linear(x, torch.cat([w, a.reshape(-1, k)]))
    expected = expand_reference(y_aug.float(), sum(sizes), b.float(), ts, st, ss, sizes)
    got = lora_expand_augmented(y_aug, sum(sizes), b, ts, st, ss, sizes)
    torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=2e-2, msg=f"seed={seed}")
    # The base part is the plain product (cuBLAS / skinny rounding of the same GEMM).
    none = ts < 0
    torch.testing.assert_close(got[none].float(), (x @ w.T)[none].float(), atol=3e-2, rtol=2e-2)


def test_kernels_in_a_cuda_graph_follow_the_mapping_buffers(seed):
    """One capture, replays after rewriting the mapping buffers in place (what the runner
    does between steps): each replay matches the reference for its own mapping."""
    from engine_triton.kernels.lora import add_lora_linear

    k, sizes = PROJECTIONS["qkv"]
    t, slots = 16, 8
    y0, x, a, b, ts, _, ss = _inputs(t, k, sizes, 16, slots, [-1] * t)
    st = torch.zeros(t, dtype=torch.int32, device="cuda")  # a fixed buffer, as the runner's
    y = y0.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        add_lora_linear(y, x, a, b, ts, st, ss, sizes)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        add_lora_linear(y, x, a, b, ts, st, ss, sizes)
    rng = random.Random(seed)
    for _ in range(4):
        mapping = np.array([rng.randrange(-1, slots) for _ in range(t)], dtype=np.int32)
        sorted_tokens, starts = group_by_slot(mapping, slots)
        ts.copy_(torch.from_numpy(mapping))
        st[: len(sorted_tokens)].copy_(torch.from_numpy(sorted_tokens))
        ss.copy_(torch.from_numpy(starts))
        y.copy_(y0)
        graph.replay()
        torch.cuda.synchronize()
        expected = reference(y0.clone(), x, a, b, ts, st, ss, sizes)
        torch.testing.assert_close(y.float(), expected.float(), atol=3e-2, rtol=2e-2)
