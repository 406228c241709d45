"""Request fields that ask for structured outputs, mapped to ``StructuredOutputsParams``.

A request may use exactly one of:

- OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type":
  "json_object"}`` or ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...},
  "strict": ...}}``;
- vLLM's ``structured_outputs``: ``{"json": ..., "regex": ..., "choice": [...], "grammar":
  ..., "json_object": true}`` (one of them);
- vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.

Errors are 400s whose ``param`` is the field the client used, also for errors found later
by the engine while compiling (see ``rename_param``).
"""

from __future__ import annotations

from typing import Any

from engine.server.errors import APIError, bad_request
from engine.server.protocol import SamplingFields

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


def structured_outputs_field(req: SamplingFields) -> str | None:
    """The request field that asks for structured outputs, or None. More than one is a 400."""
    used = []
    rf = req.response_format
    if rf is not None and not (isinstance(rf, dict) and rf.get("type", "text") == "text"):
        used.append("response_format")
    if req.structured_outputs is not None:
        used.append("structured_outputs")
    used += [name for name in _GUIDED if getattr(req, name) is not None]
    if len(used) > 1:
        raise bad_request(
            f"only one of response_format, structured_outputs, {', '.join(_GUIDED)} may ask for "
            f"structured outputs; got {', '.join(used)}",
            used[1],
        )
    return used[0] if used else None


def structured_outputs_from_request(req: SamplingFields) -> Any:
    """The ``StructuredOutputsParams`` the request asks for (None for none); 400 naming the
    field when the value is malformed."""
    from engine.sampling_params import SamplingParamsError, StructuredOutputsParams

    field = structured_outputs_field(req)
    if field is None:
        return None
    try:
        if field == "response_format":
            return _from_response_format(req.response_format, StructuredOutputsParams)
        if field == "structured_outputs":
            return StructuredOutputsParams.from_dict(req.structured_outputs)
        value = getattr(req, field)
        if field == "guided_choice" and not isinstance(value, list):
            raise bad_request(f"{field} must be a list of strings, got {value!r}", field)
        if field in ("guided_regex", "guided_grammar") and not isinstance(value, str):
            raise bad_request(f"{field} must be a string, got {type(value).__name__}", field)
        return StructuredOutputsParams(**{_GUIDED[field]: value})
    except SamplingParamsError as e:
        raise bad_request(str(e), field) from None


def _from_response_format(rf: Any, cls: type) -> Any:
    if not isinstance(rf, dict):
        raise bad_request("response_format must be an object", "response_format")
    kind = rf.get("type")
    if kind not in _RESPONSE_FORMAT_TYPES:
        raise bad_request(
            f"response_format.type must be one of {', '.join(_RESPONSE_FORMAT_TYPES)}, "
            f"got {kind!r}",
            "response_format",
        )
    if kind == "json_object":
        return cls(json_object=True)
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request(
            'response_format of type "json_schema" needs a "json_schema" object '
            '({"name": ..., "schema": {...}})',
            "response_format",
        )
    schema = spec.get("schema")
    if schema is None:
        # OpenAI makes the schema optional; without one any JSON object is allowed.
        return cls(json_object=True)
    if not isinstance(schema, dict):
        raise bad_request(
            f"response_format.json_schema.schema must be a JSON schema object, got "
            f"{type(schema).__name__}",
            "response_format",
        )
    return cls(json=schema)


def rename_param(err: APIError, field: str | None) -> APIError:
    """Point an engine error about ``structured_outputs`` at the request field the client
    used (``response_format``, ``guided_json``...)."""
    if field is not None and err.param == "structured_outputs":
        err.param = field
    return err
