"""What front ends and engine cores say to each other: msgspec Structs, msgpack on the wire.

Front end -> core: ``AddRequests`` (token ids plus ``SamplingParams``, the prompt's images and
its ``LoRARequest``), ``AbortRequests``,
``FinishSequences`` (a stop string found by the front end's detokenizer), ``GetStats`` (answered
by an ``EngineCoreOutputs`` carrying only stats), ``FrontEndReady`` (a start-up barrier of
several front ends, answered by ``AllFrontEndsReady``), ``UtilityCall`` (vLLM's engine utility
calls, ``add_lora`` / ``remove_lora`` / ``list_loras`` / ``lora_adapters``, answered by
``UtilityResult``),
``Shutdown``.

Core -> front end: ``EngineCoreOutputs`` once per step for every front end whose requests
progressed (new token ids, logprobs, finish reasons: token level, no text), ``AddResult`` (which
requests were accepted, which rejected and why) right after the core took them, ``CoreReady``
once the model is loaded (the resolved configuration the front end needs), ``CoreFailed`` when
loading or a step fails (then the core exits).

Every message is a tagged Struct with ``array_like=True`` (fields by position, no names on the
wire) and ``gc=False`` (no cycles, so the collector need not track them). ``SamplingParams`` and
``Logprob``, ``LoRARequest`` and ``MultiModalFeature`` are dataclasses, which msgspec encodes
natively; an image's pixel array travels as its dtype, shape and raw bytes (``Codec``'s hooks).
Nothing is pickled. The in-process client passes the same objects without encoding them.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from engine.lora.request import LoRARequest
from engine.multimodal.inputs import ImageInputSpec, MultiModalFeature
from engine.outputs import Logprob
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from engine.spec_decode.stats import SpecDecodingStats


class EngineStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Counters and gauges of one engine core, for the periodic log line and Prometheus.

    Cumulative counters (``*_total``, prefix-cache counters, preemptions) only grow; gauges
    describe the moment ``time`` (``time.monotonic()`` of the core, system-wide on Linux).
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_used_blocks: int = 0
    time: float = 0.0
    # Speculative decoding counters (cumulative), None when speculative decoding is off.
    spec_decoding: SpecDecodingStats | None = None
    # Image inputs: images first reached by a request's chunk, and of which already encoded.
    encoder_cache_queries: int = 0
    encoder_cache_hits: int = 0


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request as the core sees it: token ids and how to sample them."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    # Which front end sent it: where its outputs go.
    client_index: int = 0
    # The prompt's images (the front end's processor: placeholder runs in prompt_token_ids).
    mm_features: list[MultiModalFeature] | None = None
    # The LoRA adapter it runs with (the core loads it on first use).
    lora_request: LoRARequest | None = None
    # Set for a pooling (embedding) request: the core returns one vector, samples nothing
    # (``sampling_params`` is then ignored).
    pooling_params: PoolingParams | None = None
    # The server's requests: run with the adapter loaded under lora_request's name *now*,
    # refused (404) when none is; never load one (the cores' adapters are the served set).
    lora_loaded_only: bool = False


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one sequence of a request gained in a step.

    ``index`` is the completion index (``n > 1``). ``finish_reason`` is set when the core ended
    the sequence: "stop" (EOS, a stop token (``stop_reason``), the grammar's end), "length" or
    "abort". Stop *strings* are the front end's business. ``prompt_logprobs`` is the chunk
    computed by this step, for prompt positions after those sent before. On the wire a plain
    decode output is ``[id, [token], 0, 0, nil, nil, nil, nil, nil, nil]``: 14 bytes besides the id
    (msgspec writes every field of an array-like Struct).
    """

    request_id: str
    new_token_ids: list[int]
    index: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | None = None
    new_logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    first_scheduled_time: float | None = None
    # A pooling request's embedding: float32 little-endian bytes (4 bytes a value on the
    # wire, msgpack bin), sent once with finish_reason "stop".
    pooled: bytes | None = None


class RequestError(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Why the core refused a request, enough to raise the same error in the front end."""

    request_id: str
    # "invalid" (a ValueError: 400), "too_long", "sampling", "lora_not_loaded" (404), or
    # "internal"
    kind: str
    message: str
    param: str | None = None
    num_tokens: int | None = None
    max_model_len: int | None = None


# --------------------------------------------------------------------- front end -> core
class AddRequests(msgspec.Struct, tag=True, array_like=True, gc=False):
    requests: list[EngineCoreRequest]


class AbortRequests(msgspec.Struct, tag=True, array_like=True, gc=False):
    request_ids: list[str]


class FinishSequences(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Sequences the front end ended (a stop string): ``(request id, completion index)``."""

    sequences: list[tuple[str, int]]


class GetStats(msgspec.Struct, tag=True, array_like=True, gc=False):
    client_index: int = 0


class FrontEndReady(msgspec.Struct, tag=True, array_like=True, gc=False):
    """A front end (of several) is ready; engine core 0 answers every front end with
    ``AllFrontEndsReady`` once all are, so that none serves before the others can."""

    client_index: int


class Shutdown(msgspec.Struct, tag=True, array_like=True, gc=False):
    pass


class UtilityCall(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Run ``EngineCore.<method>(*args)`` between steps (one of ``UTILITY_METHODS``) and answer
    ``client_index`` with a ``UtilityResult`` carrying ``call_id``."""

    call_id: int
    method: str
    args: list[LoRARequest | bool | int | str | None] = []
    client_index: int = 0


# What a front end may call on a core (vLLM's engine utility calls for LoRA adapters, and the
# adapters themselves: the cores' set is the one every front end serves).
UTILITY_METHODS = frozenset({"add_lora", "remove_lora", "list_loras", "lora_adapters"})


ToCore = (
    AddRequests
    | AbortRequests
    | FinishSequences
    | GetStats
    | FrontEndReady
    | UtilityCall
    | Shutdown
)


# --------------------------------------------------------------------- core -> front end
class EngineCoreOutputs(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """One step's outputs for one front end (plus the core's stats, when refreshed)."""

    outputs: list[EngineCoreOutput] = []
    engine_index: int = 0
    stats: EngineStats | None = None


class AddResult(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """The core took these requests (``accepted``) or refused them (``rejected``)."""

    accepted: list[str] = []
    rejected: list[RequestError] = []
    engine_index: int = 0


class CoreReady(msgspec.Struct, tag=True, array_like=True, gc=False):
    """The core loaded its model: what the front end must know of the resolved config."""

    engine_index: int
    pid: int
    model: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    dtype: str
    platform: str
    served_model_name: str | list[str] | None
    default_sampling: dict[str, Any]
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool
    max_num_seqs: int
    max_num_batched_tokens: int
    max_logprobs: int
    async_scheduling: bool
    attention_backend: str
    load_seconds: float
    # How the model takes images (None: text only); the front end's processor needs it.
    image_input_spec: ImageInputSpec | None = None
    # The implementation the loader chose for --model-impl auto ("native" / "transformers").
    implementation: str | None = None
    # The runner chosen for --runner auto: "generate" or "pooling" (embeddings).
    runner_type: str = "generate"
    # A pooling model's PoolerConfig fields (None: generate): the front end's OpenAPI
    # document states the embedding dimensions it takes.
    pooler_config: dict[str, Any] | None = None


class AllFrontEndsReady(msgspec.Struct, tag=True, array_like=True, gc=False):
    pass


class UtilityResult(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """The answer to a ``UtilityCall``: its result (a set comes as a sorted list; a
    ``LoRARequest`` in a list as its fields, a dict, over the wire) or the error it raised
    (``RequestError``'s kinds: a bad adapter is "invalid", a 400)."""

    call_id: int
    engine_index: int = 0
    result: bool | int | list[Any] | None = None
    error: RequestError | None = None


class CoreFailed(msgspec.Struct, tag=True, array_like=True, gc=False):
    """The core failed (while loading or in a step) and exits. ``user_error``: a configuration
    or plugin problem (one paragraph, exit status 2), not a bug (traceback kept)."""

    engine_index: int
    message: str
    kind: str
    user_error: bool
    traceback: str = ""


FromCore = (
    EngineCoreOutputs | AddResult | CoreReady | CoreFailed | AllFrontEndsReady | UtilityResult
)


def run_utility(core: Any, msg: UtilityCall, engine_index: int) -> UtilityResult:
    """Run a ``UtilityCall`` on ``core``; its error comes back as a ``RequestError``."""
    if msg.method not in UTILITY_METHODS:
        err = ValueError(f"unknown engine utility call {msg.method!r}")
        return UtilityResult(msg.call_id, engine_index, error=request_error("", err))
    try:
        result = getattr(core, msg.method)(*msg.args)
    except Exception as e:  # noqa: BLE001 - refused (a bad adapter...), the core is intact
        return UtilityResult(msg.call_id, engine_index, error=request_error("", e))
    if isinstance(result, set):
        result = sorted(result)
    return UtilityResult(msg.call_id, engine_index, result)


def raise_utility_error(err: RequestError) -> None:
    """Raise in the front end what a utility call raised in the core."""
    if err.kind == "internal":
        raise RuntimeError(f"the engine core failed: {err.message}")
    raise_request_error(err)


def request_error(request_id: str, exc: BaseException) -> RequestError:
    """The ``RequestError`` that carries ``exc`` across the process boundary."""
    from engine.lora.errors import LoRAAdapterNotLoadedError
    from engine.sampling_params import SamplingParamsError

    param = getattr(exc, "param", None)
    max_len = getattr(exc, "max_model_len", None)
    num_tokens = getattr(exc, "num_tokens", None)
    if max_len is not None and num_tokens is not None:
        return RequestError(request_id, "too_long", str(exc), param, int(num_tokens), int(max_len))
    if isinstance(exc, SamplingParamsError):
        return RequestError(request_id, "sampling", str(exc), param)
    if isinstance(exc, LoRAAdapterNotLoadedError):
        return RequestError(request_id, "lora_not_loaded", exc.lora_name, param)
    if isinstance(exc, ValueError):
        return RequestError(request_id, "invalid", str(exc), param)
    return RequestError(request_id, "internal", f"{type(exc).__name__}: {exc}")


def raise_request_error(err: RequestError) -> None:
    """Raise in the front end what the core raised (the same classes the in-process engine
    raises, so the server maps them to the same HTTP answers)."""
    from engine.errors import InvalidRequestError, PromptTooLongError
    from engine.lora.errors import LoRAAdapterNotLoadedError
    from engine.sampling_params import SamplingParamsError

    if err.kind == "too_long":
        raise PromptTooLongError(int(err.num_tokens or 0), int(err.max_model_len or 0))
    if err.kind == "sampling":
        raise SamplingParamsError(err.message, err.param)
    if err.kind == "lora_not_loaded":
        raise LoRAAdapterNotLoadedError(err.message)
    if err.kind == "invalid":
        raise InvalidRequestError(err.message, err.param)
    raise RuntimeError(f"the engine core failed to add request {err.request_id}: {err.message}")


class Codec:
    """The msgpack encoder and the two decoders (one per direction), built once."""

    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        self.to_core = msgspec.msgpack.Decoder(ToCore, dec_hook=_dec_hook)
        self.from_core = msgspec.msgpack.Decoder(FromCore)

    def encode(self, message: Any) -> bytes:
        return self.encoder.encode(message)


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):  # an image's pixels: dtype, shape, raw bytes
        array = np.ascontiguousarray(obj)
        return (array.dtype.str, list(array.shape), array.tobytes())
    raise NotImplementedError(f"cannot send a {type(obj).__name__} to the engine core")


def _dec_hook(type_: type, obj: Any) -> Any:
    if type_ is np.ndarray:
        dtype, shape, data = obj
        return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape).copy()
    raise NotImplementedError(f"cannot decode a {type_}")
