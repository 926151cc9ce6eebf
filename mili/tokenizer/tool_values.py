"""Typing the text of an XML tool-call parameter by the tool's JSON schema.

Qwen3.5/3.6 (Qwen3-Coder's format) write each argument as the raw text between ``<parameter=NAME>\\n``
and ``\\n</parameter>``: a string as it is, anything else as its template renders it — Qwen3.6 as JSON
(``args_value | tojson``), Qwen3.5 objects and arrays as JSON but numbers, booleans and null through
Jinja's ``| string``, so as Python writes them (``True``, ``None``). ``typed_value`` turns the text back
into the value the schema asks for:

- a parameter the schema types as a free string (or does not know) stays the text, exactly;
- a constrained string (enum, const, pattern, format, a length) is the text without the whitespace around
  it: xgrammar's ``qwen_xml`` style lets whitespace around such a value (not around a free string), so a
  forced call's values still validate;
- otherwise the text is read as JSON, then as a Python literal (``True``, ``None``, ``{'a': 1}``), and
  kept when it has one of the schema's types (an integral number for ``integer`` becomes an int);
- ``true``/``false`` in any case are booleans where the schema allows one; ``null``/``None`` are null
  where it allows null, or where it allows no string;
- what fits none of its types stays a string where the schema allows strings, else it is the JSON (or
  Python) value it reads as, else the text: the client sees what the model wrote, never an invented value.
"""

from __future__ import annotations

import ast
import json
from typing import Any, NamedTuple

_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null",
               dict: "object", list: "array"}
_LITERAL_LIMIT = 65536  # longer text is not given to ast.literal_eval (its parser recurses)


_STRING_CONSTRAINTS = ("enum", "const", "pattern", "format", "minLength", "maxLength")


class ParamType(NamedTuple):
    types: frozenset[str] | None  # the JSON types the schema allows; None when it does not say
    free: bool  # the value is its text exactly (a string without constraints, or a type not known)


def param_type(schema: dict | None, name: str) -> ParamType:
    """What the tool's ``parameters`` schema says of argument ``name`` (nothing: no schema, an unknown
    argument, a property without a type)."""
    prop = None
    if isinstance(schema, dict):
        props = schema.get("properties")
        prop = props.get(name) if isinstance(props, dict) else None
        if prop is None and isinstance(schema.get("additionalProperties"), dict):
            prop = schema["additionalProperties"]
    types = _types(prop)
    free = types is None or (types == {"string"} and not any(k in prop for k in _STRING_CONSTRAINTS))
    return ParamType(types, free)


def _types(schema: Any) -> frozenset[str] | None:
    if not isinstance(schema, dict):
        return None
    declared = schema.get("type")
    if isinstance(declared, str):
        return frozenset({declared})
    if isinstance(declared, list) and all(isinstance(t, str) for t in declared):
        return frozenset(declared)
    values = schema.get("enum") if isinstance(schema.get("enum"), list) else None
    if values is None and "const" in schema:
        values = [schema["const"]]
    if values:
        return frozenset(_JSON_TYPES.get(type(v), "string") for v in values)
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            parts = [_types(s) for s in schema[key]]
            known = [p for p in parts if p is not None]
            return frozenset().union(*known) if known and len(known) == len(parts) else None
    if "properties" in schema:
        return frozenset({"object"})
    if "items" in schema:
        return frozenset({"array"})
    return None


def typed_value(text: str, param: ParamType) -> Any:
    """The argument's value: see the module's rules."""
    types, word = param.types, text.strip()
    if param.free:
        return text
    if types == {"string"}:
        return word
    if word in ("null", "None") and ("null" in types or "string" not in types):
        return None
    if "boolean" in types and word.lower() in ("true", "false"):
        return word.lower() == "true"
    parsed, value = _literal(word)
    if parsed:
        fitted = _fit(value, types)
        if fitted is not _NO_FIT:
            return fitted
    if "string" in types:
        return text
    return value if parsed else text


_NO_FIT = object()


def _fit(value: Any, types: frozenset[str]) -> Any:
    """``value`` as one of ``types`` (an integral float as an integer), or ``_NO_FIT``."""
    kind = _JSON_TYPES.get(type(value))
    if kind == "string":  # strings are written raw in this form: a quoted one is its text, quotes too
        return _NO_FIT
    if kind in types:
        return value
    if kind == "integer" and "number" in types:
        return value
    if kind == "number" and "integer" in types and value.is_integer():
        return int(value)
    return _NO_FIT


def _literal(text: str) -> tuple[bool, Any]:
    """(True, the JSON or Python literal ``text`` is) when it is one whose value JSON can hold."""
    if not text:
        return False, None
    try:
        return True, json.loads(text, parse_constant=_not_json)
    except ValueError:
        pass
    if len(text) > _LITERAL_LIMIT:
        return False, None
    try:
        value = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None
    return (True, value) if _json_like(value) else (False, None)


def _not_json(name: str):
    raise ValueError(f"{name} is not JSON")


def _json_like(value: Any, depth: int = 0) -> bool:
    if depth > 100:
        return False
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_like(v, depth + 1) for k, v in value.items())
    if isinstance(value, list):
        return all(_json_like(v, depth + 1) for v in value)
    return value is None or isinstance(value, (bool, int, str)) or (isinstance(value, float) and value == value
                                                                    and abs(value) != float("inf"))
