"""Constraints and checks shared by the grammar tests."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import jsonschema

#: nested object, enum, bounded integer, bounded strings, an array with maxItems
PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 16},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "address", "tags"],
    "additionalProperties": False,
}
PERSON_PROMPT = "Describe a person (name, age, favourite color, address, tags) as JSON."

REGEX = r"(yes|no), because [a-z ]{1,30}\."
REGEX_PROMPT = "Is the sky blue? Answer yes or no and say why."

#: a context-free grammar (``object`` nests), in GBNF syntax
EBNF = "\n".join([
    'root ::= subject " " verb " " object "."',
    'subject ::= "The cat" | "A dog" | "My friend"',
    'verb ::= "likes" | "sees" | "eats"',
    'object ::= "fish" | "the ball" | "(" object " and " object ")"',
])
EBNF_PROMPT = "Write one short sentence about an animal."


def without_bounds(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` less integer minimum/maximum (outlines-core does not enforce them)."""
    schema = copy.deepcopy(schema)
    for prop in schema["properties"].values():
        prop.pop("minimum", None)
        prop.pop("maximum", None)
    return schema


def check_json(text: str, schema: dict[str, Any]) -> Any:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


def check_regex(text: str) -> None:
    assert re.fullmatch(REGEX, text), text


def check_ebnf(text: str) -> None:
    """Parse ``text`` with :data:`EBNF`'s grammar (recursive descent)."""
    m = re.match(r"(The cat|A dog|My friend) (likes|sees|eats) ", text)
    assert m, text
    rest = _object(text[m.end():])
    assert rest == ".", text


def _object(s: str) -> str:
    for word in ("fish", "the ball"):
        if s.startswith(word):
            return s[len(word):]
    assert s.startswith("("), s
    s = _object(s[1:])
    assert s.startswith(" and "), s
    s = _object(s[5:])
    assert s.startswith(")"), s
    return s[1:]
