"""Fault isolation: a planted NaN draft logit, a planted drafter exception (propose and
extend_context) and out-of-range draft ids leave greedy output equal to plain decoding (counted in
num_draft_faults); NaN target logits fail only the request they belong to, loudly (offline: a
RuntimeError; served: a 500) while the others finish as plain decoding would; a tokenizer or
detokenizer exception is that request's 500 and the server keeps serving.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from dspark.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from dspark.drafters import build_drafter
from dspark.drafters.dspark import save_dspark
from dspark.engine.engine import Engine
from dspark.llm import LLM
from dspark.sampling import SamplingParams
from server_harness import MODEL, CharTokenizer, build_tiny_model, make_engine, serve
from tests.dspark_helpers import TARGET, random_model, random_target, tiny_cfg

PROMPTS = [[1, 17, 33, 60, 5, 9, 88, 21, 40], [1, 90, 4], list(range(3, 40)), [1, 5, 5, 5, 5, 5]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def target():
    return random_target(seed=7)


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    cfg = tiny_cfg(enable_confidence_head=True)
    path = tmp_path_factory.mktemp("faults") / "d"
    save_dspark(random_model(cfg, seed=3), cfg, path, dtype="float32")
    return path


def build(target, drafter_dir=None, **spec_kw) -> Engine:
    spec = None if drafter_dir is None else SpecConfig(
        method="dspark", model=str(drafter_dir), num_speculative_tokens=4, **spec_kw)
    config = EngineConfig(spec=spec, cache=CacheConfig(kv_block_size=4, num_kv_blocks=96),
                          scheduler=SchedulerConfig(max_num_batched_tokens=24))
    drafter = None if spec is None else build_drafter(spec, target_config=TARGET,
                                                      target_model=target, dtype=torch.float32,
                                                      device="cpu")
    return Engine(config, model=target, model_config=TARGET, drafter=drafter)


def run(engine: Engine, params=GREEDY, errors: dict | None = None) -> dict[str, list[int]]:
    """Every prompt to its end: request id -> its tokens; `errors` gets the failed ones' messages."""
    ids = [engine.add_request(p, params) for p in PROMPTS]
    out = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            if o.error is not None and errors is not None:
                errors[o.request_id] = o.error
    bm = engine.block_manager
    assert not engine.requests and bm.num_free_blocks == len(bm.blocks), "blocks leaked"
    bm.check_invariants()
    return out


@pytest.fixture(scope="module")
def plain(target):
    return list(run(build(target)).values())


def _plant(drafter, name: str, corrupt):
    real = getattr(drafter, name)
    calls = {"n": 0}

    def planted(*args, **kwargs):
        calls["n"] += 1
        return corrupt(calls["n"], real, *args, **kwargs)

    setattr(drafter, name, planted)
    return calls


@pytest.mark.parametrize("path", ["per-op", "one call"])
def test_nan_draft_logit_falls_back_to_plain_decoding(target, drafter_dir, plain, path):
    engine = build(target, drafter_dir)

    def nan_row0(n, real, batch):
        logits, hidden, prev = real(batch)  # [num_reqs, γ, vocab], [num_reqs, γ, d]
        logits[0, 1] = float("nan")  # a NaN draft logit; the confidence of that row follows
        hidden[0] = float("nan")
        return logits, hidden, prev

    def nan_conf_row0(n, real, *args, **kwargs):  # the greedy proposal in one kernel call (dspark_fused.py)
        out = real(*args, **kwargs)
        if out is not None and out[1] is not None:
            out[1][0] = float("nan")  # a NaN hidden row gives a NaN confidence there
        return out

    if path == "per-op":
        engine.drafter._fused_proposal = lambda batch: None
        calls = _plant(engine.drafter, "forward_blocks", nan_row0)
    else:
        calls = _plant(engine.drafter.model, "fused_proposal", nan_conf_row0)
    assert list(run(engine).values()) == plain
    assert calls["n"] > 0 and engine.metrics.num_draft_faults > 0
    assert engine.metrics.num_accepted_tokens > 0, "the other rows still speculate"


def test_nan_draft_logits_under_sampling_never_crash(target, drafter_dir):
    engine = build(target, drafter_dir, draft_sample_method="probabilistic")

    def nan_all(n, real, batch):
        logits, hidden, prev = real(batch)
        logits[:, :, 3] = float("nan")
        return logits, hidden, prev

    _plant(engine.drafter, "forward_blocks", nan_all)
    out = run(engine, SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=1))
    assert all(len(ids) == 12 and all(0 <= t < TARGET.vocab_size for t in ids)
               for ids in out.values())
    assert engine.metrics.num_draft_faults > 0


@pytest.mark.parametrize("where", ["propose", "extend_context"])
def test_drafter_exception_falls_back_to_plain_decoding(target, drafter_dir, plain, where):
    engine = build(target, drafter_dir)

    def boom(n, real, *args):
        if n == 3:
            raise RuntimeError("planted drafter fault")
        return real(*args)

    _plant(engine.drafter, where, boom)
    assert list(run(engine).values()) == plain
    assert engine.metrics.num_draft_faults > 0
    # the engine goes on: a new request after the fault speculates and matches plain decoding
    assert list(run(engine).values()) == plain


def test_out_of_range_draft_ids_are_dropped(target, drafter_dir, plain):
    engine = build(target, drafter_dir)

    def bad_ids(n, real, batch):
        proposal = real(batch)
        proposal.draft_ids[0, 0] = TARGET.vocab_size + 5
        proposal.draft_ids[-1, -1] = -1
        return proposal

    _plant(engine.drafter, "propose", bad_ids)
    assert list(run(engine).values()) == plain
    assert engine.metrics.num_draft_faults > 0


def _nan_target_row(engine: Engine, at_step: int):
    real = engine.runner.forward

    def forward(batch, **kw):
        logits, taps = real(batch, **kw)
        if engine.metrics.num_steps == at_step:
            logits = logits.clone()
            logits[0] = float("nan")
        return logits, taps

    engine.runner.forward = forward


@pytest.mark.parametrize("speculative", [False, True])
def test_nan_target_logits_fail_that_request_only(target, drafter_dir, plain, speculative):
    engine = build(target, drafter_dir if speculative else None)
    _nan_target_row(engine, at_step=6)
    failed = {}
    out = run(engine, errors=failed)
    assert len(failed) == 1 and "non-finite logits" in next(iter(failed.values()))
    for rid, ids, want in zip(out, out.values(), plain):
        if rid in failed:
            assert len(ids) < len(want) and ids == want[:len(ids)], "nothing after the NaN"
        else:
            assert ids == want
    assert engine.metrics.num_failed_requests == 1


def test_nan_target_logits_raise_offline(target):
    engine = build(target)
    _nan_target_row(engine, at_step=2)
    with pytest.raises(RuntimeError, match="non-finite logits"):
        LLM(engine=engine, tokenizer=None).generate(PROMPTS, GREEDY)


# -- served ----------------------------------------------------------------------------------------
class FaultyTokenizer(CharTokenizer):
    """Raises on a prompt holding "BOOM", and in decode while `fail_decode` is set."""

    fail_decode = False

    def encode(self, text: str) -> list[int]:
        if "BOOM" in text:
            raise RuntimeError("planted tokenizer fault")
        return super().encode(text)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        if self.fail_decode and ids:
            raise RuntimeError("planted detokenizer fault")
        return super().decode(ids, skip_special_tokens)


def test_served_faults_are_500s_and_the_server_keeps_serving():
    engine = make_engine(build_tiny_model())
    _nan_target_row(engine, at_step=4)
    tokenizer = FaultyTokenizer()
    with serve(engine, tokenizer=tokenizer) as srv:
        resp = srv.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 20,
                                                 "ignore_eos": True})
        assert resp.status_code == 500 and "non-finite logits" in resp.json()["error"]["message"]
        resp = srv.post("/v1/completions", json={"model": MODEL, "prompt": "BOOM"})
        assert resp.status_code == 500
        assert "planted tokenizer fault" in resp.json()["error"]["message"]
        tokenizer.fail_decode = True
        resp = srv.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 5})
        tokenizer.fail_decode = False
        assert resp.status_code == 500
        assert "planted detokenizer fault" in resp.json()["error"]["message"]
        srv.wait_idle()
        assert httpx.get(srv.base_url + "/health").status_code == 200
        ok = srv.post("/v1/completions", json={"model": MODEL, "prompt": "fine", "max_tokens": 3})
        assert ok.status_code == 200
        assert srv.metrics()[("vllm:num_requests_failed_total", ())] == 2


def test_nonfinite_and_misshapen_draft_probs_are_dropped(target, drafter_dir):
    """Probabilistic drafting: NaN, negative or wrongly shaped draft distributions never reach
    rejection sampling (which would raise on the shape and mis-sample on NaN)."""
    engine = build(target, drafter_dir, draft_sample_method="probabilistic")

    def bad_probs(n, real, batch):
        proposal = real(batch)
        if proposal.draft_probs is not None:
            probs = [None if p is None else p.clone() for p in proposal.draft_probs]
            probs[0] = [probs[0][:, :5], -probs[0], probs[0] * float("nan")][n % 3]
            proposal.draft_probs = probs
        return proposal

    _plant(engine.drafter, "propose", bad_probs)
    out = run(engine, SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=2))
    assert all(len(ids) == 12 for ids in out.values())
    assert engine.metrics.num_draft_faults > 0


@pytest.mark.parametrize("seed", range(4))
def test_proposal_check_equals_a_row_by_row_scan(seed):
    """faulty_proposal_rows (a whole-tensor pass first, the row-by-row masks where it fails) against a plain
    scan of each row's valid positions: planted bad ids and confidences (NaN, ±inf, < 0, > 1), in valid
    positions and past them, in int64/fp32 and bf16 confidences."""
    from dspark.drafters.base import DraftProposal
    from dspark.speculation.faults import faulty_proposal_rows

    g = torch.Generator().manual_seed(seed)
    vocab, gamma = 50, 5
    bad_ids, bad_conf = [-1, vocab, vocab + 7], [float("nan"), float("inf"), -float("inf"), -0.1, 1.5]
    for trial in range(60):
        num_reqs = int(torch.randint(1, 5, (1,), generator=g))
        ids = torch.randint(0, vocab, (num_reqs, gamma), generator=g)
        conf = torch.rand(num_reqs, gamma, generator=g)
        num_valid = torch.randint(0, gamma + 1, (num_reqs,), generator=g).tolist()
        for _ in range(int(torch.randint(0, 3, (1,), generator=g))):  # trials without plants: the fast path
            r, j = int(torch.randint(0, num_reqs, (1,), generator=g)), int(torch.randint(0, gamma, (1,), generator=g))
            if trial % 2:
                ids[r, j] = bad_ids[trial % len(bad_ids)]
            else:
                conf[r, j] = bad_conf[trial % len(bad_conf)]
        expected = [r for r in range(num_reqs)
                    if any(not 0 <= int(ids[r, j]) < vocab or not 0.0 <= float(conf[r, j]) <= 1.0
                           for j in range(num_valid[r]))]
        for c in (conf, conf.bfloat16(), None):
            want = expected if c is not None else [r for r in range(num_reqs) if any(
                not 0 <= int(ids[r, j]) < vocab for j in range(num_valid[r]))]
            proposal = DraftProposal(draft_ids=ids, draft_probs=None, confidence=c, num_valid=num_valid)
            assert faulty_proposal_rows(proposal, vocab_size=vocab, num_valid=num_valid) == want
