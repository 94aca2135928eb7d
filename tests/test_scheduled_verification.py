"""Confidence-scheduled verification on the serving path, end to end on a tiny random Llama target
with a random-weight DSpark drafter (Markov + confidence heads):

* greedy parity, token for token, under every length policy (fixed K ∈ {1, 3, γ}, threshold,
  prefix with a synthetic cost table, async) with prompts arriving while the engine steps, a long
  prompt chunked across steps, and prompt coalescing on; speculation stays on in mixed steps
  (a prompt chunk and a verify window with drafts in one step);
* a flat cost curve admits every draft (verify_lens == proposal lengths), a steep one fewer;
* fail-closed configuration through `build_engine` (prefix/async without a cost table, threshold
  with n-gram, a DSpark checkpoint without a confidence head);

The draft gate in the engine: tests/test_gate_engine.py; online upkeep: tests/test_online_upkeep.py.

    pytest tests/test_scheduled_verification.py -q
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dspark.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from dspark.drafters.dspark import build as build_dspark
from dspark.drafters.dspark import save_dspark
from dspark.drafters.dspark_config import dspark_config_for_target
from dspark.engine.engine import Engine
from dspark.speculation.cost_table import CostTable
from dspark.speculation.length_policy import (
    PrefixScheduler,
)
from tests.engine_helpers import greedy
from tests.scheduled_helpers import (  # noqa: F401  (fixtures)
    ARRIVAL_STEPS, FLAT, GAMMA, MAX_TOKENS, POLICIES, STEEP, _mismatches, _mixed_steps, _prompts,
    _random_drafter_model, _save_drafter, _spec, _spec_engine, drafter_dir, plain_outputs,
    run_staged, target)

# -- greedy parity under every policy --------------------------------------------------------------


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
    drafts = m[("vllm:spec_decode_num_drafts_total", ())]
    accepted = m[("vllm:spec_decode_num_accepted_tokens_total", ())]
    verified = m[("vllm:spec_decode_num_draft_tokens_total", ())]
    assert drafts > 0
    assert m[("vllm:spec_decode_verify_budget_count", ())] > 0
    assert m[("vllm:spec_decode_verify_budget_sum", ())] == pytest.approx(
        GAMMA * m[("vllm:spec_decode_verify_budget_count", ())]), "flat curve: every budget is γ"
    assert m[("vllm:spec_decode_num_wasted_verify_tokens_total", ())] == verified - accepted
    tau = m[("vllm:spec_decode_mean_acceptance_length", ())]
    assert tau == pytest.approx(1 + accepted / drafts)
    assert ("vllm:spec_decode_num_accepted_tokens_per_pos_total", (("position", "0"),)) in m
    for b, sps in zip(FLAT.num_tokens, FLAT.steps_per_second):
        assert m[("vllm:cost_table_sps", (("num_tokens", str(b)),))] == pytest.approx(sps)
    assert m[("vllm:coalesce_held_steps_count", ())] == 2  # one observation per finished request
    assert m[("vllm:spec_decode_num_admitted_without_drafter_total", ())] == 0  # flat curve: the gate stays open
    assert m[("vllm:spec_decode_num_measured_off_steps_total", ())] == 0  # (no switch in this engine)

