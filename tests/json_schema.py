"""A small JSON Schema (draft 2020-12) checker for the keywords shardwise's config schema uses, so the tests
need no `jsonschema` package. `KEYWORDS` lists what it checks and `ANNOTATIONS` what it ignores; a schema
with any other keyword is refused, so nothing in it goes unchecked."""

from __future__ import annotations

import math
import re
from typing import Any

KEYWORDS = {"type", "enum", "const", "anyOf", "properties", "additionalProperties", "required", "items",
            "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "pattern"}
ANNOTATIONS = {"$schema", "title", "description", "default", "examples"}


def unknown_keywords(schema: Any, path: str = "$") -> list[str]:
    if not isinstance(schema, dict):
        return []
    found = [f"{path}: {key}" for key in schema if key not in KEYWORDS | ANNOTATIONS]
    for key, sub in schema.get("properties", {}).items():
        found += unknown_keywords(sub, f"{path}.{key}")
    for i, sub in enumerate(schema.get("anyOf", [])):
        found += unknown_keywords(sub, f"{path}|{i}")
    for key in ("items", "additionalProperties"):
        found += unknown_keywords(schema.get(key), f"{path}[{key}]")
    return found


def _is_type(value: Any, kind: str) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return {"null": value is None, "boolean": isinstance(value, bool), "string": isinstance(value, str),
            "object": isinstance(value, dict), "array": isinstance(value, list), "number": number,
            "integer": number and (isinstance(value, int) or (math.isfinite(value) and value.is_integer()))}[kind]


def json_equal(a: Any, b: Any) -> bool:
    """JSON equality: 1 equals 1.0, true never equals 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if _is_type(a, "number") and _is_type(b, "number"):
        return a == b
    return type(a) is type(b) and a == b


def errors(value: Any, schema: dict[str, Any], path: str = "$") -> list[str]:
    """What is wrong with `value` under `schema` (empty when it is valid)."""
    kinds = schema.get("type")
    if kinds is not None and not any(_is_type(value, k) for k in ([kinds] if isinstance(kinds, str) else kinds)):
        return [f"{path}: {value!r} is not of type {kinds}"]
    if "enum" in schema and not any(json_equal(value, option) for option in schema["enum"]):
        return [f"{path}: {value!r} is not one of {schema['enum']}"]
    if "const" in schema and not json_equal(value, schema["const"]):
        return [f"{path}: {value!r} is not {schema['const']!r}"]
    if "anyOf" in schema:
        tried = [errors(value, branch, path) for branch in schema["anyOf"]]
        if all(tried):
            return [f"{path}: no alternative matches ({'; '.join(e[0] for e in tried)})"]
    found = _number_errors(value, schema, path)
    if isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"], value):
        found.append(f"{path}: {value!r} does not match {schema['pattern']}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            found += errors(item, schema["items"], f"{path}[{i}]")
    if isinstance(value, dict):
        found += _object_errors(value, schema, path)
    return found


def _number_errors(value: Any, schema: dict[str, Any], path: str) -> list[str]:
    if not _is_type(value, "number"):
        return []
    checks = {"minimum": lambda b: value >= b, "maximum": lambda b: value <= b,
              "exclusiveMinimum": lambda b: value > b, "exclusiveMaximum": lambda b: value < b}
    return [f"{path}: {value!r} fails {name} {schema[name]}" for name, ok in checks.items()
            if name in schema and not ok(schema[name])]


def _object_errors(value: dict[str, Any], schema: dict[str, Any], path: str) -> list[str]:
    found = [f"{path}: {key!r} is required" for key in schema.get("required", []) if key not in value]
    properties, extra = schema.get("properties", {}), schema.get("additionalProperties", True)
    for key, item in value.items():
        if key in properties:
            found += errors(item, properties[key], f"{path}.{key}")
        elif extra is False:
            found.append(f"{path}.{key}: not allowed (unknown key)")
        elif isinstance(extra, dict):
            found += errors(item, extra, f"{path}.{key}")
    return found
