"""The transformers modeling backend and the native Phi-3 / Gemma 2 paths on a CUDA GPU against
the CPU: tiny float32 models, mixed-length prompts (longer than the sliding windows, and across
the LongRoPE switch), greedy tokens identical. The backend runs under the triton attention
backend with decode CUDA graphs and eager, and with the sdpa backend."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.testing.tiny_models import build_tiny_model

pytestmark = pytest.mark.gpu
NUM_NEW = 16
ORIGINAL = 64  # LongRoPE's original_max_position_embeddings in the phi3-longrope model

MODELS = {
    "llama": ("llama", {}),
    "gemma2": ("gemma2", {}),
    "phi3-window": ("phi3", {"sliding_window": 6}),
    "phi3-longrope": (
        "phi3",
        {
            "rope_scaling": {
                "type": "longrope",
                "short_factor": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5],
                "long_factor": [1.0, 2.0, 4.0, 6.0, 9.0, 12.0],
            },
            "max_position_embeddings": 4 * ORIGINAL,
            "original_max_position_embeddings": ORIGINAL,
        },
    ),
    "gpt_neox": ("gpt_neox", {}),
    "starcoder2": ("starcoder2", {}),
    "gpt_oss": ("gpt_oss", {}),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    built = {}

    def get(name: str) -> str:
        if name not in built:
            arch, overrides = MODELS[name]
            built[name] = str(build_tiny_model(tmp_path_factory.mktemp(name), arch, **overrides))
        return built[name]

    return get


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    lengths = [1, 3, 7, 16, 17, 40, 60, 70, 100, 129]
    prompts = [[rng.randrange(10, 300) for _ in range(n)] for n in lengths]
    prompts.append(prompts[8][:96] + [rng.randrange(10, 300) for _ in range(5)])  # prefix hit
    return prompts


def _run(
    path: str, providers: dict[str, str] | None = None, info: dict | None = None, **kwargs
) -> tuple[list[list[int]], bool]:
    """Greedy tokens of ``_prompts()`` and whether decode graphs were captured; ``providers``
    maps kernel ops to the provider each must be bound to on the run's platform; ``info``,
    when given, receives the name of the attention backend chosen (``"backend"``)."""
    # One prefill chunk holds any prompt (as transformers prefills it), so LongRoPE's choice is
    # the same on every path.
    # A cache sized by block count, not by profiling: run_all.sh runs test files side by side
    # on one GPU, and a profiled cache takes 90% of it.
    if kwargs.get("platform") == "cuda":
        kwargs.setdefault("num_gpu_blocks_override", 512)
    llm = LLM(path, dtype="float32", block_size=16, max_num_batched_tokens=512, **kwargs)
    kernels = llm.llm_engine.runner.kernels
    for op, provider in (providers or {}).items():
        assert kernels.provider(op) == provider, (op, kernels.provider(op))
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]
    assert llm.llm_engine.num_used_blocks == 0
    runner = llm.llm_engine.runner
    graphs = runner.graphs is not None
    if info is not None:
        info["backend"] = runner.attn_backend_cls.name
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, graphs


@pytest.mark.parametrize("name", ["llama", "gemma2", "phi3-window", "gpt_neox", "starcoder2"])
def test_transformers_backend_on_gpu_matches_cpu(name, model_dir):
    path = model_dir(name)
    want, _ = _run(path, platform="cpu", attention_backend="torch", model_impl="transformers")
    graphs_tokens, graphs = _run(
        path, platform="cuda", attention_backend="triton", model_impl="transformers"
    )
    assert graphs, "decode graphs were not captured"
    assert graphs_tokens == want
    eager, _ = _run(
        path,
        platform="cuda",
        attention_backend="triton",
        model_impl="transformers",
        enforce_eager=True,
    )
    assert eager == want
    sdpa, _ = _run(path, platform="cuda", attention_backend="sdpa", model_impl="transformers")
    assert sdpa == want


@pytest.mark.parametrize("name", ["gemma2", "phi3-window", "phi3-longrope"])
def test_native_phi3_gemma2_on_gpu_match_cpu(name, model_dir):
    """Triton attention with soft-caps and windows, the LongRoPE table switch inside decode
    graphs (prompts of 60 and 70 tokens straddle the original 64)."""
    path = model_dir(name)
    want, _ = _run(path, platform="cpu", attention_backend="torch")
    got, graphs = _run(path, platform="cuda", attention_backend="triton")
    assert graphs, "decode graphs were not captured"
    assert got == want


# GPT-OSS's experts on engine-triton's fused_moe_biased (and its router on moe_topk_softmax).
GPT_OSS_TRITON = {"fused_moe_biased": "engine-llm-triton", "moe_topk_softmax": "engine-llm-triton"}


def test_gpt_oss_on_gpu_matches_cpu(model_dir, triton_sinks_declared):
    """GPT-OSS on a GPU with the default attention backend (``auto``: the first that has
    attention sinks, now triton) and engine-triton's ``fused_moe_biased`` experts (decode and
    grouped paths, float32), and with the torch reference attention backend (the spec, on any
    device); the same greedy tokens as the CPU's."""
    path = model_dir("gpt_oss")
    want, _ = _run(path, platform="cpu", attention_backend="torch")
    info: dict = {}
    got, _ = _run(path, GPT_OSS_TRITON, info, platform="cuda")
    assert info["backend"] == "triton"
    assert got == want
    reference, _ = _run(path, GPT_OSS_TRITON, platform="cuda", attention_backend="torch")
    assert reference == want


def test_gpt_oss_in_decode_cuda_graphs_matches_cpu(model_dir, triton_sinks_declared):
    """GPT-OSS's decode steps captured in CUDA graphs (the Triton attention backend with its
    attention sinks, split-KV: 11 requests leave most of the GPU to the splits; the Triton
    experts, which the runner's host-loop guard no longer refuses), and eagerly: the CPU's
    greedy tokens."""
    path = model_dir("gpt_oss")
    want, _ = _run(path, platform="cpu", attention_backend="torch")
    got, graphs = _run(path, GPT_OSS_TRITON, platform="cuda", attention_backend="triton")
    assert graphs, "decode graphs were not captured"
    assert got == want
    eager, _ = _run(
        path, GPT_OSS_TRITON, platform="cuda", attention_backend="triton", enforce_eager=True
    )
    assert eager == want
