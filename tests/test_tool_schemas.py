"""Tool schemas a hostile or careless client sends: `$defs` / `$ref` served under every tool_choice (the `required`
wrapper rebases each tool's references), recursion that has no finite value refused with a 400 naming the tool
(and recursion that has one compiled), nesting bounded, names checked against OpenAI's rule, strict arguments
matched in linear time (the same verdicts as `jsonschema`, the backtracking twin, on small inputs), and a forced
call whose output is not a call returned as text instead of a 500."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import pytest

from dspark.json_schema import MAX_DEPTH, check_schema, matches, rebase
from dspark.server.config import ServerConfig
from dspark.server.tools import ToolMode, tool_constraint
from dspark.structured import GrammarCompiler
from server_harness import CharTokenizer, ScriptedTarget, build_tiny_model, make_engine, serve

TOK = CharTokenizer()
MESSAGES = [{"role": "user", "content": "weather?"}]
PROMPT = TOK.apply_chat_template(MESSAGES)
EOS = 2
LOC = {"$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                         "required": ["city"], "additionalProperties": False}},
       "type": "object", "properties": {"where": {"$ref": "#/$defs/Loc"}}, "required": ["where"],
       "additionalProperties": False}
TREE = {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["v", "kids"], "additionalProperties": False}
NO_VALUE = [{"$ref": "#"},
            {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
            {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"allOf": [{"$ref": "#/$defs/A"}]}}, "$ref": "#/$defs/A"},
            {"type": "array", "minItems": 1, "items": {"$ref": "#"}}]


def _tool(name: str, params: dict, **kw) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": params, **kw}}


def _request(tools, choice):
    functions = [SimpleNamespace(function=SimpleNamespace(**t["function"])) for t in tools]
    return SimpleNamespace(tools=functions, tool_choice=choice)


class _Refused(Exception):
    def __init__(self, message, param):
        super().__init__(message)
        self.param = param


def _constraint(tools, choice):
    return tool_constraint(_request(tools, choice), _Refused, auto_tools=True)


def _accepts(spec: dict, text: str) -> bool:
    """Does the request's grammar (compiled for the char tokenizer) take `text` whole?"""
    matcher = GrammarCompiler.for_tokenizer(TOK, vocab_size=TOK.vocab_size, eos_token_ids=(EOS,)).matcher(spec)
    ids = TOK.encode(text)
    return matcher.valid_prefix(ids) == len(ids)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get"}}])
def test_refs_resolve_whatever_wraps_the_parameters(choice):
    spec, mode = _constraint([_tool("other", TREE), _tool("get", LOC)], choice)
    args = {"where": {"city": "Paris"}}
    text = json.dumps({"name": "get", "arguments": args} if mode.name is None else args, separators=(",", ":"))
    assert _accepts(spec, text)
    assert not _accepts(spec, text.replace("Paris", "Paris, France"))  # Loc's maxLength still applies
    if mode.name is None:  # the other tool's "#" is its own root, not the wrapper
        tree = json.dumps({"name": "other", "arguments": {"v": 1, "kids": [{"v": 2, "kids": []}]}}, separators=(",", ":"))
        assert _accepts(spec, tree)
        assert not _accepts(spec, tree.replace('"kids":[]', '"kids":[{"name":"get"}]'))
    assert [c["function"]["name"] for c in mode.calls(text)] == ["get"]


def test_rebase_rewrites_local_references_only():
    schema = {"properties": {"a": {"$ref": "#/$defs/L"}, "b": {"$ref": "#"}}, "const": {"$ref": "#"}}
    assert rebase(schema, "#/$defs/t0") == {"properties": {"a": {"$ref": "#/$defs/t0/$defs/L"},
                                                           "b": {"$ref": "#/$defs/t0"}}, "const": {"$ref": "#"}}


@pytest.mark.parametrize("schema", NO_VALUE)
def test_a_schema_with_no_finite_value_is_refused(schema):
    with pytest.raises(ValueError, match="admits no finite value"):
        check_schema(schema)
    for choice in ("required", "auto", "none", {"type": "function", "function": {"name": "f"}}):
        with pytest.raises(_Refused, match=r"tools\[1\]\.function\.parameters \(f\)") as e:
            _constraint([_tool("ok", LOC), _tool("f", schema)], choice)
        assert e.value.param == "tools[1].function.parameters"


@pytest.mark.parametrize("schema", [TREE, {"$defs": {"A": {"anyOf": [{"$ref": "#/$defs/A"}, {"type": "null"}]}},
                                           "$ref": "#/$defs/A"}, {"type": "object", "properties": {"a": {"$ref": "#"}}}])
def test_recursion_with_a_way_out_compiles(schema):
    check_schema(schema)
    spec, _ = _constraint([_tool("f", schema)], "required")
    assert _accepts(spec, json.dumps({"name": "f", "arguments": None if "$defs" in schema else
                                      {"v": 1, "kids": []} if schema is TREE else {}}, separators=(",", ":")))


@pytest.mark.parametrize("schema,message", [
    ({"$ref": "https://example.com/s.json"}, "only references inside the schema"),
    ({"properties": {"a": {"$ref": "#/$defs/Missing"}}}, "points at nothing"),
])
def test_references_outside_the_schema_are_refused(schema, message):
    with pytest.raises(ValueError, match=message):
        check_schema(schema)


def test_nesting_is_bounded():
    deep = {"type": "string"}
    for _ in range(MAX_DEPTH + 1):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ValueError, match="nested deeper"):
        check_schema(deep)
    for _ in range(MAX_DEPTH * 10):  # a schema far past any stack: refused the same way, no RecursionError
        deep = {"type": "array", "items": deep}
    with pytest.raises(ValueError, match="nested deeper"):
        check_schema(deep)


@pytest.mark.parametrize("name", ["", "a b", "get\nweather", "</tool_call>", "x" * 65, "名前", "a.b"])
def test_tool_names_follow_openais_rule(name):
    with pytest.raises(_Refused, match="must be 1 to 64") as e:
        _constraint([_tool("fine_name-1", LOC), _tool(name, LOC)], "required")
    assert e.value.param == "tools[1].function.name"
    _constraint([_tool("x" * 64, LOC), _tool("A-b_9", LOC)], "required")
    with pytest.raises(_Refused, match="names another tool"):
        _constraint([_tool("same", LOC), _tool("same", TREE)], "required")


PATTERN = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(a+)+$"}}, "required": ["s"]}
VERDICTS = [  # (schema, arguments text): matches() must agree with jsonschema on each
    (PATTERN, '{"s": "aaaa"}'), (PATTERN, '{"s": "aaab"}'), (PATTERN, '{"s": ""}'), (PATTERN, '{"s": 1}'),
    (PATTERN, ' {"s" : "a"} '), (LOC, '{"where": {"city": "Oslo"}}'), (LOC, '{"where": {"city": "Ouagadougou"}}'),
    (LOC, '{"where": {}}'), (LOC, '{"where": {"city": "Oslo"}, "x": 1}'), (TREE, '{"v": 1, "kids": [{"v": 2, "kids": []}]}'),
    (TREE, '{"v": 1, "kids": [{"v": "2", "kids": []}]}'), ({"type": "object"}, "[]"), ({"type": "object"}, "{"),
    ({"type": "integer", "minimum": 3}, "2"), ({"type": "integer", "minimum": 3}, "3"),
]


@pytest.mark.parametrize("schema,text", VERDICTS)
def test_strict_matching_agrees_with_the_backtracking_twin(schema, text):
    try:
        jsonschema.validate(json.loads(text), schema)
        expected = True
    except (jsonschema.ValidationError, ValueError):
        expected = False
    assert matches(schema, text) == expected


def test_a_catastrophic_pattern_costs_linear_time():
    """`^(a+)+$` against a's then '!': a backtracking matcher takes 2^n steps (n = 30 would take minutes, n = 100
    000 forever); the derivative-based one answers at once."""
    assert not matches(PATTERN, json.dumps({"s": "a" * 100_000 + "!"}))
    assert matches(PATTERN, json.dumps({"s": "a" * 100_000}))


def test_a_forced_call_that_is_not_one_is_text_not_an_error():
    deep = "[" * 5000 + "]" * 5000  # valid JSON past Python's parser's depth
    assert ToolMode("f").calls(deep) is None
    assert ToolMode(None).calls('{"name": "f"}') is None
    assert ToolMode("f").calls('{"a": 1}')[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}


def _server(script: str):
    target = ScriptedTarget(build_tiny_model(), len(PROMPT), TOK.encode(script) + [EOS])
    return serve(make_engine(target), config=ServerConfig(enable_auto_tool_choice=True, tool_call_parser="hermes"))


def test_through_the_server():
    """$defs under `required` answers with the call; a value-less schema, a bad name and a recursive response_format
    are 400s naming the field, whole and streamed; a strict tool with a catastrophic pattern turns a call whose
    arguments do not match into content."""
    call = '{"name":"get","arguments":{"where":{"city":"Paris"}}}'
    with _server(call) as srv:
        client = srv.client()
        reply = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[_tool("get", LOC)],
                                               tool_choice="required", temperature=0.0, max_tokens=80).choices[0]
        assert reply.finish_reason == "tool_calls"
        assert json.loads(reply.message.tool_calls[0].function.arguments) == {"where": {"city": "Paris"}}
        for stream in (False, True):
            for tools, fields, param in (
                    ([_tool("rec", {"$ref": "#"}, strict=True)], {"tool_choice": {"type": "function",
                                                                               "function": {"name": "rec"}}},
                     "tools[0].function.parameters"),
                    ([_tool("bad name", LOC)], {"tool_choice": "required"}, "tools[0].function.name"),
                    (None, {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {
                        "$ref": "#"}}}}, "response_format")):
                body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8, "stream": stream, **fields}
                if tools:
                    body["tools"] = tools
                resp = srv.post("/v1/chat/completions", json=body)
                assert resp.status_code == 400, resp.text
                assert resp.json()["error"]["param"] == param
    bad = '<tool_call>{"name": "p", "arguments": {"s": "' + "a" * 30 + '!"}}</tool_call>'
    with _server(bad) as srv:
        reply = srv.client().chat.completions.create(model="tiny", messages=MESSAGES,
                                                     tools=[_tool("p", PATTERN, strict=True)], temperature=0.0,
                                                     max_tokens=100).choices[0]
        assert reply.message.content == bad and not reply.message.tool_calls


@pytest.mark.parametrize("pattern,refused", [("^a{100000}$", True), ("^(x{1,1001})$", True), ("^(?=a{5000})a$", True),
                                             ("^\\d{4}-\\d{2}-\\d{2}$", False), ("^[a-z]{1,1000}$", False),
                                             ("^x{2,}$", False)])
def test_counted_repetitions_are_bounded(pattern, refused):
    """A mask's cost grows with a pattern's repeat count (`a{100000}`: tens of ms a step on the engine thread every
    request waits for), so counts past MAX_REPEAT_COUNT are refused wherever a pattern comes in."""
    from dspark.structured import check_spec
    specs = [{"json": {"type": "string", "pattern": pattern}}, {"regex": pattern},
             {"json": {"type": "object", "patternProperties": {pattern: {"type": "integer"}}}}]
    for spec in specs:
        if refused:
            with pytest.raises(ValueError, match="repeats a part"):
                check_spec(spec)
        else:
            check_spec(spec)
    if refused:
        with pytest.raises(_Refused, match=r"tools\[0\]\.function\.parameters"):
            _constraint([_tool("f", {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}})],
                        "required")
