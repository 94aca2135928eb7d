"""JSON schemas that come with requests (`response_format`, structured outputs, tool parameters): checked before
anything is compiled or generated, moved under a wrapper without breaking their references, and matched
against a text in time linear in its length.

* `check_schema`: nested at most `MAX_DEPTH` levels, references local (`#...`) and resolvable, every schema
  a reference reaches admits a finite value (`{"$ref": "#"}`, or an object that requires itself, admits none:
  a grammar for it could only end the output or nest until `max_tokens`), and no pattern repeats a part more
  than `MAX_REPEAT_COUNT` times (`check_pattern`: a mask's cost grows with the count). ValueError names what is
  wrong.
* `rebase`: a schema's local references rewritten for its new place under a wrapper (`#` → `#/$defs/t0`), so
  a tool's `$defs` still resolve once its parameters sit inside the `required` tool call's schema.
* `matches`: does a JSON text match a schema? llguidance's matcher over a byte vocabulary (derivative-based
  regular expressions: a pattern such as `^(a+)+$` costs linear time, where a backtracking `re` takes time
  exponential in the text).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Iterator

MAX_DEPTH = 64  # schema nesting accepted from a request (real tool schemas stay under ~10)
# a counted repetition in a pattern ({n} / {n,m}) past this: llguidance's masks cost time linear in the count
# (~45 ms a step at 100 000) on the engine thread every request's step waits for
MAX_REPEAT_COUNT = 1000
DATA_KEYWORDS = ("const", "enum", "default", "examples")  # values, not schemas: never walked or rewritten


def _children(node: dict) -> Iterator[tuple[str, Any]]:
    """(pointer token, subschema) of every schema directly inside `node` (a dict schema)."""
    for key, value in node.items():
        if key in DATA_KEYWORDS:
            continue
        if isinstance(value, dict):
            if key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
                for name, sub in value.items():
                    yield f"{_escape(key)}/{_escape(name)}", sub
            else:
                yield _escape(key), value
        elif isinstance(value, list) and key in ("allOf", "anyOf", "oneOf", "prefixItems", "items"):
            for i, sub in enumerate(value):
                yield f"{key}/{i}", sub


def _escape(token: str) -> str:
    return str(token).replace("~", "~0").replace("/", "~1")


def _walk(schema: Any) -> dict[str, Any]:
    """Every subschema by its JSON pointer ("" for the root); ValueError past MAX_DEPTH levels."""
    nodes: dict[str, Any] = {}
    stack = [("", schema, 0)]
    while stack:
        pointer, node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"schema nested deeper than {MAX_DEPTH} levels (at {_where(pointer)})")
        nodes[pointer] = node
        if isinstance(node, dict):
            stack.extend((f"{pointer}/{token}", sub, depth + 1) for token, sub in _children(node))
    return nodes


def _where(pointer: str) -> str:
    """A pointer as an error message shows it: '#' for the root, at most 80 characters."""
    where = f"#{pointer}"
    return where if len(where) <= 80 else f"{where[:38]}...{where[-38:]}"


def _target(ref: Any, where: str, nodes: dict[str, Any]) -> str:
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise ValueError(f"$ref {str(ref)[:80]!r} at {_where(where)}: only references inside the schema (#...) "
                         "are supported")
    pointer = ref[1:]
    if pointer not in nodes:
        raise ValueError(f"$ref {ref[:80]!r} at {_where(where)} points at nothing in the schema")
    return pointer


def check_pattern(pattern: str, where: str = "pattern") -> None:
    """ValueError where a regular expression repeats a part a counted number of times past MAX_REPEAT_COUNT
    (`a{100000}`); a pattern Python's parser does not read is left to the grammar compiler."""
    import re._constants as sre
    import re._parser

    try:
        items = [re._parser.parse(pattern)]
    except (re.error, RecursionError, OverflowError, ValueError):
        return
    repeats = (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT)
    while items:
        for op, arg in items.pop():
            if op in repeats:
                low, high, sub = arg
                count = max(low, 0 if high == sre.MAXREPEAT else high)
                if count > MAX_REPEAT_COUNT:
                    raise ValueError(f"{where} repeats a part {count} times; at most {MAX_REPEAT_COUNT}")
                items.append(sub)
            elif op == sre.SUBPATTERN:
                items.append(arg[-1])
            elif op == sre.BRANCH:
                items.extend(arg[1])
            elif op in (sre.ASSERT, sre.ASSERT_NOT):
                items.append(arg[1])


def check_schema(schema: Any) -> None:
    """ValueError where `schema` is nested too deep, has a reference that is not local or resolves to nothing,
    has a part that admits no finite value (a reference cycle with no way out), or a pattern that repeats a part
    too many times (`check_pattern`)."""
    nodes = _walk(schema)
    for pointer, node in nodes.items():
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                check_pattern(node["pattern"], f"the pattern at {_where(pointer)}")
            for key in node.get("patternProperties") or {} if isinstance(node.get("patternProperties"), dict) else {}:
                check_pattern(key, f"a patternProperties key at {_where(pointer)}")
    refs = {p: _target(n["$ref"], p, nodes) for p, n in nodes.items() if isinstance(n, dict) and "$ref" in n}
    # least fixpoint: a schema admits a value when what it requires does (children first, then the cycles)
    order = sorted(nodes, key=lambda p: -p.count("/"))
    admits: set[str] = set()
    changed = True
    while changed:
        changed = False
        for p in order:
            if p not in admits and _admits(p, nodes[p], refs, admits):
                admits.add(p)
                changed = True
    empty = [p for p in refs if p not in admits] or ([""] if "" not in admits else [])
    if empty:
        raise ValueError(f"the schema at {_where(empty[0])} admits no finite value (a $ref cycle with no way out)")


def _admits(pointer: str, node: Any, refs: dict[str, str], admits: set[str]) -> bool:
    """Does `node` admit a value, given the subschemas known to (`admits`)? Only what forces a subschema's value
    counts: references, allOf / anyOf / oneOf, required properties and items an array must have."""
    if node is False:
        return False
    if not isinstance(node, dict):
        return True

    def ok(token: str) -> bool:
        return f"{pointer}/{token}" in admits
    if pointer in refs and refs[pointer] not in admits:
        return False
    if not all(ok(f"allOf/{i}") for i in range(len(node.get("allOf") or []))):
        return False
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and not any(ok(f"{key}/{i}") for i in range(len(node[key]))):
            return False
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    for name in node.get("required") or []:
        if isinstance(name, str) and name in properties and not ok(f"properties/{_escape(name)}"):
            return False
    min_items = node.get("minItems", 0) if isinstance(node.get("minItems", 0), int) else 0
    if min_items > 0:
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
        if not all(ok(f"prefixItems/{i}") for i in range(min(min_items, len(prefix)))):
            return False
        if min_items > len(prefix) and isinstance(node.get("items"), (dict, bool)) and not ok("items"):
            return False
    return True


def rebase(schema: Any, base: str) -> Any:
    """`schema` with every local reference `#X` rewritten to `base` + X (`base`: the JSON pointer reference of
    where the schema will sit, e.g. "#/$defs/t0"); data keywords (const, enum, ...) are left as they are."""
    if isinstance(schema, list):
        return [rebase(v, base) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        elif key in DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = rebase(value, base)
    return out


def matches(schema: dict, text: str) -> bool:
    """Does the JSON `text` (any whitespace between tokens) match `schema`? Linear in the text's length."""
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": True})
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    if matcher.is_error():
        raise ValueError(matcher.get_error())
    data = text.strip().encode()  # whitespace around the value is JSON's too
    return (bool(data) and matcher.try_consume_tokens(list(data)) == len(data) and not matcher.is_error()
            and matcher.is_accepting())


@lru_cache(maxsize=1)
def _byte_tokenizer():
    """llguidance's tokenizer over the 256 bytes (token i = byte i) and an end token (256)."""
    import llguidance

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(BytesVocab([bytes([i]) for i in range(256)] + [b""],
                                                                          256)), n_vocab=257, eos_token=[256])


class BytesVocab:
    """llguidance's tokenizer protocol over a plain list of token byte strings."""

    def __init__(self, tokens: list[bytes], eos_token_id: int):
        self.tokens = tokens
        self.eos_token_id = eos_token_id
        self.bos_token_id = None
        self.special_token_ids = [i for i, t in enumerate(tokens) if not t]
        self._by_bytes = {t: i for i, t in enumerate(tokens) if len(t) == 1}

    def __call__(self, text: bytes) -> list[int]:
        return [self._by_bytes[bytes([b])] for b in text if bytes([b]) in self._by_bytes]
