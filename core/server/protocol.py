"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Field names and defaults follow the OpenAI API; the extra sampling fields (``top_k``,
``min_p``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``min_tokens``,
``skip_special_tokens``, ``structured_outputs``, ``guided_json``...) follow vLLM's, so clients
pass them through ``extra_body``.
Unknown fields are accepted and ignored (a warning is logged), as vLLM does, so newer clients
keep working.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with the token usage."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(_Body):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
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


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``.

    ``prompt`` is a string, a list of strings, a list of token ids, or a list of token-id lists.
    ``echo`` prepends the prompt to each choice; with ``logprobs`` it also returns the prompt's
    logprobs (first token: ``None``). ``max_tokens=0`` is allowed with ``echo`` (scores the
    prompt only, as lm-eval's loglikelihood tasks do).
    """

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True


class TextContentPart(BaseModel):
    """A text part of a chat message's content."""

    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    """One chat message; ``content`` is a string or a list of text parts.

    An assistant message may carry the ``tool_calls`` it made, and a ``tool`` message the
    ``tool_call_id`` it answers (checked in ``engine.server.tools.prepare_tool_history``).
    """

    role: str
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
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
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


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


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
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ChatToolCall] = Field(default_factory=list)


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


class TokenizeCompletionRequest(_Body):
    """``POST /tokenize`` with a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Body):
    """``POST /tokenize`` with chat messages (rendered with the chat template)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
