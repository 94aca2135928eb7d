"""Structured output (dspark/structured.py) in the engine, speculation on:

* 50 json_schema requests over four schemas (greedy and seeded sampling, batched) all parse and
  validate with jsonschema, drafts are accepted under the grammar, and drafts it forbids are cut
  before verification;
* greedy and seeded speculative output under a grammar equals plain decoding under it, token for token
  (n-gram and draft-model drafters);
* regex, choice and lark grammars hold; window masks equal the masks of plain decoding after the drafts.

    pytest tests/test_structured.py -q
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from dspark.config import SpecConfig
from dspark.sampling import SamplingParams
from server_harness import CharTokenizer, build_tiny_model, make_engine

TOK = CharTokenizer()
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "tags": {"type": "array", "items": {"enum": ["a", "bb", "c"]},
                                               "maxItems": 3}},
     "required": ["ok", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                      "score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["kind"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4},
]
NGRAM = SpecConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
SELF_DRAFT = SpecConfig(method="draft_model", draft_num_layers=2, num_speculative_tokens=3)


@pytest.fixture(scope="module")
def model():
    return build_tiny_model()


def run(engine, prompts, params_list) -> list[list[int]]:
    ids = [engine.add_request(p, params) for p, params in zip(prompts, params_list)]
    out = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[i] for i in ids]


def _requests(n: int):
    prompts, params = [], []
    for i in range(n):
        prompts.append(TOK.encode(f"user: give me json number {i}\nassistant: "))
        sampled = i % 2 == 1
        params.append(SamplingParams(temperature=1.0 if sampled else 0.0, seed=i if sampled else None,
                                     max_tokens=70, structured_outputs={"json": SCHEMAS[i % len(SCHEMAS)]}))
    return prompts, params


def test_fifty_json_schema_requests_validate_and_equal_plain(model):
    prompts, params = _requests(50)
    engine = make_engine(model, spec=NGRAM)
    spec_out = run(engine, prompts, params)
    for i, out in enumerate(spec_out):
        text = TOK.decode(out)
        jsonschema.validate(json.loads(text), SCHEMAS[i % len(SCHEMAS)])
    m = engine.metrics
    assert m.num_draft_tokens > 0 and m.num_accepted_tokens > 0, "speculation never ran under the grammar"
    plain = run(make_engine(model), prompts, params)
    assert spec_out == plain


@pytest.mark.parametrize("spec", [NGRAM, SELF_DRAFT], ids=["ngram", "draft_model"])
def test_grammar_output_equals_plain_per_drafter(model, spec):
    prompts, params = _requests(8)
    assert run(make_engine(model, spec=spec), prompts, params) == run(make_engine(model), prompts, params)


def test_forbidden_drafts_are_cut_before_verification(model):
    engine = make_engine(model, spec=SELF_DRAFT)
    seen = []
    run_target = engine._run_target

    def checking(sched):
        for s in sched.scheduled:
            g = s.request.grammar
            if g is not None and s.num_drafts:
                drafts = s.draft_ids
                seen.append(len(drafts))
                assert g.valid_prefix(drafts) == len(drafts), "a draft the grammar forbids was verified"
        return run_target(sched)
    engine._run_target = checking
    prompts, params = _requests(4)
    run(engine, prompts, params)
    assert seen, "no draft was verified"


@pytest.mark.parametrize("spec,check", [
    ({"regex": "[a-e]{2,5}-[0-9]"}, lambda t: __import__("re").fullmatch("[a-e]{2,5}-[0-9]", t)),
    ({"choice": ["alpha", "beta", "gamma delta"]}, lambda t: t in ("alpha", "beta", "gamma delta")),
    ({"grammar": 'start: "(" item ("," item)~0..2 ")"\nitem: "x" | "yy"'},
     lambda t: __import__("re").fullmatch(r"\((x|yy)(,(x|yy)){0,2}\)", t)),
    ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
])
def test_other_grammars_hold_under_speculation(model, spec, check):
    engine = make_engine(model, spec=NGRAM)
    prompts = [TOK.encode(f"q{i}: ") for i in range(4)]
    # json_object leaves keys and values free: a bias toward closing quotes and braces ends them (and
    # runs a logits processor beside the grammar)
    bias = {TOK.encode('"')[0]: 8.0, TOK.encode("}")[0]: 4.0} if "json_object" in spec else {}
    params = [SamplingParams(temperature=t, seed=i, max_tokens=80, structured_outputs=spec, logit_bias=bias)
              for i, t in enumerate((0.0, 1.0, 0.0, 1.0))]
    for out in run(engine, prompts, params):
        assert check(TOK.decode(out)), TOK.decode(out)


def test_window_masks_equal_plain_masks_after_the_drafts(model):
    engine = make_engine(model)
    compiler = engine.grammar_compiler
    for drafts in (TOK.encode('{"name":"ab'), TOK.encode('{"nope'), []):
        m = compiler.matcher({"json": SCHEMAS[0]})
        m.advance(TOK.encode('{'))
        window = m.window_masks(drafts[1:])
        valid = m.valid_prefix(drafts[1:])
        for j in range(valid + 1):
            plain = compiler.matcher({"json": SCHEMAS[0]})
            plain.advance(TOK.encode('{') + drafts[1:1 + j])
            assert torch.equal(window[j], plain.window_masks([])[0])
