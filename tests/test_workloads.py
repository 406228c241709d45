"""The fixed benchmark workloads (``engine bench throughput --workload``): both engines are
measured on the same requests (tests/gpu/vllm_peer_mixed.py feeds them to the vLLM kit), so a
workload must be fixed by its seed and have the shape its help text states."""

from __future__ import annotations

import pytest

from engine.benchmarks.workload import (
    SHARED_PREFIX_LEN,
    SHARED_PREFIX_OUTPUT,
    SHARED_PREFIX_SUFFIX,
    named_workload,
)


def test_the_shared_prefix_workload():
    a = named_workload("shared-prefix", 256, 128256, seed=0)
    assert a.prompts == named_workload("shared-prefix", 256, 128256, seed=0).prompts
    assert len(a.prompts) == len(a.output_lens) == 256
    prefix = a.prompts[0][:SHARED_PREFIX_LEN]
    for prompt, out in zip(a.prompts, a.output_lens, strict=True):
        assert prompt[:SHARED_PREFIX_LEN] == prefix
        assert SHARED_PREFIX_SUFFIX[0] <= len(prompt) - SHARED_PREFIX_LEN <= SHARED_PREFIX_SUFFIX[1]
        assert SHARED_PREFIX_OUTPUT[0] <= out <= SHARED_PREFIX_OUTPUT[1]
        assert all(10 <= t < 128256 - 10 for t in prompt)
    # The user turns differ (no request is a copy of another), and another seed is another run.
    assert len({tuple(p[SHARED_PREFIX_LEN:]) for p in a.prompts}) == 256
    assert named_workload("shared-prefix", 256, 128256, seed=1).prompts[0][:10] != prefix[:10]


def test_an_unknown_workload_is_refused():
    with pytest.raises(ValueError, match="unknown workload 'chat'; choose mixed or shared-prefix"):
        named_workload("chat", 8, 1000)
