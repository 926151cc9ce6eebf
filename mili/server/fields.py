"""The building blocks of the request models (protocol.py): strict bases, integer and field types, and the
markers the OpenAPI document reads (openapi.py). A dialect's request models are built from these, so that
its schema says exactly what it accepts.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, Tag, ValidationError,
                      WrapValidator, model_validator)

from mili.sampling_params import SEED_RANGE
from mili.tokenizer.tokenizer import RESERVED_TEMPLATE_KWARGS

RUNTIME_MAXIMUM = "x-mili-maximum"  # in a field's JSON schema: a maximum only the running server knows
RUNTIME_ENUM = "x-mili-enum"  # ... and the values only it knows


def runtime_maximum(limit: str) -> dict:
    """``json_schema_extra`` for a bound the app fills in (``token_id``, ``max_tokens``, ``n``)."""
    return {RUNTIME_MAXIMUM: limit}


class Strict(BaseModel):
    """A request body whose unknown fields are a 400 naming them: nothing is silently ignored. Values are
    taken as the schema types them (no "5" for 5, no true for 1, no NaN)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class Open(BaseModel):
    """An object MILI passes on as sent (to the chat template, a grammar): other fields are allowed."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


def _on_field(value, handler):
    try:
        return handler(value)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise ValueError(f"{where + ': ' if where else ''}{err['msg']}") from None


def _as_sent(value, handler):
    _on_field(value, handler)
    return value


def _integral(value):
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _false(value: bool) -> bool:
    if value:
        raise ValueError("only false is supported")
    return value


# A field whose type is checked (and shown in the schema) as declared, an error inside it reported on the
# field itself (param "prompt", not "prompt.list[str].0"); AsSent also keeps the value as sent, key order and
# all (the chat template and the grammar builder read it).
OnField = WrapValidator(_on_field)
AsSent = WrapValidator(_as_sent)


def integer(**constraints):
    """An integer type with ``Field`` constraints; 3.0 is taken as 3 (JSON Schema counts it an integer),
    a "3" or a true is still refused."""
    return Annotated[int, Field(**constraints), BeforeValidator(_integral)]


def _integral_ids(value):
    """``_integral`` over a list of ids, after one C pass that finds none is a float (the usual case: this
    runs per request over every prompt token, where a validator per item costs a Python call each)."""
    if isinstance(value, list) and float in set(map(type, value)):
        return [_integral(v) for v in value]
    return value


def token_ids(**constraints):
    """A list of token ids (each an integer in [0, vocabulary), 3.0 taken as 3) with ``Field`` constraints."""
    item = Annotated[int, Field(ge=0, json_schema_extra=runtime_maximum("token_id"))]
    return Annotated[list[item], Field(**constraints), BeforeValidator(_integral_ids)]
Text = Annotated[str, Field(min_length=1)]
# 64-bit bounds as < 2**63 (the document's numbers are floats: 2**63 - 1 is not one)
Count = integer(ge=0, lt=2**63)  # a count or an id
MaxTokens = integer(ge=1, json_schema_extra=runtime_maximum("max_tokens"))
Seed = integer(ge=SEED_RANGE[0], lt=SEED_RANGE[1] + 1)
TopK = integer(ge=-1, lt=2**63, description="-1 or 0: off")
TemplateKwargs = Annotated[dict[str, Any], Field(
    description='e.g. {"enable_thinking": false}',
    json_schema_extra={"propertyNames": {"not": {"enum": sorted(RESERVED_TEMPLATE_KWARGS)}}})]
OnlyFalse = Annotated[bool, AfterValidator(_false), Field(json_schema_extra={"const": False})]
Logprobs = integer(ge=0, le=20)
ModelName = Annotated[str, Field(description="the served model's name (another is a 404)",
                                 json_schema_extra={RUNTIME_ENUM: "model"})]


def only_types(*types: str, default: str | None = None) -> BeforeValidator:
    """For a field holding a list of typed items (a union): the first item whose ``type`` is not one of
    ``types`` (``default``: the type of an item without one) is an error naming it, not lost in the
    errors of every branch of the union."""
    def check(items: Any) -> Any:
        for item in items if isinstance(items, list) else []:
            kind = item.get("type", default) if isinstance(item, dict) else None
            if kind not in types:
                raise ValueError(f"items of type {kind!r} are not supported (MILI takes {', '.join(types)})")
        return items

    return BeforeValidator(check)


def requires(field: str, when: dict, then: dict) -> dict:
    """A rule between two fields, in JSON Schema: when ``field`` is present and matches ``when``, ``then``."""
    return {"if": {"properties": {field: when}, "required": [field]}, "then": then}


def _type_needs(schema: dict, model: type[TypeNeeds]) -> None:
    kind, field, field_schema = model.needs
    schema.setdefault("allOf", []).append(
        requires("type", {"const": kind}, {"properties": {field: field_schema}, "required": [field]}))


class TypeNeeds(Strict):
    """An object one of whose ``type`` values needs another field: ``needs`` = (that type, the field as sent,
    its schema); checked, and stated in the schema."""

    model_config = ConfigDict(json_schema_extra=_type_needs)
    needs: ClassVar[tuple[str, str, dict]]

    @model_validator(mode="after")
    def _needed(self):
        kind, field, _ = self.needs
        name = next(n for n, f in type(self).model_fields.items() if (f.alias or n) == field)
        if self.type == kind and getattr(self, name) is None:
            raise ValueError(f"{field} is required when type is {kind}")
        return self


BRANCH_TAGS: set[str] = set()  # the tags of unions told apart by a discriminator (not part of a field's location)


def branch(name: str) -> Tag:
    """The tag of a union's branch (with a callable ``Discriminator``): an error names the field without it."""
    BRANCH_TAGS.add(name)
    return Tag(name)
