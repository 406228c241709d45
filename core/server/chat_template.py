"""Rendering a chat request's messages with a chat template, and what the template accepts.

- **Which template**: the request's ``chat_template`` (vLLM's field; refused unless the server
  runs with ``--trust-request-chat-template``, since a template is code the server runs),
  else ``--chat-template``, else the tokenizer's.
- **Content**: every message needs content (a string or text parts), except an assistant
  message that carries ``tool_calls`` (OpenAI's rule). The template would otherwise render a
  null as an empty turn, or as the text ``None``.
- **Roles**: any role the template renders is accepted, as vLLM accepts any role and leaves it
  to the template; one the template does not render is a 400. Templates signal that in two
  ways: raising (``raise_exception``: a 400 with the template's message) or silently dropping
  the message (an ``if``/``elif`` chain without ``else``). The second is found by rendering the
  conversation once with a marker as each message's content and checking that every marker
  reached the prompt. A content-blind probe, so a template that rewrites content (``trim``,
  ``upper``, splitting off ``</think>``) keeps its markers; the answer is cached per template
  and shape of conversation, so a steady workload renders once per request, not twice.
"""

from __future__ import annotations

import functools
import inspect
import json
import threading
from collections import OrderedDict
from typing import Any

from engine.server.errors import bad_request
from engine.server.protocol import ChatMessage
from engine.server.tools.request import prepare_tool_history

# Arguments of apply_chat_template that chat_template_kwargs may not replace: the request's own
# fields (add_generation_prompt, continue_final_message, tools) win, as in vLLM.
_REQUEST_ARGS = ("add_generation_prompt", "continue_final_message", "tools")
# Its arguments a template may read (besides the request's fields).
_TEMPLATE_ARGS = ("documents", "chat_template", *_REQUEST_ARGS)


@functools.cache
def reserved_template_args() -> tuple[str, ...]:
    """Names chat_template_kwargs may not use: apply_chat_template's own arguments that are not
    template variables (``tokenize``, ``padding``, ``return_dict``...), read from transformers'
    signature so that a new version's arguments are covered too."""
    from transformers import PreTrainedTokenizerBase

    params = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    return tuple(
        name
        for name, p in params.items()
        if name not in ("self", *_TEMPLATE_ARGS)
        and p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    )


# Digits survive any case change or trimming a template may apply to content.
_MARKER = "7391046285{:05d}5820649137"
_PROBE_CACHE_SIZE = 1024


class ChatTemplates:
    """Chooses the template of a request and renders conversations with it (on the caller's
    thread: ``ServingContext`` runs ``render`` on its tokenizer thread)."""

    def __init__(
        self, tokenizer: Any, server_template: str | None, trust_request_template: bool
    ) -> None:
        self.tokenizer = tokenizer
        self.server_template = server_template
        self.trust_request_template = trust_request_template
        # (template, conversation shape, flags) -> index of the first dropped message, or -1.
        self._probes: OrderedDict[tuple, int] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def default_template(self) -> str | None:
        """The template a request without its own gets: ``--chat-template`` or the
        tokenizer's."""
        return self.server_template or getattr(self.tokenizer, "chat_template", None)

    def choose(
        self, request_template: str | None, kwargs: dict[str, Any], model_name: str
    ) -> tuple[str, str]:
        """``(template, param)``: the template to render with and the request field a failure
        of it is reported against. ``kwargs`` (the request's ``chat_template_kwargs``, copied)
        loses a ``chat_template`` key, which vLLM also reads as the request's template."""
        if "chat_template" in kwargs:
            nested = kwargs.pop("chat_template")
            if request_template is None:
                request_template = nested
        if request_template is not None:
            if not self.trust_request_template:
                raise bad_request(
                    "this server does not run chat templates sent with requests; start it "
                    "with --trust-request-chat-template to allow them (a template is code the "
                    "server runs), or leave chat_template out to use the model's",
                    "chat_template",
                )
            if not isinstance(request_template, str) or not request_template.strip():
                raise bad_request("chat_template must be a non-empty string", "chat_template")
            return request_template, "chat_template"
        template = self.default_template
        if not template:
            raise bad_request(
                f"The model `{model_name}` has no chat template, so /v1/chat/completions "
                "cannot format messages. Use /v1/completions with a plain prompt, or start the "
                "server with --chat-template.",
                param="messages",
                code="chat_template_missing",
            )
        return template, "messages"

    def render(
        self,
        conversation: list[dict[str, Any]],
        template: str,
        param: str,
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        kwargs: dict[str, Any],
    ) -> str:
        """The prompt text; a 400 when the template fails or drops a message."""
        for name in reserved_template_args():
            if name in kwargs:
                raise bad_request(
                    f"chat_template_kwargs may not set {name!r}: it is an argument of the "
                    "template renderer, not a template variable",
                    "chat_template_kwargs",
                )
        args = {
            **kwargs,
            "chat_template": template,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
        }
        dropped = self._dropped_message(conversation, args)
        if dropped >= 0:
            role = conversation[dropped]["role"]
            raise bad_request(
                f"messages.{dropped}.role: the chat template does not take the role {role!r} "
                f"(the message's content does not reach the prompt); use a role it renders, "
                "such as user, assistant or system",
                f"messages.{dropped}.role",
            )
        try:
            return self.tokenizer.apply_chat_template(conversation, tokenize=False, **args)
        except Exception as e:  # noqa: BLE001 - jinja's raise_exception, syntax errors...
            raise bad_request(f"the chat template failed: {e}", param=param) from e

    def _dropped_message(self, conversation: list[dict[str, Any]], args: dict[str, Any]) -> int:
        """The index of the first message whose content the template leaves out, or -1."""
        shape = tuple(
            (m["role"], bool(m.get("tool_calls")), "name" in m, "tool_call_id" in m)
            for m in conversation
        )
        options = {k: v for k, v in args.items() if k != "tools"}
        key = (
            shape,
            "tools" in args,
            json.dumps(options, sort_keys=True, default=repr),
        )
        with self._lock:
            if key in self._probes:
                self._probes.move_to_end(key)
                return self._probes[key]
        probe = []
        checked = []
        for i, message in enumerate(conversation):
            marker = _MARKER.format(i)
            probe.append({**message, "content": marker})
            # An assistant turn that made tool calls may be rendered as the calls alone.
            if not message.get("tool_calls"):
                checked.append((i, marker))
        try:
            text = self.tokenizer.apply_chat_template(probe, tokenize=False, **args)
        except Exception:  # noqa: BLE001 - the real render reports the template's own error
            return -1
        dropped = next((i for i, marker in checked if marker not in text), -1)
        with self._lock:
            self._probes[key] = dropped
            while len(self._probes) > _PROBE_CACHE_SIZE:
                self._probes.popitem(last=False)
        return dropped


def has_image_parts(messages: list[ChatMessage]) -> bool:
    """Whether any message has an ``image_url`` content part."""
    return any(
        isinstance(m.content, list)
        and any(not hasattr(p, "type") and p.get("type") == "image_url" for p in m.content)
        for m in messages
    )


def conversation_of(
    messages: list[ChatMessage], allow_images: bool = False
) -> list[dict[str, Any]]:
    """The messages as templates take them: text parts joined, tool history shaped, content
    required (400 naming the message) except on an assistant message with tool calls. With
    ``allow_images`` a message with ``image_url`` parts keeps its part list (for
    ``engine.multimodal.chat``); otherwise such a part is a 400."""
    return [_message_dict(m, i, allow_images) for i, m in enumerate(messages)]


def _message_dict(message: ChatMessage, index: int, allow_images: bool = False) -> dict[str, Any]:
    data = message.model_dump(exclude_none=True)
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            part_type = part.type if hasattr(part, "type") else part.get("type")
            if part_type == "image_url" and allow_images:
                prepare_tool_history(data, index)
                return data  # the parts as sent; engine.multimodal.chat reads them
            if part_type != "text":
                what = (
                    "image parts are not supported here (this model takes no images, or the "
                    "endpoint reads text only)"
                    if part_type == "image_url"
                    else "only text and image_url parts are supported"
                )
                raise bad_request(
                    f"messages[{index}].content: {what}, got {part_type!r}",
                    param=f"messages.{index}.content",
                )
            texts.append(part.text if hasattr(part, "text") else str(part.get("text", "")))
        data["content"] = "\n".join(texts)
    elif content is None:
        if message.role != "assistant" or not message.tool_calls:
            raise bad_request(
                f"messages.{index}.content is required: a {message.role!r} message needs "
                "content (a string or a list of text parts); only an assistant message with "
                "tool_calls may leave it out",
                f"messages.{index}.content",
            )
        data["content"] = ""
    prepare_tool_history(data, index)
    return data


def request_kwargs(
    chat_template_kwargs: dict[str, Any] | None, tools: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """The extra template arguments of a request: its ``chat_template_kwargs`` (the request's
    own fields win over the same names there) and its tools."""
    kwargs = dict(chat_template_kwargs or {})
    for name in _REQUEST_ARGS:
        kwargs.pop(name, None)
    if tools:
        kwargs["tools"] = tools
    return kwargs


__all__ = ["ChatTemplates", "conversation_of", "has_image_parts", "request_kwargs"]
