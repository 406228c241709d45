"""engine-triton's multi-LoRA kernels (shrink + expand) against the torch reference.

Mixed batches (several adapter slots, tokens without an adapter), the fused q/k/v and gate/up
slices and a single slice, ranks padded past the adapter's, every tile path: several M tiles
per slot, split K with the last-arriver reduction, uneven K. Shapes stay tiny for the
interpreter (each program costs about a millisecond there); the engine test at the end runs a
tiny model with the LoRA kernel in the interpreter and the rest on the torch reference.
"""

from __future__ import annotations

import pytest
import torch
from kernel_tolerance import close

from engine.kernels.reference import add_lora_linear as reference
from engine.lora.mapping import group_by_slot

DTYPES = [torch.float32, torch.bfloat16]


def _case(t, k, slices, rank, slots, dtype, device, seed_slots=None):
    n, s = sum(slices), len(slices)
    x = torch.randn(t, k).to(dtype)
    a = (torch.randn(slots, s * rank, k) * k**-0.5).to(dtype)
    b = (torch.randn(slots, n, rank) * rank**-0.5).to(dtype)
    y = torch.randn(t, n).to(dtype)
    token_slots = (
        torch.tensor(seed_slots, dtype=torch.int32)
        if seed_slots is not None
        else torch.randint(-1, slots, (t,), dtype=torch.int32)
    )
    sorted_tokens, starts = group_by_slot(token_slots.numpy(), slots)
    host = (y, x, a, b, token_slots, torch.from_numpy(sorted_tokens), torch.from_numpy(starts))
    dev = tuple(v.to(device) for v in host)
    return host, dev


# (tokens, K, slices, rank, slots, shrink config (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K) or None)
CASES = [
    (1, 64, (40, 24, 24), 16, 4, (16, 64, 16, 4)),  # decode: split K, q/k/v
    (5, 48, (48,), 8, 2, (16, 16, 16, 2)),  # split K with several tokens per slot
    (20, 40, (36, 36), 4, 2, (16, 16, 16, 1)),  # 2 M tiles per slot, gate/up, K % 16 != 0
    (9, 72, (20, 12, 12), 16, 3, None),  # the op's own heuristics
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-K{c[1]}-S{len(c[2])}-R{c[3]}")
def test_shrink_expand_match_the_reference(case, dtype, device, seed):
    from engine_triton.kernels.lora import lora_expand, lora_shrink

    t, k, slices, rank, slots, config = case
    # Every slot and "no adapter" present when there are enough tokens.
    pattern = [(i % (slots + 1)) - 1 for i in range(t)] if t > slots else None
    host, (y, x, a, b, ts, st, starts) = _case(t, k, slices, rank, slots, dtype, device, pattern)
    expected = reference(host[0].clone(), *host[1:], slices)
    shrunk = lora_shrink(x, a, st, starts, config=config)
    out = lora_expand(y, shrunk, b, st, starts, slices)
    assert out is y  # in place
    # Rows without an adapter are untouched, bit for bit.
    none = host[4] < 0
    assert torch.equal(out.cpu()[none], host[0][none]), f"seed={seed}"
    close(out, expected, dtype, seed)


def test_split_k_counters_are_left_zero_for_the_next_launch(device):
    """The last-arriver reduction resets its counters: graph replays need no memset."""
    from engine_triton.kernels.lora import _SCRATCH, lora_shrink

    _, (y, x, a, b, ts, st, starts) = _case(3, 64, (32,), 16, 2, torch.float32, device, [0, 1, 0])
    first = lora_shrink(x, a, st, starts, config=(16, 16, 16, 4))
    second = lora_shrink(x, a, st, starts, config=(16, 16, 16, 4))
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    assert int(_SCRATCH.counters[x.device].abs().sum()) == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_registered_op_leaves_a_batch_without_adapters_untouched(dtype, device):
    from engine_triton.kernels.lora import add_lora_linear

    _, (y, x, a, b, ts, st, starts) = _case(4, 32, (16, 16), 8, 2, dtype, device, [-1] * 4)
    before = y.clone()
    add_lora_linear(y, x, a, b, ts, st, starts, (16, 16))
    assert torch.equal(y, before)


def test_conformance_kit_accepts_the_override():
    """The kit's own kernel check (what ``--engine-conformance=cuda`` runs on a GPU)."""
    from engine.testing.checks import check_kernel
    from engine_triton.kernels.lora import add_lora_linear

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for dtype in ("float32", "bfloat16"):
        check_kernel("add_lora_linear", add_lora_linear, device, dtype)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without a GPU")
@pytest.mark.parametrize("fused", [False, True], ids=["separate-shrink", "shrink-in-gemm"])
def test_engine_with_lora_kernels_on_the_interpreter_matches_torch(tmp_path, monkeypatch, fused):
    """Two adapters and the base model in one batch (chunked prefill, then decodes): the
    Triton LoRA kernels reading the engine's mapping buffers give the torch path's tokens."""
    import engine_triton.kernels as triton_kernels
    from engine import LLM, SamplingParams
    from engine.lora.request import LoRARequest
    from engine.testing.lora import make_peft_adapter
    from engine.testing.tiny_models import build_tiny_model
    from engine_triton.kernels.lora import add_lora_linear, lora_expand_augmented

    path = build_tiny_model(tmp_path / "m", "llama", num_layers=1)
    a1 = make_peft_adapter(path, tmp_path / "a1", rank=8, seed=1)
    a2 = make_peft_adapter(path, tmp_path / "a2", rank=4, seed=2, targets=["q_proj", "down_proj"])
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23, 24]]
    loras = [LoRARequest("a1", 1, str(a1)), None, LoRARequest("a2", 2, str(a2))]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

    if fused:  # plain weights (no oneDNN packing), so the A slots can join them
        import engine.layers.cpu_packed_linear as packing

        monkeypatch.setattr(packing, "pack_linears", lambda model, shared_weights=(): 0)

    def run(provider: str) -> list[list[int]]:
        llm = LLM(str(path), dtype="float32", block_size=4, max_num_batched_tokens=8,
                  enable_lora=True, max_loras=2, max_lora_rank=8, platform="cpu",
                  lora_fused_shrink=fused)  # fmt: skip
        op = "lora_expand_augmented" if fused else "add_lora_linear"
        assert llm.llm_engine.runner.kernels.provider(op) == provider
        assert llm.llm_engine.runner.lora.num_fused == (
            len(llm.llm_engine.runner.lora.targets) if fused else 0
        )
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        assert llm.llm_engine.num_used_blocks == 0
        return [o.outputs[0].token_ids for o in outs]

    expected = run("engine-llm (torch reference)")
    monkeypatch.setattr(
        triton_kernels,
        "register",
        lambda registry: [
            registry.register(name, fn, platforms=("cpu",), priority=10)
            for name, fn in (
                ("add_lora_linear", add_lora_linear),
                ("lora_expand_augmented", lora_expand_augmented),
            )
        ],
    )
    assert run("engine-llm-triton") == expected


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("t", "slices", "rank", "slots"),
    [(1, (40, 24, 24), 16, 4), (6, (48,), 8, 2), (21, (36, 36), 4, 3), (5, (16,), 4, 2)],
    ids=["decode-qkv", "mixed", "tiles", "no-adapter"],
)
def test_expand_augmented_matches_the_reference(t, slices, rank, slots, dtype, device, seed):
    """The expand of layers whose GEMM computed the shrink: every row is written, those
    without an adapter with their base values only."""
    from engine.kernels.reference import lora_expand_augmented as reference
    from engine_triton.kernels.lora import lora_expand_augmented

    n, s = sum(slices), len(slices)
    y_aug = torch.randn(t, n + slots * s * rank).to(dtype)
    b = (torch.randn(slots, n, rank) * rank**-0.5).to(dtype)
    mapping = [-1] * t if t == 5 else [(i % (slots + 1)) - 1 for i in range(t)]
    token_slots = torch.tensor(mapping, dtype=torch.int32)
    sorted_tokens, starts = group_by_slot(token_slots.numpy(), slots)
    args = (token_slots, torch.from_numpy(sorted_tokens), torch.from_numpy(starts), slices)
    expected = reference(y_aug, n, b, *args)
    got = lora_expand_augmented(
        y_aug.to(device),
        n,
        b.to(device),
        *(a.to(device) if isinstance(a, torch.Tensor) else a for a in args),
    )
    assert got.shape == (t, n) and got.is_contiguous()
    none = token_slots < 0
    assert torch.equal(got.cpu()[none], y_aug[:, :n][none]), f"seed={seed}"
    close(got, expected, dtype, seed)


def test_expand_augmented_reads_padding_rows_as_tokens_without_an_adapter(device):
    """A graph padded past the step: the kernel's T exceeds the mapping's tokens; the mapping
    buffers list the padding rows (identity, slot -1), so every row is written once."""
    import numpy as np

    from engine.kernels.reference import lora_expand_augmented as reference
    from engine.lora.mapping import LoRABatchMapping
    from engine_triton.kernels.lora import lora_expand_augmented

    slots, rank, n = 2, 8, 32
    m = LoRABatchMapping(8, slots, torch.device("cpu"))
    m.set(np.array([1, -1, 0], dtype=np.int32))  # 3 real tokens, the graph holds 8
    y_aug = torch.randn(8, n + slots * rank)
    b = torch.randn(slots, n, rank) * 0.3
    args = (m.token_slots, m.sorted_tokens, m.slot_starts, (n,))
    expected = reference(y_aug, n, b, *args)
    got = lora_expand_augmented(
        y_aug.to(device),
        n,
        b.to(device),
        *(a.to(device) if isinstance(a, torch.Tensor) else a for a in args),
    )
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)


def test_augmented_weights_take_the_tuned_linear_configs_of_their_base_shape():
    """8 rank-16 slots add 384 rows to Llama-3.1-8B's q/k/v (128 to o and down, 256 to
    gate/up): the skinny GEMM keeps the measured choice of the base shape."""
    from engine_triton.kernels import linear as mod

    for n, extra, k in (
        (6144, 384, 4096),
        (4096, 128, 4096),
        (28672, 256, 4096),
        (4096, 128, 14336),
    ):
        for m in (1, 2, 16):
            assert mod.prefers_cublas(m, n + extra, k) == mod.prefers_cublas(m, n, k), (m, n)
            if not mod.prefers_cublas(m, n, k):
                assert mod.config_for(m, n + extra, k) == mod.config_for(m, n, k), (m, n)
    assert mod._tuned_key(1, 3 * 4096, 4096) is None  # far from every measured shape
