"""The engine on torch_xla's CPU device (``PJRT_DEVICE=CPU``): greedy tokens identical to the
cpu platform, graphs compiled once per shape bucket (counted with torch_xla's metrics), and the
XLA communicator's all_reduce across two replicas.

Run with ``tox -e tpu``. The Pallas kernel and real TPUs are not exercised here (no TPU).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.testing.tiny_models import build_tiny_model

# Mixed lengths: several token and block buckets, chunked prefill (max_num_batched_tokens 32),
# two prompts sharing a 20-token prefix (prefix caching on).
SHARED = [5 + (i * 7) % 200 for i in range(20)]
PROMPTS = [
    SHARED + [11, 12, 13],
    [3, 1, 4, 1, 5, 9, 2, 6],
    SHARED + [40, 41],
    [7] * 45,
    [2, 7, 1, 8],
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tpu_llama"), "llama")


def _llm(model, platform: str):
    from engine import LLM

    return LLM(
        str(model),
        platform=platform,
        dtype="float32",
        block_size=16,
        max_model_len=128,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        num_gpu_blocks_override=64,
        seed=0,
    )


def _generate(llm) -> list[list[int]]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _compilations() -> int:
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0


def test_greedy_tokens_match_the_cpu_platform_and_graphs_are_reused(tiny_llama) -> None:
    cpu_tokens = _generate(_llm(tiny_llama, "cpu"))

    llm = _llm(tiny_llama, "tpu")
    engine = llm.llm_engine
    assert engine.config.platform == "tpu" and engine.runner.device.type == "xla"
    assert engine.runner.attn_backend_cls.name == "xla"  # auto: pallas needs a real TPU
    assert engine.runner.shape_buckets.tokens == (16, 32)

    before = _compilations()
    steps = _count_steps(engine)
    xla_tokens = _generate(llm)
    first = _compilations() - before
    assert xla_tokens == cpu_tokens
    assert engine.num_used_blocks == 0  # nothing leaked
    # Every step ran a graph; far fewer were compiled: one per bucket combination seen.
    assert steps["n"] > 0 and first < steps["n"], (first, steps["n"])

    # The same workload again: every shape is a bucket already compiled.
    again = _compilations()
    assert _generate(llm) == cpu_tokens
    assert _compilations() - again == 0
    assert engine.num_used_blocks == 0


def _count_steps(engine) -> dict[str, int]:
    """Count engine steps by wrapping the engine's step method."""
    counter = {"n": 0}
    step = engine.step

    def counted(*args, **kwargs):
        counter["n"] += 1
        return step(*args, **kwargs)

    engine.step = counted
    return counter


def test_steps_are_padded_to_buckets(tiny_llama) -> None:
    """The shapes the model sees are buckets: a runner on XLA pads tokens, sequences and
    block-table width, and the attention metadata reflects it."""
    from engine.shape_buckets import ShapeBuckets

    buckets = ShapeBuckets.for_limits(32, 8, 8)
    assert buckets.tokens == (16, 32) and buckets.seqs == (8,) and buckets.blocks == (8,)
    assert buckets.pad_tokens(17) == 32 and buckets.pad_seqs(3) == 8
    with pytest.raises(ValueError, match="above the largest shape bucket 32"):
        buckets.pad_tokens(33)


# ---- the communicator on two XLA replicas ----------------------------------------------------
@pytest.mark.timeout(300)
def test_xla_communicator_all_reduce_on_two_replicas() -> None:
    """In a fresh interpreter (xmp.spawn must come before any XLA device is used), two
    replicas of XLA's CPU device all_reduce through XlaCommunicator."""
    script = Path(__file__).with_name("xla_replicas.py")
    env = dict(os.environ, CPU_NUM_DEVICES="2", PJRT_DEVICE="CPU")
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=280
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    lines = sorted(line for line in out.stdout.splitlines() if line.startswith("replica "))
    assert lines == [
        "replica 0 of 2: all_reduce sum, max, min ok",
        "replica 1 of 2: all_reduce sum, max, min ok",
    ], out.stdout
