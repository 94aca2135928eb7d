"""A reduced draft vocabulary chosen at load for a full-vocabulary drafter (spec "draft_vocab_size",
dspark/drafters/vocab.py): the target's special tokens plus the most frequent tokens of `lookup_corpus`.

* the kept ids: eos and bos always, then by corpus frequency (ties: the lower id), ascending;
* the sliced drafter drafts what its slow twin drafts (the full drafter, its logits masked to the subset: the
  argmax over it; sampled, the probabilities renormalised on it): DFlash, DSpark with a vanilla and an RNN
  Markov head (head rows and Markov W2 sliced, W1 whole), EAGLE-3 (head rows); a checkpoint's own differing
  head keeps its own rows;
* greedy speculative output with the sliced drafter equals plain output;
* sampled output through the engine follows the target's law (chi-square), and a deliberately wrong drafter
  whose probabilities are not renormalised on the subset fails the same check;
* every refusal names draft_vocab_size and comes before any weight is read.

    pytest tests/test_draft_vocab_at_load.py -q
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import PagedKV
from dspark.config import SpecConfig
from dspark.drafters import check_drafter
from dspark.drafters.base import ContextSegment, ContextUpdate, ProposeBatch
from dspark.drafters.checkpoint import save_tensors
from dspark.drafters.corpus import write_corpus
from dspark.drafters.dspark import build, save_dspark
from dspark.drafters.eagle3 import save_eagle3
from dspark.drafters.eagle3_model import state_dict_hf
from dspark.drafters.vocab import draft_vocab_at_load
from dspark.sampling import SamplingParams, logits_to_probs
from engine_helpers import make_engine
from stat_checks import assert_differs_from_distribution, assert_matches_distribution
from tests.dspark_helpers import (TAPS, TARGET, greedy_engine_run, make_pool, propose_request, random_model,
                                  random_target, spec, tiny_cfg)
from test_drafter_formats import _build
from test_eagle3_draft_model import CFG, Harness, random_eagle3
from test_eagle3_draft_model import random_target as eagle3_target

N = 12  # eos 2 and bos 1 of the tiny targets, and the 10 most frequent corpus tokens


def _corpus(path, counts: dict[int, int], vocab: int = 128):
    docs = [[t] * c for t, c in counts.items()]
    write_corpus(path, docs, vocab_size=vocab, model="tiny", source="test")
    return str(path)


COUNTS = {90: 9, 7: 8, 60: 8, 33: 7, 101: 6, 12: 5, 45: 5, 88: 4, 20: 4, 64: 3, 70: 3, 5: 2, 3: 1}
KEPT = sorted({1, 2, 90, 7, 60, 33, 101, 12, 45, 88, 20, 64})  # 64 beats 70 on the tie (the lower id)


def test_kept_ids_are_the_special_tokens_and_the_most_frequent(tmp_path):
    corpus = _corpus(tmp_path / "c.safetensors", COUNTS)
    keep = draft_vocab_at_load(spec("x", draft_vocab_size=N, lookup_corpus=corpus), TARGET,
                               checkpoint_draft_vocab=None, where="x")
    assert keep.tolist() == KEPT
    assert draft_vocab_at_load(spec("x", draft_vocab_size=128, lookup_corpus=corpus), TARGET,
                               checkpoint_draft_vocab=None, where="x") is None  # the whole vocabulary
    assert draft_vocab_at_load(spec("x", draft_vocab_size=48), TARGET, checkpoint_draft_vocab=48, where="x") is None


# -- the sliced drafter against its slow twin --------------------------------------------------------

def _drafters(tmp_path, method: str, head: str | None, **spec_kw):
    """(full, sliced) drafters built from one full-vocabulary checkpoint (fp32 products), and the target."""
    cfg = tiny_cfg(markov_rank=8 if head else 0, markov_head_type=head or "vanilla", enable_confidence_head=bool(head))
    save_dspark(random_model(cfg, seed=5), cfg, tmp_path / "d", dtype="float32")
    corpus = _corpus(tmp_path / "c.safetensors", COUNTS)
    target = random_target(seed=2)
    kw = dict(method=method, n=cfg.block_size, draft_matmul_dtype="float32", **spec_kw)
    make = lambda **extra: build(spec(tmp_path / "d", **kw, **extra), target_config=TARGET,  # noqa: E731
                                 target_model=target, dtype=torch.float32, device="cpu")
    return make(), make(draft_vocab_size=N, lookup_corpus=corpus), target


def _batch(method: str, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, 120, (9,), generator=g).tolist() for _ in range(3)]
    tables = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    taps = torch.randn(24, len(TAPS) * TARGET.hidden_size, generator=g)
    update = ContextUpdate([ContextSegment(f"r{i}", tables[i], 0, ids[i][:8], None, slice(8 * i, 8 * i + 8))
                            for i in range(3)], taps)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_p=0.95),
              SamplingParams(temperature=1.3)]
    reqs = [propose_request(f"r{i}", ids[i], 8, tables[i], params[i] if method == "probabilistic" else params[0],
                            torch.Generator().manual_seed(7 + i)) for i in range(3)]
    return update, ProposeBatch(reqs, 4, method)


@torch.inference_mode()
def _twin(full, batch, keep: torch.Tensor, forced: torch.Tensor | None = None):
    """The slow twin: the full drafter's logits, −inf outside `keep`; greedy drafts (or the `forced`
    predecessors) → (draft ids [R, γ], probabilities [R, γ, vocab], confidence logits or None)."""
    model = full.model
    base, hidden, prev = full.forward_blocks(batch)  # [R, γ, vocab]
    mask = torch.full((base.shape[-1],), float("-inf"))
    mask[keep] = 0.0
    reqs = batch.requests
    temperature = torch.tensor([r.params.temperature for r in reqs])
    top_k, top_p = torch.tensor([r.params.top_k for r in reqs]), torch.tensor([r.params.top_p for r in reqs])
    head = model.markov_head
    state = head.init_state(num_rows=len(reqs), device="cpu", dtype=hidden.dtype) if head else None
    ids, probs, prevs = [], [], []
    for k in range(base.shape[1]):
        prevs.append(prev)
        logits = base[:, k]
        if head is not None:
            logits, state = head.step(base_logits=logits, hidden=hidden[:, k], prev_ids=prev, state=state)
        logits = logits + mask
        probs.append(logits_to_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p))
        prev = logits.argmax(-1) if forced is None else forced[:, k]
        ids.append(prev)
    conf = model.confidence_logits(hidden, prev_ids=torch.stack(prevs, 1))
    return torch.stack(ids, 1), torch.stack(probs, 1), conf


@pytest.mark.parametrize("method,head", [("dflash", None), ("dspark", "vanilla"), ("dspark", "rnn")])
def test_sliced_dspark_drafts_what_its_slow_twin_drafts(tmp_path, method, head):
    full, sliced, target = _drafters(tmp_path, method, head)
    keep = torch.tensor(KEPT)
    m = sliced.model
    assert m.cfg.draft_vocab_size == N and torch.equal(m.d2t, keep)
    assert tuple(m.lm_head.weight.shape) == (N, TARGET.hidden_size)
    torch.testing.assert_close(m.lm_head.weight, target.lm_head.weight[keep], rtol=0, atol=0)
    if head:  # W2 sliced to the kept rows, W1 whole (a predecessor is any target token)
        assert torch.equal(m.markov_head.markov_w2.weight, full.model.markov_head.markov_w2.weight[keep])
        assert torch.equal(m.markov_head.markov_w1.weight.float(), full.model.markov_head.markov_w1.weight.float())
    for d in (full, sliced):
        make_pool(d, num_blocks=16, kv_block_size=4)
    for method_ in ("greedy", "probabilistic"):
        for d in (full, sliced):
            update, batch = _batch(method_)
            d.extend_context(update)
        _, batch = _batch(method_)
        got = sliced.propose(batch)
        assert set(got.draft_ids.flatten().tolist()) <= set(KEPT)
        _, batch = _batch(method_)
        want_ids, want_probs, want_conf = _twin(full, batch, keep,
                                                forced=got.draft_ids if method_ == "probabilistic" else None)
        assert torch.equal(got.draft_ids, want_ids), method_
        if method_ == "probabilistic":
            torch.testing.assert_close(got.draft_probs, want_probs, atol=1e-6, rtol=1e-5)
            assert torch.equal(got.draft_probs[..., ~torch.isin(torch.arange(128), keep)],
                               torch.zeros(3, 4, 128 - N))
        if head:
            torch.testing.assert_close(got.confidence, torch.sigmoid(want_conf), atol=1e-6, rtol=1e-5)


def test_sliced_eagle3_drafts_what_its_slow_twin_drafts(tmp_path):
    target = eagle3_target()
    ref = random_eagle3(target)
    save_eagle3(ref, ref.config, str(tmp_path / "e"))
    corpus = _corpus(tmp_path / "c.safetensors", {**COUNTS, 200: 9, 255: 9}, vocab=256)
    keep = sorted({1, 2, 90, 200, 255, 7, 60, 33, 101, 12, 45, 20})  # 20 beats 88 on the tie; 64 makes way
    full = _build(tmp_path / "e", "eagle3", CFG, target)
    sliced = _build(tmp_path / "e", "eagle3", CFG, target, draft_vocab_size=N, lookup_corpus=corpus)
    assert sliced.model.d2t.tolist() == keep and sliced.model.config.draft_vocab_size == N
    mask = torch.full((256,), float("-inf"))
    mask[keep] = 0.0
    full_logits = full.model.compute_logits
    full.model.compute_logits = lambda h: full_logits(h) + mask  # the twin: the full head, masked
    taps = torch.randn(7, 3 * 64, generator=torch.Generator().manual_seed(3))
    ids = [4, 8, 15, 16, 23, 42, 99, 7]
    out = {}
    for name, d in (("twin", full), ("sliced", sliced)):
        h = Harness(d, 2)
        h.extend([(0, 0, ids[:-1], ids[-1], taps), (1, 0, ids[:-1], ids[-1], taps)])
        out[name] = h.propose([(0, ids, SamplingParams(temperature=0.0)), (1, ids, SamplingParams(temperature=1.1))],
                              method="probabilistic")
    assert torch.equal(out["sliced"].draft_ids, out["twin"].draft_ids)
    assert set(out["sliced"].draft_ids.flatten().tolist()) <= set(keep)
    torch.testing.assert_close(out["sliced"].draft_probs, out["twin"].draft_probs, atol=1e-6, rtol=1e-5)


def test_a_checkpoints_own_head_is_sliced_too(tmp_path):
    """A stored LM head that differs from the target's (the drafter was trained with it) keeps its own rows."""
    cfg = tiny_cfg(enable_confidence_head=True)
    model = random_model(cfg, seed=8)  # its random head is not the target's
    save_dspark(model, cfg, tmp_path / "d", dtype="float32", include_shared=True)
    sliced = build(spec(tmp_path / "d", draft_vocab_size=N, lookup_corpus=_corpus(tmp_path / "c.safetensors", COUNTS),
                        draft_matmul_dtype="float32"),
                   target_config=TARGET, target_model=random_target(), dtype=torch.float32, device="cpu")
    assert torch.equal(sliced.model.lm_head.weight, model.lm_head.weight[torch.tensor(KEPT)])
    target = eagle3_target()
    ref = random_eagle3(target)
    own = torch.randn(256, 64)
    (tmp_path / "e").mkdir()
    save_tensors({**state_dict_hf(ref), "lm_head.weight": own}, tmp_path / "e" / "model.safetensors")
    (tmp_path / "e" / "config.json").write_text(json.dumps(ref.config.to_dict()))
    corpus = _corpus(tmp_path / "c256.safetensors", COUNTS, vocab=256)
    eagle = _build(tmp_path / "e", "eagle3", CFG, target, draft_vocab_size=N, lookup_corpus=corpus)
    h = torch.randn(3, 64)
    with torch.no_grad():
        torch.testing.assert_close(eagle.model.draft_logits(h), eagle.model.norm(h) @ own[torch.tensor(KEPT)].T)


@pytest.mark.parametrize("method,head", [("dflash", None), ("dspark", "vanilla")])
def test_greedy_speculative_output_with_a_sliced_drafter_equals_plain(tmp_path, method, head):
    cfg = tiny_cfg(markov_rank=8 if head else 0, enable_confidence_head=bool(head))
    save_dspark(random_model(cfg, seed=3), cfg, tmp_path / "d", dtype="float32")
    target = random_target(seed=7)
    plain, _ = greedy_engine_run(target, None)
    sliced = spec(tmp_path / "d", method=method, n=4, draft_vocab_size=N,
                  lookup_corpus=_corpus(tmp_path / "c.safetensors", COUNTS))
    out, engine = greedy_engine_run(target, sliced)
    assert out == plain
    assert engine.drafter.model.cfg.draft_vocab_size == N and engine.metrics.verify_lens, "the drafter never proposed"


# -- the sampled law ------------------------------------------------------------------------------------

PROMPT = [1, 17, 33, 60, 5, 9, 88, 21, 40]
TEMPERATURE = 0.7
FIRSTS = 4


def _probs(target, ids: list[int]) -> torch.Tensor:
    kv = PagedKV.create(target, num_requests=1, max_len=len(ids) + 1, kv_block_size=4)
    hidden, _ = kv.step(target, [(ids, 0)])
    with torch.no_grad():
        return torch.softmax(target.compute_logits(hidden[-1:])[0].double() / TEMPERATURE, -1)


def _law(target):
    """Categories (first token among the FIRSTS likeliest, second token) + one for any other first token."""
    p1 = _probs(target, PROMPT)
    top = p1.topk(FIRSTS).indices.tolist()
    rows = [p1[t] * _probs(target, PROMPT + [t]) for t in top]
    return top, torch.cat(rows + [torch.tensor([1.0 - float(p1[top].sum())], dtype=torch.float64)])


def _sampled(engine, top: list[int], n: int) -> torch.Tensor:
    ids = [engine.add_request(PROMPT, SamplingParams(temperature=TEMPERATURE, max_tokens=2, ignore_eos=True, seed=s))
           for s in range(n)]
    outs = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
    return torch.tensor([top.index(o[0]) * 128 + o[1] if o[0] in top else FIRSTS * 128
                         for o in (outs[i] for i in ids)])


def test_sampled_law_with_a_sliced_vocabulary_and_a_wrong_variant(tmp_path, monkeypatch):
    """Probabilistic drafts over a sliced vocabulary keep the target's law; drafts sampled on the subset whose
    reported probabilities are the full head's, not renormalised on the subset, break it (the check can fail)."""
    target = random_target(seed=4)
    with torch.no_grad():  # a peaked head: the likeliest first tokens carry most of the mass
        target.lm_head.weight.mul_(2.0)
    top, law = _law(target)
    second = sum(_probs(target, PROMPT + [t]) for t in top)
    frequent = {int(t): 10 - i for i, t in enumerate(second.topk(6).indices)}  # what the target says most
    cfg = tiny_cfg(enable_confidence_head=True)
    save_dspark(random_model(cfg, seed=6), cfg, tmp_path / "d", dtype="float32")
    corpus = _corpus(tmp_path / "c.safetensors", frequent)
    spec_kw = dict(method="dspark", n=4, draft_sample_method="probabilistic", draft_matmul_dtype="float32")
    sliced_spec = spec(tmp_path / "d", draft_vocab_size=8, lookup_corpus=corpus, **spec_kw)

    def sample(spec_config, n=2500):
        drafter = build(spec_config, target_config=TARGET, target_model=target, dtype=torch.float32, device="cpu")
        engine = make_engine(target, TARGET, drafter=drafter, spec=spec_config, budget=512, max_num_seqs=64,
                             num_kv_blocks=1024, prefix=False)
        samples = _sampled(engine, top, n)
        assert engine.metrics.num_accepted_tokens > 0, "no draft was ever accepted"
        return samples, drafter

    samples, drafter = sample(sliced_spec)
    keep = drafter.model.d2t
    assert keep.numel() == 8 and set(frequent) <= set(keep.tolist())
    assert_matches_distribution(samples, law, what="sliced vocabulary, probabilistic drafts")

    import dspark.drafters.dspark as dspark_drafter
    inside = torch.zeros(128)
    inside[keep] = 1.0
    real = dspark_drafter.logits_to_probs
    monkeypatch.setattr(dspark_drafter, "logits_to_probs",  # full-vocabulary drafter: restricted, not renormalised
                        lambda logits, **kw: real(logits, **kw) * inside)
    wrong, _ = sample(spec(tmp_path / "d", **spec_kw))
    assert_differs_from_distribution(wrong, law, what="probabilities not renormalised on the subset")


# -- refusals -------------------------------------------------------------------------------------------

def test_refusals_name_draft_vocab_size_before_any_weight_loads(tmp_path, monkeypatch):
    cfg = tiny_cfg()
    save_dspark(random_model(cfg), cfg, tmp_path / "full", dtype="float32")
    reduced = tiny_cfg(draft_vocab_size=48)
    model = random_model(reduced)
    model.reset_buffers(d2t=torch.arange(48) * 2)
    save_dspark(model, reduced, tmp_path / "reduced", dtype="float32")
    corpus = _corpus(tmp_path / "c.safetensors", COUNTS)
    import dspark.drafters.dspark_checkpoint as ckpt
    monkeypatch.setattr(ckpt, "load_tensors", None)  # the check reads no weight
    cases = [
        ("full", dict(draft_vocab_size=129, lookup_corpus=corpus), "draft_vocab_size 129 is larger than the target's"),
        ("full", dict(draft_vocab_size=1, lookup_corpus=corpus), "draft_vocab_size 1 is smaller than the 2 special"),
        ("reduced", dict(draft_vocab_size=40, lookup_corpus=corpus), "draft_vocab_size 40: .* already has a reduced"),
        ("full", dict(draft_vocab_size=20), 'draft_vocab_size 20: .* give "lookup_corpus".*dspark build-corpus'),
    ]
    for folder, kw, message in cases:
        with pytest.raises(ValueError, match=message):
            check_drafter(spec(tmp_path / folder, **kw), TARGET)
    check_drafter(spec(tmp_path / "reduced", draft_vocab_size=48), TARGET)  # its own size: used as it is
    check_drafter(spec(tmp_path / "full", draft_vocab_size=128), TARGET)  # the whole vocabulary: nothing to count
    eagle = random_eagle3(eagle3_target())
    save_eagle3(eagle, eagle.config, str(tmp_path / "e"))
    with pytest.raises(ValueError, match='draft_vocab_size 20: .* give "lookup_corpus"'):
        check_drafter(SpecConfig(method="eagle3", model=str(tmp_path / "e"), num_speculative_tokens=3,
                                 draft_vocab_size=20), CFG)
    for kw, message in ((dict(draft_vocab_size=0), "draft_vocab_size must be a positive"),
                        (dict(draft_vocab_size=True), "draft_vocab_size must be a positive"),
                        (dict(method="ngram", draft_vocab_size=8), "draft_vocab_size applies to methods"),
                        (dict(lookup_corpus=corpus), "lookup_corpus applies")):
        with pytest.raises(ValueError, match=message):
            SpecConfig(**{"method": "dspark", "model": "x", **kw})
