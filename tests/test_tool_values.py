"""Tool-call values typed by the request's tool schema (`dspark/chat/arguments.py`) and the call layouts that
need the schema to read: for `qwen3_coder` (values written as text) a table per JSON type against the declared
type, whole and streamed at every split; `gemma4` strings and bare values re-read by the schema; markup inside a
value and a left-out `</parameter>` read with the tool's declared and required parameters.
Run: pytest tests/test_tool_values.py -q"""

import json

import pytest

from dspark.chat.arguments import declared_types, typed_value
from dspark.chat.tool_parsers import get_tool_parser

Q = '<|"|>'


def qwen_call(name, **values):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def tools_of(name, properties, required=(), **more):
    return {name: {"type": "object", "properties": properties, "required": list(required), **more}}


# (declared schema, raw text the model wrote, the value the call carries)
TYPING = [
    ({"type": "string"}, '{"name": "demo", "version": "1.0.0"}', '{"name": "demo", "version": "1.0.0"}'),
    ({"type": "string"}, "42", "42"),
    ({"type": "string"}, "true", "true"),
    ({"type": "string"}, "null", "null"),
    ({"type": "string"}, "[1, 2, 3]", "[1, 2, 3]"),
    ({"type": "string"}, '"quoted"', '"quoted"'),
    ({"type": "integer"}, "42", 42),
    ({"type": "integer"}, " -7 ", -7),
    ({"type": "integer"}, "4.0", 4),
    ({"type": "integer"}, "4.5", "4.5"),  # not an integer: the text (a strict tool then refuses the call)
    ({"type": "integer"}, "forty", "forty"),
    ({"type": "number"}, "1.5e3", 1500.0),
    ({"type": "number"}, "3", 3),
    ({"type": "number"}, "NaN", "NaN"),
    ({"type": "boolean"}, "true", True),
    ({"type": "boolean"}, "False", False),
    ({"type": "boolean"}, "yes", "yes"),
    ({"type": "null"}, "null", None),
    ({"type": "object"}, '{"k": [1, {"n": null}]}', {"k": [1, {"n": None}]}),
    ({"type": "object"}, "{'k': 1}", {"k": 1}),  # a Python literal, as models sometimes write
    ({"type": "object"}, "[1]", "[1]"),
    ({"type": "array"}, '[1, "a"]', [1, "a"]),
    ({"type": "array"}, '{"a": 1}', '{"a": 1}'),
    ({"type": ["integer", "null"]}, "null", None),
    ({"type": ["integer", "null"]}, "5", 5),
    ({"type": ["string", "null"]}, "null", None),
    ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, "12", 12),
    ({"enum": ["a", "b"]}, "a", "a"),
    ({"enum": [1, 2]}, "2", 2),
    ({"$ref": "#/$defs/Count"}, "9", 9),
    ({}, '{"a": 1}', {"a": 1}),  # declared without a type: JSON where it is JSON other than a string
    ({}, "Paris", "Paris"),
]


@pytest.mark.parametrize(("schema", "text", "value"), TYPING, ids=[f"{s}-{t}" for s, t, _ in TYPING])
def test_qwen3_coder_values_typed_by_the_declared_type(schema, text, value):
    tools = {"f": {"type": "object", "properties": {"v": schema}, "$defs": {"Count": {"type": "integer"}}}}
    output = qwen_call("f", v=text)
    parser = get_tool_parser("qwen3_coder")
    whole = parser.parse(output, tools=tools)
    assert [json.loads(c.arguments) for c in whole.calls] == [{"v": value}]
    got = json.loads(whole.calls[0].arguments)["v"]
    assert type(got) is type(value)
    for cut in range(len(output) + 1):  # streamed at every split, the same call
        state = parser.stream(tools)
        deltas = [state.feed(output[:cut]), state.feed(output[cut:]), state.finish()]
        entries = [e for d in deltas for e in d.tool_calls]
        assert [json.loads(e["function"]["arguments"]) for e in entries] == [{"v": value}], cut


def test_undeclared_parameter_and_unknown_tool_stay_text():
    tools = tools_of("f", {"a": {"type": "integer"}})
    parser = get_tool_parser("qwen3_coder")
    out = parser.parse(qwen_call("f", a="1", extra="2") + qwen_call("g", n="3"), tools=tools)
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("f", {"a": 1, "extra": "2"}),
                                                                        ("g", {"n": "3"})]


def test_declared_types():
    assert declared_types({"type": "string"}) == {"string"}
    assert declared_types({"oneOf": [{"type": "integer"}, {"const": None}]}) == {"integer", "null"}
    assert declared_types({"anyOf": [{"type": "integer"}, {}]}) == set()  # a branch of any type
    assert declared_types({"$ref": "#/$defs/X"}, {"$defs": {"X": {"type": "array"}}}) == {"array"}
    loop = {"$defs": {"X": {"$ref": "#/$defs/X"}}}
    assert declared_types({"$ref": "#/$defs/X"}, loop) == set()  # a reference loop ends
    assert typed_value("3", None) == "3"


def test_qwen3_coder_markup_in_a_value_with_the_tools_schema():
    """File content holding `</parameter>`, `<parameter=NAME>` (a name the tool does not admit, and a declared
    one given already) and `</tool_call>`: the value is the whole content, and the other argument keeps its own
    value."""
    tools = tools_of("write_file", {"path": {"type": "string"}, "content": {"type": "string"}}, ["path", "content"],
                     additionalProperties=False)
    content = ('Tags:\n</parameter>\n<parameter=mode>\nfast\n</parameter>\n<parameter=path>\n/etc/passwd\n'
               '</parameter>\n</tool_call>\nend')
    output = "Writing.\n" + qwen_call("write_file", path="notes.md", content=content) + "\nDone."
    parser = get_tool_parser("qwen3_coder")
    out = parser.parse(output, tools=tools)
    assert out.content == "Writing.\n\nDone."
    assert [json.loads(c.arguments) for c in out.calls] == [{"path": "notes.md", "content": content}]
    for size in (1, 3, 7, 64):
        state = parser.stream(tools)
        deltas = [state.feed(output[i:i + size]) for i in range(0, len(output), size)] + [state.finish()]
        assert "".join(d.content for d in deltas) == "Writing.\n\nDone."
        assert [json.loads(e["function"]["arguments"]) for d in deltas for e in d.tool_calls] == \
            [{"path": "notes.md", "content": content}]


def test_qwen3_coder_left_out_end_tag_before_a_required_parameter():
    tools = tools_of("f", {"a": {"type": "string"}, "b": {"type": "integer"}}, ["a", "b"])
    output = ("<tool_call>\n<function=f>\n<parameter=a>\nx\n<parameter=b>\n2\n</parameter>\n</function>\n"
              "</tool_call>")
    out = get_tool_parser("qwen3_coder").parse(output, tools=tools)
    assert [json.loads(c.arguments) for c in out.calls] == [{"a": "x", "b": 2}]
    # without the schema the well-formed reading stands: one value holding the tag
    out = get_tool_parser("qwen3_coder").parse(output)
    assert [json.loads(c.arguments) for c in out.calls] == [{"a": "x\n<parameter=b>\n2"}]


def test_gemma4_values_re_read_by_the_schema():
    tools = tools_of("f", {"n": {"type": "integer"}, "ok": {"type": "boolean"}, "s": {"type": "string"},
                           "any": {}})
    output = f"<|tool_call>call:f{{n:{Q}3{Q},ok:{Q}true{Q},s:42,any:{Q}7{Q},other:{Q}x{Q}}}<tool_call|>"
    out = get_tool_parser("gemma4").parse(output, tools=tools)
    assert [json.loads(c.arguments) for c in out.calls] == [{"n": 3, "ok": True, "s": "42", "any": "7",
                                                             "other": "x"}]
    out = get_tool_parser("gemma4").parse(output)  # no schema: as written
    assert [json.loads(c.arguments) for c in out.calls] == [{"n": "3", "ok": "true", "s": 42, "any": "7",
                                                             "other": "x"}]
