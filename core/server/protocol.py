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
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from engine.server.unicode_check import find_lone_surrogate

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest positive normal float32

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
# A token id; whether it is in the vocabulary is checked against the served model.
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]


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


class SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=INT64_MAX)
    temperature: float | None = Field(None, ge=0.0, le=FLOAT32_MAX)
    top_p: float | None = Field(None, ge=FLOAT32_TINY, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, ge=FLOAT32_TINY, le=FLOAT32_MAX)
    seed: Int64 | None = None
    stop: str | list[str] | None = None
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
    # Structured outputs (see engine.server.structured): OpenAI's response_format, vLLM's
    # structured_outputs, or vLLM's older guided_* fields; at most one of them.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: the top-N logprobs of every prompt token (the response's prompt_logprobs).
    prompt_logprobs: Count | None = None
    # vLLM's: keep only the last N prompt tokens (-1: the last max_model_len);
    # truncation_side "right" keeps the first N instead.
    truncate_prompt_tokens: Literal[-1] | Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
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


Prompt = Annotated[
    Annotated[str, Tag("Text")]
    | Annotated[list[str], Field(min_length=1), Tag("Strings")]
    | Annotated[list[TokenId], Field(min_length=1), Tag("TokenIds")]
    | Annotated[
        list[Annotated[list[TokenId], Field(min_length=1)]],
        Field(min_length=1),
        Tag("TokenIdLists"),
    ],
    Discriminator(_prompt_form),
]


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
    best_of: int | None = Field(None, ge=1, le=INT64_MAX)
    add_special_tokens: bool = True


class TextContentPart(_Body):
    """A text part of a chat message's content."""

    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    """One chat message; ``content`` is a string or a list of text parts.

    An assistant message may carry the ``tool_calls`` it made, and a ``tool`` message the
    ``tool_call_id`` it answers (checked in ``engine.server.tools.prepare_tool_history``).
    """

    role: str = Field(min_length=1)
    content: str | list[TextContentPart | dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``.

    ``max_completion_tokens`` (OpenAI's newer name) wins over ``max_tokens``; neither means
    "until the context is full". ``logprobs=true`` returns the chosen tokens' logprobs,
    ``top_logprobs`` (0-20) the alternatives at each position.
    """

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
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
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True


class UsageInfo(BaseModel):
    """Token counts of a request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


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
    tool_calls: list[ChatToolCall] | None = None

    @model_serializer(mode="wrap")
    def _omit_empty_tool_calls(self, handler):
        data = handler(self)
        if not data.get("tool_calls"):
            data.pop("tool_calls", None)
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
    tools: list[dict[str, Any]] | None = None
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
