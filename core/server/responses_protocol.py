"""Request bodies of OpenAI's Responses API (``POST /v1/responses``), as pydantic models.

Field names, shapes and defaults follow OpenAI's API; ``engine.server.responses`` translates a
request to the chat path. The models share the OpenAI models' strictness
(``engine.server.protocol``): strict types, finite numbers, valid Unicode, unknown fields
ignored with a warning.

``input`` is a string (one user message) or a list of items told apart by ``type`` (a missing
type is a message, as OpenAI reads it): ``message``, ``function_call``,
``function_call_output`` and ``reasoning``. A type this server does not take (hosted tools'
items, ``item_reference``...) is a 400 that lists the types it does take. The sampling fields
vLLM adds to its requests (``top_k``, ``min_p``, ``seed``, ``stop``, penalties...) are taken
here too and checked as the chat route checks them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Discriminator, Field, Tag, TypeAdapter
from pydantic_core import PydanticCustomError

from engine.server.protocol import (
    FLOAT32_MAX,
    FLOAT32_TINY,
    INT64_MAX,
    Count,
    Int64,
    NonEmptyText,
    Positive,
    Stop,
    _Body,
    _integral,
    _Request,
)


class InputText(_Body):
    """``{"type": "input_text", "text": ...}``."""

    type: Literal["input_text"]
    text: str


class InputImage(_Body):
    """``{"type": "input_image", "image_url": ...}``: a URL or a ``data:`` URL, read as the
    chat path's ``image_url`` part (so only by a model that takes images). Uploaded files
    (``file_id``) are not kept here."""

    type: Literal["input_image"]
    image_url: NonEmptyText | None = None
    file_id: str | None = None
    detail: Literal["low", "high", "auto"] | None = None


class OutputText(_Body):
    """An earlier answer's text, sent back in an assistant message."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class Refusal(_Body):
    """An earlier answer's refusal, sent back in an assistant message (read as its text)."""

    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[InputText | InputImage | OutputText | Refusal, Field(discriminator="type")]


def _text_form(value: Any) -> str:
    return "Text" if isinstance(value, str) else "Parts"


# A string or a list of parts, told apart by shape (so that an error is about the form sent).
Content = Annotated[
    Annotated[str, Tag("Text")] | Annotated[list[ContentPart], Tag("Parts")],
    Discriminator(_text_form),
]


class MessageItem(_Body):
    """A message of the conversation; ``developer`` reads as ``system``."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Content
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_Body):
    """A call the model made in an earlier answer."""

    type: Literal["function_call"]
    call_id: NonEmptyText
    name: NonEmptyText
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Body):
    """The result of call ``call_id``: text, or text parts."""

    type: Literal["function_call_output"]
    call_id: NonEmptyText
    output: Content
    id: str | None = None
    status: str | None = None


class ReasoningItem(_Body):
    """An earlier answer's reasoning, sent back: taken, and left out of the prompt (reasoning
    models' chat templates leave earlier reasoning out)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


class ItemReference(_Body):
    """An item of a kept response (its input or its output) by ``id``."""

    type: Literal["item_reference"]
    id: NonEmptyText


# Input item types, and the union tag of each (capitalised: an error's location then names
# the item's index, not the tag).
_ITEM_TAGS = {
    "message": "Message",
    "function_call": "FunctionCall",
    "function_call_output": "FunctionCallOutput",
    "reasoning": "Reasoning",
    "item_reference": "ItemReference",
}


def _item_type(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "")
    return _ITEM_TAGS.get(kind, "Message") if isinstance(kind, str) else "Message"


def _known_item(value: Any) -> Any:
    """A 400 naming the item's type for one this server does not take (a type that is not a
    string fails as the message item's ``type``)."""
    if isinstance(value, dict):
        kind = value.get("type", "message")
        if isinstance(kind, str) and kind not in _ITEM_TAGS:
            raise PydanticCustomError(
                "item_type",
                "input items of type '{kind}' are not taken here; the types taken are "
                "message, function_call, function_call_output, reasoning and item_reference",
                {"kind": kind},
            )
    return value


InputItem = Annotated[
    Annotated[MessageItem, Tag("Message")]
    | Annotated[FunctionCallItem, Tag("FunctionCall")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")]
    | Annotated[ReasoningItem, Tag("Reasoning")]
    | Annotated[ItemReference, Tag("ItemReference")],
    Discriminator(_item_type),
    BeforeValidator(_known_item),
]


# One input item on its own (an item_reference resolves to one of these).
INPUT_ITEM = TypeAdapter(InputItem)


def _input_form(value: Any) -> str:
    return "Text" if isinstance(value, str) else "Items"


# ``input``: its form is read from its shape, so that an error is about the items sent.
Input = Annotated[
    Annotated[str, Tag("Text")] | Annotated[list[InputItem], Field(min_length=1), Tag("Items")],
    Discriminator(_input_form),
]


class TextFormat(_Body):
    """``text.format``: ``text`` (the default), ``json_object``, or ``json_schema`` with the
    schema's ``name``, ``schema`` and ``strict``."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Body):
    """``text``: the output's format (``verbosity`` is taken and has no effect here)."""

    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(_Request):
    """``POST /v1/responses``.

    ``instructions`` is a first system message (not carried to a later response that names
    this one in ``previous_response_id``, as OpenAI's API does); ``max_output_tokens`` bounds
    the answer; ``tools`` are function tools (``{"type": "function", "name", "parameters"}``);
    ``text.format`` constrains the output (structured outputs); ``reasoning.effort`` reaches the
    chat template as ``reasoning_effort``; ``store`` keeps the response for
    ``GET /v1/responses/{id}`` and ``previous_response_id``; ``include:
    ["message.output_text.logprobs"]`` with ``top_logprobs`` returns logprobs.
    """

    model: str | None = None
    input: Input
    instructions: str | None = None
    max_output_tokens: Positive | None = None
    temperature: float | None = Field(None, ge=0.0, le=FLOAT32_MAX)
    top_p: float | None = Field(None, ge=FLOAT32_TINY, le=1.0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_tool_calls: Positive | None = None
    stream: bool = False
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool = True
    previous_response_id: str | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    include: list[str] | None = None
    top_logprobs: Count | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's sampling extensions, with the chat route's types and bounds.
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX), BeforeValidator(_integral)] | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: Int64 | None = None
    stop: Stop | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, ge=FLOAT32_TINY, le=FLOAT32_MAX)
    ignore_eos: bool | None = None
    min_tokens: Count | None = None
    priority: Int64 | None = None
    skip_special_tokens: bool | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# The sampling extensions passed on to the chat request as they are.
PASSED_FIELDS = (
    "top_k",
    "min_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "min_tokens",
    "priority",
    "skip_special_tokens",
    "logit_bias",
    "temperature",
    "top_p",
    "user",
)
