"""Block verification (`dspark/verify/block.py`) against its slow twins: the law of the emitted tokens computed
exactly by enumerating every draft block and every accepted length (equal to the target's, and a deliberately
wrong rule caught), the batched implementation sampled 200k times (chi-square over the first two tokens, and
the same test catching drafts verified against the wrong rows), its accepted length against token-by-token
rejection sampling on the same drafts, and the engine's probabilistic drafts through it.
Run: pytest tests/test_block_verification.py -q"""

from __future__ import annotations

import itertools

import pytest
import torch
from dspark.verify.block import block_verify_batched
from dspark.verify.block import verify_one_block as block_one
from dspark.verify.rejection import rejection_sample_batched
from stat_checks import assert_differs_from_distribution, assert_matches_distribution

V = 4  # vocabulary of the toy models


class Toy:
    """A target and a drafter over a V-token vocabulary whose next-token law depends on the whole prefix: one
    random softmax row per prefix, the drafter's a perturbed copy of the target's (they overlap, as real drafters
    do, so the block test has something to gain)."""

    def __init__(self, seed: int, sharpness: float = 1.5):
        self.gen, self.sharpness, self.rows = torch.Generator().manual_seed(seed), sharpness, {}

    def _pair(self, prefix: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        if prefix not in self.rows:
            base = torch.randn(V, generator=self.gen, dtype=torch.float64) * self.sharpness
            noise = torch.randn(V, generator=self.gen, dtype=torch.float64)
            self.rows[prefix] = (torch.softmax(base, 0), torch.softmax(base + noise, 0))
        return self.rows[prefix]

    def target(self, prefix: tuple) -> torch.Tensor:
        return self._pair(prefix)[0]

    def draft(self, prefix: tuple) -> torch.Tensor:
        return self._pair(prefix)[1]


def _weights_and_tests(toy: Toy, xs: tuple, rule: str) -> tuple[list[float], list[float]]:
    """(p_0..p_γ, h_1..h_γ) of the paper's rule for the draft block xs; `rule` "wrong": h_i = p_i throughout
    (a plausible-looking rule that is not lossless)."""
    p = [1.0]
    for i, x in enumerate(xs):
        p.append(min(1.0, p[-1] * toy.target(xs[:i])[x].item() / toy.draft(xs[:i])[x].item()))
    h = []
    for i in range(1, len(xs)):
        r = (p[i] * toy.target(xs[:i]) - toy.draft(xs[:i])).clamp_min(0).sum().item()
        h.append(p[i] if rule == "wrong" else (r / (r + 1 - p[i]) if r + 1 - p[i] > 1e-12 else 1.0))
    return p, h + [p[-1]]


def exact_law(toy: Toy, gamma: int, rule: str = "paper") -> torch.Tensor:  # [V, V]
    """P(first two emitted tokens), every draft block and accepted length enumerated; where one token is emitted
    the second is the target's next token (what the next step, lossless, emits)."""
    out = torch.zeros(V, V, dtype=torch.float64)
    for xs in itertools.product(range(V), repeat=gamma):
        q = 1.0
        for i, x in enumerate(xs):
            q *= toy.draft(xs[:i])[x].item()
        p, h = _weights_and_tests(toy, xs, rule)
        for tau in range(gamma + 1):  # τ = the largest index whose test passed
            pr = (h[tau - 1] if tau else 1.0) * float(torch.tensor([1 - h[j - 1] for j in range(tau + 1, gamma + 1)],
                                                                   dtype=torch.float64).prod())
            res = toy.target(xs) if tau == gamma else (p[tau] * toy.target(xs[:tau]) - toy.draft(xs[:tau])).clamp_min(0)
            if pr < 1e-15 or res.sum() <= 0:
                continue
            for y, w in enumerate((res / res.sum()).tolist()):
                seq = xs[:tau] + (y,)
                if len(seq) >= 2:
                    out[seq[0], seq[1]] += q * pr * w
                else:
                    out[seq[0]] += q * pr * w * toy.target(seq)
    return out


def target_law(toy: Toy) -> torch.Tensor:  # [V, V]
    return torch.stack([toy.target(())[a] * toy.target((a,)) for a in range(V)])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("gamma", [2, 3])
def test_the_rule_is_lossless_exactly_and_a_wrong_rule_is_not(seed, gamma):
    toy = Toy(seed)
    assert (exact_law(toy, gamma) - target_law(toy)).abs().max() < 1e-12
    assert (exact_law(toy, gamma, rule="wrong") - target_law(toy)).abs().max() > 1e-3


def _sampled(toy: Toy, gamma: int, n: int, seed: int, verify=block_verify_batched, shift_drafts: bool = False):
    """n independent steps through `verify`: drafts sampled from the toy drafter, then the first two emitted
    tokens (the second from the target where one token came out). Returns (first two [n, 2], num_accepted [n])."""
    gen = torch.Generator().manual_seed(seed)
    prefixes = [()] * n
    drafts = torch.zeros(n, gamma, dtype=torch.long)
    dprobs, tprobs = torch.zeros(n, gamma, V), torch.zeros(n, gamma + 1, V)
    for i in range(gamma + 1):
        tprobs[:, i] = torch.stack([toy.target(p) for p in prefixes]).float()
        if i == gamma:
            break
        rows = torch.stack([toy.draft(p) for p in prefixes]).float()
        dprobs[:, i] = rows
        drafts[:, i] = torch.multinomial(rows, 1, generator=gen).squeeze(1)
        prefixes = [p + (x,) for p, x in zip(prefixes, drafts[:, i].tolist())]
    if shift_drafts:  # the drafter's rows one position off: what a wrong row index in the engine would do
        dprobs = torch.roll(dprobs, 1, dims=1)
    accepted, final = verify(target_probs=tprobs, draft_ids=drafts, draft_probs=dprobs, generator=gen)
    first = torch.where(accepted > 0, drafts[:, 0], final)
    second_next = torch.multinomial(torch.stack([toy.target((a,)) for a in first.tolist()]).float(), 1,
                                    generator=gen).squeeze(1)
    second = torch.where(accepted > 1, drafts[:, 1], torch.where(accepted == 1, final, second_next))
    return torch.stack([first, second], dim=1), accepted


@pytest.mark.parametrize("seed", [0, 1])
def test_the_batched_implementation_samples_the_target_law(seed):
    toy = Toy(seed)
    law = target_law(toy).flatten()
    pairs, _ = _sampled(toy, gamma=3, n=200_000, seed=seed)
    assert_matches_distribution(pairs[:, 0] * V + pairs[:, 1], law, what="block verification")
    # the same test catches drafts verified against the wrong rows
    pairs, _ = _sampled(toy, gamma=3, n=200_000, seed=seed, shift_drafts=True)
    assert_differs_from_distribution(pairs[:, 0] * V + pairs[:, 1], law, what="drafts against the wrong rows")


def test_block_accepts_at_least_token_by_token_on_the_same_drafts():
    """Same drafts, same target: the mean accepted length of block verification is at or above rejection
    sampling's on every toy (the paper's Theorem 2), and above it on some."""
    gains = []
    for seed in range(4):
        toy = Toy(seed, sharpness=0.7)
        _, block = _sampled(toy, gamma=4, n=100_000, seed=10 + seed)
        _, token = _sampled(toy, gamma=4, n=100_000, seed=10 + seed, verify=rejection_sample_batched)
        gain = block.double().mean().item() - token.double().mean().item()
        assert gain > -0.02, (seed, gain)  # ~5 standard errors of the difference
        gains.append(gain)
    assert max(gains) > 0.03, gains


def test_one_draft_is_token_by_token():
    """γ = 1: the same decisions as rejection sampling from the same uniforms."""
    gen_a, gen_b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    toy = Toy(5)
    t = torch.stack([toy.target(()), toy.target((0,))]).float().expand(1000, 2, V).contiguous()
    d = toy.draft(()).float().expand(1000, 1, V).contiguous()
    ids = torch.multinomial(d[:, 0], 1, generator=torch.Generator().manual_seed(4))
    a = block_verify_batched(target_probs=t, draft_ids=ids, draft_probs=d, generator=gen_a)
    b = rejection_sample_batched(target_probs=t, draft_ids=ids, draft_probs=d, generator=gen_b)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_config_refuses_block_with_greedy_drafts():
    from dspark.config import SpecConfig
    with pytest.raises(ValueError, match="probabilistic"):
        SpecConfig(method="ngram", rejection_sample_method="block")
    with pytest.raises(ValueError, match="rejection_sample_method"):
        SpecConfig(method="ngram", rejection_sample_method="typical")
    assert SpecConfig(method="ngram", draft_sample_method="probabilistic",
                      rejection_sample_method="block").rejection_sample_method == "block"


def test_engine_block_verified_drafts_sample_the_target_law(monkeypatch):
    """Through the engine: a tiny Llama target, a one-layer draft model sampling its drafts (top_k 4, T = 1), block
    verification; the first two tokens of 3000 seeded requests follow the target's own top-4 law (from its
    logprobs one token at a time), and the drafts were accepted in the run."""
    from conftest import TINY_LLAMA
    from dspark.config import SpecConfig
    from dspark.drafters import build_drafter
    from dspark.llm import LLM
    from dspark.sampling import SamplingParams
    from engine_helpers import make_engine, tiny_target

    target, _ = tiny_target(TINY_LLAMA, seed=3)
    prompt, k = [1, 17, 42, 99, 7], 4

    def top_law(ids: list[int]) -> tuple[list[int], torch.Tensor]:
        plain = LLM(engine=make_engine(target, TINY_LLAMA), tokenizer=None)
        out = plain.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, logprobs=k), use_tqdm=False)
        (entry,) = out[0].outputs[0].logprobs
        tokens, logps = zip(*entry.top)
        return list(tokens), torch.softmax(torch.tensor(logps, dtype=torch.float64), 0)

    firsts, p1 = top_law(prompt)
    law = torch.zeros(k, k, dtype=torch.float64)
    seconds = {}
    for a, pa in zip(firsts, p1):
        seconds[a], p2 = top_law(prompt + [a])
        law[firsts.index(a)] = pa * p2
    spec = SpecConfig(method="draft_model", draft_num_layers=1, num_speculative_tokens=3,
                      draft_sample_method="probabilistic", rejection_sample_method="block")
    drafter = build_drafter(spec, target_config=TINY_LLAMA, target_model=target, dtype=torch.float32, device="cpu")
    engine = make_engine(target, TINY_LLAMA, drafter=drafter, spec=spec, max_num_seqs=256, budget=2048,
                         num_kv_blocks=2048)
    import dspark.verify.sampler as sampler
    calls = []
    monkeypatch.setattr(sampler, "verify_one_block", lambda *a: calls.append(1) or block_one(*a))
    n = 3000
    outs = LLM(engine=engine, tokenizer=None).generate(
        [prompt] * n, [SamplingParams(temperature=1.0, top_k=k, max_tokens=2, ignore_eos=True, seed=i)
                       for i in range(n)], use_tqdm=False)
    cells = torch.tensor([firsts.index(o.outputs[0].token_ids[0]) * k
                          + seconds[o.outputs[0].token_ids[0]].index(o.outputs[0].token_ids[1]) for o in outs])
    assert_matches_distribution(cells, law.flatten(), what="engine, block verification")
    assert engine.metrics.num_accepted_tokens > 0 and len(calls) >= n  # every request verified as a block
