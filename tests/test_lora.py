"""Multi-LoRA through the offline ``LLM`` on the CPU: greedy tokens equal transformers with the
adapter merged (PEFT's ``merge_and_unload``), for several adapters and the base model mixed in
one batch, on Llama and Qwen3, with adapters of different ranks and targets made by ``peft``
in the test (random non-zero B, so each adapter really changes the output).

Also: the prefix cache keyed by adapter, more adapters than ``max_loras`` (the scheduler
rotates them) and than ``max_cpu_loras`` (read from disk again), asynchronous scheduling,
``n > 1``, removing an adapter with requests in flight, and every refused adapter with its
reason while the engine keeps serving.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, LoRARequest, SamplingParams
from engine.errors import InvalidRequestError
from engine.testing.lora import hf_greedy, make_peft_adapter, merged_model
from engine.testing.tiny_models import build_tiny_model

NUM_NEW = 10


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def setup(request, tmp_path_factory):
    """A tiny model, three adapters (ranks 8, 4 and 2..16 by pattern; all seven projections,
    q/v/down with rsLoRA, attention only) and the greedy references of a prompt set under
    each (None: the base model)."""
    arch = request.param
    root = tmp_path_factory.mktemp(f"lora-{arch}")
    path = build_tiny_model(root / "model", arch)
    adapters = {
        "all8": make_peft_adapter(path, root / "all8", rank=8, seed=1),
        "qvd4": make_peft_adapter(
            path,
            root / "qvd4",
            rank=4,
            seed=2,
            targets=["q_proj", "v_proj", "down_proj"],
            use_rslora=True,
        ),
        "attn": make_peft_adapter(
            path,
            root / "attn",
            rank=2,
            seed=3,
            targets=["q_proj", "k_proj", "v_proj", "o_proj"],
            rank_pattern={"o_proj": 16},
            alpha_pattern={"k_proj": 7.0},
        ),
    }
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 300) for _ in range(n)] for n in (3, 9, 17, 30, 5, 41, 12, 26)]
    prompts.append(prompts[5][:32] + [11, 12])  # shares whole blocks with prompt 5
    refs = {}
    for name in [None, *adapters]:
        model = merged_model(path, adapters[name] if name else None)
        refs[name] = [hf_greedy(model, p, NUM_NEW) for p in prompts]
    # Each adapter changes what the model generates (B is not zero).
    for name in adapters:
        assert refs[name] != refs[None], name
    return path, adapters, prompts, refs


def _llm(path, **kwargs) -> LLM:
    args = dict(
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        num_gpu_blocks_override=200,
        enable_lora=True,
        max_loras=3,
        max_lora_rank=16,
    )
    args.update(kwargs)
    return LLM(str(path), **args)


def _requests(adapters) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i, str(p)) for i, (name, p) in enumerate(adapters.items(), 1)}


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)


def _check(llm, prompts, assignment, refs, loras):
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        _params(),
        use_tqdm=False,
        lora_request=[loras[a] if a else None for a in assignment],
    )
    for i, (out, name) in enumerate(zip(outs, assignment, strict=True)):
        assert out.outputs[0].token_ids == refs[name][i], f"prompt {i} with adapter {name}"
    assert llm.llm_engine.num_used_blocks == 0
    return outs


def test_mixed_batch_of_adapters_matches_peft_merged(setup):
    """Three adapters and the base model in every step (chunked prefill, prefix hits, decodes)."""
    path, adapters, prompts, refs = setup
    llm = _llm(path)
    loras = _requests(adapters)
    names = [None, "all8", "qvd4", "attn"]
    assignment = [names[i % 4] for i in range(len(prompts))]
    _check(llm, prompts, assignment, refs, loras)
    # Rotated: every prompt under another adapter, through the same (now warm) slots.
    _check(llm, prompts, [names[(i + 1) % 4] for i in range(len(prompts))], refs, loras)
    manager = llm.llm_engine.runner.lora
    assert sorted(manager.in_slots()) == [1, 2, 3] and manager.num_disk_loads == 3


def test_shrink_in_the_base_gemm_matches_too(setup, monkeypatch):
    """The GPU default: the A slots appended to each unquantized weight, one GEMM for the base
    output and every slot's shrink, then ``lora_expand_augmented`` (forced here, with the
    CPU's oneDNN packing off so the weights stay plain)."""
    import engine.layers.cpu_packed_linear as packing

    monkeypatch.setattr(packing, "pack_linears", lambda model, shared_weights=(): 0)
    path, adapters, prompts, refs = setup
    llm = _llm(path, lora_fused_shrink=True, max_loras=2)
    manager = llm.llm_engine.runner.lora
    assert manager.num_fused == len(manager.targets)
    names = [None, "all8", "qvd4", "attn"]
    _check(llm, prompts, [names[i % 4] for i in range(len(prompts))], refs, _requests(adapters))
    layer = next(iter(manager.targets.values())).layer
    assert layer.weight.data_ptr() == layer.quant_method.augmented.data_ptr()


def test_more_adapters_than_slots_rotate_and_all_complete(setup):
    """max_loras=1 and max_cpu_loras=2 with three adapters: each step holds one adapter, the
    others wait their turn; adapters evicted from the host cache are read from disk again."""
    path, adapters, prompts, refs = setup
    llm = _llm(path, max_loras=1, max_cpu_loras=2)
    loras = _requests(adapters)
    names = ["all8", None, "qvd4", "attn", "all8", "attn", "qvd4", None, "attn"]
    manager = llm.llm_engine.runner.lora
    seen = []
    prepare = manager.prepare

    def spy(scheduled):
        seen.append({s.request.lora_id for s in scheduled} - {0})
        return prepare(scheduled)

    manager.prepare = spy
    _check(llm, prompts, names, refs, loras)
    assert max(len(s) for s in seen) == 1
    assert len({k for s in seen for k in s}) == 3
    assert manager.num_disk_loads > 3  # the host cache of 2 had to re-read one
    assert llm.llm_engine.scheduler.lora.running_adapters == set()


def test_async_scheduling_and_n_greater_than_one(setup):
    path, adapters, prompts, refs = setup
    llm = _llm(path, async_scheduling=True, max_loras=2)
    loras = _requests(adapters)
    _check(llm, prompts[:6], ["qvd4", "attn", None, "attn", "qvd4", None], refs, loras)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, n=2)
    out = llm.generate(
        [{"prompt_token_ids": prompts[3]}], params, use_tqdm=False, lora_request=loras["all8"]
    )[0]
    assert [c.token_ids for c in out.outputs] == [refs["all8"][3]] * 2
    assert llm.llm_engine.num_used_blocks == 0


def test_prefix_cache_is_keyed_by_adapter(setup):
    path, adapters, prompts, refs = setup
    llm = _llm(path)
    loras = _requests(adapters)
    prompt = prompts[5]  # 41 tokens: 10 full blocks of 4
    i = 5

    def run(name):
        out = llm.generate(
            [{"prompt_token_ids": prompt}],
            _params(),
            use_tqdm=False,
            lora_request=loras[name] if name else None,
        )[0]
        assert out.outputs[0].token_ids == refs[name][i], name
        return out.num_cached_tokens

    assert run("all8") == 0
    assert run(None) == 0  # the same tokens under another adapter are other KV
    assert run("qvd4") == 0
    assert run("all8") == 40  # but the same adapter's prefix is reused
    assert run(None) == 40


def test_removing_an_adapter_finishes_its_requests_first(setup):
    path, adapters, prompts, refs = setup
    llm = _llm(path)
    engine = llm.llm_engine
    lora = _requests(adapters)["all8"]
    assert engine.add_lora(lora) and engine.list_loras() == {1}
    for i in range(3):
        engine.add_request(f"r{i}", None, _params(), prompt_token_ids=prompts[i], lora_request=lora)
    finished = {}
    for _ in range(3):
        for out in engine.step():
            finished[out.request_id] = out
    assert engine.remove_lora(1)
    assert engine.list_loras() == set()
    assert list(engine.runner.lora.registered()) == [1]  # still serving its requests
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    for i in range(3):
        assert finished[f"r{i}"].outputs[0].token_ids == refs["all8"][i]
    assert engine.runner.lora.registered() == {} and engine.runner.lora.in_slots() == {}
    assert engine.num_used_blocks == 0
    assert not engine.remove_lora(1)
    # The same request loads it again (a fresh key), and it still matches.
    out = llm.generate(
        [{"prompt_token_ids": prompts[0]}], _params(), use_tqdm=False, lora_request=lora
    )[0]
    assert out.outputs[0].token_ids == refs["all8"][0]


def test_lora_int_id_must_name_one_adapter(setup):
    path, adapters, _, _ = setup
    llm = _llm(path)
    llm.add_lora(LoRARequest("a", 1, str(adapters["all8"])))
    with pytest.raises(InvalidRequestError, match="lora_int_id 1 is already adapter 'a'"):
        llm.add_lora(LoRARequest("b", 1, str(adapters["qvd4"])))
    with pytest.raises(ValueError, match="lora_int_id must be > 0"):
        LoRARequest("c", 0, str(adapters["qvd4"]))
    with pytest.raises(InvalidRequestError, match="one or one per prompt"):
        llm.generate([[5, 6], [7, 8]], _params(), lora_request=[None], use_tqdm=False)


def test_lora_requests_need_enable_lora(setup):
    path, adapters, _, _ = setup
    llm = LLM(str(path), dtype="float32", num_gpu_blocks_override=64)
    with pytest.raises(InvalidRequestError, match="LoRA is not enabled"):
        llm.generate(
            [[5, 6, 7]], _params(), lora_request=LoRARequest("a", 1, str(adapters["all8"]))
        )
    assert llm.llm_engine.num_used_blocks == 0 and not llm.llm_engine.has_unfinished_requests()


def _broken_adapters(base, root):
    """Adapters the engine must refuse, each with the words its reason contains."""
    out = {}

    def copy(name):
        dst = root / name
        shutil.copytree(base, dst)
        return dst

    out["missing"] = (root / "does-not-exist", "does not exist")
    d = copy("no-config")
    (d / "adapter_config.json").unlink()
    out["no-config"] = (d, "has no adapter_config.json")
    d = copy("no-weights")
    (d / "adapter_model.safetensors").unlink()
    out["no-weights"] = (d, "has no adapter_model.safetensors")
    d = copy("pickle")
    torch.save(load_file(str(d / "adapter_model.safetensors")), d / "adapter_model.bin")
    (d / "adapter_model.safetensors").unlink()
    out["pickle"] = (d, "only adapter_model.bin")
    for name, field, value, words in (
        ("dora", "use_dora", True, "DoRA"),
        ("saved", "modules_to_save", ["lm_head"], "modules_to_save"),
        ("bias", "bias", "all", "bias='all'"),
        ("embed", "target_modules", ["embed_tokens", "q_proj"], "embeddings and the LM head"),
        ("ia3", "peft_type", "IA3", "only LoRA adapters"),
    ):
        d = copy(name)
        config = json.loads((d / "adapter_config.json").read_text())
        config[field] = value
        (d / "adapter_config.json").write_text(json.dumps(config))
        out[name] = (d, words)
    d = copy("unknown-module")
    tensors = load_file(str(d / "adapter_model.safetensors"))
    renamed = {k.replace(".q_proj.", ".qq_proj."): v for k, v in tensors.items()}
    save_file(renamed, str(d / "adapter_model.safetensors"))
    out["unknown-module"] = (d, "modules the model does not have as linear layers: qq_proj")
    d = copy("wrong-shape")
    tensors = load_file(str(d / "adapter_model.safetensors"))
    key = next(k for k in tensors if ".q_proj.lora_A" in k)
    tensors[key] = torch.zeros(tensors[key].shape[0], 7)
    save_file(tensors, str(d / "adapter_model.safetensors"))
    out["wrong-shape"] = (d, "trained for another model")
    return out


def test_bad_adapters_are_refused_with_the_reason_and_the_engine_keeps_serving(setup, tmp_path):
    path, adapters, prompts, refs = setup
    llm = _llm(path, max_lora_rank=8)
    high = make_peft_adapter(path, tmp_path / "rank16", rank=16, seed=4, targets=["v_proj"])
    broken = _broken_adapters(adapters["qvd4"], tmp_path)
    broken["rank"] = (high, "rank 16, more than --max-lora-rank 8")
    for i, (name, (adapter, words)) in enumerate(sorted(broken.items()), start=10):
        with pytest.raises(InvalidRequestError, match=words.replace("[", r"\[")):
            llm.add_lora(LoRARequest(name, i, str(adapter)))
        # The same through a request: refused before anything is queued.
        with pytest.raises(InvalidRequestError, match=words.replace("[", r"\[")):
            llm.generate(
                [[5, 6, 7]],
                _params(),
                use_tqdm=False,
                lora_request=LoRARequest(name, i, str(adapter)),
            )
    engine = llm.llm_engine
    assert engine.list_loras() == set() and engine.runner.lora.registered() == {}
    assert engine.num_used_blocks == 0 and not engine.has_unfinished_requests()
    loras = _requests(adapters)
    _check(llm, prompts[:3], ["qvd4", None, "qvd4"], refs, loras)


def test_bench_throughput_with_dummy_adapters(tmp_path):
    """``engine bench throughput --num-loras 3 --lora-rank 4``: adapters written for the
    model, loaded, and the requests spread over them."""
    from engine.benchmarks import throughput

    path = build_tiny_model(tmp_path / "m", "llama", num_layers=1)
    out = tmp_path / "result.json"
    argv = ["--model", str(path), "--dtype", "float32", "--num-prompts", "6", "--input-len", "8",
            "--output-len", "3", "--no-warmup", "--num-loras", "3", "--lora-rank", "4",
            "--json", str(out)]  # fmt: skip
    assert throughput.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["num_loras"] == 3 and result["output_tokens"] == 18
    assert result["settings"]["lora"] == {
        "adapters_loaded": 3,
        "max_loras": 3,
        "max_lora_rank": 4,
        "max_cpu_loras": 3,
    }
