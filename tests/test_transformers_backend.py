"""The transformers modeling backend (``engine.models.transformers_backend``) on the CPU.

Tiny random checkpoints of nine architectures, each run through ``LLM(model_impl=
"transformers")`` with chunked prefill, prefix caching and preemption: greedy tokens equal
transformers' own decoding. Plus: what reaches the attention backend (per-layer sliding windows,
soft-caps, scales, head counts), how ``auto`` chooses and logs, the refusals with their
reasons, loading errors, dummy weights, the benchmark flag, and tensor parallelism over two gloo
ranks equal to one process.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from greedy_reference import assert_greedy_matches, mixed_prompts

from engine import LLM
from engine.layers.weight_utils import ModelLoadError
from engine.models.transformers_backend import TransformersForCausalLM
from engine.testing.tiny_models import build_tiny_model, build_tokenizer

# Phi-3 and Gemma 2 are native too; here they are forced through the backend.
ARCHS = ["phi3", "gemma2", "olmo2", "granite", "gpt_neox", "phi", "cohere", "starcoder2", "gpt2"]
NUM_NEW = 10
# KV blocks small enough that the batch preempts (Starcoder 2 has a window on every layer, so
# its requests need far fewer).
NUM_BLOCKS = {"starcoder2": 16}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """``model_dir(arch)``: a tiny random checkpoint of ``arch``, built once per module."""
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = build_tiny_model(tmp_path_factory.mktemp(arch), arch)
        return built[arch]

    return get


def backend_llm(path: Path, **kw) -> LLM:
    settings = dict(
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=32,  # prompts of 33+ tokens are prefilled in chunks
        max_num_seqs=6,
        num_gpu_blocks_override=40,  # small enough to preempt
        model_impl="transformers",
    )
    settings.update(kw)
    return LLM(model=str(path), **settings)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch, model_dir):
    from transformers import AutoModelForCausalLM

    path = model_dir(arch)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = backend_llm(path, num_gpu_blocks_override=NUM_BLOCKS.get(arch, 40))
    assert isinstance(llm.llm_engine.runner.model, TransformersForCausalLM)
    assert llm.config.model.implementation == "transformers"
    prompts = mixed_prompts(hf.config.vocab_size, (1, 3, 8, 17, 33, 64, 90))
    assert_greedy_matches(llm, hf, prompts, NUM_NEW)
    assert llm.llm_engine.get_stats().num_preemptions > 0


def test_sliding_windows_soft_caps_and_scales_reach_the_attention_layers(model_dir):
    """Gemma 2 through the backend: the layers alternate a window of 8 and full attention,
    every one soft-caps scores at 10 and scales by query_pre_attn_scalar ** -0.5 (24, not the
    head size 16); the runner makes one KV-cache group per window."""
    llm = backend_llm(model_dir("gemma2"))
    runner = llm.llm_engine.runner
    layers = runner.model.attention_layers()
    assert [a.sliding_window for a in layers] == [8, None]
    assert [a.logit_softcap for a in layers] == [10.0, 10.0]
    assert [a.impl.logit_softcap for a in layers] == [10.0, 10.0]  # the backend has it
    assert all(a.scale == pytest.approx(24**-0.5) for a in layers)
    assert [(a.num_heads, a.num_kv_heads, a.head_size) for a in layers] == [(4, 2, 16)] * 2
    assert runner.kv_cache_groups() == [None, 8]
    # Starcoder 2 applies its window on every layer.
    layers = backend_llm(model_dir("starcoder2")).llm_engine.runner.model.attention_layers()
    assert [(a.sliding_window, a.logit_softcap) for a in layers] == [(8, None), (8, None)]


def test_auto_picks_native_or_transformers_and_logs_why(model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="engine.models.selection"):
        llm = LLM(model=str(model_dir("olmo2")), dtype="float32", num_gpu_blocks_override=32)
    assert isinstance(llm.llm_engine.runner.model, TransformersForCausalLM)
    assert (
        "model Olmo2ForCausalLM: transformers implementation "
        "(engine.models.transformers_backend.TransformersForCausalLM): Olmo2ForCausalLM has no "
        "native implementation" in caplog.text
    )
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine.models.selection"):
        llm = LLM(model=str(model_dir("phi3")), dtype="float32", num_gpu_blocks_override=32)
    assert type(llm.llm_engine.runner.model).__name__ == "Phi3ForCausalLM"
    assert "Phi3ForCausalLM: native implementation" in caplog.text
    with pytest.raises(ModelLoadError, match=r"Olmo2ForCausalLM.*model_impl=native"):
        LLM(model=str(model_dir("olmo2")), model_impl="native")


def test_custom_code_runs_with_trust_remote_code(tmp_path, monkeypatch):
    """A model directory with its own modeling code (``auto_map``): refused without
    ``trust_remote_code``, served by the backend with it, greedy tokens equal transformers'."""
    import shutil

    import transformers.dynamic_module_utils as dynamic
    from greedy_reference import hf_greedy
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    path = tmp_path / "custom"
    shutil.copytree(build_tiny_model(tmp_path / "src", "llama"), path)
    (path / "configuration_tiny.py").write_text(
        "from transformers import LlamaConfig\n\n\n"
        "class TinyCustomConfig(LlamaConfig):\n    model_type = 'tiny_custom'\n"
    )
    (path / "modeling_tiny.py").write_text(
        "from transformers import LlamaForCausalLM\n\nfrom .configuration_tiny import "
        "TinyCustomConfig\n\n\nclass TinyCustomForCausalLM(LlamaForCausalLM):\n"
        "    config_class = TinyCustomConfig\n"
    )
    config = json.loads((path / "config.json").read_text())
    config.update(
        model_type="tiny_custom",
        architectures=["TinyCustomForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_tiny.TinyCustomConfig",
            "AutoModelForCausalLM": "modeling_tiny.TinyCustomForCausalLM",
        },
    )
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="contains custom code"):
        LLM(model=str(path))
    llm = LLM(model=str(path), dtype="float32", trust_remote_code=True, num_gpu_blocks_override=32)
    assert isinstance(llm.llm_engine.runner.model, TransformersForCausalLM)
    hf = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32)
    assert type(hf).__name__ == "TinyCustomForCausalLM"
    prompt = list(range(20, 50))
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(hf.eval(), prompt, NUM_NEW)


def _config_dir(tmp_path: Path, model_type: str, **kw) -> Path:
    """A model directory with only config.json (and a tokenizer): enough to be refused."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        model_type, vocab_size=384, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, **kw,
    )  # fmt: skip
    config.save_pretrained(tmp_path)
    build_tokenizer(tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    ("model_type", "reason"),
    [
        ("stablelm", "StableLmForCausalLM's attention cannot be replaced: the class does not "
         "declare _supports_attention_backend"),
        ("falcon", "FalconForCausalLM's attention cannot be replaced"),
        ("mamba", "MambaForCausalLM has recurrent / state-space layers"),
        ("olmoe", "OlmoeForCausalLM checkpoints need transformers' weight conversion"),
        ("t5", "transformers has no AutoModelForCausalLM class for model_type 't5'"),
    ],
)  # fmt: skip
def test_models_whose_attention_cannot_be_replaced_are_refused_with_the_reason(
    model_type, reason, tmp_path
):
    path = _config_dir(tmp_path, model_type)
    with pytest.raises(ModelLoadError) as forced:
        LLM(model=str(path), model_impl="transformers")
    assert "model_impl=transformers cannot serve" in str(forced.value)
    assert reason in str(forced.value)
    with pytest.raises(ModelLoadError) as auto:
        LLM(model=str(path))
    assert "no native implementation (supported architectures: " in str(auto.value)
    assert "and the transformers backend cannot serve it: " in str(auto.value)
    assert reason in str(auto.value)


def test_the_build_probe_refuses_attention_it_cannot_replace(tmp_path):
    """Gemma 2 with bidirectional attention declares backend support, but its layers say they
    are not causal: refused when the probe forward sees it, before any weight is loaded."""
    path = _config_dir(
        tmp_path, "gemma2", num_key_value_heads=2, head_dim=16, use_bidirectional_attention=True
    )
    with pytest.raises(ModelLoadError, match=r"Gemma2Attention \(layer 0\) is not causal"):
        LLM(model=str(path), model_impl="transformers", load_format="dummy")


def test_checkpoint_problems_are_named_before_loading(model_dir, tmp_path):
    """A missing tensor is named in checkpoint form; a mis-shaped one with both shapes."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = model_dir("olmo2")
    for broken, change in (("missing", "drop"), ("misshaped", "shrink")):
        path = tmp_path / broken
        shutil.copytree(src, path)
        tensors = load_file(path / "model.safetensors")
        name = "model.layers.1.self_attn.k_norm.weight"
        if change == "drop":
            del tensors[name]
        else:
            tensors[name] = tensors[name][:-1].clone()
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ModelLoadError) as e:
            LLM(model=str(path), model_impl="transformers")
        if change == "drop":
            assert f"checkpoint is missing 1 tensor(s) the config requires: {name}" in str(e.value)
        else:
            assert name in str(e.value) and "expected shape (32,), got (31,)" in str(e.value)


def test_dummy_weights_and_the_benchmark_flag(model_dir, tmp_path, capsys):
    """``--load-format dummy`` needs only the config; ``engine bench throughput --model-impl
    transformers`` runs the backend and records it."""
    from engine.benchmarks import throughput

    out = tmp_path / "result.json"
    argv = ["--model", str(model_dir("granite")), "--dtype", "float32", "--load-format",
            "dummy", "--model-impl", "transformers", "--num-prompts", "3", "--input-len", "9",
            "--output-len", "4", "--no-warmup", "--json", str(out)]  # fmt: skip
    assert throughput.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["settings"]["model_impl"] == "transformers"
    assert "Throughput" in capsys.readouterr().out


# ---- tensor parallelism over two gloo ranks --------------------------------------------------
def _tp_rank(rank: int, world: int, port: int, paths: dict, results: dict) -> None:
    import os

    import torch.distributed as dist

    from engine.distributed import TorchDistributedCommunicator
    from engine.parallel import ParallelContext

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        parallel = ParallelContext(
            tp_rank=rank, tp_size=world, tp=TorchDistributedCommunicator(None)
        )
        for arch, path in paths.items():
            results[(arch, rank)] = _backend_logits(path, parallel)
    finally:
        dist.destroy_process_group()


def _backend_logits(path: str, parallel=None) -> tuple[list[list[float]], list[int]]:
    """The backend's logits for two prompts in one prefill step, and each layer's head count
    on this rank."""
    from runner_utils import BlockAllocator, CpuTestPlatform, new_request, schedule

    from engine.attention_backends.torch_ref import TorchReferenceBackend
    from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from engine.kernels import KernelRegistry
    from engine.loader import load_model
    from engine.model_runner import ModelRunner
    from engine.parallel import SINGLE_PROCESS

    config = EngineConfig(
        model=ModelConfig(model=path, dtype="float32", model_impl="transformers"),
        cache=CacheConfig(block_size=4, num_gpu_blocks=32),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
    )
    kernels = KernelRegistry().resolve("cpu")
    runner = ModelRunner(config, CpuTestPlatform, kernels, TorchReferenceBackend, object())
    runner.model = load_model(
        config.model, kernels, TorchReferenceBackend, "cpu", parallel=parallel or SINGLE_PROCESS
    )
    groups = runner.kv_cache_groups()
    runner.allocate_kv_cache(32)
    reqs = [new_request("a", list(range(10, 21))), new_request("b", list(range(40, 45)))]
    alloc = BlockAllocator(runner.num_blocks, len(groups))
    sched = schedule([(r, r.num_prompt_tokens) for r in reqs], alloc, runner.block_size)
    batch = runner._prepare(sched.scheduled)
    with torch.inference_mode():
        hidden = runner.model(batch.input_ids, batch.positions, batch.attn_metadata)
        logits = runner.model.compute_logits(hidden)
    heads = [layer.num_heads for layer in runner.model.attention_layers()]
    return logits.tolist(), heads


@pytest.mark.slow  # two spawned processes import torch and transformers
def test_tensor_parallel_two_gloo_ranks_match_one_process(model_dir):
    """The model's base_model_tp_plan drives the linear family: column/row-parallel q/k/v/o and
    MLP (Granite), GPT-NeoX's fused per-head query_key_value, and Olmo 2's gathered q/k/v
    (full-width q/k norms, so every rank keeps all heads) with split-input o_proj; the
    embedding and LM head split by vocabulary rows. Both ranks' logits equal one process's."""
    import socket

    import torch.multiprocessing as mp

    paths = {arch: str(model_dir(arch)) for arch in ("granite", "gpt_neox", "olmo2")}
    want = {arch: _backend_logits(path) for arch, path in paths.items()}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_tp_rank, args=(2, port, paths, results), nprocs=2, join=True)
    for arch, (logits_1, heads_1) in want.items():
        sharded = arch != "olmo2"
        for rank in (0, 1):
            logits, heads = results[(arch, rank)]
            torch.testing.assert_close(
                torch.tensor(logits), torch.tensor(logits_1), atol=1e-4, rtol=0, msg=arch
            )
            assert heads == [h // 2 if sharded else h for h in heads_1], arch
