"""The engine-core messages survive msgpack unchanged, and a refused request raises in the
front end what the core raised."""

from __future__ import annotations

import pytest

from engine.engine_core.messages import (
    AbortRequests,
    AddRequests,
    AddResult,
    AllFrontEndsReady,
    Codec,
    CoreFailed,
    CoreReady,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
    FinishSequences,
    FrontEndReady,
    GetStats,
    Shutdown,
    raise_request_error,
    request_error,
)
from engine.errors import InvalidRequestError, PromptTooLongError
from engine.outputs import Logprob
from engine.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams


def test_every_message_round_trips():
    codec = Codec()
    params = SamplingParams(
        n=2, temperature=0.7, seed=3, stop=["\n\n"], stop_token_ids=[7], logit_bias={5: -1.5},
        logprobs=2, structured_outputs=StructuredOutputsParams(json={"type": "object"}),
    )  # fmt: skip
    to_core = [
        AddRequests(
            [EngineCoreRequest("r1", [1, 2, 3], params, 12.5, priority=-1, client_index=1)]
        ),
        AbortRequests(["r1", "r2"]),
        FinishSequences([("r1", 0), ("r1", 1)]),
        GetStats(1),
        FrontEndReady(1),
        Shutdown(),
    ]
    for msg in to_core:
        assert codec.to_core.decode(codec.encode(msg)) == msg
    lp = {5: Logprob(-0.1, 1), 9: Logprob(-3.0, 2)}
    from_core = [
        EngineCoreOutputs(
            [
                EngineCoreOutput("r1", [5]),
                EngineCoreOutput(
                    "r1",
                    [9],
                    index=1,
                    num_cached_tokens=16,
                    finish_reason="stop",
                    stop_reason=7,
                    new_logprobs=[lp],
                    prompt_logprobs=[None, lp],
                    first_scheduled_time=3.5,
                ),  # fmt: skip
            ],
            engine_index=1,
            stats=EngineStats(num_running=2, kv_cache_usage=0.25, num_used_blocks=4, time=9.0),
        ),
        AddResult(["r1"], [request_error("r2", ValueError("no"))], engine_index=1),
        CoreReady(
            0,
            42,
            "/m",
            256,
            384,
            [2],
            "float32",
            "cpu",
            ["a", "b"],
            {"top_k": 5},
            16,
            100,
            True,
            64,
            2048,
            20,
            False,
            "torch",
            1.5,
        ),  # fmt: skip
        CoreFailed(0, "boom", "RuntimeError", False, "Traceback..."),
        AllFrontEndsReady(),
    ]
    for msg in from_core:
        assert codec.from_core.decode(codec.encode(msg)) == msg
    # No field names on the wire: a plain decode output is 14 bytes besides its id (the
    # last nil is the pooled vector of an embedding request).
    assert codec.encode(EngineCoreOutput("r1", [5])) == b"\x9a\xa2r1\x91\x05\x00\x00" + b"\xc0" * 6


@pytest.mark.parametrize(
    ("exc", "cls", "param"),
    [
        (PromptTooLongError(300, 256), PromptTooLongError, "prompt"),
        (SamplingParamsError("bad top_p", "top_p"), SamplingParamsError, "top_p"),
        (InvalidRequestError("in use", "request_id"), InvalidRequestError, "request_id"),
        (ValueError("the prompt needs 100 blocks"), InvalidRequestError, None),
    ],
)
def test_a_refusal_raises_the_same_error_in_the_front_end(exc, cls, param):
    err = Codec().from_core.decode(Codec().encode(AddResult([], [request_error("r", exc)])))
    with pytest.raises(cls) as info:
        raise_request_error(err.rejected[0])
    assert str(info.value) == str(exc) and info.value.param == param
    if cls is PromptTooLongError:
        assert (info.value.num_tokens, info.value.max_model_len) == (300, 256)


def test_an_internal_failure_is_not_a_bad_request():
    with pytest.raises(RuntimeError, match="KeyError"):
        raise_request_error(request_error("r", KeyError("x")))


def test_a_requests_lora_adapter_and_images_cross_the_wire():
    """The LoRARequest and the processed images (pixel arrays: dtype, shape, bytes) reach the
    core as the front end built them; utility calls and their answers round-trip too."""
    import numpy as np

    from engine.engine_core.messages import UtilityCall, UtilityResult
    from engine.lora.request import LoRARequest
    from engine.multimodal.inputs import ImageInputSpec, MultiModalFeature, hash_pixel_values

    codec = Codec()
    pixels = np.arange(3 * 4 * 5, dtype=np.float32).reshape(3, 4, 5) / 7
    feature = MultiModalFeature(hash_pixel_values(pixels), 1, 4, pixels)
    lora = LoRARequest("sql", 3, "/adapters/sql", base_model_name="tiny")
    req = EngineCoreRequest(
        "r", [1, 9, 9, 9, 9, 2], SamplingParams(), 1.0, mm_features=[feature], lora_request=lora
    )
    got = codec.to_core.decode(codec.encode(AddRequests([req]))).requests[0]
    assert got.lora_request == lora and isinstance(got.lora_request, LoRARequest)
    (f,) = got.mm_features
    assert isinstance(f, MultiModalFeature) and (f.identifier, f.offset, f.length) == (
        feature.identifier,
        1,
        4,
    )
    assert f.pixel_values.dtype == np.float32 and f.pixel_values.shape == (3, 4, 5)
    assert np.array_equal(f.pixel_values, pixels) and f.pixel_values.flags.writeable
    assert hash_pixel_values(f.pixel_values) == feature.identifier
    for call in (UtilityCall(1, "add_lora", [lora], 1), UtilityCall(2, "remove_lora", [3])):
        assert codec.to_core.decode(codec.encode(call)) == call
    err = request_error("", InvalidRequestError("bad adapter", "lora_request"))
    for result in (
        UtilityResult(1, 1, [1, 3]),
        UtilityResult(2, 0, True),
        UtilityResult(3, error=err),
    ):
        assert codec.from_core.decode(codec.encode(result)) == result
    spec = ImageInputSpec(7, 4, 16, bidirectional=True, pixel_shape=(3, 4, 5))
    ready = CoreReady(
        0, 1, "m", 64, 100, [2], "float32", "cpu", None, {}, 16, 8, True, 4, 512, 20, False, "t",
        0.1,
        image_input_spec=spec,
    )  # fmt: skip
    assert codec.from_core.decode(codec.encode(ready)).image_input_spec == spec
