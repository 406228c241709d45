"""Decode CUDA graphs are not captured when a model's experts would run a host-synchronising
torch reference (a MoE op no plugin provides on the platform): the runner says why and stays
eager, where the capture would otherwise fail. Checked on the CPU with the CUDA-graph class
put in place of the CPU's native plans, and kernels standing in for a GPU platform's."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from engine import LLM
from engine.cuda_graphs import DecodeGraphs
from engine.layers.fused_moe import graph_capture_problems, moe_layers
from engine.testing.tiny_models import build_tiny_model


def gpu_kernels(references: set[str]) -> SimpleNamespace:
    """A stand-in for a GPU platform's bound kernels: ``references`` are the ops only the torch
    reference serves there."""
    return SimpleNamespace(platform="cuda", is_reference=lambda name: name in references)


@pytest.fixture(scope="module")
def llms(tmp_path_factory):
    built = {}
    for arch in ("qwen3_moe", "gpt_oss"):
        path = build_tiny_model(tmp_path_factory.mktemp(arch), arch, num_layers=2)
        built[arch] = LLM(str(path), dtype="float32", block_size=4, num_gpu_blocks_override=32)
    yield built
    for llm in built.values():
        llm.llm_engine.shutdown()


def set_kernels(llm, kernels) -> None:
    for layer in moe_layers(llm.llm_engine.runner.model):
        layer.kernels = kernels


def test_problems_name_the_reference_op_the_experts_would_run(llms):
    qwen, gpt_oss = llms["qwen3_moe"], llms["gpt_oss"]
    # A platform whose plugin provides fused_moe but not fused_moe_biased (a vendor plugin
    # without GPT-OSS's experts; engine-triton provides both, which
    # tests/triton_kernels/test_triton_fused_moe_biased.py checks with the real registry):
    # Qwen3-MoE's experts capture, GPT-OSS's (biases, clamped SwiGLU) do not.
    set_kernels(qwen, gpu_kernels({"fused_moe_biased"}))
    set_kernels(gpt_oss, gpu_kernels({"fused_moe_biased"}))
    assert graph_capture_problems(qwen.llm_engine.runner.model) == []
    problems = graph_capture_problems(gpt_oss.llm_engine.runner.model)
    assert problems == [
        "no plugin provides fused_moe_biased on cuda: its torch reference runs the experts "
        "in a host loop, which a CUDA graph cannot capture"
    ]  # one line for both layers
    # A vendor platform with no MoE kernels at all.
    set_kernels(qwen, gpu_kernels({"fused_moe", "fused_moe_biased"}))
    assert len(graph_capture_problems(qwen.llm_engine.runner.model)) == 1


def test_the_runner_stays_eager_and_says_why(llms, monkeypatch, caplog):
    gpt_oss = llms["gpt_oss"]
    runner = gpt_oss.llm_engine.runner.runner
    set_kernels(gpt_oss, gpu_kernels({"fused_moe_biased"}))
    # As on CUDA: the platform's graphs are CUDA graphs, and the backend may be captured.
    monkeypatch.setattr(runner.platform, "decode_graphs_class", lambda: DecodeGraphs)
    monkeypatch.setattr(runner.attn_backend_cls, "supports_decode_graphs", True)
    runner.graphs = None
    with caplog.at_level(logging.WARNING, logger="engine.model_runner"):
        assert runner.capture_graphs() is None
    assert runner.graphs is None
    assert "decode CUDA graphs are not captured: " in caplog.text
    assert "fused_moe_biased" in caplog.text
    # With the op provided, the guard lets the capture go ahead (the class is replaced so
    # that nothing is recorded on this CPU).
    set_kernels(gpt_oss, gpu_kernels(set()))
    made = []

    class Recorder(DecodeGraphs):
        def __init__(self, *args, **kwargs):
            made.append(kwargs)

        def capture(self) -> float:
            return 0.0

    monkeypatch.setattr("engine.cuda_graphs.DecodeGraphs", Recorder)
    monkeypatch.setattr(runner.platform, "decode_graphs_class", lambda: Recorder)
    assert runner.capture_graphs() == 0.0 and made
    runner.graphs = None
