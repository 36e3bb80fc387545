"""Hypothesis strategies from JSON Schema, for the subset FastAPI's OpenAPI documents use:
$ref into components, anyOf, const/enum, object (properties, required, additionalProperties),
array (items, minItems, maxItems), string (minLength, maxLength), integer and number (bounds,
exclusive bounds), boolean, null. Strings range over all of Unicode, lone surrogates included
(what a JSON body can carry). Anything else in a schema raises, so a schema the fuzz cannot
follow is noticed, never skipped. One string in four is drawn from a hostile alphabet.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

TEXT = st.characters(exclude_categories=())  # every code point, surrogates included
HOSTILE = st.sampled_from(["\ud800", "\udfff", "\x00", "\u202e", "\ufffd", "\U0010ffff"])
KEYS = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12)
ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(KEYS, inner, max_size=2),
    max_leaves=4,
)
_IGNORED = {"title", "description", "default", "examples", "discriminator", "format"}


def from_schema(schema: dict[str, Any], root: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values valid under `schema`; `root` is the OpenAPI document its $refs point into."""
    if "$ref" in schema:
        path = schema["$ref"].removeprefix("#/").split("/")
        target: Any = root
        for part in path:
            target = target[part]
        return st.deferred(lambda: from_schema(target, root))
    if "anyOf" in schema or "oneOf" in schema:
        options = schema.get("anyOf") or schema["oneOf"]
        return st.one_of([from_schema(s, root) for s in options])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind is None and not set(schema) - _IGNORED:
        return ANY_JSON  # {}: anything
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        lo, hi = schema.get("minimum"), schema.get("maximum")
        if "exclusiveMinimum" in schema:
            lo = int(schema["exclusiveMinimum"]) + 1
        if "exclusiveMaximum" in schema:
            hi = int(schema["exclusiveMaximum"]) - 1
        return st.integers(None if lo is None else int(lo), None if hi is None else int(hi))
    if kind == "number":
        return st.floats(
            schema.get("minimum", schema.get("exclusiveMinimum")),
            schema.get("maximum", schema.get("exclusiveMaximum")),
            exclude_min="exclusiveMinimum" in schema,
            exclude_max="exclusiveMaximum" in schema,
            allow_nan=False,
            allow_infinity=False,
        )
    if kind == "string":
        size = {"min_size": schema.get("minLength", 0), "max_size": schema.get("maxLength", 60)}
        plain = st.text(st.characters(codec="utf-8"), **size)
        # one string in four mixes in what breaks encoders: lone surrogates, NUL, bidi, U+FFFD
        return st.one_of(plain, plain, plain, st.text(HOSTILE | TEXT, **size))
    if kind == "array":
        items = from_schema(schema.get("items", {}), root)
        return st.lists(
            items, min_size=schema.get("minItems", 0), max_size=schema.get("maxItems", 4)
        )
    if kind == "object":
        return _object(schema, root)
    raise ValueError(f"schema not understood by the fuzz strategies: {schema}")


def _object(schema: dict[str, Any], root: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    props = schema.get("properties", {})
    required = set(schema.get("required", ()))
    fixed = {k: from_schema(v, root) for k, v in props.items() if k in required}
    optional = {k: from_schema(v, root) for k, v in props.items() if k not in required}
    extra = schema.get("additionalProperties", True)
    base = st.fixed_dictionaries(fixed, optional=optional)
    if extra is False:
        return base
    values = ANY_JSON if extra is True else from_schema(extra, root)
    more = st.dictionaries(KEYS.filter(lambda k: k not in props), values, max_size=2)
    return st.builds(lambda a, b: {**b, **a}, base, more)
