"""Images in chat messages: OpenAI's ``image_url`` content parts, for ``LLM.chat`` and the
server's ``/v1/chat/completions``.

A message's content list keeps its order; each ``{"type": "image_url", "image_url": {"url":
...}}`` part (vLLM also takes ``"image_url": "..."``) becomes ``{"type": "image"}`` for the chat
template, the way Hugging Face templates take images (Gemma 3's renders ``<start_of_image>``).
A template that only renders string content gets the conversation in string form instead: each
message's text parts joined by newlines with the model's image placeholder where each image
was (vLLM's "string" content format), chosen when the first rendering does not place every
image.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.multimodal.media import MediaError


def _part_type(part: Any) -> str | None:
    return part.get("type") if isinstance(part, dict) else getattr(part, "type", None)


def image_url_of(part: dict[str, Any], where: str) -> str:
    """The URL of an ``image_url`` part (``{"url": ...}`` or a bare string)."""
    value = part.get("image_url")
    if isinstance(value, dict):
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise MediaError(f'{where}: an image_url part needs "image_url": {{"url": "..."}}')
    return value


def take_image_parts(
    conversation: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """The conversation with image parts as ``{"type": "image"}`` and text parts as
    ``{"type": "text", "text": ...}``, and the images' ``(url, where)`` in order, ``where``
    naming the part (``messages.0.content.1``). Messages without images are left as they are."""
    out: list[dict[str, Any]] = []
    images: list[tuple[str, str]] = []
    for i, message in enumerate(conversation):
        content = message.get("content")
        if not isinstance(content, list) or not any(_part_type(p) == "image_url" for p in content):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = _part_type(part)
            part = part if isinstance(part, dict) else part.model_dump()
            where = f"messages.{i}.content.{j}"
            if kind == "image_url":
                images.append((image_url_of(part, where), where))
                parts.append({"type": "image"})
            elif kind == "text":
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            else:
                raise MediaError(
                    f"{where}: content part type {kind!r} is not supported; use text or image_url"
                )
        out.append({**message, "content": parts})
    return out, images


def as_string_content(conversation: list[dict[str, Any]], placeholder: str) -> list[dict]:
    """List contents as strings: text parts joined by newlines, ``placeholder`` per image."""
    out = []
    for message in conversation:
        content = message.get("content")
        if isinstance(content, list):
            pieces = [
                placeholder if p.get("type") == "image" else str(p.get("text", "")) for p in content
            ]
            message = {**message, "content": "\n".join(pieces)}
        out.append(message)
    return out


def render_with_images(
    render: Callable[[list[dict[str, Any]]], str],
    conversation: list[dict[str, Any]],
    num_images: int,
    placeholder: str,
) -> str:
    """Render a conversation whose image parts are ``{"type": "image"}``: as is when the
    template places one ``placeholder`` per image, else in string form. Raises
    ``MediaError`` when neither places them all."""
    prompt = render(conversation)
    if prompt.count(placeholder) == num_images:
        return prompt
    prompt = render(as_string_content(conversation, placeholder))
    if prompt.count(placeholder) != num_images:
        raise MediaError(
            f"the chat template placed {prompt.count(placeholder)} image placeholder(s) "
            f"{placeholder!r} for {num_images} image(s); it does not render image parts"
        )
    return prompt
