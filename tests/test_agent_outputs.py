"""What thinking models write when they call tools, through the parsers and the server: a call opened before
`</think>` ends the thoughts (whole, at every split, and the grammar of a required tool starts there), a call
whose end marker a stop cut off is a call, values typed by the tool's schema through the server, and tags that
the tokenizer marks special and skips in decoding (Gemma 4's) still reach the parsers.
Run: pytest tests/test_agent_outputs.py -q"""

from __future__ import annotations

import json

import pytest
import torch

from dspark.chat.reasoning import Phase, get_reasoning_format
from dspark.chat.special_tags import kept_tag_ids
from dspark.chat.tool_parsers import get_tool_parser
from dspark.detokenizer import Detokenizer, StreamState
from dspark.sampling import SamplingParams
from dspark.server.config import ServerConfig
from dspark.structured import AfterReasoning, GrammarCompiler
from server_harness import CharTokenizer, ScriptedTarget, build_tiny_model, make_engine, serve

TOK = CharTokenizer()
MESSAGES = [{"role": "user", "content": "weather?"}]
PROMPT = TOK.apply_chat_template(MESSAGES)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
JSON_CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
EOS = 2
QWEN3 = get_reasoning_format("qwen3")


@pytest.mark.parametrize("keep", [True, False])
def test_a_call_opened_while_thinking_ends_the_thoughts_at_every_split(keep):
    text = f"<think>I should look it up.<tool_call>\n{JSON_CALL}\n</tool_call>"
    answer = ("<tool_call>" if keep else "") + f"\n{JSON_CALL}\n</tool_call>"
    for cut in range(len(text) + 1):
        for phase in (Phase.OPEN, Phase.THINKING):
            stream = QWEN3.stream(phase, "<tool_call>", keep_call_start=keep)
            parts = [stream.feed(text[:cut]), stream.feed(text[cut:]), stream.finish()]
            assert "".join(r for r, _ in parts) == "I should look it up.", (cut, phase)
            assert "".join(c for _, c in parts) == answer, (cut, phase)
    # without the marker the whole output is thoughts (never closed)
    assert QWEN3.split(text, Phase.OPEN) == (text[len("<think>"):], None)
    # the tool parser reads the answer: the call comes out
    out = get_tool_parser("hermes").parse(QWEN3.split(text, Phase.OPEN, "<tool_call>")[1])
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("get_weather", {"city": "Paris"})]


def _gate(call_ids=()):
    compiler = GrammarCompiler.for_tokenizer(TOK, vocab_size=TOK.vocab_size, eos_token_ids=(EOS,))
    grammar = compiler.matcher({"json": {"type": "object", "properties": {"a": {"type": "integer"}},
                                         "required": ["a"], "additionalProperties": False}})
    return AfterReasoning(grammar, start_ids=tuple(TOK.encode("<think>")), end_ids=tuple(TOK.encode("</think>")),
                          prompt_ids=TOK.encode("assistant: <think>"), call_ids=tuple(call_ids))


def test_the_grammar_starts_after_a_call_marker_in_the_thoughts():
    marker = TOK.encode("<tool_call>")
    thoughts = TOK.encode("hm") + marker  # the prompt opened the thoughts
    gate = _gate(marker)
    masks = gate.window_masks(thoughts + TOK.encode('{"a'))  # the marker's last token ends the thoughts
    assert masks[:len(thoughts)].all()  # thoughts free
    assert not masks[len(thoughts)].all() and masks[len(thoughts), TOK.encode("{")[0]]
    for j, t in enumerate(thoughts + TOK.encode('{"a')):  # the one-token twin agrees
        twin = _gate(marker)
        for u in (thoughts + TOK.encode('{"a'))[:j]:
            twin.advance([u])
        assert torch.equal(twin.window_masks([])[0], masks[j]), j
    gate.advance(thoughts)
    assert gate.phase == AfterReasoning.ANSWER
    plain = _gate()  # without the marker's ids the output is still thinking
    plain.advance(thoughts)
    assert plain.phase == AfterReasoning.THINKING


def _server(script, config: dict, tokenizer=None):
    tok = tokenizer or TOK
    ids = script if isinstance(script, list) else tok.encode(script)
    target = ScriptedTarget(build_tiny_model(), len(PROMPT), ids + [EOS])
    return serve(make_engine(target), config=ServerConfig(enable_auto_tool_choice=True, **config), tokenizer=tok)


def _assembled(stream):
    content, reasoning, calls, reason = "", "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            for entry in choice.delta.tool_calls or ():
                call = calls.setdefault(entry.index, {"name": "", "arguments": ""})
                call["name"] += entry.function.name or ""
                call["arguments"] += entry.function.arguments or ""
            reason = choice.finish_reason or reason
    return content, reasoning, calls, reason


def _create(srv, tools=TOOLS, **kw):
    return srv.client().chat.completions.create(model="tiny", messages=MESSAGES, tools=tools, temperature=0.0,
                                                max_tokens=100, **kw)


def test_server_a_call_before_the_end_of_thoughts_reaches_the_client():
    script = f"<think>Hm.<tool_call>{JSON_CALL}</tool_call>"
    with _server(script, dict(tool_call_parser="hermes", reasoning_parser="qwen3")) as srv:
        reply = _create(srv).choices[0]
        assert reply.finish_reason == "tool_calls" and not reply.message.content
        assert reply.message.model_extra["reasoning_content"] == "Hm."
        assert [(c.function.name, json.loads(c.function.arguments)) for c in reply.message.tool_calls] == \
            [("get_weather", {"city": "Paris"})]
        content, reasoning, calls, reason = _assembled(_create(srv, stream=True))
        assert reason == "tool_calls" and reasoning == "Hm." and not content.strip()
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"city": "Paris"})]


def test_server_required_tool_grammar_starts_at_a_call_marker_in_the_thoughts():
    script = '<think>Hm.<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}'  # compact, as the grammar
    with _server(script, dict(tool_call_parser="hermes", reasoning_parser="qwen3")) as srv:
        reply = _create(srv, tool_choice="required").choices[0]
        assert reply.finish_reason == "tool_calls"
        assert reply.message.model_extra["reasoning_content"] == "Hm."
        assert [(c.function.name, json.loads(c.function.arguments)) for c in reply.message.tool_calls] == \
            [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("ending", ["eos", "stop string"])
def test_server_a_call_without_its_end_marker(ending):
    script = f"Checking.<tool_call>{JSON_CALL}" + ("</tool_call>" if ending == "stop string" else "")
    stop = ["</tool_call>"] if ending == "stop string" else None
    with _server(script, dict(tool_call_parser="hermes")) as srv:
        reply = _create(srv, stop=stop).choices[0]
        assert reply.finish_reason == "tool_calls" and reply.message.content == "Checking."
        assert json.loads(reply.message.tool_calls[0].function.arguments) == {"city": "Paris"}
        content, _, calls, reason = _assembled(_create(srv, stop=stop, stream=True))
        assert reason == "tool_calls" and content == "Checking."
        assert [json.loads(c["arguments"]) for c in calls.values()] == [{"city": "Paris"}]


def test_server_qwen3_coder_values_follow_the_tool_schema():
    tools = [{"type": "function", "function": {"name": "w", "parameters": {"type": "object", "properties": {
        "c": {"type": "string"}, "n": {"type": "integer"}}}}}]
    # (the end marker left out, as EOS after the call: the output fits the tiny model's context)
    script = '<tool_call><function=w><parameter=c>{"a":1}</parameter><parameter=n>7</parameter></function>'
    with _server(script, dict(tool_call_parser="qwen3_coder")) as srv:
        reply = _create(srv, tools=tools).choices[0]
        assert json.loads(reply.message.tool_calls[0].function.arguments) == {"c": '{"a":1}', "n": 7}
        _, _, calls, _ = _assembled(_create(srv, tools=tools, stream=True))
        assert json.loads(calls[0]["arguments"]) == {"c": '{"a":1}', "n": 7}


# ---- tags that are special tokens ----------------------------------------------------------------------------

SPECIAL = {"<|channel>": "^", "<channel|>": "`", "<|tool_call>": "~", "<tool_call|>": "$", '<|"|>': "#"}


class SpecialTagTokenizer(CharTokenizer):
    """The char tokenizer with Gemma 4's tags as single special tokens (on the ids of `^`, `` ` ``, `~`, `$`,
    `#`): decoding skips them unless asked for special tokens, as Gemma 4's tokenizer does."""

    def encode(self, text, add_special_tokens=True):
        ids, i = [], 0
        while i < len(text):
            tag = next((t for t in SPECIAL if text.startswith(t, i)), None)
            ids += super().encode(SPECIAL[tag] if tag else text[i])
            i += len(tag) if tag else 1
        return ids

    def decode(self, ids, skip_special_tokens=True):
        tags = {ch: tag for tag, ch in SPECIAL.items()}
        out = []
        for t in ids:
            ch = super().decode([t], skip_special_tokens)
            out.append(("" if skip_special_tokens else tags[ch]) if ch in tags else ch)
        return "".join(out)


STOK = SpecialTagTokenizer()
GEMMA_OUTPUT = ('<|channel>thought the user wants weather<channel|>Sure.'
                '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>')


def test_kept_tags_are_decoded_and_the_rest_skipped():
    gemma = get_reasoning_format("gemma4")
    kept = kept_tag_ids(STOK, gemma, get_tool_parser("gemma4"))
    assert sorted(kept) == sorted(STOK.encode(tag)[0] for tag in SPECIAL)
    assert kept_tag_ids(TOK, QWEN3, get_tool_parser("hermes")) == ()  # tags that decode as text: nothing to keep
    ids = STOK.encode(GEMMA_OUTPUT)
    for keep, expected in ((frozenset(kept), GEMMA_OUTPUT), (frozenset(), STOK.decode(ids))):
        state = StreamState(stop=(), keep=keep)
        text, _ = Detokenizer(STOK).feed(state, ids)
        assert text + Detokenizer(STOK).flush(state) == expected
    assert "<|tool_call>" not in STOK.decode(ids)  # skipped: the parsers would see nothing


def test_server_special_tags_reach_the_parsers():
    with _server(STOK.encode(GEMMA_OUTPUT), dict(tool_call_parser="gemma4", reasoning_parser="gemma4"),
                 tokenizer=STOK) as srv:
        reply = _create(srv).choices[0]
        assert reply.finish_reason == "tool_calls" and reply.message.content == "Sure."
        assert reply.message.model_extra["reasoning_content"] == " the user wants weather"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in reply.message.tool_calls] == \
            [("get_weather", {"city": "Paris"})]
        content, reasoning, calls, reason = _assembled(_create(srv, stream=True))
        assert (content, reasoning, reason) == ("Sure.", " the user wants weather", "tool_calls")
        assert [json.loads(c["arguments"]) for c in calls.values()] == [{"city": "Paris"}]
        plain = srv.client().completions.create(model="tiny", prompt="weather?", max_tokens=5, temperature=0.0)
        assert not any(ch in plain.choices[0].text for ch in "^`~$#")  # completions skip specials as before


def test_offline_chat_keeps_the_special_tags():
    from dspark.llm import LLM
    target = ScriptedTarget(build_tiny_model(), len(PROMPT), STOK.encode(GEMMA_OUTPUT) + [EOS])
    llm = LLM(engine=make_engine(target), tokenizer=STOK)
    (out,) = llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=100), use_tqdm=False, tools=TOOLS,
                      reasoning_parser="gemma4", tool_parser="gemma4")[0].outputs
    assert out.reasoning_content == " the user wants weather" and out.content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", {"city": "Paris"})]
