"""Request and response bodies of the Anthropic Messages API (pydantic models).

Field names, shapes and defaults follow Anthropic's ``POST /v1/messages`` and
``POST /v1/messages/count_tokens``; ``engine.server.anthropic`` translates them to the chat
path. The request models share the OpenAI models' strictness (``engine.server.protocol``):
strict types, finite numbers, valid Unicode, unknown fields ignored with a warning.

Content blocks are told apart by their ``type``; a type this server does not take
(``document``, server tools...) is a 400 that lists the types it does take. An assistant turn's
``thinking`` and ``redacted_thinking`` blocks (what clients send back of a reasoning model's
earlier answers) are taken and left out of the prompt, as reasoning models' chat templates
leave out earlier reasoning.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag

from engine.server.protocol import FLOAT32_TINY, NonEmptyText, Positive, _Body, _Request


class TextBlock(_Body):
    """``{"type": "text", "text": ...}``."""

    type: Literal["text"]
    text: str


class Base64ImageSource(_Body):
    """An image sent inline: ``media_type`` (``image/png``...) and base64 ``data``."""

    type: Literal["base64"]
    media_type: NonEmptyText
    data: NonEmptyText


class URLImageSource(_Body):
    """An image by URL (loaded only where the server allows URLs, as ``image_url`` parts)."""

    type: Literal["url"]
    url: NonEmptyText


class ImageBlock(_Body):
    """``{"type": "image", "source": ...}``: read as the chat path's ``image_url`` part, so
    only by a model that takes images."""

    type: Literal["image"]
    source: Annotated[Base64ImageSource | URLImageSource, Field(discriminator="type")]


class ToolUseBlock(_Body):
    """A call the assistant made (in the history, and in responses)."""

    type: Literal["tool_use"]
    id: NonEmptyText
    name: NonEmptyText
    input: dict[str, Any]


class ThinkingBlock(_Body):
    """Reasoning of an earlier answer (``--reasoning-parser``), sent back in the history."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Body):
    """Anthropic's encrypted reasoning, sent back in the history (never produced here)."""

    type: Literal["redacted_thinking"]
    data: str


class ToolResultBlock(_Body):
    """The result of call ``tool_use_id``, sent in a user message; ``content`` is text or
    text blocks."""

    type: Literal["tool_result"]
    tool_use_id: NonEmptyText
    content: str | list[TextBlock] | None = None
    is_error: bool = False


UserBlock = Annotated[TextBlock | ImageBlock | ToolResultBlock, Field(discriminator="type")]
AssistantBlock = Annotated[
    TextBlock | ToolUseBlock | ThinkingBlock | RedactedThinkingBlock, Field(discriminator="type")
]


class UserMessage(_Body):
    """A user turn: a string, or ``text``, ``image`` and ``tool_result`` blocks."""

    role: Literal["user"]
    content: str | Annotated[list[UserBlock], Field(min_length=1)]


class AssistantMessage(_Body):
    """An assistant turn: a string, or ``text``, ``tool_use`` and (ignored) ``thinking``
    blocks. A last assistant turn is a prefill: the response continues it."""

    role: Literal["assistant"]
    content: str | Annotated[list[AssistantBlock], Field(min_length=1)]


def _role(value: Any) -> str | None:
    role = value.get("role") if isinstance(value, dict) else getattr(value, "role", None)
    if not isinstance(role, str):  # any JSON value may come: {} is not a dictionary key
        return None
    return {"user": "UserMessage", "assistant": "AssistantMessage"}.get(role)


# The role decides which blocks a turn takes, so that the schema states it too.
AnthropicMessage = Annotated[
    Annotated[UserMessage, Tag("UserMessage")]
    | Annotated[AssistantMessage, Tag("AssistantMessage")],
    Discriminator(
        _role,
        custom_error_type="invalid_role",
        custom_error_message="role must be 'user' or 'assistant'",
    ),
]


class AnthropicTool(_Body):
    """A client tool: ``name``, ``description`` and the JSON schema of its ``input``."""

    type: Literal["custom"] | None = None
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoiceAuto(_Body):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(_Body):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(_Body):
    type: Literal["tool"]
    name: NonEmptyText
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(_Body):
    type: Literal["none"]


ToolChoice = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")
]
System = str | list[TextBlock]


class Metadata(_Body):
    """Anthropic's ``metadata``; ``user_id`` is accepted (and only logged with the request)."""

    user_id: str | None = None


class CountTokensRequest(_Request):
    """``POST /v1/messages/count_tokens``: the prompt part of a Messages request."""

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: System | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``. ``max_tokens`` is required, as Anthropic requires it."""

    max_tokens: Positive
    stop_sequences: list[NonEmptyText] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, ge=FLOAT32_TINY, le=1.0)
    top_k: Positive | None = None
    metadata: Metadata | None = None


# ---------------------------------------------------------------- responses


class ResponseTextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ResponseThinkingBlock(BaseModel):
    """A reasoning model's thinking (with ``--reasoning-parser``). ``signature`` is empty:
    nothing here signs it, and a client sends it back as it came."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class ResponseToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class AnthropicUsage(BaseModel):
    """Prompt tokens the engine saw and tokens generated."""

    input_tokens: int
    output_tokens: int


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessagesResponse(BaseModel):
    """A whole assistant message (``stream: false``)."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[
        Annotated[
            ResponseThinkingBlock | ResponseTextBlock | ResponseToolUseBlock,
            Field(discriminator="type"),
        ]
    ]
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class CountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicErrorInfo(BaseModel):
    """``type``: ``invalid_request_error``, ``authentication_error``, ``not_found_error``,
    ``request_too_large``, ``api_error``, ``overloaded_error``..."""

    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """The body of every error on the Messages routes (Anthropic's envelope)."""

    type: Literal["error"] = "error"
    error: AnthropicErrorInfo
