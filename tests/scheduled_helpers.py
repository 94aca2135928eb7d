"""Shared fixtures and helpers for the scheduled-verification tests (test_scheduled_verification.py,
test_gate_engine.py, test_online_upkeep.py, test_lookup_first.py): a tiny random Llama target, a
random-weight DSpark drafter (Markov + confidence heads) saved once per module, plain greedy outputs,
staged arrivals, and the synthetic cost tables.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dspark.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from dspark.drafters import build_drafter
from dspark.drafters.dspark import save_dspark
from dspark.drafters.dspark_config import dspark_config_for_target
from dspark.drafters.dspark_model import DSparkModel
from dspark.engine.engine import Engine
from dspark.speculation.cost_table import CostTable
from dspark.speculation.length_policy import (
    AsyncPrefixScheduler,
    ConfidenceThreshold,
    FixedLength,
    PrefixScheduler,
)
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


POLICIES = {
    "fixed1": (lambda: FixedLength(1), None),
    "fixed3": (lambda: FixedLength(3), None),
    "fixedG": (lambda: FixedLength(GAMMA), None),
    "threshold": (lambda: ConfidenceThreshold(0.3), None),
    "threshold_conditional": (lambda: ConfidenceThreshold(0.6, cumulative=False), None),
    "prefix": (lambda: PrefixScheduler(), MILD),
    "async": (lambda: AsyncPrefixScheduler(cold_start_len=GAMMA), MILD),
}

# drafting costs as much as 5 one-token steps: only a long run of near-certain drafts could pay
COSTLY_DRAFTS = CostTable(num_tokens=[1, 8, 16, 32, 64], steps_per_second=[100.0, 95.0, 80.0, 60.0, 35.0],
                          draft_num_reqs=[1, 16], draft_seconds=[0.05, 0.05])
