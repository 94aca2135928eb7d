"""Prompt logprobs (`SamplingParams.prompt_logprobs`): each prompt token's log-probability under the target's
raw distribution at the position before it, the token's rank and the top k there, against transformers'
log-softmax over the same ids (the slow twin): in one prompt step, in chunks, with a prefix-cache hit (the
cached positions are computed again, not skipped), under preemption (no position scored twice), with
speculation (which changes nothing of it), and through `LLM.generate`."""

from __future__ import annotations

import pytest
import torch

from dspark.llm import LLM
from dspark.sampling import SamplingParams
from tests.conftest import TINY_GEMMA3, TINY_LLAMA, TINY_QWEN3
from tests.engine_helpers import greedy, make_engine, ngram_engine_args, repetitive_prompts, run, tiny_target

ATOL = 1e-4
K = 3


def _hf_prompt_logprobs(hf, ids: list[int]) -> torch.Tensor:  # [len(ids) - 1, vocab]: row j scores ids[j + 1]
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)


def _check(entries, ids: list[int], ref: torch.Tensor, k: int = K) -> None:
    assert entries[0] is None and len(entries) == len(ids)
    for j, e in enumerate(entries[1:]):
        assert e.token_id == ids[j + 1]
        assert abs(e.logprob - ref[j, ids[j + 1]].item()) < ATOL, f"position {j + 1}"
        chosen = ref[j, ids[j + 1]]
        assert 1 + int((ref[j] > chosen + ATOL).sum()) <= e.rank <= 1 + int((ref[j] > chosen - ATOL).sum())
        top = ref[j].topk(k)
        assert [t for t, _ in e.top] == top.indices.tolist()
        assert max((abs(lp - v) for (_, lp), v in zip(e.top, top.values.tolist())), default=0.0) < ATOL


def _generate(engine, prompts, params):
    return LLM(engine=engine, tokenizer=None).generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("cfg", [TINY_LLAMA, TINY_QWEN3, TINY_GEMMA3], ids=["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("budget", [64, 16], ids=["one_step", "chunked"])
def test_prompt_logprobs_equal_transformers(cfg, budget):
    model, hf = tiny_target(cfg)
    prompts = repetitive_prompts(3, cfg.vocab_size, seed=1, length=30)
    outs = _generate(make_engine(model, cfg, budget=budget), prompts,
                     SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=K))
    for ids, out in zip(prompts, outs):
        _check(out.prompt_logprobs, ids, _hf_prompt_logprobs(hf, ids))


def test_a_prefix_cache_hit_is_scored_not_skipped():
    """The second request's prompt extends the first's (its blocks cached): a request asking for prompt
    logprobs computes the cached positions again and scores all of them; one that does not ask takes the hit."""
    cfg = TINY_LLAMA
    model, hf = tiny_target(cfg)
    first = repetitive_prompts(1, cfg.vocab_size, seed=2, length=33)[0]
    second = first + [7, 8, 9, 10, 11]
    engine = make_engine(model, cfg)
    _generate(engine, [first], greedy(2))
    plain = _generate(engine, [second], greedy(2))[0]
    assert plain.num_cached_tokens >= 32  # the cache holds the shared blocks
    scored = _generate(engine, [second], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True,
                                                        prompt_logprobs=K))[0]
    assert scored.num_cached_tokens == 0
    _check(scored.prompt_logprobs, second, _hf_prompt_logprobs(hf, second))
    assert scored.token_ids == plain.token_ids


def test_preemption_scores_each_position_once():
    """A pool too small for every request: preempted requests recompute their prompts, whose positions
    were scored already; each prompt's logprobs still hold one entry per token, equal to transformers'."""
    cfg = TINY_LLAMA
    model, hf = tiny_target(cfg)
    prompts = repetitive_prompts(6, cfg.vocab_size, seed=4, length=36)
    engine = make_engine(model, cfg, num_kv_blocks=40, budget=16)
    outs = _generate(engine, prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                                     prompt_logprobs=0))
    assert engine.metrics.num_preemptions > 0
    for ids, out in zip(prompts, outs):
        _check(out.prompt_logprobs, ids, _hf_prompt_logprobs(hf, ids), k=0)
    assert engine.block_manager.num_free_blocks == 40


def test_speculation_changes_neither_output_nor_prompt_logprobs():
    cfg = TINY_QWEN3
    model, _ = tiny_target(cfg)
    prompts = repetitive_prompts(4, cfg.vocab_size, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, prompt_logprobs=2, logprobs=1)
    plain = _generate(make_engine(model, cfg, budget=16), prompts, params)
    spec_engine = make_engine(model, cfg, budget=16, **ngram_engine_args())
    spec = _generate(spec_engine, prompts, params)
    assert spec_engine.metrics.num_drafts > 0
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids
        assert [e and (e.token_id, e.rank, [t for t, _ in e.top]) for e in a.prompt_logprobs] == \
            [e and (e.token_id, e.rank, [t for t, _ in e.top]) for e in b.prompt_logprobs]
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])) < ATOL


def test_requests_without_prompt_logprobs_are_unchanged():
    cfg = TINY_LLAMA
    model, _ = tiny_target(cfg)
    prompts = repetitive_prompts(4, cfg.vocab_size, seed=6)
    expected = run(make_engine(model, cfg, budget=16), prompts, greedy(12))
    mixed = [greedy(12, prompt_logprobs=1) if i % 2 else greedy(12) for i in range(len(prompts))]
    outs = _generate(make_engine(model, cfg, budget=16), prompts, mixed)
    assert [o.token_ids for o in outs] == expected
    assert [o.prompt_logprobs is None for o in outs] == [True, False, True, False]


def test_prompt_logprobs_are_validated():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


# -- the server: echo with logprobs (what eval harnesses read), max_tokens 0, vLLM's prompt_logprobs ---------
PROMPT = "abcabcab"


@pytest.fixture(scope="module")
def srv():
    from server_harness import build_tiny_model, make_engine as server_engine, serve
    with serve(server_engine(build_tiny_model())) as s:
        yield s


def _completion(srv, **fields):
    return srv.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "temperature": 0.0,
                                             "max_tokens": 4, "ignore_eos": True, **fields})


def _offline(srv, k: int) -> tuple[list[int], list]:
    """The prompt's ids and logprobs from the same weights through the offline path (tested above)."""
    from server_harness import CharTokenizer, make_engine as server_engine
    ids = CharTokenizer().encode(PROMPT)
    out = LLM(engine=server_engine(srv.engine.runner.model), tokenizer=None).generate(
        [ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=k), use_tqdm=False)[0]
    return ids, out.prompt_logprobs


def test_echo_with_logprobs_leads_with_the_prompt_tokens(srv):
    """lm-evaluation-harness's loglikelihood request: echo + logprobs returns every prompt token with its
    logprob (the first null) and its position's top k, then the generated ones."""
    ids, expected = _offline(srv, 1)
    body = _completion(srv, echo=True, logprobs=1).json()
    plain = _completion(srv, logprobs=1).json()["choices"][0]
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == PROMPT + plain["text"]
    n = len(ids)
    assert lp["tokens"][n:] == plain["logprobs"]["tokens"] and lp["token_logprobs"][n:] == \
        plain["logprobs"]["token_logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert "".join(lp["tokens"][:n]).endswith(PROMPT)
    for j in range(1, n):
        assert abs(lp["token_logprobs"][j] - expected[j].logprob) < 1e-5
        assert len(lp["top_logprobs"][j]) == 1
        assert list(lp["top_logprobs"][j].values())[0] >= lp["token_logprobs"][j] - 1e-6
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0


def test_max_tokens_0_with_echo_scores_the_prompt_alone(srv):
    ids, expected = _offline(srv, 0)
    body = _completion(srv, echo=True, logprobs=0, max_tokens=0).json()
    choice = body["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(ids)
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    assert [round(x, 5) for x in choice["logprobs"]["token_logprobs"][1:]] == \
        [round(e.logprob, 5) for e in expected[1:]]


def test_streamed_echo_with_logprobs_equals_the_whole_response(srv):
    from server_harness import stream_events
    import json
    whole = _completion(srv, echo=True, logprobs=2).json()["choices"][0]
    events = stream_events(srv, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "temperature": 0.0,
                                                     "max_tokens": 4, "ignore_eos": True, "echo": True,
                                                     "logprobs": 2, "stream": True})
    chunks = [json.loads(e)["choices"] for e in events[:-1]]
    choices = [c[0] for c in chunks if c]
    assert "".join(c["text"] for c in choices) == whole["text"]
    merged = {key: [x for c in choices if c["logprobs"] for x in c["logprobs"][key]]
              for key in ("tokens", "token_logprobs")}
    assert merged["tokens"] == whole["logprobs"]["tokens"]
    assert merged["token_logprobs"] == whole["logprobs"]["token_logprobs"]


def test_prompt_logprobs_refusals_name_the_field(srv):
    resp = _completion(srv, prompt_logprobs=1, stream=True)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt_logprobs"
    resp = _completion(srv, max_tokens=0)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"
    resp = _completion(srv, prompt_logprobs=21)
    assert resp.status_code == 400 and "prompt_logprobs" in resp.json()["error"]["message"]
