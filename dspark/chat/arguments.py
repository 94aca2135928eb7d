"""Argument values typed by the request's tool schema, for the formats that write values as text.

Qwen3-Coder and Qwen3.5 (`qwen3_coder`) write every parameter value as raw text; their own parser converts each
by the type the tool declares for that parameter, and so does this module: a `string` parameter stays the text
as written (`{"a": 1}`, `42`, `true` and `null` included), `integer`, `number`, `boolean`, `null`, `object` and
`array` are parsed and kept only where the text is a value of that type (else the text: a strict tool's check
then refuses the call), a parameter the tool does not declare stays a string, and one declared without a type
(`{}`) is JSON where the text is JSON other than a string. Gemma 4 (`gemma4`) delimits strings itself; there a
string written for a number, integer or boolean parameter is read as one, and a bare number or boolean written
for a string parameter becomes its text.

The declared types of a parameter come from its `type` (a name or a list), its `enum`/`const` values, and the
branches of `anyOf`/`oneOf`/`allOf`, following local `$ref`s ("#/...") into the tool's parameters.
"""

from __future__ import annotations

import ast
import json
import math

_JSON_TYPES = ("null", "boolean", "integer", "number", "array", "object")  # tried in this order; string last
_MAX_DEPTH = 8  # $ref and branch nesting followed this far


def parameter_schemas(tools: dict[str, dict] | None, name: str) -> dict[str, dict] | None:
    """The declared parameters of tool `name` (property name -> schema); None where the tool is unknown or
    declares no properties (then nothing is typed)."""
    params = (tools or {}).get(name)
    props = params.get("properties") if isinstance(params, dict) else None
    return props if isinstance(props, dict) and props else None


def declared_types(schema, root: dict | None = None, depth: int = 0) -> set[str]:
    """The JSON types a parameter's schema admits ("number" admits integers too); empty: any type."""
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return set()
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and root is not None:
        return declared_types(_resolve(root, ref), root, depth + 1)
    types: set[str] = set()
    kind = schema.get("type")
    for t in ([kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []):
        if isinstance(t, str):
            types.add(t)
    values = list(schema.get("enum") or []) + ([schema["const"]] if "const" in schema else [])
    types.update(_type_of(v) for v in values)
    for key in ("anyOf", "oneOf", "allOf"):
        for branch in schema.get(key) or []:
            branch_types = declared_types(branch, root, depth + 1)
            if not branch_types:  # a branch of any type: the parameter may be anything
                return set()
            types |= branch_types
    return types


def typed_value(text: str, schema, root: dict | None = None):
    """A qwen3_coder parameter's raw text as the value its declared schema asks for (see the module docstring);
    `schema` None: an undeclared parameter, kept as text."""
    if schema is None:
        return text
    types = declared_types(schema, root)
    if not types:
        return _json_or_text(text)
    for kind in _JSON_TYPES:
        if kind in types:
            value = _read_as(kind, text.strip())
            if value is not _NOT:
                return value
    return text


def retyped(value, schema, root: dict | None = None):
    """A gemma4 value re-read by its parameter's schema: a string for a number, integer, boolean or null
    parameter read as one where it is one; a bare number or boolean for a string-only parameter as its text."""
    if schema is None:
        return value
    types = declared_types(schema, root)
    if isinstance(value, str) and types and "string" not in types:
        return typed_value(value, schema, root)
    if types == {"string"} and (isinstance(value, (bool, int, float))):
        return json.dumps(value)
    return value


class _Not:
    pass


_NOT = _Not()  # "not a value of this type"


def _read_as(kind: str, text: str):
    if kind == "null":
        return None if text == "null" else _NOT
    if kind == "boolean":
        return {"true": True, "false": False}.get(text.lower(), _NOT)
    if kind in ("integer", "number"):
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            return _NOT
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return _NOT
        if kind == "integer":
            return value if isinstance(value, int) else int(value) if value.is_integer() else _NOT
        return value
    value = _container(text)
    return value if isinstance(value, dict if kind == "object" else list) else _NOT


def _container(text: str):
    """JSON, or a Python literal (a model may write `{'a': 1}`) that is JSON-serialisable; _NOT otherwise."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        pass
    try:
        value = ast.literal_eval(text)
        json.dumps(value, allow_nan=False)
        return value
    except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
        return _NOT


def _json_or_text(text: str):
    try:
        value = json.loads(text)
        json.dumps(value, allow_nan=False)  # NaN, Infinity and 1e999 read as floats but are not JSON
    except (ValueError, RecursionError):
        return text
    return text if isinstance(value, str) else value


def _type_of(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(value), "string")


def _resolve(root: dict, ref: str):
    node = root
    for part in ref.lstrip("#").split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
