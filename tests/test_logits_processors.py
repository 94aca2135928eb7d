"""Logits processors and the target sampler (dspark/logits_processors.py, dspark/verify/sampler.py):

* every processor against a naive per-token twin (Python loops over the vocabulary), and window row j
  of a verify window equal to plain decoding after the drafts d1..dj;
* Monte-Carlo (chi-square over the joint law of three tokens, enumerated exactly): speculative
  sampling with penalties, min_p, min_tokens and logit_bias follows plain autoregressive sampling,
  for point-mass drafts (the keyed inverse-CDF lane) and probabilistic drafts (rejection sampling on
  the processed rows); a variant whose processors ignore the drafts is caught;
* the keyed sampler: its draws follow the distribution, and a seeded run emits the same tokens with
  any drafts, or none.

    pytest tests/test_logits_processors.py -q
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections import Counter

import pytest
import torch

import dspark.verify.sampler as sampler
from dspark.engine.scheduler import ScheduledRequest
from dspark.logits_processors import WindowRows, apply_processors
from dspark.request import Drafts, Request
from dspark.sampling import SamplingParams, logits_to_probs
from tests.stat_checks import assert_differs_from_distribution, assert_matches_distribution

V = 6
EOS = 2


def naive(row: torch.Tensor, p: SamplingParams, prompt: list[int], history: list[int]) -> torch.Tensor:
    """The processors one token at a time."""
    x = row.tolist()
    counts = Counter(history)
    for v in range(len(x)):
        if p.repetition_penalty != 1.0 and (v in prompt or counts[v]):
            x[v] = x[v] / p.repetition_penalty if x[v] > 0 else x[v] * p.repetition_penalty
        x[v] -= p.frequency_penalty * counts[v] + p.presence_penalty * (counts[v] > 0)
    for t, b in p.logit_bias:
        x[t] += b
    if len(history) < p.min_tokens:
        for t in list(p.stop_token_ids) + ([] if p.ignore_eos else [EOS]):
            x[t] = -math.inf
    for word in p.bad_words:
        head = list(word[:-1])
        if not head or history[len(history) - len(head):] == head:
            x[word[-1]] = -math.inf
    if p.allowed_token_ids:
        x = [x[v] if v in p.allowed_token_ids else -math.inf for v in range(len(x))]
    return torch.tensor(x)


PARAMS = {
    "repetition": SamplingParams(repetition_penalty=1.7),
    "frequency_presence": SamplingParams(frequency_penalty=0.8, presence_penalty=-0.5),
    "logit_bias": SamplingParams(logit_bias={3: 2.5, 7: -100}),
    "min_tokens": SamplingParams(min_tokens=4, stop_token_ids=(5,)),
    "bad_words": SamplingParams(bad_words=[(9,), (4, 8), (1, 4, 6)]),
    "allowed": SamplingParams(allowed_token_ids=(1, 4, 6, 8)),
    "all": SamplingParams(repetition_penalty=0.8, frequency_penalty=0.3, presence_penalty=0.4,
                          logit_bias={4: 1.0}, min_tokens=3, bad_words=[(4, 6)]),
}


@pytest.mark.parametrize("name", list(PARAMS))
def test_processors_equal_naive_twin_per_window_row(name):
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    vocab = 12
    p = PARAMS[name]
    for _ in range(20):
        prompt = torch.randint(0, vocab, (5,), generator=g).tolist()
        output = torch.randint(0, vocab, (int(torch.randint(0, 5, (1,), generator=g)),), generator=g).tolist()
        drafts = torch.randint(0, vocab, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g).tolist()
        logits = torch.randn(len(drafts) + 1, vocab, generator=g) * 3
        got = apply_processors(logits, WindowRows(p, prompt, output, drafts, (EOS,)))
        for j in range(len(drafts) + 1):
            want = naive(logits[j], p, prompt, output + drafts[:j])
            torch.testing.assert_close(got[j], want, rtol=1e-6, atol=1e-6)
            plain = apply_processors(logits[j:j + 1], WindowRows(p, prompt, output + drafts[:j], [], (EOS,)))
            assert torch.equal(plain[0], got[j]), "window row differs from plain decoding at that position"


# -- a mini engine over a fixed logits table --------------------------------------------------------
TABLE = torch.randn(8, V, generator=torch.Generator().manual_seed(5)) * 1.5  # raw logits per position
DRAFT_TABLE = torch.randn(8, V, generator=torch.Generator().manual_seed(6))
PROMPT = [0, 3]
NUM_OUT = 3
SAMPLED = SamplingParams(temperature=0.9, presence_penalty=1.2, frequency_penalty=0.7,
                         repetition_penalty=1.3, min_p=0.08, min_tokens=1, logit_bias={1: 0.8},
                         max_tokens=NUM_OUT, seed=0)


def _processed_probs(p: SamplingParams, history: list[int]) -> torch.Tensor:  # [V] plain decoding's row
    row = naive(TABLE[len(history)], p, PROMPT, history).unsqueeze(0)
    return logits_to_probs(row, temperature=torch.tensor([p.temperature]), top_k=torch.tensor([p.top_k]),
                           top_p=torch.tensor([p.top_p]), min_p=torch.tensor([p.min_p]))[0]


def _exact_joint(p: SamplingParams) -> torch.Tensor:  # [V ** NUM_OUT] autoregressive law of the output
    joint = torch.zeros(V ** NUM_OUT, dtype=torch.float64)
    for seq in itertools.product(range(V), repeat=NUM_OUT):
        prob = 1.0
        for i in range(NUM_OUT):
            prob *= float(_processed_probs(p, list(seq[:i]))[seq[i]])
        joint[sum(t * V ** (NUM_OUT - 1 - i) for i, t in enumerate(seq))] = prob
    return joint / joint.sum()


def generate(p: SamplingParams, *, seed: int, num_drafts: int, draft_mode: str) -> list[int]:
    """Steps of `sample_step` over TABLE (row for output position q = TABLE[q]) until NUM_OUT tokens."""
    req = Request("r", list(PROMPT), p, eos_token_ids=(EOS,))
    req.sample_seed = seed
    req.generator = torch.Generator().manual_seed(seed)
    draft_gen = torch.Generator().manual_seed(seed + 10**6)
    while len(req.output_ids) < NUM_OUT:
        start = len(req.output_ids)
        k = min(num_drafts, NUM_OUT - start - 1)
        if draft_mode == "point":  # a deterministic drafter: the raw argmax
            drafts = Drafts(ids=tuple(int(TABLE[start + j].argmax()) for j in range(k)), verify_len=k)
        else:  # probabilistic: drafts drawn from their own distribution
            probs = torch.softmax(DRAFT_TABLE[start:start + k], dim=-1)  # [k, vocab_size]
            drafts = Drafts(ids=tuple(int(torch.multinomial(probs[j], 1, generator=draft_gen)) for j in range(k)),
                            probs=probs, verify_len=k)
        logits = TABLE[start:start + k + 1]
        result, _ = sampler.sample_step([ScheduledRequest(req, 1 + k, k, emits=True, drafts=drafts)], logits,
                                        eos_token_ids=(EOS,))
        req.output_ids += result.output_ids[0]
    return req.output_ids[:NUM_OUT]


def _codes(seqs: list[list[int]]) -> torch.Tensor:
    return torch.tensor([sum(t * V ** (NUM_OUT - 1 - i) for i, t in enumerate(s)) for s in seqs])


@pytest.mark.parametrize("draft_mode", ["point", "probabilistic"])
def test_speculative_sampling_with_processors_follows_plain_law(draft_mode):
    samples = _codes([generate(SAMPLED, seed=s, num_drafts=2, draft_mode=draft_mode) for s in range(6000)])
    assert_matches_distribution(samples, _exact_joint(SAMPLED), what=f"{draft_mode} drafts, processors")


class _DraftBlind(WindowRows):
    """The deliberately wrong processors: every window row sees the committed output only."""

    def __init__(self, params, prompt_ids, output_ids, drafts, eos_token_ids=()):
        super().__init__(params, prompt_ids, output_ids, [], eos_token_ids)
        self._num_rows = len(drafts) + 1

    @property
    def num_rows(self) -> int:
        return self._num_rows

    def history(self, j: int) -> list[int]:
        return self.output_ids


def test_draft_blind_processors_are_caught(monkeypatch):
    monkeypatch.setattr(sampler, "WindowRows", _DraftBlind)
    samples = _codes([generate(SAMPLED, seed=s, num_drafts=2, draft_mode="point") for s in range(6000)])
    assert_differs_from_distribution(samples, _exact_joint(SAMPLED), what="processors blind to drafts")


def test_keyed_sampler_draws_the_distribution():
    probs = torch.softmax(torch.randn(V, generator=torch.Generator().manual_seed(2)) * 1.3, dim=0)
    draws = torch.tensor([sampler.keyed_sample(probs, seed, 7) for seed in range(20000)])
    assert_matches_distribution(draws, probs, what="keyed draws over seeds")
    draws = torch.tensor([sampler.keyed_sample(probs, 3, pos) for pos in range(20000)])
    assert_matches_distribution(draws, probs, what="keyed draws over positions")


def test_keyed_batch_draws_equal_the_flat_inverse_cdf():
    """The two-level batched draw against its slow twin: one fp64 running sum over the whole row. A vocabulary
    that is no multiple of the block, rows with zeros (top-k/top-p cut) and peaked rows."""
    g = torch.Generator().manual_seed(5)
    vocab = 3 * sampler.KEYED_BLOCK + 77
    probs = torch.softmax(torch.randn(300, vocab, generator=g) * torch.linspace(0.5, 6, 300).unsqueeze(1), dim=-1)
    probs[::2, ::3] = 0  # every other row: a third of its tokens cut
    probs[5, :] = 0
    probs[5, vocab - 1] = 1.0  # all mass on the last (padded block's) token
    probs = probs / probs.sum(dim=-1, keepdim=True)
    keys = [(seed, 11 * seed + 3) for seed in range(300)]
    got = sampler.keyed_samples(probs, keys)
    cdf = probs.double().cumsum(dim=-1)
    u = torch.tensor([sampler.keyed_uniform(*k) for k in keys], dtype=torch.float64)
    want = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1).tolist()
    assert got == want
    assert all(probs[r, t] > 0 for r, t in enumerate(got))
    assert got[5] == vocab - 1


def test_seeded_output_is_independent_of_drafts():
    p = SamplingParams(temperature=1.0, presence_penalty=0.5, max_tokens=NUM_OUT, seed=0)
    for seed in range(200):
        plain = generate(p, seed=seed, num_drafts=0, draft_mode="point")
        assert generate(p, seed=seed, num_drafts=2, draft_mode="point") == plain
