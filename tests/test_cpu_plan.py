"""Native plans (``engine_cpu.plan``): a CPU decode step recorded once and replayed by one call
into the compiled kernels must give exactly the tokens of the eager steps, refuse (loudly) a
step with torch ops between its kernels, and lay its buffers out without two live ones sharing
bytes."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kernels import reference
from engine.testing.tiny_gguf import MIXED_SHAPE, MIXED_TYPES, write_tiny_gemma3_gguf
from engine.testing.tiny_models import build_tiny_model
from engine_cpu import activations, native, norms, plan

pytestmark = pytest.mark.skipif(
    native.load("avx2") is None, reason=f"no AVX2 kernels: {native.unavailable_reason('avx2')}"
)


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    # Mixed types: q/k and v, gate and up are runs of two types, so their products fill the
    # columns of one output (``writes_out``) inside the plan.
    return write_tiny_gemma3_gguf(
        tmp_path_factory.mktemp("plan") / "tiny.gguf", seed=3, types=MIXED_TYPES, **MIXED_SHAPE
    )


def generate(path, dtype="float32", **kw) -> tuple[LLM, list[list[int]]]:
    llm = LLM(model=str(path), dtype=dtype, max_model_len=256, max_num_seqs=4, **kw)
    # Six requests of different lengths through four slots: decode batches of 4 down to 1,
    # with prefill steps (eager) between them as requests finish and others start.
    prompts = [[2, *range(10 + 7 * i, 13 + 12 * i)] for i in range(6)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=5 + 6 * i, ignore_eos=True) for i in range(6)
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_plans_give_exactly_the_eager_tokens(gguf_path, async_scheduling):
    _, want = generate(gguf_path, enforce_eager=True)
    llm, got = generate(gguf_path, async_scheduling=async_scheduling)
    assert got == want
    engine = llm.llm_engine
    graphs = engine.runner.graphs
    assert isinstance(graphs, plan.CpuDecodePlans)
    assert graphs._refused is None
    assert {1, 2, 3} <= set(graphs._plans), sorted(graphs._plans)
    assert engine.num_used_blocks == 0 and not engine.has_unfinished_requests()
    # Replays again on a second batch through the recorded plans.
    again = llm.generate(
        [{"prompt_token_ids": [2, 40, 41, 42]}] * 2,
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
        use_tqdm=False,
    )
    assert again[0].outputs[0].token_ids == again[1].outputs[0].token_ids
    assert engine.num_used_blocks == 0


def test_bfloat16_steps_run_as_plans_with_the_eager_tokens(gguf_path):
    """In bfloat16 (``engine serve``'s default dtype on the CPU) the GGUF products write their
    bfloat16 results themselves, so the step records: no torch cast or copy between kernels."""
    _, want = generate(gguf_path, dtype="bfloat16", enforce_eager=True)
    llm, got = generate(gguf_path, dtype="bfloat16")
    assert got == want
    graphs = llm.llm_engine.runner.graphs
    assert graphs._refused is None and {1, 2, 3} <= set(graphs._plans)


def test_a_step_with_torch_ops_stays_eager_and_says_why(tmp_path, caplog):
    """A dense model's linear layers are torch ops: the first decode step refuses its
    recording, names the ops once in the log, and every step stays eager and exact."""
    path = build_tiny_model(tmp_path / "llama", "llama")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10]}]
    eager = LLM(model=str(path), dtype="float32", enforce_eager=True)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    with caplog.at_level(logging.INFO, logger="engine_cpu.plan"):
        llm = LLM(model=str(path), dtype="float32")
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    graphs = llm.llm_engine.runner.graphs
    assert graphs._refused is not None and not graphs._plans
    lines = [r.getMessage() for r in caplog.records if "stay eager" in r.getMessage()]
    assert len(lines) == 1 and "torch ops between the compiled kernels" in lines[0], lines


def test_the_guard_refuses_what_a_replay_would_not_repeat():
    x = torch.randn(4, 8)
    guard = plan.CaptureGuard()
    with guard:
        y = torch.empty_like(x)  # an allocation: becomes an arena buffer
        y.view(-1)[:3]  # views: nothing to repeat
        x.to(torch.float32)  # a cast to the same dtype is the tensor itself
        x + 1  # arithmetic: a replay would not run it
        x.sum().item()  # a value read on the host: frozen into the recording
    assert [t.data_ptr() for t in guard.allocations] == [y.data_ptr()]
    assert "aten.add.Tensor" in guard.refused
    assert any("_local_scalar_dense" in name for name in guard.refused)
    assert not any(n.startswith(("aten.view", "aten.slice", "aten.to")) for n in guard.refused)


def test_a_recorded_plan_reruns_on_new_inputs():
    """Kernels recorded over a persistent input, replayed after the input changed: the plan's
    output (moved into its arena) is what the eager calls give on the new input."""
    x = torch.randn(3, 128)
    w = torch.randn(64)
    recorder, guard = plan.PlanRecorder(), plan.CaptureGuard()
    native.Kernel.recorder = recorder
    try:
        with guard:
            out = norms.rms_norm(activations.gelu_tanh_and_mul(x), w, 1e-6)
    finally:
        native.Kernel.recorder = None
    assert not guard.refused and len(recorder.calls) == 2
    recorded = plan.build_plan(recorder.calls, guard.allocations, out)
    x.copy_(torch.randn(3, 128))
    got = recorded.run()
    assert got.data_ptr() != out.data_ptr()  # the arena's copy, not the recording's buffer
    assert torch.equal(got, norms.rms_norm(activations.gelu_tanh_and_mul(x), w, 1e-6))


def test_buffers_share_arena_bytes_only_when_their_uses_do_not_overlap():
    bufs = [torch.empty(256) for _ in range(5)]  # 1 KiB each
    p = [b.data_ptr() for b in bufs]
    # Uses: 0 in call 0; 1 in calls 0-1; 2 in calls 1-2; 3 in 2-3; 4 (the output) from 3 on.
    calls = [(0, [p[0], p[1]], "pp"), (0, [p[1], p[2]], "pp"), (0, [p[2], p[3]], "pp")]
    calls.append((0, [p[3], p[4], 7], "ppi"))
    _spans, starts, offsets, size = plan._layout(calls, bufs, bufs[4])
    life = {0: (0, 0), 1: (0, 1), 2: (1, 2), 3: (2, 3), 4: (3, 4)}
    where = {i: offsets[starts.index(p[i])] for i in range(5)}
    for i in range(5):
        for j in range(i):
            (a0, a1), (b0, b1) = life[i], life[j]
            if not (a1 < b0 or b1 < a0):
                assert abs(where[i] - where[j]) >= 1024, (i, j, where)
    assert size == 2 * 1024  # two buffers live at any time


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["silu_and_mul", "gelu_tanh_and_mul"])
def test_the_compiled_gated_activations_are_the_reference(name, dtype):
    x = (torch.randn(5, 2 * 200) * 4).to(dtype)
    x[0, :8] = torch.tensor([0.0, -0.0, 30.0, -30.0, 90.0, -90.0, 1e-6, -1e-6])
    got = getattr(activations, name)(x)
    want = getattr(reference, name)(x)
    assert got.dtype == dtype and got.shape == want.shape
    # Where torch's 1 + tanh(u) cancels to zero for a very negative gate, g / (1 + e^-2u)
    # keeps a value of about 1e-6, times the up half (|up| up to about 15 here): in float32
    # too (one element in 1,000 at 1.2e-6 in about one run of eight), hence atol 2e-5.
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=2e-5)
    else:  # at most one bfloat16 rounding step apart
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-5)
    # A strided input (the gate/up halves of a wider row) reads the same values.
    wide = torch.cat([x, torch.zeros(5, 16, dtype=dtype)], dim=1)[:, : x.shape[1]]
    assert torch.equal(getattr(activations, name)(wide), got)


def test_a_kernel_without_a_twin_refuses_the_recording():
    """Every compiled call goes through ``native.Kernel``, so none can run unseen by a
    recording; one the plans cannot call (no twin) is named."""
    lib = native.load("avx2")
    recorder = plan.PlanRecorder()
    x = torch.randn(1, 64)
    xq = torch.empty(64, dtype=torch.int8)
    xd, xs = torch.empty(2), torch.empty(4)
    native.Kernel.recorder = recorder
    try:
        lib.gguf_avx2_quantize_rows(
            x.data_ptr(), 0, 1, 64, 32, xq.data_ptr(), xd.data_ptr(), xs.data_ptr()
        )
    finally:
        native.Kernel.recorder = None
    assert recorder.refused == ["gguf_avx2_quantize_rows"] and not recorder.calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gguf_moe_decode_steps_run_as_plans_with_the_eager_tokens(tmp_path, dtype):
    """A Qwen3-MoE GGUF (experts kept quantized, untied Q8_0 embedding and head kept too):
    the router's product, the top-k softmax and the routed experts are compiled kernels
    (``engine_cpu.routing``, ``gguf_avx2_moe``), so its decode steps record and replay with
    the eager tokens."""
    from engine.testing.tiny_gguf import MOE_TYPES, tiny_moe_hf, write_tiny_moe_gguf

    # Decisive routing: plans and eager steps sum in other orders.
    hf = tiny_moe_hf("qwen3_moe", router_scale=4.0)
    types = {**MOE_TYPES, "attn_v": "Q8_0", "output": "Q8_0"}  # every dense layer kept
    path = write_tiny_moe_gguf(tmp_path / "moe.gguf", hf, types)
    _, want = generate(path, dtype=dtype, enforce_eager=True)
    llm, got = generate(path, dtype=dtype)
    assert got == want
    graphs = llm.llm_engine.runner.graphs
    assert graphs._refused is None and {1, 2, 3} <= set(graphs._plans), graphs._refused
    assert llm.llm_engine.num_used_blocks == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_routing_is_the_reference(dtype):
    """``engine_cpu.routing``: the router's product within float32 summation order of
    ``F.linear``; the top-k softmax with the reference's experts, in its order, and its
    weights to float32 rounding, with and without renormalisation; ties go to the lower expert
    index in both (``torch.topk`` itself does not promise an order for them)."""
    from engine_cpu import routing

    gen = torch.Generator().manual_seed(0)
    for t, k, n in ((1, 2048, 128), (7, 64, 8), (64, 256, 60)):
        x = torch.randn(t, k, generator=gen).to(dtype)
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
        got = routing.linear(x, w)
        want = torch.nn.functional.linear(x.float(), w.float()).to(dtype)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
        for top_k, renorm in ((2, True), (8 if n >= 8 else n, False)):
            # Distinct logits (exact in bf16), so that the two softmaxes' last bits cannot
            # reorder two choices.
            logits = torch.stack([torch.randperm(n, generator=gen) for _ in range(t)])
            logits = (logits.float() * 0.25 - n / 8).to(dtype)
            weights, ids = routing.moe_topk_softmax(logits, top_k, renorm)
            ref_w, ref_ids = reference.moe_topk_softmax(logits, top_k, renorm)
            assert ids.dtype == torch.int32 and torch.equal(ids, ref_ids)
            torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=1e-7)
    tied = torch.zeros(2, 8, dtype=dtype)
    tied[0, 5] = tied[0, 2] = 1.0
    for op in (routing.moe_topk_softmax, reference.moe_topk_softmax):
        _, ids = op(tied, 3, True)
        assert ids.tolist() == [[2, 5, 0], [0, 1, 2]], op
