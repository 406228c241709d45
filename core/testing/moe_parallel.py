"""A real multi-process check of ``FusedMoE``'s parallel styles.

``run_moe_parallel_check(world_size)`` spawns ``world_size`` CPU ranks in a gloo group; each
builds the same random experts (same seed) and, for every style, a ``FusedMoE`` holding only
its rank's part (plain tensor parallelism: every expert's intermediate slice; expert
parallelism: its run of whole experts; expert parallelism with each rank bringing its own
tokens: all-gather in, reduce-scatter out), loads it from per-expert checkpoint tensors through
``weight_loader``, runs it with ``TorchDistributedCommunicator`` and checks the output against
a single-rank layer holding everything. Raises on the first mismatch (re-raised by torch
multiprocessing).

``assert_moe_layouts_match_one_process(path, parameter, shapes)`` is the same check end to end:
a checkpoint served by ``LLM`` on two gloo worker processes, its experts split (TP=2) and
placed (expert parallelism), against one process.
"""

from __future__ import annotations

from engine.testing.distributed import _free_port

NUM_TOKENS, NUM_EXPERTS, TOP_K, HIDDEN, INTER = 12, 10, 3, 32, 24


def _build(parallel, communicator, weights):
    from engine.kernels import KernelRegistry
    from engine.layers.fused_moe import FusedMoE

    w1, w3, w2 = weights
    layer = FusedMoE(
        NUM_EXPERTS, TOP_K, HIDDEN, INTER, renormalize=True,
        kernels=KernelRegistry().resolve("cpu"), dtype=w1.dtype, parallel=parallel,
        communicator=communicator,
    )  # fmt: skip
    for e in range(NUM_EXPERTS):
        layer.weight_loader(layer.w13_weight, w1[e], "w1", e)
        layer.weight_loader(layer.w13_weight, w3[e], "w3", e)
        layer.weight_loader(layer.w2_weight, w2[e], "w2", e)
    return layer


def _worker(rank: int, world_size: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    from engine.distributed import TorchDistributedCommunicator
    from engine.layers.fused_moe import MoEParallel

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        comm = TorchDistributedCommunicator()
        gen = torch.Generator().manual_seed(0)
        weights = (
            torch.randn(NUM_EXPERTS, INTER, HIDDEN, generator=gen) * HIDDEN**-0.5,
            torch.randn(NUM_EXPERTS, INTER, HIDDEN, generator=gen) * HIDDEN**-0.5,
            torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen) * INTER**-0.5,
        )
        x = torch.randn(NUM_TOKENS, HIDDEN, generator=gen)
        logits = torch.randn(NUM_TOKENS, NUM_EXPERTS, generator=gen)
        with torch.inference_mode():
            expected = _build(MoEParallel(), None, weights)(x, logits)
            styles = {
                "tp": MoEParallel.for_group(rank, world_size),
                "ep": MoEParallel.for_group(rank, world_size, enable_expert_parallel=True),
                "ep-own-tokens": MoEParallel.for_group(
                    rank, world_size, enable_expert_parallel=True, tokens_partitioned=True
                ),
            }
            for name, style in styles.items():
                layer = _build(style, comm, weights)
                if style.ep_size > 1:
                    assert layer.num_local_experts < NUM_EXPERTS, name
                if style.tokens_partitioned:
                    n = NUM_TOKENS // world_size
                    mine = slice(rank * n, (rank + 1) * n)
                    got, want = layer(x[mine], logits[mine]), expected[mine]
                else:
                    got, want = layer(x, logits), expected
                torch.testing.assert_close(
                    got, want, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
                )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_moe_parallel_check(world_size: int = 2) -> None:
    """Spawn ``world_size`` gloo ranks and check every MoE parallel style against one rank."""
    import torch.multiprocessing as mp

    if NUM_TOKENS % world_size:
        raise ValueError(f"world_size {world_size} must divide {NUM_TOKENS} tokens")
    mp.spawn(_worker, args=(world_size, _free_port()), nprocs=world_size, join=True)


#: Engine arguments small enough for a tiny MoE model on two CPU ranks.
TINY_MOE_LLM_KWARGS = dict(dtype="float32", block_size=4, max_num_batched_tokens=48,
                           max_num_seqs=8, num_gpu_blocks_override=120, max_model_len=256)  # fmt: skip


def assert_moe_layouts_match_one_process(
    path: str,
    parameter: str,
    shapes: dict[bool, list[tuple[int, ...]]],
    *,
    prompt_lens: tuple[int, ...] = (2, 19),
    max_tokens: int = 6,
    **llm_kwargs,
) -> None:
    """Serve ``path`` on one process, then at TP=2 over gloo for each ``enable_expert_parallel``
    in ``shapes`` (False: every expert split; True: whole experts placed per rank). Each rank's
    ``parameter`` must have the shape ``shapes[expert_parallel][rank]``; greedy tokens must equal
    one process's, top-2 logprobs within 1e-4; no KV block may stay in use."""
    import random

    from engine import LLM, SamplingParams

    kw = {**TINY_MOE_LLM_KWARGS, **llm_kwargs}
    rng = random.Random(5)
    prompts = [
        {"prompt_token_ids": [rng.randrange(10, 300) for _ in range(n)]} for n in prompt_lens
    ]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    single = LLM(path, **kw)
    try:
        want = single.generate(prompts, params, use_tqdm=False)
    finally:
        single.llm_engine.shutdown()
    for expert_parallel, expected_shapes in shapes.items():
        llm = LLM(path, tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **kw)
        try:
            described = llm.llm_engine.runner.collective_rpc("describe")
            got_shapes = [r["parameters"][parameter] for r in described]
            assert got_shapes == expected_shapes, (expert_parallel, got_shapes)
            got = llm.generate(prompts, params, use_tqdm=False)
            for out, ref in zip(got, want, strict=True):
                assert out.outputs[0].token_ids == ref.outputs[0].token_ids, expert_parallel
                for lp, ref_lp in zip(
                    out.outputs[0].logprobs, ref.outputs[0].logprobs, strict=True
                ):
                    for token, entry in lp.items():
                        assert abs(entry.logprob - ref_lp[token].logprob) < 1e-4, expert_parallel
            assert llm.llm_engine.num_used_blocks == 0
        finally:
            llm.llm_engine.shutdown()
