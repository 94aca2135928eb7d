"""Confidence-scheduled verification on the serving path, end to end on a tiny random Llama target
with a random-weight DSpark drafter (Markov + confidence heads):

* greedy parity, token for token, under every length policy (fixed K ∈ {1, 3, γ}, threshold,
  prefix with a synthetic cost table, async) with prompts arriving while the engine steps, a long
  prompt chunked across steps, and prompt coalescing on; speculation stays on in mixed steps
  (a prompt chunk and a verify window with drafts in one step);
* a flat cost curve admits every draft (verify_lens == proposal lengths), a steep one fewer;
* fail-closed configuration through `build_engine` (prefix/async without a cost table, threshold
  with n-gram, a DSpark checkpoint without a confidence head);
* the coalescing cost per request (StepOutput.coalesce_held_steps) and the /metrics surface
  (verify budget, wasted tokens, τ gauge, per-position acceptance, cost table, coalescing);
* online upkeep (dspark/verify/upkeep.py): moves the cost table and the temperatures toward the
  truth, stays bounded, is a no-op when switched off, and keeps greedy parity in the engine.

    pytest tests/test_scheduled_verification.py -q
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from dspark.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from dspark.drafters import build_drafter
from dspark.drafters.dspark import build as build_dspark
from dspark.drafters.dspark import save_dspark
from dspark.drafters.dspark_config import dspark_config_for_target
from dspark.drafters.dspark_model import DSparkModel
from dspark.engine.engine import Engine
from dspark.verify.calibration import OnlineCalibrationConfig
from dspark.verify.cost_table import CostTable
from dspark.verify.length_policy import (AsyncPrefixScheduler, ConfidenceThreshold, FixedLength,
                                         PrefixScheduler)
from dspark.verify.upkeep import OnlineUpkeep, UpkeepConfig
from tests.conftest import TINY_LLAMA
from tests.engine_helpers import greedy, make_engine, repetitive_prompts, run, tiny_target

GAMMA = 4
BUDGET = 64  # tokens per step: a 150-token prompt takes several chunks; coalescing holds 1 prompt
MAX_TOKENS = 20
# Mildly rising step time: the prefix scheduler admits some drafts and not others.
MILD = CostTable(num_tokens=[1, 8, 16, 32, 64], steps_per_second=[100.0, 95.0, 80.0, 60.0, 35.0])
FLAT = CostTable(num_tokens=[1, 512], steps_per_second=[100.0, 100.0])
STEEP = CostTable(num_tokens=[1, 2, 4, 8, 16, 32, 64],  # time ∝ B
                  steps_per_second=[64.0, 32.0, 16.0, 8.0, 4.0, 2.0, 1.0])


# -- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target():
    model, hf = tiny_target(TINY_LLAMA, seed=0)
    return model, hf


def _random_drafter_model(cfg, seed: int) -> DSparkModel:
    torch.manual_seed(seed)
    model = DSparkModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn_like(p)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.3 * noise)
    return model.eval()


def _save_drafter(path, *, confidence: bool = True, bigrams: dict[int, int] | None = None) -> str:
    """A random DSpark checkpoint; with `bigrams` (prev → next target id) its Markov head is a
    full-rank bigram table that dominates the random base logits, and its confidence is high after
    a known predecessor, so drafts are often accepted (the accept path is exercised) and the
    confidence carries signal for the adaptive policies."""
    vocab = TINY_LLAMA.vocab_size
    cfg = dspark_config_for_target(TINY_LLAMA, num_hidden_layers=1, block_size=GAMMA,
                                   tap_layer_ids=(-1, 0, 1), markov_rank=vocab if bigrams else 8,
                                   enable_confidence_head=confidence)
    model = _random_drafter_model(cfg, seed=3)
    if bigrams:
        known = torch.zeros(vocab)  # [vocab] 1 for a predecessor with a known successor
        with torch.no_grad():
            model.markov_head.markov_w1.weight.copy_(torch.eye(vocab))
            table = model.markov_head.markov_w2.weight  # [vocab (next), vocab (prev)]
            table.zero_()
            for prev, nxt in bigrams.items():
                table[nxt, prev] = 30.0
                known[prev] = 1.0
            if confidence:
                model.confidence_head.proj.weight[0, cfg.hidden_size:] = 4.0 * known - 2.0
    save_dspark(model, cfg, path, dtype="float32")
    return str(path)


def _bigrams(prompts, outputs) -> dict[int, int]:
    """The most frequent successor of each token in the prompts' greedy continuations."""
    counts: dict[int, dict[int, int]] = {}
    for prompt, out in zip(prompts, outputs):
        seq = prompt[-1:] + out
        for a, b in zip(seq, seq[1:]):
            counts.setdefault(a, {}).setdefault(b, 0)
            counts[a][b] += 1
    return {a: max(succ, key=succ.get) for a, succ in counts.items()}


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, plain_outputs):
    return _save_drafter(tmp_path_factory.mktemp("dspark_drafter"),
                         bigrams=_bigrams(_prompts(), plain_outputs))


def _spec(drafter_dir, **kw) -> SpecConfig:
    kw.setdefault("measured_switch", False)  # the clock would decide (tested with scripted decisions)
    return SpecConfig(method="dspark", model=drafter_dir, num_speculative_tokens=GAMMA, **kw)


def _spec_engine(target, drafter_dir, policy, *, cost=None, coalesce_steps=2, **spec_kw) -> Engine:
    model, _ = target
    spec = _spec(drafter_dir, **spec_kw)
    drafter = build_drafter(spec, target_config=TINY_LLAMA, target_model=model, dtype=torch.float32,
                            device="cpu")
    config = EngineConfig(
        cache=CacheConfig(kv_block_size=4, num_kv_blocks=512),
        scheduler=SchedulerConfig(max_num_batched_tokens=BUDGET, max_num_seqs=16,
                                  coalesce_steps=coalesce_steps), spec=spec)
    return Engine(config, model=model, model_config=TINY_LLAMA, drafter=drafter,
                  length_policy=policy, cost_table=cost)


def _prompts() -> list[list[int]]:
    long_prompt = torch.randint(3, TINY_LLAMA.vocab_size, (150,),
                                generator=torch.Generator().manual_seed(11)).tolist()
    return repetitive_prompts(5, TINY_LLAMA.vocab_size, seed=1) + [long_prompt, [1, 90, 4]]


ARRIVAL_STEPS = [0, 0, 0, 3, 6, 9, 9]  # the long prompt (index 5) arrives while 4 requests decode


@pytest.fixture(scope="module")
def plain_outputs(target):
    model, _ = target
    return run(make_engine(model, TINY_LLAMA, budget=BUDGET), _prompts(), greedy(MAX_TOKENS))


@dataclasses.dataclass
class StagedRun:
    outputs: list[list[int]]
    held_steps: list[int]  # per request, from its finishing StepOutput
    steps: list[list[tuple[bool, int]]]  # per step: (is a prompt chunk, num_drafts) per item


def run_staged(engine: Engine, prompts, params, arrival_steps) -> StagedRun:
    """Add prompt i at step arrival_steps[i] while the engine runs; record each step's schedule."""
    steps: list[list[tuple[bool, int]]] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        steps.append([(s.start_pos < len(s.request.prompt_ids), s.num_drafts)
                      for s in out.scheduled])
        return out

    engine.scheduler.schedule = recording_schedule
    ids: dict[int, str] = {}
    tokens: dict[str, list[int]] = {}
    held: dict[str, int] = {}
    step = 0
    while len(ids) < len(prompts) or engine.has_unfinished():
        for i, prompt in enumerate(prompts):
            if arrival_steps[i] == step:
                ids[i] = engine.add_request(prompt, params)
                tokens[ids[i]] = []
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
            if o.finished:
                held[o.request_id] = o.coalesce_held_steps
        step += 1
        assert step < 2000, "the engine did not finish"
    return StagedRun([tokens[ids[i]] for i in range(len(prompts))],
                     [held[ids[i]] for i in range(len(prompts))], steps)


def _mixed_steps(steps) -> int:
    """Steps carrying a prompt chunk AND a verify window with at least one draft."""
    return sum(any(chunk for chunk, _ in items) and any(n > 0 for _, n in items) for items in steps)


def _mismatches(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x != y for ra, rb in zip(a, b) for x, y in zip(ra, rb)) + sum(
        abs(len(ra) - len(rb)) for ra, rb in zip(a, b))


# -- greedy parity under every policy --------------------------------------------------------------
POLICIES = {
    "fixed1": (lambda: FixedLength(1), None),
    "fixed3": (lambda: FixedLength(3), None),
    "fixedG": (lambda: FixedLength(GAMMA), None),
    "threshold": (lambda: ConfidenceThreshold(0.3), None),
    "prefix": (lambda: PrefixScheduler(), MILD),
    "async": (lambda: AsyncPrefixScheduler(cold_start_len=GAMMA), MILD),
}


@pytest.mark.parametrize("name", list(POLICIES))
def test_greedy_parity_every_policy_with_arrivals_and_coalescing(target, drafter_dir, plain_outputs,
                                                                 name):
    make_policy, cost = POLICIES[name]
    engine = _spec_engine(target, drafter_dir, make_policy(), cost=cost, coalesce_steps=2)
    staged = run_staged(engine, _prompts(), greedy(MAX_TOKENS), ARRIVAL_STEPS)
    assert _mismatches(staged.outputs, plain_outputs) == 0, name
    m = engine.metrics
    assert m.num_accepted_tokens > 0 and m.num_wasted_verify_tokens > 0, \
        "both the accept and the reject path must be exercised"
    assert max(staged.held_steps) > 0, "coalescing never held a prompt"
    assert max(staged.held_steps) <= 2, "coalescing must stay bounded by coalesce_steps"
    assert any(chunk and len(items) > 1 for items in staged.steps for chunk, _ in items), \
        "no prompt chunk ever shared a step with decoding requests"
    if name.startswith("fixed"):
        assert _mixed_steps(staged.steps) > 0, "speculation must stay on while a prompt is chunked"
    bm = engine.block_manager
    assert bm.num_free_blocks == len(bm.blocks)


def test_speculation_stays_on_while_a_long_prompt_is_chunked(target, drafter_dir):
    engine = _spec_engine(target, drafter_dir, PrefixScheduler(), cost=FLAT, coalesce_steps=0)
    staged = run_staged(engine, _prompts(), greedy(MAX_TOKENS), ARRIVAL_STEPS)
    long_chunks = [items for items in staged.steps
                   if any(chunk for chunk, _ in items) and any(n == GAMMA for _, n in items)]
    assert len(long_chunks) >= 2, "decoding requests must verify full windows during prefill"


# -- the cost curve drives admission ---------------------------------------------------------------
def test_flat_curve_admits_every_draft_steep_curve_fewer(target, drafter_dir, plain_outputs):
    results = {}
    for label, cost in (("flat", FLAT), ("steep", STEEP)):
        # the policy alone (the draft gate would skip whole steps under the steep curve: tested below)
        engine = _spec_engine(target, drafter_dir, PrefixScheduler(), cost=cost, coalesce_steps=0,
                              draft_gate=False)
        staged = run_staged(engine, _prompts(), greedy(MAX_TOKENS), ARRIVAL_STEPS)
        assert _mismatches(staged.outputs, plain_outputs) == 0, label
        results[label] = list(engine.metrics.verify_lens)
    flat, steep = results["flat"], results["steep"]
    assert flat and all(v == GAMMA for v in flat), "flat: every draft with survival > 0 is admitted"
    assert sum(steep) < sum(flat)
    # time ∝ B at the table's points (SPS is interpolated between them): a draft costs about what a token
    # earns, and a prompt chunk sharing the step is charged to the prompt, so only near-certain drafts pay
    assert steep.count(0) > len(steep) // 2


@dataclasses.dataclass(frozen=True)
class _RecordingPrefix(PrefixScheduler):
    calls: list = dataclasses.field(default_factory=list)

    def choose(self, **kw):
        lengths = super().choose(**kw)
        self.calls.append({**{k: kw.get(k) for k in ("num_reqs", "num_nondraft_tokens", "num_prompt_tokens",
                                                     "num_drafted_reqs", "max_drafts")},
                           "admitted": sum(lengths)})
        return lengths


@pytest.mark.parametrize("ngram_first", [False, True])
def test_engine_prices_prompt_chunks_and_free_lookup_rows(target, drafter_dir, plain_outputs, ngram_first):
    """The policy learns which of the next step's tokens are prompt chunks (the long prompt arrives at
    step 6 and takes several 64-token chunks), how many rows the model drafter ran for, and the budget
    the prompts leave: drafts never push prompt tokens out of a step (no model draft at all while the
    prompts need the whole budget)."""
    policy = _RecordingPrefix()
    engine = _spec_engine(target, drafter_dir, policy, cost=FLAT, coalesce_steps=0, draft_gate=False,
                          ngram_first=ngram_first)
    staged = run_staged(engine, _prompts(), greedy(MAX_TOKENS), ARRIVAL_STEPS)
    assert _mismatches(staged.outputs, plain_outputs) == 0
    calls = policy.calls
    assert calls and all(0 <= c["num_prompt_tokens"] <= c["num_nondraft_tokens"] - c["num_reqs"] for c in calls)
    assert any(c["num_prompt_tokens"] > 0 for c in calls), "the long prompt's chunks were not seen"
    assert all(c["admitted"] <= c["max_drafts"] for c in calls), "drafts displaced prompt tokens"
    if not ngram_first:  # the model is not asked while the prompts take the budget
        assert all(c["max_drafts"] > 0 for c in calls)
    assert all(0 <= c["num_drafted_reqs"] <= c["num_reqs"] for c in calls)
    lookup_rows = [c["num_reqs"] - c["num_drafted_reqs"] for c in calls]
    if ngram_first:
        assert any(lookup_rows) and any(c["num_drafted_reqs"] for c in calls), "both sources must draft"
    else:
        assert not any(lookup_rows)


# -- the draft gate ----------------------------------------------------------------------------------
# drafting costs as much as 5 one-token steps: only a long run of near-certain drafts could pay
COSTLY_DRAFTS = CostTable(num_tokens=[1, 8, 16, 32, 64], steps_per_second=[100.0, 95.0, 80.0, 60.0, 35.0],
                          draft_num_reqs=[1, 16], draft_seconds=[0.05, 0.05])


@pytest.mark.parametrize("policy", ["prefix", "async"])
def test_draft_gate_skips_unprofitable_steps_and_stays_lossless(target, drafter_dir, plain_outputs, policy):
    make_policy = POLICIES[policy][0]
    engine = _spec_engine(target, drafter_dir, make_policy(), cost=COSTLY_DRAFTS, coalesce_steps=2)
    staged = run_staged(engine, _prompts(), greedy(MAX_TOKENS), ARRIVAL_STEPS)
    assert _mismatches(staged.outputs, plain_outputs) == 0
    m = engine.metrics
    assert m.num_draft_skips > 0, "drafting at 5 steps' cost must be skipped"
    assert m.num_drafts > 0, "the gate must still probe (draft every probe_every steps)"
    bm = engine.block_manager
    assert bm.num_free_blocks == len(bm.blocks)
    # with the gate off the same policy drafts every step
    ungated = _spec_engine(target, drafter_dir, make_policy(), cost=COSTLY_DRAFTS, coalesce_steps=2,
                           draft_gate=False)
    run_staged(ungated, _prompts(), greedy(MAX_TOKENS), ARRIVAL_STEPS)
    assert ungated.metrics.num_draft_skips == 0 and ungated.draft_gate is None


def test_skipped_requests_defer_drafter_context_and_draft_the_same(target, drafter_dir, plain_outputs):
    """While the gate skips a request its drafter context waits (no drafter work in that step) and is
    extended, with the proposing step's positions, in one call. Same scripted gate decisions with and
    without deferral: every proposal (draft ids; confidences up to rounding) and every output are the
    same, and the drafter's context is extended in fewer calls."""
    runs = []
    for defer in (True, False):
        # fp32 products: bf16 ones switch on by batch size (`Linear.LOWP_MIN_ROWS`), and deferral
        # changes the batch sizes of context extension
        engine = _spec_engine(target, drafter_dir, PrefixScheduler(), cost=MILD, coalesce_steps=2,
                              draft_matmul_dtype="float32")
        if not defer:
            engine.MAX_DEFERRED_BYTES = 0
        step = {"n": 0}
        # drafting in 2 of every 7 steps, per request in turn; the rest plain
        engine.draft_gate.drafted_requests = lambda *, num_reqs, **_: (
            [i for i in range(num_reqs) if (step["n"] + i) % 7 in (0, 3)])
        calls = {"extend": 0, "propose": []}
        extend, propose = engine.drafter.extend_context, engine.drafter.propose

        def counted_extend(update, _f=extend):
            calls["extend"] += 1
            return _f(update)

        def recorded_propose(batch, _f=propose):
            out = _f(batch)
            calls["propose"].append(([r.request_id for r in batch.requests], out.draft_ids.tolist(),
                                     out.confidence.tolist()))
            return out
        engine.drafter.extend_context, engine.drafter.propose = counted_extend, recorded_propose
        original_step = engine.step

        def counting_step(_f=original_step):
            step["n"] += 1
            return _f()
        engine.step = counting_step
        staged = run_staged(engine, _prompts(), greedy(MAX_TOKENS), ARRIVAL_STEPS)
        assert _mismatches(staged.outputs, plain_outputs) == 0
        bm = engine.block_manager
        assert bm.num_free_blocks == len(bm.blocks)
        runs.append((calls, engine.metrics.num_steps))
    (deferred, steps), (eager, _) = runs
    assert len(deferred["propose"]) == len(eager["propose"]) > 3
    for (ids_d, drafts_d, conf_d), (ids_e, drafts_e, conf_e) in zip(deferred["propose"], eager["propose"]):
        assert ids_d == ids_e and drafts_d == drafts_e, "deferral changed a proposal"
        # the context K/V were computed over differently shaped batches: equal up to rounding
        assert torch.allclose(torch.tensor(conf_d), torch.tensor(conf_e), atol=1e-5)
    assert deferred["extend"] < eager["extend"] <= steps, (deferred["extend"], eager["extend"])


def test_proposing_stops_where_even_lookup_drafts_cannot_pay_and_output_is_unchanged(target, drafter_dir,
                                                                                     plain_outputs):
    """On a step-cost curve linear in the batch (every size profiled, drafter time as dear) neither the
    model nor prompt lookup can pay: after the first lookup proposals the engine stops proposing (a
    probe now and then), and the output is plain decoding's. On a flat curve it never stops."""
    sizes = list(range(1, 257))
    linear = CostTable(num_tokens=sizes, steps_per_second=[100.0 / b for b in sizes],
                       draft_num_reqs=[1, 64], draft_seconds=[0.05, 0.05])
    counts = {}
    for name, cost in (("linear", linear), ("flat", FLAT)):
        engine = _spec_engine(target, drafter_dir, PrefixScheduler(), cost=cost, coalesce_steps=2,
                              ngram_first=True)
        staged = run_staged(engine, _prompts(), greedy(MAX_TOKENS), ARRIVAL_STEPS)
        assert _mismatches(staged.outputs, plain_outputs) == 0
        counts[name] = (engine.metrics.num_proposal_skips, engine.metrics.num_steps)
        assert engine.block_manager.num_free_blocks == len(engine.block_manager.blocks)
    skips, steps = counts["linear"]
    assert skips > steps // 2, counts
    assert counts["flat"][0] == 0, counts


@pytest.mark.parametrize("budget_rows", [None, 6])
def test_a_closed_gate_extends_prompts_only_and_bounds_the_kept_taps(target, drafter_dir, plain_outputs,
                                                                     budget_rows):
    """With the gate closed for good, the drafter context covers the prompts (their drafter K/V make a
    later prefix hit a draft hit) and no generated position: those wait, and are dropped when their
    request finishes. Under a small budget of kept taps the longest backlogs are extended instead, and
    after every step the kept taps fit the budget. Output equals plain decoding either way."""
    engine = _spec_engine(target, drafter_dir, PrefixScheduler(), cost=MILD, coalesce_steps=2,
                          draft_matmul_dtype="float32")
    prompts = _prompts()
    row_bytes = len(engine.drafter.tap_layer_ids) * TINY_LLAMA.hidden_size * 4  # fp32 taps
    if budget_rows is not None:
        engine.MAX_DEFERRED_BYTES = budget_rows * row_bytes
    engine.draft_gate.drafted_requests = lambda **_: []
    extended: list[tuple[str, int, int]] = []  # (request id, first position, positions)
    prompt_len: dict[str, int] = {}
    extend = engine.drafter.extend_context

    def recorded_extend(update, _f=extend):
        extended.extend((s.request_id, s.start_pos, len(s.token_ids)) for s in update.segments)
        prompt_len.update((s.request_id, len(engine.requests[s.request_id].prompt_ids)) for s in update.segments)
        return _f(update)
    engine.drafter.extend_context = recorded_extend
    kept: list[int] = []
    original_step = engine.step

    def step_noting_backlog(_f=original_step):
        out = _f()
        kept.append(sum(r.num_pending_positions for r in engine.requests.values()))
        return out
    engine.step = step_noting_backlog
    staged = run_staged(engine, prompts, greedy(MAX_TOKENS), ARRIVAL_STEPS)
    assert _mismatches(staged.outputs, plain_outputs) == 0
    assert engine.metrics.num_draft_tokens == 0
    covered: dict[str, int] = {}
    for rid, start, n in extended:
        # (a request may start past a prefix-cache hit that carried the drafter's K/V)
        assert start == covered.get(rid, start) and (rid in covered or start < prompt_len[rid]), \
            "drafter context extended out of order"
        covered[rid] = start + n
    assert len(covered) == len(prompts)
    if budget_rows is None:  # the prompts and nothing generated
        assert all(covered[rid] == prompt_len[rid] for rid in covered), (covered, prompt_len)
        assert max(kept) > 6, "the budget case below would not bind"
    else:
        assert max(kept) <= budget_rows, kept
        assert any(covered[rid] > prompt_len[rid] for rid in covered), "the budget flushed nothing"
    assert engine.block_manager.num_free_blocks == len(engine.block_manager.blocks)


def test_requests_admitted_while_the_gate_stays_closed_get_no_drafter_context(target, drafter_dir, plain_outputs):
    """A request admitted where the gate says drafting cannot pay at its load (`admits_model_drafting`, scripted
    here; its rule is tested in test_length_policy) gets no drafter context: no extension over its prompt, no taps in steps that carry only such requests, never a
    model proposal (prompt lookup still drafts for it), and its prefix-cache hits need no drafter K/V.
    Requests admitted before the gate closed keep theirs. Output equals plain decoding."""
    engine = _spec_engine(target, drafter_dir, PrefixScheduler(), cost=MILD, coalesce_steps=2, ngram_first=True)
    gate = engine.draft_gate
    closed_from = 3  # the first three prompts are admitted while the gate is open
    engine.draft_gate.drafted_requests = lambda *, num_reqs, **_: []  # the gate never lets the model draft
    admitted: dict[str, bool] = {}
    admit = engine.scheduler.admit_model_drafting

    gate.admits_model_drafting = lambda **_: len(admitted) < closed_from  # (the gate's rule: test_length_policy)

    def recording_admit(_f=admit):
        ok = _f()
        admitted[f"n{len(admitted)}"] = ok
        return ok
    engine.scheduler.admit_model_drafting = recording_admit
    extended: set[str] = set()
    extend = engine.drafter.extend_context

    def recorded_extend(update, _f=extend):
        extended.update(s.request_id for s in update.segments)
        return _f(update)
    engine.drafter.extend_context = recorded_extend
    forward, taps_seen = engine.runner.forward, []

    def recorded_forward(batch, *, with_taps=True, _f=forward):
        logits, taps = _f(batch, with_taps=with_taps)
        taps_seen.append((with_taps, taps is not None))
        return logits, taps
    engine.runner.forward = recorded_forward
    prompts = _prompts()
    staged = run_staged(engine, prompts, greedy(MAX_TOKENS), ARRIVAL_STEPS)
    assert _mismatches(staged.outputs, plain_outputs) == 0
    assert list(admitted.values()) == [True] * closed_from + [False] * (len(prompts) - closed_from)
    early = {f"req-{i}" for i in range(closed_from)}  # (the engine's ids follow the arrival order)
    assert extended == early, "drafter context for a request admitted while the gate was closed"
    assert all(w == t for w, t in taps_seen) and (False, False) in taps_seen
    assert engine.metrics.num_lookup_drafts > 0, "prompt lookup must still draft for them"
    # the same prompts again, all admitted lookup-only: they take the prefix hits of blocks without drafter
    # K/V (the later requests' blocks), which a request with a drafter context could not
    again = engine.add_request(prompts[-2], greedy(MAX_TOKENS))
    engine.step()
    assert engine.requests[again].num_cached_tokens > 0 and not engine.requests[again].model_drafting
    while engine.has_unfinished():
        engine.step()
    assert engine.metrics.num_admitted_without_drafter == len(prompts) - closed_from + 1
    assert engine.block_manager.num_free_blocks == len(engine.block_manager.blocks)


def test_a_load_measured_off_proposes_nothing_and_admits_without_drafter_context(target, drafter_dir, plain_outputs):
    """Where the measured switch (dspark/verify/switch.py; its rule: tests/test_switch.py) has found
    speculation slower than plain decoding, scripted here for every load: no proposal at all (lookup
    included), no drafts verified, every request admitted without drafter context (no extension, no taps),
    and output equal to plain decoding. Off in the config, the engine has no switch."""
    engine = _spec_engine(target, drafter_dir, PrefixScheduler(), cost=FLAT, coalesce_steps=2, ngram_first=True,
                          measured_switch=True)
    switch = engine.switch
    switch.propose = lambda **_: False  # every load measured off, and no speculative probe in this run
    switch.is_off = lambda **_: True
    proposed: list[int] = []
    propose = engine.drafter.propose

    def recorded_propose(batch, _f=propose):
        proposed.append(len(batch.requests))
        return _f(batch)
    engine.drafter.propose = recorded_propose
    extended: list[str] = []
    extend = engine.drafter.extend_context

    def recorded_extend(update, _f=extend):
        extended.extend(s.request_id for s in update.segments)
        return _f(update)
    engine.drafter.extend_context = recorded_extend
    prompts = _prompts()
    staged = run_staged(engine, prompts, greedy(MAX_TOKENS), ARRIVAL_STEPS)
    assert _mismatches(staged.outputs, plain_outputs) == 0
    assert proposed == [] and extended == []
    assert engine.metrics.num_draft_tokens == 0 and engine.metrics.num_measured_off_steps > 0
    assert engine.metrics.num_admitted_without_drafter == len(prompts)
    assert engine.block_manager.num_free_blocks == len(engine.block_manager.blocks)
    assert _spec_engine(target, drafter_dir, PrefixScheduler(), cost=FLAT, measured_switch=False).switch is None


@pytest.mark.parametrize("policy", ["prefix", "async"])
def test_a_switch_turning_on_and_off_keeps_greedy_parity(target, drafter_dir, plain_outputs, policy):
    """Speculation switched off and on again mid-request (scripted: three steps on, two off, over and over):
    drafts proposed before an "off" step are still verified in it, none are proposed in it, and the output
    equals plain decoding."""
    engine = _spec_engine(target, drafter_dir, PrefixScheduler() if policy == "prefix" else AsyncPrefixScheduler(),
                          cost=FLAT, coalesce_steps=2, ngram_first=True, measured_switch=True)
    pattern = itertools.cycle([True, True, True, False, False])
    engine.switch.propose = lambda **_: next(pattern)
    staged = run_staged(engine, _prompts(), greedy(MAX_TOKENS), ARRIVAL_STEPS)
    assert _mismatches(staged.outputs, plain_outputs) == 0
    assert engine.metrics.num_draft_tokens > 0 and engine.metrics.num_measured_off_steps > 0
    assert engine.block_manager.num_free_blocks == len(engine.block_manager.blocks)


# -- fail closed --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target_dir(target, tmp_path_factory):
    _, hf = target
    path = tmp_path_factory.mktemp("tiny_target")
    hf.config.save_pretrained(path)  # the checks fail before any weight is read
    return str(path)


@pytest.mark.parametrize("case", ["prefix_no_cost", "async_no_cost", "threshold_ngram",
                                  "prefix_ngram", "threshold_no_head"])
def test_build_engine_fails_closed(target_dir, drafter_dir, tmp_path, case):
    from dspark.engine.build import build_engine

    spec, expected = {
        "prefix_no_cost": (_spec(drafter_dir, length_policy="prefix"), "cost table"),
        "async_no_cost": (_spec(drafter_dir, length_policy="async"), "cost table"),
        "threshold_ngram": (SpecConfig(method="ngram", length_policy="threshold"),
                            "confidence head"),
        "prefix_ngram": (SpecConfig(method="ngram", length_policy="prefix",
                                    cost_table=str(tmp_path / "c.json")), "confidence head"),
        "threshold_no_head": (_spec(_save_drafter(tmp_path / "nohead", confidence=False),
                                    length_policy="threshold"), "confidence head"),
    }[case]
    with pytest.raises(ValueError, match=expected):
        build_engine(EngineConfig(model=target_dir, spec=spec))


@pytest.mark.parametrize("table_dtype,engine_dtype", [(None, "bfloat16"), ("bfloat16", "float32")])
def test_build_engine_refuses_a_cost_table_of_another_matmul_dtype(target_dir, drafter_dir, tmp_path,
                                                                  table_dtype, engine_dtype):
    """A table profiled with fp32 products prices bf16 steps ~2x too high (and the reverse): refused
    before any weight loads, naming both dtypes (a table without the field is an fp32 one)."""
    from dspark.engine.build import build_engine
    meta = {} if table_dtype is None else {"matmul_dtype": table_dtype}
    path = tmp_path / "cost.json"
    CostTable(num_tokens=[1, 8], steps_per_second=[50.0, 30.0], meta=meta).save(path)
    spec = _spec(drafter_dir, length_policy="prefix", cost_table=str(path))
    with pytest.raises(ValueError, match=f"profiled with {table_dtype or 'float32'} .* multiplies in {engine_dtype}"):
        build_engine(EngineConfig(model=target_dir, spec=spec, matmul_dtype=engine_dtype))


def test_matmul_dtype_is_validated():
    with pytest.raises(ValueError, match="matmul_dtype must be"):
        EngineConfig(matmul_dtype="int8")
    with pytest.raises(ValueError, match="applies to dtype float32"):
        EngineConfig(dtype="bfloat16", matmul_dtype="bfloat16")
    EngineConfig(dtype="bfloat16", matmul_dtype="auto")  # resolves to the dtype's own products


# -- /metrics -------------------------------------------------------------------------------------
def test_metrics_scrape_scheduled_verification(tmp_path):
    from server_harness import MODEL, TINY, build_tiny_model, serve

    model = build_tiny_model()
    cfg = dspark_config_for_target(TINY, num_hidden_layers=1, block_size=GAMMA,
                                   tap_layer_ids=(-1, 0), markov_rank=8,
                                   enable_confidence_head=True)
    save_dspark(_random_drafter_model(cfg, seed=5), cfg, tmp_path / "d", dtype="float32")
    spec = _spec(str(tmp_path / "d"), length_policy="prefix")
    drafter = build_dspark(spec, target_config=TINY, target_model=model, dtype=torch.float32,
                           device="cpu")
    config = EngineConfig(model=MODEL, cache=CacheConfig(kv_block_size=4, num_kv_blocks=96),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                                    max_model_len=128, coalesce_steps=2), spec=spec)
    engine = Engine(config, model=model, model_config=TINY, drafter=drafter,
                    length_policy=PrefixScheduler(), cost_table=FLAT, eos_token_ids=(2,))
    with serve(engine) as srv:
        for prompt in ("ab ab ab", "hello there"):
            srv.client().completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                            temperature=0, extra_body={"ignore_eos": True})
        srv.wait_idle()
        m = srv.metrics()
    drafts = m[("dspark:spec_decode_num_drafts_total", ())]
    accepted = m[("dspark:spec_decode_num_accepted_tokens_total", ())]
    verified = m[("dspark:spec_decode_num_draft_tokens_total", ())]
    assert drafts > 0
    assert m[("dspark:spec_decode_verify_budget_count", ())] > 0
    assert m[("dspark:spec_decode_verify_budget_sum", ())] == pytest.approx(
        GAMMA * m[("dspark:spec_decode_verify_budget_count", ())]), "flat curve: every budget is γ"
    assert m[("dspark:spec_decode_num_wasted_verify_tokens_total", ())] == verified - accepted
    tau = m[("dspark:spec_decode_mean_acceptance_length", ())]
    assert tau == pytest.approx(1 + accepted / drafts)
    assert ("dspark:spec_decode_num_accepted_tokens_per_pos_total", (("position", "0"),)) in m
    for b, sps in zip(FLAT.num_tokens, FLAT.steps_per_second):
        assert m[("dspark:cost_table_sps", (("num_tokens", str(b)),))] == pytest.approx(sps)
    assert m[("dspark:coalesce_held_steps_count", ())] == 2  # one observation per finished request
    assert m[("dspark:spec_decode_num_admitted_without_drafter_total", ())] == 0  # flat curve: the gate stays open
    assert m[("dspark:spec_decode_num_measured_off_steps_total", ())] == 0  # (no switch in this engine)


# -- online upkeep --------------------------------------------------------------------------------
PROFILED = CostTable(num_tokens=[1, 8, 64], steps_per_second=[1000.0, 800.0, 200.0])


def _feed_timings(upkeep: OnlineUpkeep, seconds_of, num_steps: int) -> None:
    for i in range(num_steps):
        b = (1, 8, 64)[i % 3]
        upkeep.observe_step(num_tokens=b, seconds=seconds_of(b))


def test_upkeep_moves_cost_table_toward_truth():
    upkeep = OnlineUpkeep(cost_table=PROFILED, config=UpkeepConfig(refresh_every=12, min_samples=2))
    truth = {b: 2.0 / sps for b, sps in zip(PROFILED.num_tokens, PROFILED.steps_per_second)}
    _feed_timings(upkeep, truth.get, 12 * 12)
    for b, sps in zip(upkeep.cost_table.num_tokens, upkeep.cost_table.steps_per_second):
        assert 1.0 / sps == pytest.approx(truth[b], rel=0.02), b
    assert upkeep.cost_table.meta["online_refreshes"] == 12
    assert upkeep._ratio.numel() == len(PROFILED.num_tokens), "memory is one EMA per profiled point"


def test_upkeep_cost_table_is_bounded():
    cfg = UpkeepConfig(refresh_every=3, min_samples=1, max_step_factor=1.5, max_drift_factor=4.0)
    upkeep = OnlineUpkeep(cost_table=PROFILED, config=cfg)
    previous = PROFILED
    for _ in range(20):  # absurdly slow steps: each refresh moves ≤ 1.5x, the total ≤ 4x
        _feed_timings(upkeep, lambda b: 1000.0, 3)
        for old, new in zip(previous.steps_per_second, upkeep.cost_table.steps_per_second):
            assert old / new <= 1.5 + 1e-9
        previous = upkeep.cost_table
    for base, new in zip(PROFILED.steps_per_second, upkeep.cost_table.steps_per_second):
        assert base / new == pytest.approx(4.0)


class _FakeDrafter:
    has_confidence = True

    def __init__(self, num_positions: int):
        self.confidence_temperatures = torch.ones(num_positions)


def _feed_rounds(upkeep: OnlineUpkeep, drafter: _FakeDrafter, *, true_temperature: float,
                 num_steps: int, rounds_per_step: int = 8, seed: int = 0) -> None:
    """Rounds whose conditional acceptance is σ(z / true_temperature); confidences are emitted
    with the drafter's current temperatures, as the DSpark drafter does."""
    g = torch.Generator().manual_seed(seed)
    gamma = drafter.confidence_temperatures.numel()
    for _ in range(num_steps):
        for r in range(rounds_per_step):
            z = torch.rand(gamma, generator=g, dtype=torch.float64) * 12 - 6  # [γ] raw logits
            conf = torch.sigmoid(z / drafter.confidence_temperatures.double())
            accept = torch.rand(gamma, generator=g, dtype=torch.float64) < torch.sigmoid(
                z / true_temperature)
            num_accepted = int(accept.long().cumprod(0).sum())
            upkeep.observe_verify(f"r{r}", conf.tolist(), gamma, num_accepted)
        upkeep.observe_step(num_tokens=8, seconds=1e-3)


def test_upkeep_moves_temperatures_toward_truth():
    drafter = _FakeDrafter(GAMMA)
    calibration = OnlineCalibrationConfig(refit_every=4, prior_weight=8.0)
    upkeep = OnlineUpkeep(drafter=drafter, config=UpkeepConfig(calibration=calibration))
    _feed_rounds(upkeep, drafter, true_temperature=2.0, num_steps=300)
    temps = drafter.confidence_temperatures.tolist()
    assert temps == pytest.approx(list(upkeep.calibrator.temperatures), rel=1e-6), "not pushed"
    for k, t in enumerate(temps):
        assert abs(math.log(t / 2.0)) < math.log(1.3), f"position {k + 1}: T = {t:.3g}, truth 2"
        assert calibration.min_temperature <= t <= calibration.max_temperature


def test_upkeep_keeps_greedy_and_sampling_fits_apart():
    """A drafter with a separate greedy fit: greedy requests' outcomes move only the greedy
    temperatures, sampling requests' only the sampling ones, each toward its own truth."""
    drafter = _FakeDrafter(GAMMA)
    drafter.greedy_confidence_temperatures = torch.ones(GAMMA)
    calibration = OnlineCalibrationConfig(refit_every=4, prior_weight=8.0)
    greedy_ids = {"r0", "r2", "r4", "r6"}
    upkeep = OnlineUpkeep(drafter=drafter, config=UpkeepConfig(calibration=calibration),
                          is_greedy=lambda rid: rid in greedy_ids)
    assert upkeep.calibrators[True][0] is not upkeep.calibrators[False][0]
    g = torch.Generator().manual_seed(3)
    truth = {True: 0.5, False: 2.0}
    for _ in range(300):
        for r in range(8):
            greedy = f"r{r}" in greedy_ids
            temps = drafter.greedy_confidence_temperatures if greedy else drafter.confidence_temperatures
            z = torch.rand(GAMMA, generator=g, dtype=torch.float64) * 12 - 6
            accept = torch.rand(GAMMA, generator=g, dtype=torch.float64) < torch.sigmoid(z / truth[greedy])
            upkeep.observe_verify(f"r{r}", torch.sigmoid(z / temps.double()).tolist(), GAMMA,
                                  int(accept.long().cumprod(0).sum()))
        upkeep.observe_step(num_tokens=8, seconds=1e-3)
    for greedy, tensor in ((True, drafter.greedy_confidence_temperatures), (False, drafter.confidence_temperatures)):
        for k, t in enumerate(tensor.tolist()):
            assert abs(math.log(t / truth[greedy])) < math.log(1.3), (greedy, k, t)
    # without a separate greedy fit, both regimes feed one calibrator and one tensor
    shared = _FakeDrafter(GAMMA)
    one = OnlineUpkeep(drafter=shared, config=UpkeepConfig(calibration=calibration), is_greedy=lambda rid: True)
    assert one.calibrators[True] is one.calibrators[False]


def test_upkeep_switched_off_changes_nothing():
    drafter = _FakeDrafter(GAMMA)
    upkeep = OnlineUpkeep(drafter=drafter, cost_table=PROFILED,
                          config=UpkeepConfig(enabled=False, refresh_every=1, min_samples=1))
    _feed_rounds(upkeep, drafter, true_temperature=2.0, num_steps=100)
    _feed_timings(upkeep, lambda b: 1.0, 30)
    assert upkeep.cost_table is PROFILED
    assert drafter.confidence_temperatures.tolist() == [1.0] * GAMMA


def test_engine_online_upkeep_wiring(target, drafter_dir, plain_outputs):
    off = _spec_engine(target, drafter_dir, PrefixScheduler(), cost=MILD)
    assert off.upkeep is None, "online_upkeep defaults to off"
    assert off.verify_observers == [] and off.model_verify_observers == [off.draft_gate.observe_verify], \
        "only the draft gate observes"

    engine = _spec_engine(target, drafter_dir, PrefixScheduler(), cost=MILD, online_upkeep=True)
    assert engine.upkeep is not None and engine.upkeep.observe_verify in engine.model_verify_observers
    # the same wiring with a faster schedule, so a short run refreshes and refits
    engine.model_verify_observers.remove(engine.upkeep.observe_verify)
    fast = UpkeepConfig(refresh_every=8, min_samples=1,
                        calibration=OnlineCalibrationConfig(refit_every=2, min_trials=8.0))
    engine.upkeep = OnlineUpkeep(drafter=engine.drafter, cost_table=engine.cost_table, config=fast)
    engine.model_verify_observers.append(engine.upkeep.observe_verify)
    temps_before = engine.drafter.confidence_temperatures.clone()
    staged = run_staged(engine, _prompts(), greedy(MAX_TOKENS), ARRIVAL_STEPS)
    assert _mismatches(staged.outputs, plain_outputs) == 0
    assert engine.cost_table is engine.upkeep.cost_table
    assert engine.cost_table.meta.get("online_refreshes", 0) >= 1
    assert engine.cost_table.num_tokens == MILD.num_tokens
    assert not torch.equal(engine.drafter.confidence_temperatures, temps_before), \
        "live verification outcomes must refit the temperatures"
