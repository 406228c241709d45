"""A plugin overriding two kernels on the cpu platform (one right, one subtly wrong when
``ENGINE_TEST_WRONG_KERNEL=1``, to show the conformance kit catching it)."""

import os

from engine.hookspecs import hookimpl

ENGINE_PLUGIN_API = "1"


def silu_and_mul(x):
    import torch

    gate, up = x.chunk(2, dim=-1)
    out = gate * torch.sigmoid(gate) * up
    if os.environ.get("ENGINE_TEST_WRONG_KERNEL") == "1":
        out = out * 1.05
    return out


@hookimpl
def engine_kernels(registry):
    # Above engine-llm-cpu's own compiled silu_and_mul (the default priority, 10).
    registry.register("silu_and_mul", silu_and_mul, platforms=("cpu",), priority=20)
