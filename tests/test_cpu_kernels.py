"""engine-llm-cpu's kernel overrides: exactly the reference's results (the conformance kit checks
them on random inputs too; these are the cases that tell the ops apart)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import reference as ref
from engine.plugins import default_plugin_manager


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_argmax_is_torch_argmax_with_ties_nan_and_inf(dtype):
    from engine_cpu.kernels import argmax

    torch.manual_seed(0)
    # Coarse values: bf16 logits tie often, and the first maximum must win.
    x = (torch.randn(40, 5003) * 2).round().to(dtype)
    x[1] = float("-inf")  # all -inf: index 0
    x[2, 17] = float("nan")  # a NaN counts as the maximum
    x[3, 4000] = x[3, 9] = x[3].max() + 1  # a tie far apart
    x[4] = 0.0  # all equal
    for logits in (x, x[:, :4999]):  # and a padded-vocabulary view (row stride != V)
        out = argmax(logits)
        assert out.dtype == torch.int64
        assert torch.equal(out, ref.argmax(logits))
    assert argmax(x)[[1, 2, 3, 4]].tolist() == [0, 17, 9, 0]


def test_the_cpu_platform_uses_the_override():
    kernels = default_plugin_manager().kernel_registry().resolve("cpu")
    assert kernels.impls["argmax"].provider == "engine-llm-cpu"
    assert kernels.impls["argmax"].fn.__module__ == "engine_cpu.kernels"
