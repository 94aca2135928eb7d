"""Tool-call parsers (dspark/chat/tool_parsers.py): recorded model outputs parse to the expected content
and calls, malformed calls come back as content, and streaming any output in any split (every cut into
two pieces, one character at a time) gives the same content and calls as the whole-text parse.
Run: pytest tests/test_tool_parsers.py -q"""

import json
import re

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from dspark.chat.tool_parsers import (TOOL_PARSERS, ParsedOutput, StreamDelta, ToolParser,
                                        get_tool_parser)

SAME = "<the whole output, unchanged>"  # expected content: no call parsed, the text comes back as is
Q = '<|"|>'  # Gemma 4's string delimiter


def call(name, **arguments):
    return name, arguments


def hermes(name, arguments):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


WEATHER = hermes("get_weather", {"city": "Paris", "days": 3})
TIME = hermes("get_time", {})
BRACES = {"code": "def f(x):\n    return {'a': [x, {}]}", "pattern": "}{][", "nested": {"a": {"b": [1, {"c": "}"}]}}}


def qwen(name, **parameters):
    """A qwen3_coder block as the Qwen3-Coder / Qwen3.5 template writes it: each tag and value on its own
    lines; the values are given as the raw text the model writes."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


QWEN_WEATHER = qwen("get_weather", city="Paris", days="3")
QWEN_TIME = qwen("get_time")
# a value with blank lines, braces, `<`, `>` and `</parameter` without its `>`
QWEN_CODE = ("def f(x):\n    if x < 1 and x > -1:\n        return {'a': [x, {}]}\n\n"
             "    return '</parameter' + '}{'")
GEMMA_WEATHER = (f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},days:3,units:{{system:{Q}metric{Q}}},"
                 f"tags:[{Q}a{Q},{Q}b{Q}],exact:true}}<tool_call|>")
GEMMA_WEATHER_ARGS = {"city": "Paris", "days": 3, "units": {"system": "metric"}, "tags": ["a", "b"],
                      "exact": True}

# (parser, case, model output, expected content, expected calls)
CASES = [
    # hermes
    ("hermes", "single", WEATHER, None, [call("get_weather", city="Paris", days=3)]),
    ("hermes", "parallel", f"{WEATHER}\n{TIME}", None,
     [call("get_weather", city="Paris", days=3), call("get_time")]),
    ("hermes", "text before", f"Let me check the weather.\n{WEATHER}", "Let me check the weather.",
     [call("get_weather", city="Paris", days=3)]),
    ("hermes", "text between and after", f"First:\n{WEATHER}\nthen\n{TIME}\nDone.", "First:\n\nthen\n\nDone.",
     [call("get_weather", city="Paris", days=3), call("get_time")]),
    ("hermes", "brace-rich arguments", hermes("run", BRACES), None, [("run", BRACES)]),
    ("hermes", "arguments as a JSON string",
     '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}\n</tool_call>', None,
     [call("get_weather", city="Paris")]),
    ("hermes", "unicode", hermes("translate", {"text": "Zürich ☀ 東京"}), None,
     [call("translate", text="Zürich ☀ 東京")]),
    ("hermes", "malformed JSON",
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>', SAME, []),
    # EOS or a stop string right after a complete call: the call stands without its end marker
    ("hermes", "missing end marker", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {}}', "Sure.",
     [call("get_weather")]),
    ("hermes", "end marker cut by a stop string", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_',
     None, [call("f", a=1)]),
    ("hermes", "call cut short", '<tool_call>\n{"name": "f", "arguments": {"a": ', SAME, []),
    ("hermes", "end marker inside a string value",
     hermes("write_file", {"content": "a </tool_call> b\n</tool_call>"}) + "\nDone.", "Done.",
     [call("write_file", content="a </tool_call> b\n</tool_call>")]),
    ("hermes", "not a call object", '<tool_call>\n["get_weather", {"city": "Paris"}]\n</tool_call>', SAME, []),
    ("hermes", "no arguments key", '<tool_call>\n{"name": "get_time"}\n</tool_call>', SAME, []),
    ("hermes", "NaN argument", '<tool_call>\n{"name": "f", "arguments": {"x": NaN}}\n</tool_call>', SAME, []),
    ("hermes", "XML body (qwen3_coder syntax)",
     "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
     SAME, []),
    ("hermes", "one good call, one malformed",
     f'{WEATHER}\n<tool_call>\n{{"name": "get_time", "arguments": {{</tool_call>',
     '<tool_call>\n{"name": "get_time", "arguments": {</tool_call>', [call("get_weather", city="Paris", days=3)]),
    ("hermes", "plain text", "The capital of France is Paris.", SAME, []),
    ("hermes", "pieces of the end marker in the arguments", hermes("f", {"s": "</tool_cal </tool_ <//tool_call"}),
     None, [call("f", s="</tool_cal </tool_ <//tool_call")]),
    ("hermes", "text with marker-like pieces", "Compare a < b, use <tool> or <tool_cal and </tool_call>.", SAME, []),
    ("hermes", "empty", "", None, []),
    # qwen3_coder
    ("qwen3_coder", "single", QWEN_WEATHER, None, [call("get_weather", city="Paris", days=3)]),
    ("qwen3_coder", "parallel", f"{QWEN_WEATHER}\n{QWEN_TIME}", None,
     [call("get_weather", city="Paris", days=3), call("get_time")]),
    ("qwen3_coder", "text before", f"Let me check the weather.\n\n{QWEN_WEATHER}", "Let me check the weather.",
     [call("get_weather", city="Paris", days=3)]),
    ("qwen3_coder", "text between and after", f"First:\n{QWEN_WEATHER}\nthen\n{QWEN_TIME}\nDone.",
     "First:\n\nthen\n\nDone.", [call("get_weather", city="Paris", days=3), call("get_time")]),
    ("qwen3_coder", "multi-line value with braces and <", qwen("write_file", path="a.py", content=QWEN_CODE),
     None, [call("write_file", path="a.py", content=QWEN_CODE)]),
    ("qwen3_coder", "only one newline stripped each side", qwen("echo", text="\n  indented\n"), None,
     [call("echo", text="\n  indented\n")]),
    ("qwen3_coder", "typed values",
     qwen("f", i="-2", x="1.5e3", yes="true", no="false", none="null", obj='{"k": [1, {"n": null}]}',
          arr='[1, "a"]'),
     None, [call("f", i=-2, x=1500.0, yes=True, no=False, none=None, obj={"k": [1, {"n": None}]},
                 arr=[1, "a"])]),
    ("qwen3_coder", "values that stay text",
     qwen("f", quoted='"3"', word="Paris", phrase="3 apples", empty="", nan="NaN", huge="1e999", bad="{oops}"),
     None, [call("f", quoted='"3"', word="Paris", phrase="3 apples", empty="", nan="NaN", huge="1e999",
                 bad="{oops}")]),
    ("qwen3_coder", "no newlines, blanks between tags",
     "<tool_call><function=get_weather> <parameter=city>Paris</parameter>\t<parameter=days>3</parameter>"
     "</function></tool_call>", None, [call("get_weather", city="Paris", days=3)]),
    ("qwen3_coder", "unicode", qwen("translate", text="Zürich ☀ 東京"), None,
     [call("translate", text="Zürich ☀ 東京")]),
    ("qwen3_coder", "no function tag", "<tool_call>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",
     SAME, []),
    ("qwen3_coder", "unclosed function tag",
     "<tool_call>\n<function=get_weather\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
     SAME, []),
    ("qwen3_coder", "no </function>",
     "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>", SAME, []),
    ("qwen3_coder", "unclosed parameter",
     "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>", None,
     [call("get_weather", city="Paris")]),
    ("qwen3_coder", "missing </parameter> before the next",
     "<tool_call>\n<function=f>\n<parameter=a>\nx\n<parameter=b>\ny\n</function>\n</tool_call>",
     None, [call("f", a="x", b="y")]),
    ("qwen3_coder", "text between parameters",
     # a `</parameter>` that text follows is part of the value: the value runs to the one that ends it
     "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\nand\n<parameter=b>\n2\n</parameter>\n"
     "</function>\n</tool_call>", None, [call("f", a="1\n</parameter>\nand\n<parameter=b>\n2")]),
    ("qwen3_coder", "markup inside a value",
     qwen("write_file", path="notes.md", content="use </parameter> and <parameter=path> and </tool_call> and "
          "</function> freely\n</parameter>\ntext"), None,
     [call("write_file", path="notes.md", content="use </parameter> and <parameter=path> and </tool_call> and "
           "</function> freely\n</parameter>\ntext")]),
    ("qwen3_coder", "two functions in one block",
     "<tool_call>\n<function=get_time>\n</function>\n<function=get_date>\n</function>\n</tool_call>", SAME, []),
    ("qwen3_coder", "missing end marker", f"Sure.\n{QWEN_WEATHER.removesuffix('</tool_call>')}", "Sure.",
     [call("get_weather", city="Paris", days=3)]),
    ("qwen3_coder", "cut inside a value", f"Sure.\n{QWEN_WEATHER[:60]}", SAME, []),
    ("qwen3_coder", "JSON body (hermes syntax)", WEATHER, SAME, []),
    ("qwen3_coder", "one good call, one malformed",
     f"{QWEN_WEATHER}\n<tool_call>\n<function=get_time>\n</tool_call>",
     "<tool_call>\n<function=get_time>\n</tool_call>", [call("get_weather", city="Paris", days=3)]),
    ("qwen3_coder", "plain text", "The capital of France is Paris. Use <function=x> or <tool_cal", SAME, []),
    ("qwen3_coder", "empty", "", None, []),
    # llama3_json
    ("llama3_json", "single", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', None,
     [call("get_weather", city="Paris", days=3)]),
    ("llama3_json", "python tag, leading blank",
     '\n <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [call("get_weather", city="Paris")]),
    ("llama3_json", "arguments key", '{"name": "get_weather", "arguments": {"city": "Paris"}}', None,
     [call("get_weather", city="Paris")]),
    ("llama3_json", "parallel",
     '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}', None,
     [call("get_weather", city="Paris"), call("get_time")]),
    ("llama3_json", "semicolon inside a string",
     '{"name": "run_sql", "parameters": {"query": "SELECT 1; SELECT {2}"}};', None,
     [call("run_sql", query="SELECT 1; SELECT {2}")]),
    ("llama3_json", "text before", 'Here you go: {"name": "get_weather", "parameters": {"city": "Paris"}}',
     SAME, []),
    ("llama3_json", "malformed JSON", '{"name": "get_weather", "parameters": {"city": "Paris"}', SAME, []),
    ("llama3_json", "text after the call", '{"name": "get_time", "parameters": {}} Anything else?',
     "Anything else?", [call("get_time")]),
    ("llama3_json", "calls on separate lines",
     '{"name": "get_time", "parameters": {}}\n{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [call("get_time"), call("get_weather", city="Paris")]),
    ("llama3_json", "calls on lines, then text",
     '<|python_tag|>{"name": "get_time", "parameters": {}}\n\n{"name": "f", "parameters": {"s": "a;b"}}\n'
     'I have asked both tools.', "I have asked both tools.", [call("get_time"), call("f", s="a;b")]),
    ("llama3_json", "JSON that is not a call", '{"answer": 42}', SAME, []),
    ("llama3_json", "python tag, then code", '<|python_tag|>print("hello")', SAME, []),
    ("llama3_json", "partial python tag", "<|python", SAME, []),
    ("llama3_json", "plain text", "  The capital of France is Paris.", SAME, []),
    ("llama3_json", "blank", " \n", SAME, []),
    ("llama3_json", "python tag, blanks after it",
     ' <|python_tag|> \n {"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [call("get_weather", city="Paris")]),
    ("llama3_json", "python tag, blanks, then text", "<|python_tag|>\n\n  Hello", SAME, []),
    ("llama3_json", "python tag, blanks only", "\n<|python_tag|>  \n", SAME, []),
    # pythonic
    ("pythonic", "single", '[get_weather(city="Paris", days=3)]', None, [call("get_weather", city="Paris", days=3)]),
    ("pythonic", "parallel", '[get_weather(city="Paris"), get_time()]', None,
     [call("get_weather", city="Paris"), call("get_time")]),
    ("pythonic", "python_start wrapper", '<|python_start|>[get_weather(city="Paris")]<|python_end|>', None,
     [call("get_weather", city="Paris")]),
    ("pythonic", "literals",
     "[f(s='it\\'s, (ok)', i=-2, x=1.5, b=True, n=None, l=[1, 'a'], d={'k': {'n': [False]}}, t=(1, 2))]", None,
     [call("f", s="it's, (ok)", i=-2, x=1.5, b=True, n=None, l=[1, "a"], d={"k": {"n": [False]}}, t=[1, 2])]),
    ("pythonic", "blanks around the wrapper", ' \n<|python_start|>\n [get_time()] \n<|python_end|>\n', None,
     [call("get_time")]),
    ("pythonic", "text before", 'Sure! [get_weather(city="Paris")]', SAME, []),
    ("pythonic", "malformed", '[get_weather(city="Paris"]', SAME, []),
    ("pythonic", "positional argument", '[get_weather("Paris")]', SAME, []),
    ("pythonic", "not a literal", '[get_weather(city=__import__("os").getcwd())]', SAME, []),
    ("pythonic", "a set is not JSON", "[f(x={1, 2})]", SAME, []),
    ("pythonic", "empty list", "[]", SAME, []),
    ("pythonic", "reference list", "[1] See the reference above.", SAME, []),
    ("pythonic", "plain text", "The capital of France is Paris.", SAME, []),
    # gemma4
    ("gemma4", "single", GEMMA_WEATHER, None, [("get_weather", GEMMA_WEATHER_ARGS)]),
    ("gemma4", "parallel", f"{GEMMA_WEATHER}<|tool_call>call:get_time{{}}<tool_call|>", None,
     [("get_weather", GEMMA_WEATHER_ARGS), call("get_time")]),
    ("gemma4", "text before", f"I'll look that up. {GEMMA_WEATHER}", "I'll look that up.",
     [("get_weather", GEMMA_WEATHER_ARGS)]),
    ("gemma4", "string with braces, commas, colons",
     f'<|tool_call>call:write_file{{path:{Q}a.json{Q},text:{Q}{{"k": [1, 2]}}, x:y}}{Q}}}<tool_call|>', None,
     [call("write_file", path="a.json", text='{"k": [1, 2]}, x:y}')]),
    ("gemma4", "numbers, null, blanks", "<|tool_call>call:f{ a: -1.5e3 , b: null, c: [ ], d: 0 }<tool_call|>",
     None, [call("f", a=-1500.0, b=None, c=[], d=0)]),
    ("gemma4", "unterminated string", f"<|tool_call>call:get_weather{{city:{Q}Paris}}<tool_call|>", SAME, []),
    ("gemma4", "unbalanced braces", f"<|tool_call>call:get_weather{{city:{Q}Paris{Q}<tool_call|>", SAME, []),
    ("gemma4", "missing end marker", f"Checking. <|tool_call>call:get_weather{{city:{Q}Paris{Q}}}", "Checking.",
     [call("get_weather", city="Paris")]),
    ("gemma4", "end marker inside a string", f"<|tool_call>call:f{{s:{Q}a <tool_call|> b{Q}}}<tool_call|>", None,
     [call("f", s="a <tool_call|> b")]),
    ("gemma4", "bare word value", "<|tool_call>call:get_weather{city:Paris}<tool_call|>", SAME, []),
    ("gemma4", "no call: prefix", f"<|tool_call>get_weather{{city:{Q}Paris{Q}}}<tool_call|>", SAME, []),
    ("gemma4", "plain text", "The capital of France is Paris. <|tool", SAME, []),
]
CASE_IDS = [f"{parser}: {case}" for parser, case, *_ in CASES]


def assemble(deltas: list[StreamDelta]) -> tuple[str, list[dict]]:
    """Streamed content, and the calls put together as OpenAI's client does: by index, id/type/name
    from the first entry, arguments concatenated."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        indexes = [entry["index"] for entry in delta.tool_calls]
        assert len(set(indexes)) == len(indexes)  # one entry per call index per delta, as OpenAI and vLLM send
        for entry in delta.tool_calls:
            if entry["index"] not in calls:
                calls[entry["index"]] = {"id": entry["id"], "type": entry["type"],
                                         "name": entry["function"]["name"], "arguments": ""}
            else:  # a repeated id or name would be concatenated onto the first by the client
                assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
            calls[entry["index"]]["arguments"] += entry["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return "".join(d.content for d in deltas), [calls[i] for i in sorted(calls)]


def stream(parser: ToolParser, pieces: list[str]) -> list[StreamDelta]:
    state = parser.stream()
    return [state.feed(piece) for piece in pieces] + [state.finish()]


def check_stream(text: str, whole: ParsedOutput, deltas: list[StreamDelta]):
    """The streaming invariant. Content: without calls the pieces join to the text itself; with calls
    they join to the text outside the calls, which the whole parse returns stripped (None if empty)."""
    content, calls = assemble(deltas)
    if whole.calls:
        assert content.strip() == (whole.content or "")
    else:
        assert content == text
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
        [(c.name, json.loads(c.arguments)) for c in whole.calls]
    assert all(c["type"] == "function" and re.fullmatch(r"call_[0-9a-f]{24}", c["id"]) for c in calls)


@pytest.mark.parametrize(("parser", "case", "text", "content", "calls"), CASES, ids=CASE_IDS)
def test_parse(parser, case, text, content, calls):
    out = get_tool_parser(parser).parse(text)
    assert out.content == ((text or None) if content is SAME else content)
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == calls
    assert all(isinstance(json.loads(c.arguments), dict) for c in out.calls)


@pytest.mark.parametrize(("parser", "text"), [(p, t) for p, _, t, *_ in CASES], ids=CASE_IDS)
def test_stream_every_two_piece_split(parser, text):
    parser = get_tool_parser(parser)
    whole = parser.parse(text)
    for cut in range(len(text) + 1):
        check_stream(text, whole, stream(parser, [text[:cut], text[cut:]]))


@pytest.mark.parametrize(("parser", "text"), [(p, t) for p, _, t, *_ in CASES], ids=CASE_IDS)
def test_stream_one_character_at_a_time(parser, text):
    parser = get_tool_parser(parser)
    check_stream(text, parser.parse(text), stream(parser, list(text)))


@pytest.mark.parametrize(("parser", "text"), [(p, t) for p, _, t, *_ in CASES], ids=CASE_IDS)
def test_stream_in_fixed_size_deltas(parser, text):
    """Pieces of 2 to 7 characters after a first piece of every length below that: every cut, and cuts
    close together (a marker over three pieces)."""
    parser = get_tool_parser(parser)
    whole = parser.parse(text)
    for size in range(2, 8):
        for offset in range(size):
            check_stream(text, whole, stream(parser, [text[:offset]] + [text[i:i + size]
                                                                        for i in range(offset, len(text), size)]))


LONG_CALLS = {  # one complete call per format, for outputs of many calls
    "hermes": hermes("f", {"s": "</tool_cal <tool_call", "n": 1}),
    "qwen3_coder": qwen("f", s="</tool_cal </parameter", n="1"),
    "gemma4": f"<|tool_call>call:f{{s:{Q}<tool_call {Q},n:1}}<tool_call|>",
    "llama3_json": '{"name": "f", "parameters": {"s": "</tool_cal <tool_call", "n": 1}}',
    "pythonic": 'f(s="</tool_cal <tool_call", n=1)',
}
LONG_ARGUMENTS = {"hermes": {"s": "</tool_cal <tool_call", "n": 1}, "qwen3_coder": {"s": "</tool_cal </parameter",
                                                                                  "n": 1},
                  "gemma4": {"s": "<tool_call ", "n": 1}, "llama3_json": {"s": "</tool_cal <tool_call", "n": 1},
                  "pythonic": {"s": "</tool_cal <tool_call", "n": 1}}


def _many_calls(parser: str, n: int) -> str:
    one = LONG_CALLS[parser]
    if parser == "llama3_json":
        return "; ".join([one] * n)
    if parser == "pythonic":
        return "[" + ", ".join([one] * n) + "]"
    return "".join(f"text {i} <\n{one}" for i in range(n)) + " done"


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_long_outputs_parse_whole_and_streamed_alike(parser):
    """Many calls, a long unterminated call and long blank output: the whole parse finds every call, and the
    stream in 1-, 4- and 16-character pieces gives the same (the streams read each piece once, parse() the text
    once: the benchmark benchmarks/bench_parser_cost.py times them)."""
    tools = get_tool_parser(parser)
    text = _many_calls(parser, 300)
    whole = tools.parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [("f", LONG_ARGUMENTS[parser])] * 300
    unterminated = LONG_CALLS[parser][:len(LONG_CALLS[parser]) // 2] + "<tool_cal </tool_ x " * 200
    for size in (1, 4, 16):
        check_stream(text, whole, stream(tools, [text[i:i + size] for i in range(0, len(text), size)]))
        for other in (unterminated, " \n\t" * 300):
            out = tools.parse(other)
            assert out.content == other and out.calls == []
            check_stream(other, out, stream(tools, [other[i:i + size] for i in range(0, len(other), size)]))


def test_content_is_released_before_a_call_completes():
    state = get_tool_parser("hermes").stream()
    assert state.feed("Let me check. <tool_").content == "Let me check. "  # the partial marker is held
    assert state.feed("call>\n{").content == ""
    assert not state.has_calls
    delta = state.feed('"name": "get_time", "arguments": {}}\n</tool_call> ok')
    assert delta.content == " ok" and state.has_calls
    (entry,) = delta.tool_calls  # one entry per call index per delta: the name and the arguments together
    assert entry["function"] == {"name": "get_time", "arguments": "{}"} and entry["index"] == 0
    assert set(entry) == {"index", "id", "type", "function"} and entry["type"] == "function"
    assert state.finish() == StreamDelta()


def test_whole_output_formats_hold_the_call_until_finish():
    state = get_tool_parser("pythonic").stream()
    assert state.feed("  [get_time()") == StreamDelta()
    assert state.feed("]") == StreamDelta() and not state.has_calls
    assert [e["function"] for e in state.finish().tool_calls] == [{"name": "get_time", "arguments": "{}"}]
    assert state.has_calls
    content = get_tool_parser("llama3_json").stream()
    assert content.feed("  <|python_tag|> H").content == "  <|python_tag|> H"  # decided: content
    assert content.feed("ello").content == "ello"
    assert not content.has_calls


def test_ids_are_unique_per_call():
    text = f"{WEATHER}\n{TIME}\n{WEATHER}"
    ids = [c["id"] for _ in range(3) for c in assemble(stream(get_tool_parser("hermes"), [text]))[1]]
    assert len(ids) == 9 and len(set(ids)) == 9


def test_openai_client_assembles_the_stream():
    """The deltas, sent as chunks, come out of OpenAI's own stream accumulator as the parsed calls."""
    state = ChatCompletionStreamState()
    for n, delta in enumerate(stream(get_tool_parser("gemma4"), [f"Sure. {GEMMA_WEATHER}", "<|tool_call>call:",
                                                                 "get_time{}<tool_call|>"])):
        state.handle_chunk(ChatCompletionChunk.model_validate({
            "id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "finish_reason": "tool_calls" if n == 3 else None,
                         "delta": {"content": delta.content or None, "tool_calls": delta.tool_calls or None}}]}))
    message = state.get_final_completion().choices[0].message
    assert message.content == "Sure. "
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == \
        [("get_weather", GEMMA_WEATHER_ARGS), ("get_time", {})]


def test_registry():
    assert set(TOOL_PARSERS) == {"hermes", "qwen3_coder", "llama3_json", "pythonic", "gemma4"}
    for name, cls in TOOL_PARSERS.items():
        parser = get_tool_parser(name)
        assert type(parser) is cls and parser.name == name
    with pytest.raises(ValueError) as err:
        get_tool_parser("nope")
    assert "'nope'" in str(err.value) and all(name in str(err.value) for name in TOOL_PARSERS)


def test_qwen3_coder_deep_value_stays_text():
    """A value nested past json's recursion limit is not JSON to this parser: it stays the text."""
    deep = "[" * 5000 + "]" * 5000
    out = get_tool_parser("qwen3_coder").parse(qwen("f", x=deep))
    assert out.content is None
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("f", {"x": deep})]


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
@pytest.mark.parametrize("text", ["<tool_call>" * 2 + "</tool_call>", "[" * 5000 + "]" * 5000,
                                  "<|tool_call>call:f{a:" + "[" * 5000 + "<tool_call|>", "{" * 5000,
                                  "[f(x=1e999)]", "\x00[f()]", '<tool_call>{"name": 1, "arguments": {}}</tool_call>'],
                         ids=["nested markers", "deep list", "deep gemma", "deep json", "inf", "nul", "name not str"])
def test_never_raises(parser, text):
    parser = get_tool_parser(parser)
    out = parser.parse(text)
    assert out.content == text and out.calls == []
    check_stream(text, out, stream(parser, list(text[:200]) + [text[200:]]))
