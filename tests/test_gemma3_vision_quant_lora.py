"""Gemma 3 images composed with quantization and multi-LoRA, on the tiny random checkpoint.

* ``quantization="fp8"`` on an unquantized checkpoint (online) quantizes the decoder only: the
  vision tower's linears stay unquantized, so its image embeddings are bit-identical to the
  unquantized engine's, while the decoder's linears are FP8.
* A PEFT adapter trained on transformers' ``Gemma3ForConditionalGeneration`` (module names
  under ``model.language_model.*``) serves prompts with images: greedy tokens equal the merged
  model's ``generate`` on the same images, mixed with base-model requests in one batch; an
  adapter touching the vision tower is refused with the reason.
* An FP8 checkpoint whose ignore list names layers by the checkpoint's own module names
  (``language_model.model.layers.0...``, ``vision_tower.encoder...``, not ours) loads with
  exactly those layers unquantized.
"""

from __future__ import annotations

import pytest
import torch
from test_gemma3_vision import PARAMS, hf_generate, make_image, tiny_llm

from engine import LoRARequest
from engine.errors import InvalidRequestError
from engine.testing.tiny_models import build_tiny_gemma3_multimodal

PROMPT = "<start_of_turn>user\nWhat is in <start_of_image> this picture?"


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return build_tiny_gemma3_multimodal(tmp_path_factory.mktemp("gemma3vq"), seed=5)


def _vision_methods(llm) -> set[str]:
    tower = llm.llm_engine.runner.model.vision_tower
    return {type(m.quant_method).__name__ for m in tower.modules() if hasattr(m, "quant_method")}


def test_online_fp8_keeps_the_vision_tower_unquantized(path):
    from engine.layers.linear import LinearBase

    plain = tiny_llm(path)
    fp8 = tiny_llm(path, quantization="fp8")
    decoder = fp8.llm_engine.runner.model.model
    decoder_methods = {
        type(m.quant_method).__name__ for m in decoder.modules() if isinstance(m, LinearBase)
    }
    assert any("Fp8" in name for name in decoder_methods), decoder_methods
    assert not any("Fp8" in name for name in _vision_methods(fp8)), _vision_methods(fp8)
    image = make_image(1)
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    pixel_values = processor(text=[PROMPT], images=[[image]], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        want = plain.llm_engine.runner.model.encode_images(pixel_values)
        got = fp8.llm_engine.runner.model.encode_images(pixel_values)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    out = fp8.generate(
        {"prompt": PROMPT, "multi_modal_data": {"image": image}}, PARAMS, use_tqdm=False
    )[0]
    assert len(out.outputs[0].token_ids) == PARAMS.max_tokens
    assert fp8.llm_engine.num_used_blocks == 0


def _adapter(path, out, target_modules, seed):
    from peft import LoraConfig, get_peft_model
    from transformers import Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    peft_model = get_peft_model(
        model,
        LoraConfig(r=4, lora_alpha=8, target_modules=target_modules, lora_dropout=0.0),
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 / p.shape[1] ** 0.5)
    peft_model.save_pretrained(str(out))
    return out


def test_lora_with_images_matches_the_merged_model(path, tmp_path):
    from peft import PeftModel
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    adapter = _adapter(
        path, tmp_path / "lm", r".*language_model.*\.(q_proj|v_proj|o_proj|down_proj)", seed=1
    )
    base = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    merged = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    merged = PeftModel.from_pretrained(merged, str(adapter)).merge_and_unload().eval()
    processor = AutoProcessor.from_pretrained(path)
    images = [make_image(1)], [make_image(2)]
    want_lora, _ = hf_generate((path, merged, processor), PROMPT, images[0])
    want_base, _ = hf_generate((path, base, processor), PROMPT, images[1])
    assert want_lora != hf_generate((path, base, processor), PROMPT, images[0])[0]

    llm = tiny_llm(path, enable_lora=True, max_loras=1, max_lora_rank=8)
    lora = LoRARequest("lm", 1, str(adapter))
    outs = llm.generate(
        [{"prompt": PROMPT, "multi_modal_data": {"image": imgs}} for imgs in images],
        PARAMS,
        use_tqdm=False,
        lora_request=[lora, None],
    )
    assert outs[0].outputs[0].token_ids == want_lora
    assert outs[1].outputs[0].token_ids == want_base
    assert llm.llm_engine.num_used_blocks == 0

    # The same image and text under the adapter and without it never share KV blocks.
    again = llm.generate(
        {"prompt": PROMPT, "multi_modal_data": {"image": images[0]}},
        PARAMS,
        use_tqdm=False,
    )[0]
    assert again.outputs[0].token_ids == hf_generate((path, base, processor), PROMPT, images[0])[0]

    tower = _adapter(path, tmp_path / "tower", ["q_proj", "v_proj"], seed=2)
    with pytest.raises(InvalidRequestError, match="vision tower"):
        llm.generate(
            PROMPT, PARAMS, use_tqdm=False, lora_request=LoRARequest("tower", 2, str(tower))
        )
    assert llm.llm_engine.num_used_blocks == 0


def test_an_ignore_list_names_the_checkpoints_modules(path, tmp_path):
    """transformers 5 writes ``language_model.model.*`` and ``vision_tower.encoder.*``; the
    engine's modules are ``model.*`` and ``vision_tower.vision_model.encoder.*``. The ignore
    list is matched against the checkpoint's names, so these entries are honoured (they were
    missed when matched against ours, and the load failed on the unquantized tensors)."""
    from engine.testing.quantized_models import write_fp8

    vision = [
        f"vision_tower.encoder.layers.{i}.{p}"
        for i in range(2)
        for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                  "self_attn.out_proj", "mlp.fc1", "mlp.fc2")
    ]  # fmt: skip
    ignored = ["language_model.model.layers.0.mlp.down_proj", *vision]
    out, _ = write_fp8(path, tmp_path / "fp8", ignored_layers=ignored)
    llm = tiny_llm(out)
    model = llm.llm_engine.runner.model
    method = lambda layer: type(layer.quant_method).__name__  # noqa: E731
    assert "Fp8" not in method(model.model.layers[0].mlp.down_proj)
    assert "Fp8" in method(model.model.layers[1].mlp.down_proj)
    assert not any("Fp8" in name for name in _vision_methods(llm)), _vision_methods(llm)
    out = llm.generate(
        {"prompt": PROMPT, "multi_modal_data": {"image": make_image(2)}}, PARAMS, use_tqdm=False
    )[0]
    assert len(out.outputs[0].token_ids) == PARAMS.max_tokens
