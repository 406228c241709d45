"""Finding lone UTF-16 surrogates in a request body.

JSON may spell a surrogate half alone (``"\\ud800"``); Python's JSON parser keeps it as a lone
surrogate code point, which no tokenizer, regex compiler or UTF-8 encoder accepts. Properly
paired halves (``"\\ud83d\\ude00"``) are joined into one character while parsing, so any
surrogate left in a parsed string is a lone one.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel

_SURROGATE = re.compile("[\ud800-\udfff]")
_NUMBERS = frozenset((int, float, bool))


def surrogate_at(text: str) -> int | None:
    """The index of the first lone surrogate in ``text``, or None."""
    if text.isascii():
        return None
    found = _SURROGATE.search(text)
    return found.start() if found else None


def find_lone_surrogate(
    value: Any, path: str = "", skip: frozenset[str] = frozenset()
) -> tuple[str, str] | None:
    """Where the first lone surrogate in ``value`` (a pydantic model, dict, list or str,
    nested) is: ``(param, message)``, or None. ``param`` names the field with dots
    (``messages.0.content``). Only declared fields of models are searched (unknown fields are
    ignored anyway), and not the top-level ones named in ``skip``."""
    for where, text, is_key in _strings(value, path, skip):
        index = surrogate_at(text)
        if index is not None:
            what = f"a key of {where}" if is_key else where
            return where, (
                f"{what} contains a lone UTF-16 surrogate (U+{ord(text[index]):04X} at "
                f"character {index}); text must be valid Unicode, where surrogates only come "
                "in pairs"
            )
    return None


def _strings(value: Any, path: str, skip: frozenset[str] = frozenset()) -> Iterator:
    """``(path, text, is_key)`` for every string in ``value``."""
    if isinstance(value, str):
        yield path, value, False
    elif isinstance(value, BaseModel):
        for name in type(value).model_fields:
            item = getattr(value, name)
            if name not in skip and item is not None:
                yield from _strings(item, _join(path, name))
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str):
                yield path, key, True
            yield from _strings(item, _join(path, str(key)))
    elif isinstance(value, (list, tuple)):
        if set(map(type, value)) <= _NUMBERS:  # token-id lists are long: one pass in C
            return
        for i, item in enumerate(value):
            if type(item) not in _NUMBERS:
                yield from _strings(item, _join(path, str(i)))


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
