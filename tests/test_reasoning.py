"""Reasoning parsers (`--reasoning-parser`): the split of a thinking model's output into reasoning_content and
content (whole, and streamed at every split point), the phase the prompt leaves the output in, and the
grammar that applies to the answer only (`structured.AfterReasoning`): its masks against a one-token-at-a-time
twin, and end to end with a target scripted to think first: the JSON after the thoughts validates, greedy
speculative output equals plain, and the server's reasoning_content and content split exactly at the tags,
whole and streamed."""

from __future__ import annotations

import json

import pytest
import torch

from dspark.config import SpecConfig
from dspark.llm import LLM
from dspark.sampling import ReasoningTags, SamplingParams
from dspark.server.config import ServerConfig
from dspark.chat.reasoning import REASONING_FORMATS, Phase, get_reasoning_format
from dspark.structured import AfterReasoning, GrammarCompiler
from server_harness import CharTokenizer, ScriptedTarget, build_tiny_model, make_engine, serve, stream_events

QWEN3 = get_reasoning_format("qwen3")
R1 = get_reasoning_format("deepseek_r1")
GEMMA4 = get_reasoning_format("gemma4")
# (format, starting phase, output, reasoning, content)
SPLITS = [
    (QWEN3, Phase.OPEN, "<think>\nsteps</think>\n\nThe answer.", "\nsteps", "The answer."),
    (QWEN3, Phase.OPEN, "The answer, no thoughts.", None, "The answer, no thoughts."),
    (QWEN3, Phase.OPEN, "<think>cut off mid-thou", "cut off mid-thou", None),
    (QWEN3, Phase.ANSWER, "<think>is text here</think>", None, "<think>is text here</think>"),
    (QWEN3, Phase.THINKING, "a</thin</think>b", "a</thin", "b"),
    (R1, Phase.THINKING, "plan</think>42", "plan", "42"),
    (R1, Phase.THINKING, "<think>plan</think>42", "plan", "42"),
    (R1, Phase.THINKING, "never closed", "never closed", None),
    (GEMMA4, Phase.OPEN, "<|channel>thoughtweigh it<channel|>Yes.", "weigh it", "Yes."),
    (GEMMA4, Phase.OPEN, "Yes.", None, "Yes."),
    # blanks before the start tag are dropped with it; before an answer they are the answer's
    (QWEN3, Phase.OPEN, " \n\t<think>a</think>b", "a", "b"),
    (QWEN3, Phase.OPEN, "\n\n The answer.", None, "\n\n The answer."),
    (QWEN3, Phase.OPEN, "  \n", None, "  \n"),
    (QWEN3, Phase.OPEN, " <think> a </think>\n\n\n b ", " a ", " b "),
    (GEMMA4, Phase.OPEN, "\n <|channel>tho", None, "\n <|channel>tho"),
    (R1, Phase.THINKING, "  <think>x</think>\n\ny", "  <think>x", "y"),
]


@pytest.mark.parametrize("fmt,phase,text,reasoning,content", SPLITS)
def test_split_whole_and_at_every_point(fmt, phase, text, reasoning, content):
    assert fmt.split(text, phase) == (reasoning, content)
    for cut in range(len(text) + 1):
        stream = fmt.stream(phase)
        parts = [stream.feed(text[:cut]), stream.feed(text[cut:]), stream.finish()]
        assert ("".join(p[0] for p in parts) or None, "".join(p[1] for p in parts) or None) == \
            (reasoning, content), cut
    stream = fmt.stream(phase)
    parts = [stream.feed(ch) for ch in text] + [stream.finish()]
    assert ("".join(p[0] for p in parts) or None, "".join(p[1] for p in parts) or None) == (reasoning, content)


def _streamed(fmt, phase, pieces) -> tuple[str | None, str | None]:
    stream = fmt.stream(phase)
    parts = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    return "".join(p[0] for p in parts) or None, "".join(p[1] for p in parts) or None


@pytest.mark.parametrize("fmt", [QWEN3, R1, GEMMA4], ids=lambda f: f.name)
def test_long_outputs_streamed_in_any_delta_size_split_as_whole(fmt):
    """Long outputs (a reasoning block strewn with pieces of the tags, blank output, blanks before the tag)
    fed in pieces of 1 to 16 characters at every offset split as the whole text does (the streams read each
    piece once: the benchmark benchmarks/bench_parser_cost.py times them)."""
    noise = f"step {fmt.end[:-1]} {fmt.start[:3]} <{fmt.end[1:]} {{a}}\n"
    texts = [fmt.start + noise * 40 + fmt.end + "\n\nThe answer. " * 20, " \n\t" * 100,
             " \n" * 50 + fmt.start + noise * 5 + fmt.end + "ok", " \n" * 50 + "text" + noise, noise * 30]
    for text in texts:
        for phase in Phase:
            whole = fmt.split(text, phase)
            for size in (1, 2, 3, 4, 7, 16):
                for offset in range(0, size, 3):
                    pieces = [text[:offset]] + [text[i:i + size] for i in range(offset, len(text), size)]
                    assert _streamed(fmt, phase, pieces) == whole, (text[:40], phase, size, offset)


def test_the_prompt_decides_where_the_output_starts():
    assert QWEN3.prompt_phase("user: hi\nassistant: ") is Phase.OPEN
    assert QWEN3.prompt_phase("assistant: <think>\n") is Phase.THINKING  # the template opened the block
    assert QWEN3.prompt_phase("assistant: <think>\n\n</think>\n\n") is Phase.ANSWER  # thinking switched off
    assert QWEN3.prompt_phase("<think>old</think>answer\nuser: more\nassistant: ") is Phase.ANSWER
    assert R1.prompt_phase("user: hi\nassistant: ") is Phase.THINKING  # R1 always reasons first
    assert set(REASONING_FORMATS) == {"qwen3", "deepseek_r1", "gemma4"}
    with pytest.raises(ValueError, match="qwen3"):
        get_reasoning_format("nope")


# -- the grammar after the reasoning ---------------------------------------------------------------------
TOK = CharTokenizer()
SCHEMA = {"json": {"type": "string", "enum": ["yes", "no"]}}
THINK = ReasoningTags(tuple(TOK.encode("<think>")), tuple(TOK.encode("</think>")))


def _compiler() -> GrammarCompiler:
    return GrammarCompiler.for_tokenizer(TOK, vocab_size=TOK.vocab_size, eos_token_ids=(2,))


def _gated(prompt: str) -> AfterReasoning:
    return AfterReasoning(_compiler().matcher(SCHEMA), start_ids=THINK.start, end_ids=THINK.end,
                          prompt_ids=TOK.encode(prompt))


def _twin_masks(prompt: str, committed: list[int], drafts: list[int]) -> torch.Tensor:
    """Row j: a fresh gate advanced over the committed output and d1..dj one token at a time, row 0 of its
    masks (the slow twin of one window_masks call)."""
    rows = []
    for j in range(len(drafts) + 1):
        g = _gated(prompt)
        for t in committed + drafts[:j]:
            g.advance([t])
        rows.append(g.window_masks([])[0])
    return torch.stack(rows)


@pytest.mark.parametrize("prompt", ["assistant: ", "assistant: <think>", "assistant: <think></think>"],
                         ids=["open", "thinking", "closed"])
@pytest.mark.parametrize("committed,drafts", [
    ("", "<think>ab</think>\"yes\""), ("<thi", "nk>a</think>\"n"), ("<think>x</thi", "nk>\"no\""),
    ("", "\"yes\""), ("", "\"ye"), ("<think>", "abc"), ("<think>a</think>", "\"no\""), ("", "")])
def test_window_masks_equal_the_one_token_twin(prompt, committed, drafts):
    gate = _gated(prompt)
    committed_ids, draft_ids = TOK.encode(committed), TOK.encode(drafts)
    try:
        twin = _twin_masks(prompt, committed_ids, draft_ids)
    except ValueError:  # the grammar refuses a draft (e.g. a tag where only JSON may follow): nothing to compare
        pytest.skip("drafts the grammar refuses")
    gate.advance(committed_ids)
    masks = gate.window_masks(draft_ids)
    valid = gate.valid_prefix(draft_ids)
    assert torch.equal(masks[:valid + 1], twin[:valid + 1])
    assert all(masks[j, draft_ids[j]] for j in range(valid))  # every draft up to valid is allowed ...
    assert valid == len(draft_ids) or not masks[valid, draft_ids[valid]]  # ... and the next one is not


def test_thoughts_are_free_and_the_answer_is_constrained():
    gate = _gated("assistant: ")
    open_row = gate.window_masks([])[0]
    assert open_row[TOK.encode("<")[0]] and open_row[TOK.encode('"')[0]] and not open_row[TOK.encode("x")[0]]
    gate.advance(TOK.encode("<think>anything at all, even { and \"</thin"))
    assert gate.window_masks([])[0].all()  # still thinking: every token
    gate.advance(TOK.encode("k>"))
    row = gate.window_masks([])[0]
    assert row[TOK.encode('"')[0]] and not row[TOK.encode("x")[0]]  # the answer: the schema's JSON
    closed = _gated("assistant: <think></think>")
    assert not closed.window_masks([])[0][TOK.encode("<")[0]]  # thinking switched off: JSON from the start


TAGGED = {"choice": ["<b>yes</b>", "no"]}  # an answer whose first token is the start tag's (and the end tag's)


@pytest.mark.parametrize("committed,drafts", [("", "<b>yes</b>"), ("<", "b>ye"), ("", "<think>a</think><b>"),
                                              ("<th", "ink>x</think>no"), ("", "<t")])
def test_an_answer_that_begins_like_the_tag_is_held_to_the_grammar(committed, drafts):
    """`<` opens `<think>` and `<b>`: while the output is a prefix of the tag, a row allows the tag's next token
    and what the grammar allows after that prefix; the masks equal the one-token twin's."""
    def gate():
        return AfterReasoning(_compiler().matcher(TAGGED), start_ids=THINK.start, end_ids=THINK.end,
                              prompt_ids=TOK.encode("assistant: "))
    committed_ids, draft_ids = TOK.encode(committed), TOK.encode(drafts)
    twin = []
    for j in range(len(draft_ids) + 1):
        g = gate()
        g.advance(committed_ids + draft_ids[:j])
        twin.append(g.window_masks([])[0])
    g = gate()
    g.advance(committed_ids)
    assert torch.equal(g.window_masks(draft_ids), torch.stack(twin))
    assert g.valid_prefix(draft_ids) == len(draft_ids)
    after_lt = gate()
    after_lt.advance(TOK.encode("<"))
    row = after_lt.window_masks([])[0]
    assert row[TOK.encode("t")[0]] and row[TOK.encode("b")[0]] and not row[TOK.encode("h")[0]]


def test_a_tag_prefix_then_another_token_is_the_answer_under_the_grammar():
    """A target that writes `<html>` where the grammar wants `<b>yes</b>` or `no`: it never leaves the grammar (the
    tag's first token does not switch the grammar off), and `<b>yes</b>` itself is the answer, not thoughts."""
    params = SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=TAGGED, reasoning_tags=THINK)
    def answer(script: str) -> str:
        target = ScriptedTarget(build_tiny_model(), len(PROMPT), TOK.encode(script))
        out = LLM(engine=make_engine(target), tokenizer=None).generate([PROMPT], params, use_tqdm=False)[0]
        return TOK.decode(out.token_ids)
    assert answer("<b>yes</b>") == "<b>yes</b>"
    assert QWEN3.split("<b>yes</b>", Phase.OPEN) == (None, "<b>yes</b>")
    wants_html = answer("<html>")  # `<`, then only the tag's `t` or the grammar's `b` may follow
    assert wants_html.startswith(("<think>", "<b>yes</b>")), wants_html
    if wants_html.startswith("<think>") and "</think>" in wants_html:
        assert wants_html.split("</think>", 1)[1] in ("<b>yes</b>", "no")


# -- end to end: a target scripted to think first ---------------------------------------------------------
THOUGHTS = "<think>let me see, yes or no</think>"


PROMPT = TOK.apply_chat_template([{"role": "user", "content": "yes or no?"}])


def _engine(spec: bool = False):
    target = ScriptedTarget(build_tiny_model(), len(PROMPT), TOK.encode(THOUGHTS))
    if not spec:
        return make_engine(target)
    return make_engine(target, spec=SpecConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1,
                                               prompt_lookup_max=3))


def test_the_answer_after_the_thoughts_validates_and_speculation_changes_nothing():
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=SCHEMA, reasoning_tags=THINK)
    plain = LLM(engine=_engine(), tokenizer=None).generate([PROMPT], params, use_tqdm=False)[0].token_ids
    text = TOK.decode(plain)
    assert text.startswith(THOUGHTS)
    assert json.loads(text[len(THOUGHTS):]) in ("yes", "no")
    engine = _engine(spec=True)
    spec = LLM(engine=engine, tokenizer=None).generate([PROMPT], params, use_tqdm=False)[0].token_ids
    assert spec == plain and engine.metrics.num_drafts > 0
    # without the tags the grammar applies from the first token: no thoughts at all
    bare = LLM(engine=_engine(), tokenizer=None).generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=SCHEMA), use_tqdm=False)[0]
    assert json.loads(TOK.decode(bare.token_ids)) in ("yes", "no")


@pytest.fixture(scope="module")
def srv():
    with serve(_engine(), config=ServerConfig(reasoning_parser="qwen3")) as s:
        yield s


def _chat(**fields) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "yes or no?"}], "temperature": 0.0,
            "max_tokens": 60, "response_format": {"type": "json_schema", "json_schema": {
                "name": "a", "schema": SCHEMA["json"]}}, **fields}


def test_server_splits_reasoning_from_the_json_answer(srv):
    message = srv.post("/v1/chat/completions", json=_chat()).json()["choices"][0]["message"]
    assert message["reasoning_content"] == THOUGHTS[len("<think>"):-len("</think>")]
    assert json.loads(message["content"]) in ("yes", "no")
    events = stream_events(srv, "/v1/chat/completions", _chat(stream=True))
    deltas = [json.loads(e)["choices"][0]["delta"] for e in events[:-1] if json.loads(e)["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]


def test_the_reasoning_parser_flag_is_checked():
    with pytest.raises(ValueError, match="deepseek_r1"):
        ServerConfig(reasoning_parser="nope")
