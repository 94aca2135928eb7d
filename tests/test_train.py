"""Drafter training, the parts without a training loop: loss terms against hand-computed values, anchors on
a toy sequence, the draft vocabulary and batch sampler, the config's key check, and data preparation with a
stub engine (shards, resume, holdout, long prompts). The training loop itself: tests/test_train_loop.py.

    pytest tests/test_train.py -q
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from dspark.train.anchors import (block_eval_mask, block_labels, process_rounds, sample_anchors,
                                  valid_anchor_mask)
from dspark.train.config import load_train_config
from dspark.drafters.vocab import build_draft_vocab
from dspark.train.data import BatchSampler, Cursor, TokenDataset, done_keys
from dspark.train.losses import LossWeights, dspark_loss, eagle3_loss, eagle3_step_masks, summarise

W1 = math.exp(-1 / 4)  # position weight of slot 1


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread is faster, and kinder to a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)



# -- losses -------------------------------------------------------------------------------------------

def _toy_block():
    """One block of two slots over a draft vocab of 2 target tokens (the target vocab has a third)."""
    draft_logits = torch.tensor([[[[0.0, math.log(3)], [0.0, 0.0]]]])  # p_d = [.25, .75], [.5, .5]
    p_t = torch.tensor([[[[0.5, 0.3], [0.1, 0.9]]]])  # target probs on the draft vocab; slot 0 has 0.2 outside
    return dict(draft_logits=draft_logits, target_logits=p_t.log(), target_lse=torch.zeros(1, 1, 2),
                labels=torch.tensor([[[1, 1]]]), eval_mask=torch.ones(1, 1, 2, dtype=torch.bool),
                confidence_logits=torch.tensor([[[0.0, math.log(3)]]]))  # σ = 0.5, 0.75


def test_dspark_loss_terms_match_hand_computed_values():
    out = dspark_loss(**_toy_block(), weights=LossWeights())
    ce = (-math.log(0.75) + W1 * -math.log(0.5)) / (1 + W1)
    l1_0 = 0.25 + 0.45 + 0.2  # |p_d - p_t| on the draft vocab + target mass outside it
    l1_1 = 0.4 + 0.4
    l1 = (l1_0 + W1 * l1_1) / (1 + W1)
    c0, c1 = 1 - l1_0 / 2, 1 - l1_1 / 2  # c* = 0.55, 0.6
    bce_0 = -(c0 * math.log(0.5) + (1 - c0) * math.log(0.5))
    bce_1 = -(c1 * math.log(0.75) + (1 - c1) * math.log(0.25))
    bce = (bce_0 + W1 * bce_1) / (1 + W1)
    assert out.loss.item() == pytest.approx(0.1 * ce + 0.9 * l1 + 1.0 * bce, rel=1e-5)
    s = summarise(out.stats)
    assert s["ce"] == pytest.approx(ce, rel=1e-5)
    assert s["l1"] == pytest.approx(l1, rel=1e-5)
    assert s["bce"] == pytest.approx(bce, rel=1e-5)
    assert s["alpha"] == pytest.approx([c0, c1], abs=1e-4)
    assert s["acc"] == [1.0, 0.0]  # argmax: slot 0 → 1 (= label), slot 1 → 0 (tie; label 1)
    assert s["tau_top1"] == pytest.approx(2.0)  # slot 0 matches, slot 1 does not


def test_dspark_soft_ce_term_is_the_decayed_cross_entropy_against_the_target():
    base = dspark_loss(**_toy_block(), weights=LossWeights())
    out = dspark_loss(**_toy_block(), weights=LossWeights(soft_ce=0.5))
    # slot 0: p_t = [.5, .3] (0.2 outside: no term), p_d = [.25, .75]; slot 1: p_t = [.1, .9], p_d = [.5, .5]
    sce_0 = -(0.5 * math.log(0.25) + 0.3 * math.log(0.75))
    sce_1 = -(0.1 * math.log(0.5) + 0.9 * math.log(0.5))
    sce = (sce_0 + W1 * sce_1) / (1 + W1)
    assert out.loss.item() == pytest.approx(base.loss.item() + 0.5 * sce, rel=1e-5)
    assert summarise(out.stats)["sce"] == pytest.approx(sce, rel=1e-5)
    grad = _toy_block()["draft_logits"].requires_grad_()
    dspark_loss(**{**_toy_block(), "draft_logits": grad}, weights=LossWeights(ce=0, l1=0, confidence=0, soft_ce=1)
                ).loss.backward()
    # d/dlogits of -Σ p_t log softmax = p_d · Σ p_t − p_t: slot 0 pushes the first logit up (p_t .5 > p_d .25 · .8)
    assert grad.grad[0, 0, 0, 0].item() == pytest.approx((0.25 * 0.8 - 0.5) / (1 + W1), rel=1e-5)


def test_dspark_loss_masks_and_dflash_ce_only():
    toy = _toy_block()
    toy["eval_mask"] = torch.tensor([[[True, False]]])  # slot 1 unsupervised: no term at all
    toy["labels"] = torch.tensor([[[-100, 1]]])  # slot 0 label outside the draft vocab: no CE, still L1
    out = dspark_loss(**toy, weights=LossWeights())
    s = summarise(out.stats)
    assert s["l1"] == pytest.approx(0.9, rel=1e-5) and s["ce"] == 0.0
    dflash = dspark_loss(**{**_toy_block(), "confidence_logits": None, "target_logits": None, "target_lse": None},
                         weights=LossWeights(ce=1.0, l1=0.0, confidence=0.0))
    expected = (-math.log(0.75) + W1 * -math.log(0.5)) / (1 + W1)
    assert dflash.loss.item() == pytest.approx(expected, rel=1e-5)


def test_eagle3_loss_is_decayed_soft_ce_on_shifted_rows():
    # seq of 5 tokens, 2 TTT steps; step j at row p predicts token p+j+2 against target row p+j+1
    loss_mask = torch.tensor([[0, 0, 1, 1, 1]])
    logits = [torch.zeros(1, 5, 2), torch.zeros(1, 5, 2)]  # uniform draft: soft CE = ln 2 everywhere
    target = torch.log(torch.tensor([[[0.5, 0.5], [0.2, 0.8], [0.3, 0.7], [0.9, 0.1], [0.5, 0.5]]]))
    out = eagle3_loss(step_logits=logits, labels=torch.zeros(1, 5, dtype=torch.long), loss_mask=loss_mask,
                      target_logits=target, target_lse=torch.zeros(1, 5), step_decay=0.8)
    # step 0 scores rows 0,1,2 (tokens 2,3,4), step 1 rows 0,1 (tokens 3,4): each mean is ln 2
    assert out.loss.item() == pytest.approx(math.log(2) * (1 + 0.8), rel=1e-5)
    assert out.stats["slots"].tolist() == [3.0, 2.0]
    # the trainer passes only the scored rows of each step: same loss and stats as the dense logits
    dense = [torch.randn(1, 5, 2, generator=torch.Generator().manual_seed(j)) for j in range(2)]
    masks = eagle3_step_masks(loss_mask, num_steps=2)
    rows = [lg[:, :m.shape[1]][m] for lg, m in zip(dense, masks)]
    assert [r.shape[0] for r in rows] == [3, 2]
    kw = dict(labels=torch.ones(1, 5, dtype=torch.long), loss_mask=loss_mask, target_logits=target,
              target_lse=torch.zeros(1, 5), step_decay=0.8)
    a, b = eagle3_loss(step_logits=dense, **kw), eagle3_loss(step_logits=rows, **kw)
    assert torch.equal(a.loss, b.loss) and all(torch.equal(a.stats[k], b.stats[k]) for k in a.stats)


# -- anchors and data -------------------------------------------------------------------------------------

def test_anchors_on_a_toy_sequence():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 0], [20, 21, 22, 23, 24, 25, 26, 27]])
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 0], [0, 1, 0, 1, 1, 1, 1, 1]])
    lengths = torch.tensor([7, 8])
    valid = valid_anchor_mask(loss_mask=loss_mask, lengths=lengths)
    assert valid[0].nonzero().flatten().tolist() == [2, 3, 4, 5]  # predicts an assistant token inside the row
    anchors = sample_anchors(loss_mask=loss_mask, lengths=lengths, num_anchors=6, seeds=[0, 1])
    assert anchors[0].tolist() == [2, 3, 4, 5, -1, -1]
    few = sample_anchors(loss_mask=loss_mask, lengths=lengths, num_anchors=3, seeds=[7, 7])
    assert few.shape == (2, 3) and (few >= 0).all() and valid.gather(1, few).all()
    assert few[1].tolist() == sorted(few[1].tolist())
    assert torch.equal(few, sample_anchors(loss_mask=loss_mask, lengths=lengths, num_anchors=3, seeds=[7, 7]))
    toy = torch.tensor([[2, 4, -1], [0, 2, 6]])
    mask = block_eval_mask(loss_mask=loss_mask, lengths=lengths, anchors=toy, block_size=3)
    assert mask[0].tolist() == [[True, True, True], [True, True, False], [False, False, False]]
    assert mask[1, 0].tolist() == [True, False, False]  # token 2 is a prompt token: cumulative AND stops
    assert mask[1, 2].tolist() == [True, False, False]  # position 8 is past the end
    labels = block_labels(input_ids=ids, anchors=toy, eval_mask=mask)
    assert labels[0, 0].tolist() == [13, 14, 15] and labels[0, 1].tolist() == [15, 16, -100]


def test_process_rounds_replays_greedy_decoding():
    """Rounds along each answer: anchor at its first position, emit accepted + 1, re-anchor at the last token
    emitted; a round near the end emits only what is left. Hand-worked on two rows (the second a two-turn
    conversation: two answers)."""
    valid = torch.zeros(2, 12, dtype=torch.bool)
    valid[0, 2:10] = True  # anchors 2 .. 9 emit tokens 3 .. 10
    valid[1, 1:3] = True
    valid[1, 5:8] = True
    accepted = torch.zeros(2, 12, dtype=torch.long)
    accepted[0, 2], accepted[0, 7], accepted[0, 3] = 3, 7, 5  # anchor 3 is skipped by the round from 2
    accepted[1, 1], accepted[1, 6] = 1, 5
    # row 0: 2 (+4) → 6 (+1) → 7 (+3, all that is left) = 8 tokens in 3 rounds
    # row 1: 1 (+2) | 5 (+1) → 6 (+2) = 5 tokens in 3 rounds
    assert process_rounds(accepted=accepted, valid=valid) == (13, 6)
    assert process_rounds(accepted=accepted[:1], valid=valid[:1]) == (8, 3)
    # every answer token is emitted exactly once, whatever the drafts keep
    g = torch.Generator().manual_seed(0)
    acc = torch.randint(0, 8, (2, 12), generator=g)
    assert process_rounds(accepted=acc, valid=valid)[0] == int(valid.sum())


def test_focus_anchors_are_drawn_first_and_the_rest_uniformly():
    """anchor_focus: round(frac * num_anchors) anchors from the row's focus positions (invalid ones never),
    the rest uniformly from the other valid positions, sorted, no repeats; without focus the uniform draw is
    the one earlier runs made."""
    loss_mask = torch.zeros(2, 40, dtype=torch.long)
    loss_mask[:, 10:] = 1
    lengths = torch.tensor([40, 30])
    focus = [torch.tensor([12, 20, 21, 25, 33]), torch.tensor([3, 15, 29, 35])]  # 3 and 35/29: not anchorable
    out = sample_anchors(loss_mask=loss_mask, lengths=lengths, num_anchors=8, seeds=[1, 2], focus=focus,
                         focus_frac=0.5)
    valid = valid_anchor_mask(loss_mask=loss_mask, lengths=lengths)
    for row in range(2):
        got = out[row][out[row] >= 0]
        assert got.tolist() == sorted(set(got.tolist())) and valid[row, got].all()
    assert torch.isin(focus[0][:5], out[0]).sum() == 4  # 4 of the 5 focus positions (round(0.5 * 8))
    assert torch.isin(torch.tensor([15]), out[1]).all() and not torch.isin(torch.tensor([3, 29, 35]), out[1]).any()
    assert (out >= 0).sum(1).tolist() == [8, 8]
    plain = sample_anchors(loss_mask=loss_mask, lengths=lengths, num_anchors=8, seeds=[1, 2])
    assert torch.equal(plain, sample_anchors(loss_mask=loss_mask, lengths=lengths, num_anchors=8, seeds=[1, 2],
                                             focus=focus, focus_frac=0.0))


def test_draft_vocab_and_batch_sampler():
    counts = torch.tensor([5, 0, 9, 9, 1, 0])
    assert build_draft_vocab(counts, size=3, always=(5,)).tolist() == [2, 3, 5]
    assert build_draft_vocab(counts, size=10).tolist() == list(range(6))
    sampler = BatchSampler(num_samples=5, global_batch=2, seed=3)
    seen, cursor = [], Cursor()
    for _ in range(2):
        idx, cursor = sampler.next_batch(cursor)
        seen += idx
    assert sorted(seen) == sorted(set(seen)) and cursor == Cursor(0, 4)
    _, cursor = sampler.next_batch(cursor)
    assert cursor == Cursor(1, 2)  # partial batch dropped, next epoch


def test_train_config_rejects_unknown_keys(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"_comment": "notes are fine", "lr": 1e-3, "method": "dspark"}))
    assert load_train_config(path, overrides=["max_steps=7"]).max_steps == 7
    with pytest.raises(ValueError, match="unknown train config key"):
        load_train_config(path, overrides=["learning_rate=1"])
    with pytest.raises(ValueError, match="contradicts"):
        load_train_config(path, method="eagle3")
    assert load_train_config(path, overrides=["anchor_features=true"]).anchor_features
    with pytest.raises(ValueError, match="anchor_features is a block drafter's"):
        load_train_config(path, overrides=["method=eagle3", "anchor_features=true"])


class _StubTokenizer:
    eos_token_ids = (2,)

    def apply_chat_template(self, conv, add_generation_prompt=True):
        return [1] + [ord(c) % 50 + 3 for c in conv[-1]["content"][:12]] + [9]


class _StubLLM:
    """Answers every prompt with 20 tokens; counts the prompts it saw."""

    def __init__(self):
        self.tokenizer, self.calls = _StubTokenizer(), 0

    def generate(self, prompt_ids, params):
        from types import SimpleNamespace
        self.calls += len(prompt_ids)
        return [SimpleNamespace(prompt_token_ids=p, token_ids=[(p[1] + k) % 60 + 3 for k in range(19)] + [2])
                for p in prompt_ids]


def test_prepare_data_shards_resume_and_holdout(tmp_path):
    from dspark.train.prepare_data import PrepareConfig, prepare
    prompts = tmp_path / "train"
    prompts.mkdir()
    (prompts / "toy.jsonl").write_text("\n".join(json.dumps({"turns": [f"question {i} " * 3]}) for i in range(30)))
    cfg = PrepareConfig(out=str(tmp_path / "data"), model="stub", prompts=str(prompts), max_prompts=20,
                        batch_size=8, holdout=0.2)
    llm = _StubLLM()
    manifest = prepare(cfg, llm=llm)
    assert llm.calls == 20 and len(done_keys(cfg.out)) == 20
    assert manifest["num_samples"]["train"] + manifest["num_samples"]["val"] == 20
    assert manifest["num_samples"]["val"] > 0
    prepare(PrepareConfig(**{**cfg.__dict__, "max_prompts": 24}), llm=llm)  # resume: only 4 new
    assert llm.calls == 24
    ds = TokenDataset(cfg.out, split="train")
    s = ds[0]
    assert s.loss_mask.sum() == 20 and s.loss_mask[-1] == 1 and s.input_ids[-1] == 2
    with pytest.raises(AssertionError, match="evaluation prompts"):
        prepare(PrepareConfig(**{**cfg.__dict__, "prompts": str(tmp_path / "datasets" / "eval")}), llm=llm)


class _CharTokenizer:
    """One token per character; the template adds 3 tokens before and 2 after the content."""
    eos_token_ids = (2,)

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 250 + 3 for c in text]

    def decode(self, ids):
        return "".join(chr(i - 3) for i in ids)

    def apply_chat_template(self, conv, add_generation_prompt=True):
        return [1, 4, 5] + self.encode(conv[-1]["content"]) + [9, 10]


def test_prepare_data_truncates_long_prompts_and_redoes_earlier_drops(tmp_path):
    from dspark.train.prepare_data import PrepareConfig, fit_prompt, prepare
    tok = _CharTokenizer()
    long = "A" * 60 + "middle" * 20 + "Z" * 30
    ids = fit_prompt(tok, long, 64)
    text = tok.decode(ids[3:-2])
    assert len(ids) <= 64 and text.startswith("A" * 20) and text.endswith("Z" * 10) and "\n...\n" in text
    assert fit_prompt(tok, "short", 64) == tok.apply_chat_template([{"content": "short"}])
    assert fit_prompt(tok, long, 9) is None  # not even the template and the ellipsis fit

    prompts = tmp_path / "train"
    prompts.mkdir()
    (prompts / "toy.jsonl").write_text("\n".join(json.dumps({"turns": [f"q{i} " + "x" * (10 if i % 2 else 200)]})
                                                 for i in range(10)))
    llm = _StubLLM()
    llm.tokenizer = tok
    cfg = PrepareConfig(out=str(tmp_path / "data"), model="stub", prompts=str(prompts), max_prompt_tokens=64,
                        batch_size=4, holdout=0.0)
    assert sum(prepare(cfg, llm=llm)["num_samples"].values()) == 5 and llm.calls == 5  # long ones dropped
    prepare(cfg, llm=llm)
    assert llm.calls == 5  # drop mode: the drops are done
    manifest = prepare(PrepareConfig(**{**cfg.__dict__, "long_prompts": "truncate"}), llm=llm)
    assert manifest["num_samples"]["train"] == 10 and llm.calls == 10  # only the 5 dropped ones, cut to fit
    assert max(len(s.input_ids) - int(s.loss_mask.sum()) for s in TokenDataset(cfg.out).samples) <= 64
