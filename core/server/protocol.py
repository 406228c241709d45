"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Field names and defaults follow the OpenAI API; the extra sampling fields (``top_k``,
``min_p``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``min_tokens``,
``skip_special_tokens``, ``structured_outputs``, ``guided_json``...) follow vLLM's, so clients
pass them through ``extra_body``.
Unknown fields are accepted and ignored (a warning is logged), as vLLM does, so newer clients
keep working.

Request fields are strictly typed, as OpenAI's API types them: ``"5"`` or ``true`` is not an
integer, ``"yes"`` is not a boolean, ``[true, false]`` is not a list of token ids, and NaN or
infinity is not a number (a 400 naming the field, never a silent coercion). Integers are bounded
(a signed 64-bit ``seed``, for one) and floats stay in the float32 range the sampler computes
in. Limits that depend on the served model (``n``, ``logprobs``, token ids, ``max_tokens``)
are checked by ``engine.server.serving``.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    WithJsonSchema,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from engine.server.unicode_check import find_lone_surrogate

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest positive normal float32


def _integral(value: Any) -> Any:
    """JSON has one number type: ``5.0`` is the integer 5 (JSON Schema's reading too), while
    ``5.5``, ``"5"`` and ``true`` are not integers (strict validation rejects them)."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


# Integer fields: strict (no strings or booleans) but taking integral JSON numbers. The
# bounds come before the validator, so that pydantic writes them into the JSON schema.
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX), BeforeValidator(_integral)]
# A token id; whether it is in the vocabulary is checked against the served model.
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX), BeforeValidator(_integral)]
Count = Annotated[int, Field(ge=0, le=INT64_MAX), BeforeValidator(_integral)]
Positive = Annotated[int, Field(ge=1, le=INT64_MAX), BeforeValidator(_integral)]
NonEmptyText = Annotated[str, Field(min_length=1)]

# JSON schemas of fields the server keeps as plain JSON (and checks in engine.server.structured
# and engine.server.tools), so that the OpenAPI document states what those checks accept.
_JSON_OBJECT_OR_TEXT = {"anyOf": [{"type": "object"}, {"type": "string"}]}
_RESPONSE_FORMAT = {
    "type": "object",
    "description": 'OpenAI\'s response_format: {"type": "text"} (no constraint, also when type '
    'is absent), {"type": "json_object"}, or {"type": "json_schema", "json_schema": {"name": '
    '..., "schema": {...}}}; the schema must compile (xgrammar), else 400.',
    "properties": {
        "type": {"enum": ["text", "json_object", "json_schema"]},
        "json_schema": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "description": {"type": "string"},
                "schema": {"anyOf": [{"type": "object"}, {"type": "null"}]},
                "strict": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
            },
        },
    },
    "if": {"properties": {"type": {"const": "json_schema"}}, "required": ["type"]},
    "then": {"required": ["json_schema"]},
}
_STRUCTURED_OUTPUTS = {
    "type": "object",
    "description": "vLLM's structured_outputs: exactly one of json, json_object, regex, "
    "choice, grammar (each must compile, else 400).",
    "additionalProperties": False,
    "properties": {
        "json": {"anyOf": [{"type": "object"}, {"type": "string"}, {"type": "null"}]},
        "json_object": {"anyOf": [{"const": True}, {"type": "null"}]},
        "regex": {"anyOf": [{"type": "string", "minLength": 1}, {"type": "null"}]},
        "choice": {
            "anyOf": [
                {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
                {"type": "null"},
            ]
        },
        "grammar": {"anyOf": [{"type": "string", "minLength": 1}, {"type": "null"}]},
        "disable_any_whitespace": {"type": "boolean"},
    },
}
_TOOL = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                "description": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "parameters": {"anyOf": [{"type": "object"}, {"type": "null"}]},
                "strict": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
            },
        },
    },
}
_TOOL_CHOICE = {
    "anyOf": [
        {"enum": ["none", "auto", "required"]},
        {
            "type": "object",
            "required": ["type", "function"],
            "properties": {
                "type": {"const": "function"},
                "function": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {"name": {"type": "string"}},
                },
            },
        },
        {"type": "null"},
    ]
}
_TOOL_CALL = {
    "type": "object",
    "required": ["function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string"},
                "arguments": {
                    "description": "The arguments as a JSON text (OpenAI's wire format).",
                    "anyOf": [{"type": "string"}, {"type": "object"}],
                },
            },
        },
    },
}
_TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}
_IMAGE_URL_PART = {
    "type": "object",
    "required": ["type", "image_url"],
    "properties": {
        "type": {"const": "image_url"},
        "image_url": {
            "type": "object",
            "required": ["url"],
            "properties": {
                "url": {
                    "type": "string",
                    "description": "data:image/...;base64,... or, when the server allows "
                    "it, a file:// or http(s):// URL",
                }
            },
        },
    },
}
_CONTENT_PART = {"oneOf": [_TEXT_PART, _IMAGE_URL_PART]}
_RERANK_DOCUMENT = {
    "type": "object",
    "required": ["text"],
    "properties": {"text": {"type": "string", "minLength": 1}},
}


class _Body(BaseModel):
    """A JSON object the client sends: strict types, finite numbers, unknown fields kept (and
    ignored with a warning)."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class _Request(_Body):
    """A request body. Besides its fields' types, every string in it must be valid Unicode: a
    lone UTF-16 surrogate (JSON ``"\\ud800"``) is a 400 naming the field, wherever it is
    (prompt, message content, stop strings, tools, schemas...), since neither the tokenizer
    nor the detokenizer's stop matching nor a grammar compiler can take it. ``model`` is only
    looked up: an unknown name is a 404 whatever its characters."""

    @model_validator(mode="after")
    def _valid_unicode(self):
        found = find_lone_surrogate(self, skip=frozenset({"model"}))
        if found is not None:
            param, message = found
            raise PydanticCustomError(
                "lone_surrogate", "{message}", {"message": message, "param": param}
            )
        return self


class StreamOptions(_Body):
    """``stream_options``: ``include_usage`` adds a final chunk with the token usage."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


def _text_or_list(value: Any) -> str:
    return "List" if isinstance(value, list) else "Text"


# A stop string or a list of them; the form is read from the shape, so that an error is about it.
Stop = Annotated[
    Annotated[NonEmptyText, Tag("Text")] | Annotated[list[NonEmptyText], Tag("List")],
    Discriminator(_text_or_list),
]


class SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: Positive = 1
    temperature: float | None = Field(None, ge=0.0, le=FLOAT32_MAX)
    top_p: float | None = Field(None, ge=FLOAT32_TINY, le=1.0)
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX), BeforeValidator(_integral)] | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, ge=FLOAT32_TINY, le=FLOAT32_MAX)
    seed: Int64 | None = None
    stop: Stop | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: Count = 0
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: Int64 = 0
    # vLLM's: logprob tokens as "token_id:<id>" (exact ids, for clients that compare tokens).
    return_tokens_as_token_ids: bool = False
    # vLLM's beam search extension (engine.server.beam): n is the beam width and the number
    # of sequences returned; early_stopping is transformers' (true, false or "never").
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, ge=-FLOAT32_MAX, le=FLOAT32_MAX)
    early_stopping: bool | Literal["never"] = "never"
    # Structured outputs (see engine.server.structured): OpenAI's response_format, vLLM's
    # structured_outputs, or vLLM's older guided_* fields; at most one of them.
    response_format: Annotated[dict[str, Any], WithJsonSchema(_RESPONSE_FORMAT)] | None = None
    structured_outputs: Annotated[dict[str, Any], WithJsonSchema(_STRUCTURED_OUTPUTS)] | None = None
    guided_json: Annotated[dict[str, Any] | str, WithJsonSchema(_JSON_OBJECT_OR_TEXT)] | None = None
    guided_regex: NonEmptyText | None = None
    guided_choice: Annotated[list[NonEmptyText], Field(min_length=1)] | None = None
    guided_grammar: NonEmptyText | None = None
    # vLLM's: the top-N logprobs of every prompt token (the response's prompt_logprobs).
    prompt_logprobs: Count | None = None
    # vLLM's: keep only the last N prompt tokens (-1: the last max_model_len);
    # truncation_side "right" keeps the first N instead.
    truncate_prompt_tokens: Annotated[
        Literal[-1] | Annotated[int, Field(ge=1, le=INT64_MAX)] | None,
        BeforeValidator(_integral),
    ] = None
    truncation_side: Literal["left", "right"] | None = None


def _prompt_form(value: Any) -> str:
    """Which form of ``prompt`` the client sent, decided by its shape so that errors are about
    that form: a string, strings, token ids, or lists of token ids."""
    if isinstance(value, list) and value:
        first = value[0]
        if isinstance(first, str):
            return "Strings"
        if isinstance(first, list):
            return "TokenIdLists"
        return "TokenIds"
    if isinstance(value, list):
        return "TokenIds"  # [] fails there: min 1 token
    return "Text"


def _prompt_forms(text: Any) -> Any:
    """The four prompt forms (one text, texts, token ids, lists of token ids), ``text`` the
    type of one text."""
    return Annotated[
        Annotated[text, Tag("Text")]
        | Annotated[list[text], Field(min_length=1), Tag("Strings")]
        | Annotated[list[TokenId], Field(min_length=1), Tag("TokenIds")]
        | Annotated[
            list[Annotated[list[TokenId], Field(min_length=1)]],
            Field(min_length=1),
            Tag("TokenIdLists"),
        ],
        Discriminator(_prompt_form),
    ]


Prompt = _prompt_forms(str)


# ``/v1/embeddings``' input: the prompt forms, with no empty string (OpenAI refuses one too,
# and the schema says so, so that a client or fuzzer reading it does not send one).
EmbeddingInput = _prompt_forms(NonEmptyText)


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``.

    ``prompt`` is a string, a list of strings, a list of token ids, or a list of token-id lists.
    ``echo`` prepends the prompt to each choice; with ``logprobs`` it also returns the prompt's
    logprobs (first token: ``None``). ``max_tokens=0`` is allowed with ``echo`` (scores the
    prompt only, as lm-eval's loglikelihood tasks do).
    """

    prompt: Prompt
    max_tokens: Count | None = 16
    echo: bool = False
    logprobs: Count | None = None
    suffix: None = None  # not supported: only null is accepted
    best_of: Positive | None = None
    add_special_tokens: bool = True


# OpenAI's function tools (checked in engine.server.tools.request); at least one.
Tools = Annotated[list[Annotated[dict[str, Any], WithJsonSchema(_TOOL)]], Field(min_length=1)]


class TextContentPart(_Body):
    """A text part of a chat message's content."""

    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    """One chat message; ``content`` is a string or a list of text and ``image_url`` parts.

    An assistant message may carry the ``tool_calls`` it made, and a ``tool`` message the
    ``tool_call_id`` it answers (checked in ``engine.server.tools.prepare_tool_history``).
    """

    role: str = Field(min_length=1)
    # image_url parts are read by engine.multimodal.chat for models that take images; other
    # part types, or images for a text model, are refused by name (engine.server.chat_template).
    content: (
        str
        | list[Annotated[TextContentPart | dict[str, Any], WithJsonSchema(_CONTENT_PART)]]
        | None
    ) = None
    name: str | None = None
    tool_calls: list[Annotated[dict[str, Any], WithJsonSchema(_TOOL_CALL)]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``.

    ``max_completion_tokens`` (OpenAI's newer name) wins over ``max_tokens``; neither means
    "until the context is full". ``logprobs=true`` returns the chosen tokens' logprobs,
    ``top_logprobs`` (0-20) the alternatives at each position.
    """

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Positive | None = None
    max_completion_tokens: Positive | None = None
    logprobs: bool = False
    top_logprobs: Count | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # A Jinja chat template for this request only (refused unless the server runs with
    # --trust-request-chat-template, as in vLLM).
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the response starts with the last message's content when it has the role of
    # the response (continuing it).
    echo: bool = False
    # vLLM's: with --reasoning-parser, false leaves the reasoning out of the response (it is
    # still kept out of the content).
    include_reasoning: bool = True
    tools: Tools | None = None
    tool_choice: Annotated[str | dict[str, Any] | None, WithJsonSchema(_TOOL_CHOICE)] = None
    parallel_tool_calls: bool = True


class ErrorInfo(BaseModel):
    """What went wrong: OpenAI's error fields (``param`` names the request field)."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The body of every error response (OpenAI's envelope)."""

    error: ErrorInfo


class UsageInfo(BaseModel):
    """Token counts of a request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # With --enable-prompt-tokens-details: {"cached_tokens": N}, the prompt tokens served from
    # the prefix cache (OpenAI's field; vLLM's flag). Left out otherwise.
    prompt_tokens_details: dict[str, int] | None = None

    @model_serializer(mode="wrap")
    def _omit_absent_details(self, handler):
        data = handler(self)
        if data.get("prompt_tokens_details") is None:
            data.pop("prompt_tokens_details", None)
        return data


class EmbeddingRequest(_Request):
    """``POST /v1/embeddings`` (OpenAI's shape).

    ``input`` is a string, a list of strings, a list of token ids, or a list of token-id lists.
    ``encoding_format``: ``float`` (lists of numbers) or ``base64`` (each vector's
    little-endian float32 bytes, base64-encoded, as OpenAI). ``dimensions``: keep the first
    ``dimensions`` values (matryoshka models only), renormalised. ``normalize`` (vLLM's
    extra): None takes the model's default.
    """

    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1, le=INT64_MAX), BeforeValidator(_integral)] | None = None
    user: str | None = None
    normalize: bool | None = None
    priority: Int64 = 0


class ClassificationRequest(_Request):
    """``POST /classify`` (vLLM's): each input's class probabilities from a sequence
    classifier. ``input`` takes the forms of ``/v1/embeddings``."""

    model: str | None = None
    input: EmbeddingInput
    user: str | None = None
    priority: Int64 = 0


class ClassificationData(BaseModel):
    """One input's classes: the most probable ``label``, and every class's probability."""

    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassificationResponse(BaseModel):
    """The answer to ``POST /classify``: one entry per input, in input order."""

    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ClassificationData]
    usage: EmbeddingUsage


class EmbeddingData(BaseModel):
    """One input's embedding."""

    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    """Token counts of an embeddings request (no completion tokens)."""

    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(BaseModel):
    """The answer to ``POST /v1/embeddings``: one entry per input, in input order."""

    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


# One text, or a non-empty list of them (read by shape, as the prompt forms are).
ScoreTexts = Annotated[
    Annotated[NonEmptyText, Tag("Text")]
    | Annotated[list[NonEmptyText], Field(min_length=1), Tag("List")],
    Discriminator(_text_or_list),
]


class ScoreRequest(_Request):
    """``POST /score`` (vLLM's): how well each ``text_2`` answers ``text_1``. One ``text_1``
    and one or more ``text_2`` (1:N), or lists of the same length (N:N, pairwise)."""

    model: str | None = None
    text_1: ScoreTexts
    text_2: ScoreTexts
    user: str | None = None
    priority: Int64 = 0


class ScoreData(BaseModel):
    """One pair's score."""

    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    """The answer to ``POST /score``: one score per pair, in pair order."""

    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage


class RerankRequest(_Request):
    """``POST /rerank`` (Jina's and Cohere's shape, as vLLM serves it): the ``documents``
    ordered by relevance to ``query``; ``top_n`` keeps the best N (0 or absent: all);
    ``return_documents: false`` leaves their text out of the results."""

    model: str | None = None
    query: NonEmptyText
    documents: Annotated[
        list[NonEmptyText | Annotated[dict[str, Any], WithJsonSchema(_RERANK_DOCUMENT)]],
        Field(min_length=1),
    ]
    top_n: Count | None = None
    return_documents: bool = True
    user: str | None = None
    priority: Int64 = 0


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    """One document: its index in the request, its text and its relevance score."""

    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int = 0


class RerankResponse(BaseModel):
    """The answer to ``POST /rerank``: the documents, most relevant first."""

    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's logprob of one candidate token at a prompt position."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per prompt token: token id (as a JSON key) -> its logprob; the first is null.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatFunctionCall(BaseModel):
    """The function a tool call invokes; ``arguments`` is a JSON text."""

    name: str
    arguments: str


class ChatToolCall(BaseModel):
    """One tool call of an assistant message."""

    id: str
    type: Literal["function"] = "function"
    function: ChatFunctionCall


class ChatResponseMessage(BaseModel):
    """The message of a chat choice; ``tool_calls`` is left out when there are none, as
    OpenAI (and vLLM) do."""

    role: str = "assistant"
    content: str | None = None
    # With --reasoning-parser: the model's thinking (vLLM's field), and the same under the
    # older name that DeepSeek's API and many clients read; left out when there is none.
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ChatToolCall] | None = None

    @model_serializer(mode="wrap")
    def _omit_empty_tool_calls(self, handler):
        data = handler(self)
        for name in ("tool_calls", "reasoning", "reasoning_content"):
            if not data.get(name):
                data.pop(name, None)
        return data


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "engine"
    root: str | None = None
    # A LoRA adapter's base model (vLLM's field); None for the base model itself.
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeCompletionRequest(_Request):
    """``POST /tokenize`` with a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    """``POST /tokenize`` with chat messages (rendered with the chat template)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Tools | None = None
    return_token_strs: bool = False


def _tokenize_kind(body: Any) -> str:
    if isinstance(body, dict) and "messages" in body:
        return "TokenizeChatRequest"
    return "TokenizeCompletionRequest"


# ``POST /tokenize`` takes either body: one with ``messages`` is the chat form. Deciding up
# front means errors are about the form the client meant (not one error per form).
TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("TokenizeCompletionRequest")]
    | Annotated[TokenizeChatRequest, Tag("TokenizeChatRequest")],
    Discriminator(_tokenize_kind),
]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[TokenId]


class TokenizerInfoResponse(BaseModel):
    """``GET /tokenizer_info`` (vLLM's): the tokenizer's configuration, as its
    ``tokenizer_config.json`` has it (special tokens as their text), with the chat template in
    use and the tokenizer's class name. lm-evaluation-harness's remote tokenizer reads
    ``eos_token``, ``bos_token``, ``pad_token`` and ``chat_template`` from it."""

    model_config = ConfigDict(extra="allow")

    tokenizer_class: str
    eos_token: str | None = None
    bos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    chat_template: str | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
