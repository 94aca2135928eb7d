"""Property-based fuzzing with bounded examples: `SamplingParams` (any number, NaN, inf, huge ints,
bools → a ValueError or parameters whose distributions are finite and sum to 1), the request
models and their mapping to engine input (any JSON → a validation error, a 4xx `APIError` or a
SamplingParams, never another exception), and the live HTTP API from its own OpenAPI schema
(schemathesis: no 5xx for any generated request, the server alive and clean afterwards).
"""

from __future__ import annotations

import json
import math

import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from dspark.sampling import SamplingParams, logits_to_probs
from dspark.server import serving
from dspark.server.guard import json_problem
from dspark.server.protocol import ChatCompletionRequest, CompletionRequest
from server_harness import CharTokenizer, build_tiny_model, make_engine, serve

NUMBERS = st.one_of(
    st.integers(min_value=-2**70, max_value=2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(), st.none())
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(temperature=NUMBERS, top_p=NUMBERS, top_k=NUMBERS, max_tokens=NUMBERS, seed=NUMBERS,
       stop_token_ids=st.lists(st.integers(min_value=-2**70, max_value=2**70), max_size=3),
       stop=st.lists(st.text(max_size=3), max_size=3))
def test_sampling_params_validate_or_refuse(temperature, top_p, top_k, max_tokens, seed,
                                            stop_token_ids, stop):
    try:
        p = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                           seed=seed, stop_token_ids=stop_token_ids, stop=stop)
    except ValueError:
        return
    assert math.isfinite(p.temperature) and p.temperature >= 0 and 0 < p.top_p <= 1
    assert p.top_k == -1 or 0 <= p.top_k < 2**31
    assert p.max_tokens is None or 1 <= p.max_tokens < 2**31
    logits = torch.randn(2, 50)
    probs = logits_to_probs(logits, temperature=torch.tensor([p.temperature] * 2),
                            top_k=torch.tensor([p.top_k] * 2), top_p=torch.tensor([p.top_p] * 2))
    assert bool(torch.isfinite(probs).all())
    assert torch.allclose(probs.sum(dim=1), torch.ones(2), atol=1e-4)
    if p.seed is not None:
        torch.Generator().manual_seed(p.seed)  # any accepted seed seeds a generator


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
    | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(st.text(max_size=5), children, max_size=3), max_leaves=8)
FIELDS = ["model", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos",
          "stream", "stream_options", "n", "max_tokens", "speculation"]


def _body(data, required: str) -> dict:
    body = data.draw(st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=5))
    body[required] = data.draw(JSON)
    return body


@FUZZ
@given(data=st.data())
def test_request_models_map_to_engine_input_or_a_4xx(data):
    chat = data.draw(st.booleans())
    tok = CharTokenizer()
    if chat:
        body = _body(data, "messages")
        if data.draw(st.booleans()):
            body["messages"] = [{"role": data.draw(st.sampled_from(["user", "system", "x"])),
                                 "content": data.draw(JSON)}]
    else:
        body = _body(data, "prompt")
    try:
        req = (ChatCompletionRequest if chat else CompletionRequest).model_validate(body)
    except ValidationError:
        return
    try:
        max_tokens = serving.chat_max_tokens(req) if chat else req.max_tokens
        params = serving.sampling_params(req, max_tokens)
        batch = [serving.chat_prompt_ids(req, tok)] if chat else [ids for ids, _ in serving.completion_prompts(req, tok)]
    except serving.APIError as e:
        assert 400 <= e.status_code < 500
        return
    assert isinstance(params, SamplingParams) and all(isinstance(t, int) for ids in batch for t in ids)


# -- the HTTP API from its OpenAPI schema ------------------------------------------------------------
@pytest.fixture(scope="module")
def live():
    with serve(make_engine(build_tiny_model())) as srv:
        yield srv


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_openapi_schema_fuzz_gets_no_5xx(live, mode):
    schema = schemathesis.openapi.from_url(live.base_url + "/openapi.json")
    statuses: list[int] = []

    # positive cases are schema-valid but mostly semantically refused (empty prompts, unknown roles, two
    # structured-output constraints at once): 100 of them leave enough served ones to count
    @settings(max_examples=100 if mode == "positive" else 60, deadline=None, database=None,
              derandomize=True, suppress_health_check=list(HealthCheck))
    @given(case=schema.as_strategy(schemathesis.GenerationMode(mode)))
    def one(case):
        if isinstance(case.body, dict):  # keep generation short (valid stays valid, invalid invalid)
            case.body.setdefault("max_tokens", 2)
            for key, most in (("max_tokens", 4), ("max_completion_tokens", 4), ("n", 2)):
                value = case.body.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > most:
                    case.body[key] = most
        response = case.call(base_url=live.base_url, timeout=60)
        statuses.append(response.status_code)
        assert response.status_code < 500, (case.method, case.path, case.body, response.text)
        if response.status_code >= 400 and case.path.startswith("/v1"):
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}

    one()
    assert len(statuses) >= 20
    if mode == "positive":
        assert statuses.count(200) >= 2, "schema-valid requests are served"
    if mode == "negative":
        assert any(400 <= s < 500 for s in statuses), "negative cases must be refused"


def test_the_server_is_clean_after_the_schema_fuzz(live):
    live.wait_idle()
    ok = live.post("/v1/completions", json={"model": "tiny", "prompt": "ok", "max_tokens": 2})
    assert ok.status_code == 200


@FUZZ
@given(body=st.one_of(st.binary(max_size=64), st.text(max_size=32).map(str.encode),
                      JSON.map(lambda v: json.dumps(v).encode())))
def test_body_guard_never_raises(body):
    """Any bytes: a reason to refuse, or None for JSON the routes may parse."""
    problem = json_problem(body)
    assert problem is None or isinstance(problem, str)
    if problem is None:
        json.loads(body)
