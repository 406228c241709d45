"""The pythonic tool-call format.

A generation that calls tools is a Python list of calls with keyword arguments whose values are
Python literals (strings, numbers, ``True``/``False``/``None``, lists, dicts, tuples), optionally
wrapped in Llama 4's ``<|python_start|>`` ... ``<|python_end|>`` (special tokens: they are in the
text only when ``skip_special_tokens`` is false)::

    [get_weather(city="Paris", unit="c"), get_time()]

Each call is parsed with ``ast`` (nothing is evaluated) and its arguments become a JSON object.
A generation that does not start, after whitespace and the optional tag, with ``[`` and a call
is plain content. When a call is malformed (positional arguments, a value that is not a
literal, text that is not Python), the text from there on is content (all of it, tag included,
when no call was made before), so a model that answered in prose keeps its answer.
"""

from __future__ import annotations

import ast
import json
import re

from engine.server.tools.parser import (
    StreamUpdate,
    ToolCall,
    ToolCallStream,
    ToolParser,
)

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# UNDECIDED: nothing but whitespace, the tag, "[" and part of a name so far. CALLS: inside the
# list, before a call or a separator. AFTER: the list closed. TEXT: everything is content.
_UNDECIDED, _CALLS, _AFTER, _TEXT = range(4)


def _may_start_call(text: str) -> bool:
    """Whether ``text`` is, or may still grow into, ``name(...``."""
    m = _IDENT.match(text)
    return m is not None and (m.end() == len(text) or text[m.end()] == "(")


def _call_end(text: str) -> int:
    """Index just past the parenthesis closing the first ``(`` of ``text`` (Python strings,
    triple-quoted ones and escapes respected), or -1 when it is not closed yet."""
    depth = 0
    quote = ""  # the delimiter of the string we are in: ', ", ''' or """
    i = 0
    n = len(text)
    while i < n:
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 2
                continue
            if text.startswith(quote, i):
                i += len(quote)
                quote = ""
                continue
        elif ch in "'\"":
            # A quote near the end may still turn out triple: then no ")" follows it yet
            # and the scan returns -1, to be redone on more text.
            quote = ch * 3 if text.startswith(ch * 3, i) else ch
            i += len(quote)
            continue
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return -1


def _literal(node: ast.expr) -> object:
    """The JSON-compatible value of a literal node; ValueError for anything else."""
    value = ast.literal_eval(node)

    def check(v: object) -> object:
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, (list, tuple)):
            return [check(x) for x in v]
        if isinstance(v, dict) and all(isinstance(k, str) for k in v):
            return {k: check(x) for k, x in v.items()}
        raise ValueError(f"{type(v).__name__} is not a JSON value")

    return check(value)


def _parse_call(source: str) -> ToolCall | None:
    """``name(key=literal, ...)`` as a ``ToolCall``, or None when it is anything else."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # ValueError: a NUL byte
        return None
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
        return None
    args: dict[str, object] = {}
    for keyword in node.keywords:
        if keyword.arg is None or keyword.arg in args:  # **kwargs, or a repeated name
            return None
        try:
            args[keyword.arg] = _literal(keyword.value)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
    try:
        arguments = json.dumps(args, ensure_ascii=False, allow_nan=False)
    except ValueError:  # inf or nan
        return None
    return ToolCall(name=node.func.id, arguments=arguments)


class _PythonicStream(ToolCallStream):
    def __init__(self) -> None:
        self.mode = _UNDECIDED
        self.buf = ""
        self.prefix = ""  # text before the first call: content if no call is ever made
        self.expect_call = True  # in the list: a call may come next (vs. "," or "]")
        self.ended = False  # the closing tag was seen
        self.num_calls = 0

    def _give_up(self, out: StreamUpdate) -> None:
        """Content from the front of ``buf`` on (and the prefix, when nothing was called)."""
        rest = self.buf if self.num_calls else self.prefix + self.buf
        self.prefix = self.buf = ""
        out.content += rest
        self.mode = _TEXT

    def feed(self, text: str) -> StreamUpdate:
        out = StreamUpdate()
        if self.mode == _TEXT:
            out.content = text
            return out
        self.buf += text
        if self.mode == _UNDECIDED:
            self._decide(out)
        if self.mode == _CALLS:
            self._scan(out)
        if self.mode == _AFTER:
            self._after(out)
        return out

    def _decide(self, out: StreamUpdate) -> None:
        """Calls or content? Calls once the text reads ``[name(``; content once it cannot."""
        i = len(self.buf) - len(self.buf.lstrip())
        rest = self.buf[i:]
        if rest.startswith(PYTHON_START):
            i += len(PYTHON_START)
            rest = self.buf[i:]
            j = len(rest) - len(rest.lstrip())
            i, rest = i + j, rest[j:]
        elif PYTHON_START.startswith(rest) and rest.startswith("<"):
            return  # part of the tag so far
        if not rest:
            return
        if rest[0] != "[":
            self._give_up(out)
            return
        after = rest[1:].lstrip()
        if not after:
            return
        if not _may_start_call(after):
            self._give_up(out)
            return
        if "(" not in after:
            return  # the name may go on
        cut = i + 1 + (len(rest) - 1 - len(after))  # just past "[" and its whitespace
        self.prefix, self.buf = self.buf[:cut], self.buf[cut:]
        self.mode = _CALLS

    def _scan(self, out: StreamUpdate) -> None:
        """Emit every complete call at the front of ``buf``."""
        while self.mode == _CALLS:
            self.buf = self.buf.lstrip()  # whitespace between calls is not content
            if not self.buf:
                return
            head = self.buf[0]
            if head == "]" and self.num_calls:  # the list closes (a trailing comma is fine)
                self.buf = self.buf[1:]
                self.mode = _AFTER
            elif not self.expect_call and head == ",":
                self.buf = self.buf[1:]
                self.expect_call = True
            elif not (self.expect_call and _may_start_call(self.buf)):
                self._give_up(out)
            else:
                end = _call_end(self.buf)
                if end < 0:
                    return
                call = _parse_call(self.buf[:end])
                if call is None:
                    self._give_up(out)
                    return
                self.buf = self.buf[end:]
                self.prefix = ""
                self.num_calls += 1
                self.expect_call = False
                out.calls.append(call)

    def _after(self, out: StreamUpdate) -> None:
        """After the list: whitespace and one closing tag are dropped; anything else is content."""
        self.buf = self.buf.lstrip()
        if not self.ended:
            if self.buf.startswith(PYTHON_END):
                self.buf = self.buf[len(PYTHON_END) :].lstrip()
                self.ended = True
            elif self.buf and PYTHON_END.startswith(self.buf):
                return  # part of the closing tag so far
        if self.buf:
            self._give_up(out)

    def finish(self) -> StreamUpdate:
        out = StreamUpdate()
        unfinished = (
            self.mode == _UNDECIDED
            or (self.mode == _CALLS and (self.num_calls == 0 or self.buf.strip()))
            or (self.mode == _AFTER and self.buf)  # a cut-off closing tag
        )
        if unfinished:
            self._give_up(out)
        self.buf = ""
        return out


class PythonicToolParser(ToolParser):
    """``[name(key=value, ...), ...]`` (Llama 3.2 / 4, and models prompted for pythonic calls)."""

    name = "pythonic"

    def stream(self) -> ToolCallStream:
        return _PythonicStream()
