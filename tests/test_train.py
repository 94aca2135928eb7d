"""Drafter training: loss terms against hand-computed values, anchors on a toy sequence, data prep with
a stub engine, a few steps on a tiny random target reduce the loss, resume is bit-exact, and 2 gloo
processes give the single-process gradients of the same global batch.

    pytest tests/test_train.py -q
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from conftest import TINY_LLAMA
from dspark.models import build_model
from dspark.train import methods
from dspark.train.anchors import (block_eval_mask, block_labels, process_rounds, sample_anchors,
                                  valid_anchor_mask)
from dspark.train.config import TrainConfig, load_train_config
from dspark.train.data import (BatchSampler, Cursor, TokenDataset, build_draft_vocab, collate, done_keys,
                               t2d_labels, write_shard)
from dspark.train.features import target_features
from dspark.train.losses import LossWeights, dspark_loss, eagle3_loss, eagle3_step_masks, summarise
from dspark.train.trainer import Trainer

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


def test_anchor_focus_mines_once_and_trains(tmp_path):
    """A run with anchor_focus mines its process anchors with the starting weights, keeps them for a resume,
    and trains; eagle3 refuses the option."""
    cfg = tiny_config(anchor_focus=0.5, max_steps=4, ckpt_every=2)
    run = Trainer(cfg, data_dir=toy_data(tmp_path / "data"), out_dir=tmp_path / "run", target=tiny_target(),
                  show_progress=False)
    run.fit(stop_at=2)
    mined = torch.load(tmp_path / "run" / "focus_anchors.pt")
    assert len(mined) == len(run.train_ds) and all(m.numel() >= 1 for m in mined)
    valid = [valid_anchor_mask(loss_mask=s.loss_mask.unsqueeze(0), lengths=torch.tensor([s.input_ids.numel()]))[0]
             for s in run.train_ds.samples]
    assert all(bool(v[m].all()) and int(m[0]) == int(v.nonzero()[0]) for v, m in zip(valid, mined))
    run.close()
    again = Trainer(cfg, data_dir=toy_data(tmp_path / "data"), out_dir=tmp_path / "run", target=tiny_target(),
                    show_progress=False)
    again.fit(resume=True)
    assert again.step == 4 and all(torch.equal(a, b) for a, b in zip(again.focus, mined))
    again.close()
    with pytest.raises(ValueError, match="anchor_focus"):
        tiny_config(method="eagle3", anchor_focus=0.5)


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


# -- training on a tiny random target -------------------------------------------------------------------

def tiny_target(seed: int = 0):
    torch.manual_seed(seed)
    model = build_model(TINY_LLAMA)
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = 0.5 if name.startswith("lm_head") else 0.1  # a peaked target: its distribution is learnable
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn_like(p) * std)
    return model, TINY_LLAMA, (2,)


def toy_data(root: Path, *, n: int = 8) -> Path:
    """Random prompts, then an answer with a learnable pattern (arithmetic progression mod 60)."""
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(n):
        plen, alen = int(torch.randint(4, 10, (1,), generator=g)), int(torch.randint(14, 24, (1,), generator=g))
        prompt = torch.randint(3, 200, (plen,), generator=g).tolist()
        start = int(torch.randint(0, 60, (1,), generator=g))
        answer = [(start + 3 * k) % 60 + 3 for k in range(alen)]
        samples.append((f"toy:{i}", prompt + answer, [0] * plen + [1] * alen, i == n - 1))
    root.mkdir(parents=True, exist_ok=True)
    write_shard(root / "shard-00000.safetensors", samples)
    return root


def tiny_config(**kw) -> TrainConfig:
    base = dict(num_draft_layers=1, block_size=4, tap_layer_ids=(0, 1), markov_rank=8, draft_vocab_size=80,
                num_anchors=6, batch_size=2, max_steps=8, lr=1e-2, warmup_frac=0.0, log_every=4,
                eval_every=0, ckpt_every=0)
    return TrainConfig(**{**base, **kw})


def _fixed_loss(trainer: Trainer) -> float:
    batch = collate([trainer.train_ds[i] for i in range(4)])
    feats = target_features(trainer.target, input_ids=batch.input_ids, lengths=batch.lengths,
                            tap_layer_ids=trainer.tap_layer_ids)
    with torch.no_grad():
        out = methods.batch_loss(trainer.cfg, trainer.model, trainer.target, batch, feats, d2t=trainer.d2t,
                                 seeds=[1, 2, 3, 4], all_reduce=lambda t: t)
    return out.loss.item()


@pytest.mark.parametrize("method", ["dspark", "dflash", "eagle3", "eagle3-reduced"])
def test_a_few_steps_reduce_the_loss(tmp_path, method):
    extra = {"dflash": dict(markov_rank=0, loss_ce=1.0, loss_l1=0.0, loss_confidence=0.0),
             "eagle3": dict(draft_vocab_size=None, ttt_steps=2, tap_layer_ids=(0, 1, 2)),
             "eagle3-reduced": dict(draft_vocab_size=64, ttt_steps=2, tap_layer_ids=(0, 1, 2))}.get(method, {})
    cfg = tiny_config(method=method.split("-")[0], max_steps=40, lr=3e-2, log_every=10, **extra)
    trainer = Trainer(cfg, data_dir=toy_data(tmp_path / "data"), out_dir=tmp_path / "run", target=tiny_target(),
                      show_progress=False)
    before = _fixed_loss(trainer)
    trainer.fit()
    after = _fixed_loss(trainer)
    trainer.export(tmp_path / "export")
    trainer.close()
    assert after < 0.9 * before, (before, after)
    assert (tmp_path / "export" / "model.safetensors").exists()
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") >= 2
    if method == "eagle3-reduced":  # the exported drafter carries its map and drafts inside it
        from dspark.drafters.eagle3_model import load_eagle3
        exported = load_eagle3(str(tmp_path / "export"))
        assert exported.config.draft_vocab_size == 64 and torch.equal(exported.d2t, trainer.d2t)


def test_process_tau_in_validation_uses_the_losses_block_acceptance(tmp_path):
    """The dense acceptance behind tau_process (a block at every anchor, in chunks) is, at the loss's random
    anchors, the loss's own top-1 acceptance (its tau_sum); validation reports tau_process for the block
    drafters only."""
    trainer = Trainer(tiny_config(max_steps=4), data_dir=toy_data(tmp_path / "data"), out_dir=tmp_path / "run",
                      target=tiny_target(), show_progress=False)
    trainer.fit()
    batch = collate([trainer.train_ds[i] for i in range(4)])
    feats = target_features(trainer.target, input_ids=batch.input_ids, lengths=batch.lengths,
                            tap_layer_ids=trainer.tap_layer_ids)
    seeds = [1, 2, 3, 4]
    with torch.no_grad():
        out = methods.batch_loss(trainer.cfg, trainer.model, trainer.target, batch, feats, d2t=trainer.d2t,
                                 seeds=seeds, all_reduce=lambda t: t)
    accepted = methods.block_accepted(trainer.model, batch, feats, chunk=3)
    anchors = sample_anchors(loss_mask=batch.loss_mask, lengths=batch.lengths, num_anchors=trainer.cfg.num_anchors,
                             seeds=seeds)
    rows = torch.arange(4).unsqueeze(1).expand_as(anchors)
    keep = anchors >= 0
    assert float(out.stats["tau_sum"]) == float((1 + accepted[rows[keep], anchors[keep]]).sum())
    assert bool(accepted.max() > 0), "the trained toy drafter keeps some drafts"
    record = trainer.evaluate()
    assert 1.0 <= record["tau_process"] <= trainer.cfg.block_size
    trainer.close()


def test_eagle3_process_acceptance_follows_its_chains(tmp_path, monkeypatch):
    """EAGLE-3's drafts after position a come from its TTT chain of row a - 1, step j predicting token
    a + j + 1: with an oracle head (right unless (row + step) % 3 == 2) the acceptance per anchor is what a
    plain loop over the rows counts, across chunks; validation reports tau_process for EAGLE-3 too."""
    cfg = tiny_config(method="eagle3", draft_vocab_size=64, ttt_steps=3, tap_layer_ids=(0, 1, 2), max_steps=2)
    trainer = Trainer(cfg, data_dir=toy_data(tmp_path / "data"), out_dir=tmp_path / "eagle", target=tiny_target(),
                      show_progress=False)
    trainer.fit()
    assert 1.0 <= trainer.evaluate()["tau_process"] <= 4.0
    batch = collate([trainer.train_ds[i] for i in range(4)])
    feats = target_features(trainer.target, input_ids=batch.input_ids, lengths=batch.lengths,
                            tap_layer_ids=trainer.tap_layer_ids)
    model, seq_len = trainer.model, batch.input_ids.shape[1]
    labels = t2d_labels(batch.input_ids, trainer.d2t, vocab_size=model.config.vocab_size)

    def chains(*, taps, input_ids, anchors, ttt_steps):  # each row's "hidden": (sequence, chain row, step)
        seq = torch.arange(anchors.shape[0]).unsqueeze(1).expand_as(anchors)
        return [torch.stack([seq, anchors, torch.full_like(anchors, j)], -1).float() for j in range(ttt_steps)]

    def oracle(h):  # [rows, 3] → [rows, 64]: the label of token row + step + 2, wrong every third
        out = torch.zeros(h.shape[0], 64)
        for i, (b, p, j) in enumerate(h.long().tolist()):
            tok = int(labels[b, p + j + 2]) if p >= 0 and p + j + 2 < seq_len else -100
            out[i, tok if tok >= 0 and (p + j) % 3 != 2 else (tok + 1) % 64] = 1.0
        return out

    monkeypatch.setattr(model, "training_forward_chains", chains)
    monkeypatch.setattr(model, "draft_logits", oracle)
    accepted = methods.eagle3_accepted(model, batch, feats, d2t=trainer.d2t, ttt_steps=3, chunk=5)
    valid = valid_anchor_mask(loss_mask=batch.loss_mask, lengths=batch.lengths)
    supervised = batch.loss_mask.bool() & (torch.arange(seq_len).unsqueeze(0) < batch.lengths.unsqueeze(1))
    expected = torch.zeros_like(accepted)
    for b in range(4):
        for a in range(1, seq_len):
            if not valid[b, a]:
                continue
            for j in range(3):
                q = a + j + 1
                if q >= seq_len or not supervised[b, q] or labels[b, q] < 0 or (a - 1 + j) % 3 == 2:
                    break
                expected[b, a] += 1
    assert torch.equal(accepted, expected) and int(expected.max()) == 2  # (the oracle misses every third)
    trainer.close()


@pytest.mark.parametrize("method", ["dspark", "dflash", "eagle3"])
def test_warm_start_from_an_export(tmp_path, method):
    """init_from: the new run starts from the exported weights (bf16 in the export) and draft vocabulary,
    whatever vocabulary its own data would build; a different drafter shape is refused by name."""
    extra = {"dflash": dict(markov_rank=0, loss_ce=1.0, loss_l1=0.0, loss_confidence=0.0),
             "eagle3": dict(draft_vocab_size=64, ttt_steps=2, tap_layer_ids=(0, 1, 2))}.get(method, {})
    cfg = tiny_config(method=method, max_steps=6, **extra)
    first = Trainer(cfg, data_dir=toy_data(tmp_path / "data"), out_dir=tmp_path / "run", target=tiny_target(),
                    show_progress=False)
    first.fit()
    first.export(tmp_path / "export")
    other_data = toy_data(tmp_path / "other", n=6)
    warm = Trainer(replace(cfg, init_from=str(tmp_path / "export"), seed=5), data_dir=other_data,
                   out_dir=tmp_path / "warm", target=tiny_target(), show_progress=False)
    cold = Trainer(replace(cfg, seed=5), data_dir=other_data, out_dir=tmp_path / "cold", target=tiny_target(),
                   show_progress=False)
    assert torch.equal(warm.d2t, first.d2t)
    trained = dict(first.model.named_parameters())
    for name, p in warm.model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p, trained[name].to(torch.bfloat16).float(), atol=0, rtol=0, msg=name)
    assert _fixed_loss(warm) < _fixed_loss(cold)
    bad = dict(tap_layer_ids=(0, 1)) if method == "eagle3" else dict(num_draft_layers=2)
    with pytest.raises(ValueError, match="init_from .* the config's drafter needs"):
        Trainer(replace(cfg, init_from=str(tmp_path / "export"), **bad), data_dir=other_data,
                out_dir=tmp_path / "bad", target=tiny_target(), show_progress=False)
    for t in (first, warm, cold):
        t.close()


def test_eagle3_trainer_loss_equals_dense_unroll_on_its_chains(tmp_path):
    """The trainer scores EAGLE-3 on sampled TTT chains through the sparse unroll; the same loss from the
    dense unroll's logits restricted to those rows (so chain order and masks line up)."""
    from dspark.train.anchors import sample_anchors
    from dspark.train.features import target_rows
    from dspark.train.data import t2d_labels
    cfg = tiny_config(method="eagle3", draft_vocab_size=64, ttt_steps=3, tap_layer_ids=(0, 1, 2), num_anchors=5)
    trainer = Trainer(cfg, data_dir=toy_data(tmp_path / "data"), out_dir=tmp_path / "run", target=tiny_target(),
                      show_progress=False)
    batch = collate([trainer.train_ds[i] for i in range(4)])
    feats = target_features(trainer.target, input_ids=batch.input_ids, lengths=batch.lengths,
                            tap_layer_ids=trainer.tap_layer_ids)
    seeds = [1, 2, 3, 4]
    with torch.no_grad():
        got = methods.batch_loss(cfg, trainer.model, trainer.target, batch, feats, d2t=trainer.d2t, seeds=seeds,
                                 all_reduce=lambda t: t)
        dense = trainer.model.training_forward(taps=feats.taps, input_ids=batch.input_ids, ttt_steps=3)
    valid = torch.arange(batch.input_ids.shape[1]).unsqueeze(0) < batch.lengths.unsqueeze(1)
    anchors = sample_anchors(loss_mask=batch.loss_mask, lengths=batch.lengths, num_anchors=5, seeds=seeds)
    scored = torch.zeros_like(valid)
    keep = anchors >= 0
    scored[torch.arange(4).unsqueeze(1).expand_as(anchors)[keep], anchors[keep]] = True
    rows = target_rows(trainer.target, feats.hidden, row_mask=valid, d2t=trainer.d2t)
    logits, lse = rows.gather(torch.arange(valid.shape[1]).expand_as(valid).contiguous())
    ref = eagle3_loss(step_logits=dense, labels=t2d_labels(batch.input_ids, trainer.d2t, vocab_size=256),
                      loss_mask=batch.loss_mask * valid, row_mask=scored, target_logits=logits, target_lse=lse,
                      step_decay=cfg.step_loss_decay)
    trainer.close()
    assert got.stats["slots"].tolist() == ref.stats["slots"].tolist() and got.stats["slots"].sum() > 0
    torch.testing.assert_close(got.loss, ref.loss, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got.stats["match"], ref.stats["match"])


def test_resume_matches_uninterrupted_training(tmp_path):
    data = toy_data(tmp_path / "data")
    cfg = tiny_config(max_steps=6, grad_accum=2)
    full = Trainer(cfg, data_dir=data, out_dir=tmp_path / "full", target=tiny_target(), show_progress=False)
    full.fit()
    first = Trainer(cfg, data_dir=data, out_dir=tmp_path / "split", target=tiny_target(), show_progress=False)
    first.fit(stop_at=3)
    second = Trainer(cfg, data_dir=data, out_dir=tmp_path / "split", target=tiny_target(), show_progress=False)
    second.fit(resume=True)
    assert second.step == full.step == 6 and second.cursor == full.cursor
    for (name, a), b in zip(full.model.state_dict().items(), second.model.state_dict().values()):
        assert torch.equal(a, b), name
    for t in (full, first, second):
        t.close()


def test_select_by_tau_process_exports_the_best_validation(tmp_path, monkeypatch):
    """select_by tau_process: validation at steps 0, 2, 4, 6 scores (scripted) 1.5, 2.5, 2.5, 1.8, so the export
    holds the step-2 weights (a tie keeps the earlier step), the ones a run stopped at step 2 ends with, and
    not the last; "last" exports the final weights; selection without tau_process is refused."""
    data = toy_data(tmp_path / "data")
    cfg = tiny_config(max_steps=6, eval_every=2, select_by="tau_process")
    scripted = {0: 1.5, 2: 2.5, 4: 2.5, 6: 1.8}
    trainers = []

    def counts(cfg, model, batch, feats, d2t):
        return scripted[trainers[-1].step], 1

    monkeypatch.setattr(methods, "process_tau_counts", counts)
    for name, kw, stop in (("two", dict(select_by="last"), 2), ("best", {}, None), ("last", dict(select_by="last"), None)):
        trainers.append(Trainer(replace(cfg, **kw), data_dir=data, out_dir=tmp_path / name, target=tiny_target(),
                                show_progress=False))
        trainers[-1].fit(stop_at=stop)
        trainers[-1].export(tmp_path / name / "export")
    from safetensors.torch import load_file
    two, best, last = (load_file(tmp_path / n / "export" / "model.safetensors") for n in ("two", "best", "last"))
    assert all(torch.equal(two[k], best[k]) for k in two)
    assert not all(torch.equal(last[k], best[k]) for k in last)
    exported = json.loads((tmp_path / "best" / "export" / "train_config.json").read_text())
    assert exported["_exported_step"] == 2 and trainers[1].step == 6
    assert load_train_config(tmp_path / "best" / "export" / "train_config.json").select_by == "tau_process"
    with pytest.raises(ValueError, match="select_by tau_process needs eval_process_tau"):
        replace(cfg, eval_process_tau=False)
    for t in trainers:
        t.close()


def _ddp_worker(rank: int, world: int, store: str, data: str, out: str, result: str) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        trainer = Trainer(tiny_config(batch_size=1), data_dir=data, out_dir=out, target=tiny_target(),
                          show_progress=False)
        trainer.compute_grads()
        if rank == 0:
            torch.save({n: p.grad for n, p in trainer.model.named_parameters() if p.requires_grad}, result)
        trainer.close()
    finally:
        dist.destroy_process_group()


def test_two_gloo_processes_match_single_process_gradients(tmp_path):
    data = toy_data(tmp_path / "data")
    single = Trainer(tiny_config(batch_size=2), data_dir=data, out_dir=tmp_path / "single", target=tiny_target(),
                     show_progress=False)
    single.compute_grads()
    result = tmp_path / "grads.pt"
    mp.start_processes(_ddp_worker, args=(2, str(tmp_path / "store"), str(data), str(tmp_path / "ddp"),
                                          str(result)), nprocs=2, join=True, start_method="fork")
    grads = torch.load(result)
    for name, p in single.model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    single.close()


def test_feature_cache_is_written_and_read_back(tmp_path):
    from dspark.train.features import batch_features
    data = toy_data(tmp_path / "data")
    trainer = Trainer(tiny_config(max_steps=4), data_dir=data, out_dir=tmp_path / "run", target=tiny_target(),
                      cache_dir=tmp_path / "cache", show_progress=False)
    trainer.fit()
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) >= 6  # 3 steps of 2 fill epoch 0
    seen = trainer.sampler.permutation(0)[:2]
    batch = collate([trainer.train_ds[i] for i in seen])
    cached = batch_features(None, batch=batch, tap_layer_ids=trainer.tap_layer_ids, cache=trainer.cache)
    fresh = target_features(trainer.target, input_ids=batch.input_ids, lengths=batch.lengths,
                            tap_layer_ids=trainer.tap_layer_ids)
    torch.testing.assert_close(cached.taps, fresh.taps, rtol=2e-3, atol=2e-3)  # fp16 on disk
    trainer.close()


def _bf16_target():
    model, cfg, eos = tiny_target()
    return model.to(torch.bfloat16), cfg, eos


@pytest.mark.parametrize("method", ["dspark", "eagle3"])
def test_sharded_feature_cache_matches_online_features_and_step(tmp_path, method):
    """Precomputed bf16 features == online bf16 features; a step from the cache == the same step online."""
    from dspark.train.features import ShardedFeatureCache
    data = toy_data(tmp_path / "data")
    kw = dict(target_dtype="bfloat16", drafter_autocast="bfloat16", max_steps=2)
    if method == "eagle3":
        kw.update(method="eagle3", draft_vocab_size=None, ttt_steps=2, markov_rank=0)
    online = Trainer(tiny_config(**kw), data_dir=data, out_dir=tmp_path / "online", target=_bf16_target(),
                     show_progress=False)
    cached = Trainer(tiny_config(**kw, feature_cache=str(tmp_path / "fc")), data_dir=data,
                     out_dir=tmp_path / "cached", target=_bf16_target(), show_progress=False)
    rec = cached.precompute_features()
    assert isinstance(cached.cache, ShardedFeatureCache) and rec["samples"] == len(cached.cache) == 8
    assert len(list((tmp_path / "fc").glob("feat-*.safetensors"))) == 1  # many samples per shard
    batch = collate([online.train_ds[i] for i in range(4)])
    fresh = target_features(online.target, input_ids=batch.input_ids, lengths=batch.lengths,
                            tap_layer_ids=online.tap_layer_ids)
    hit = cached.cache.get(batch.keys, batch.lengths)
    torch.testing.assert_close(hit.taps.float(), fresh.taps.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(hit.hidden.float(), fresh.hidden.float(), rtol=1e-2, atol=1e-2)
    need = torch.zeros_like(batch.loss_mask, dtype=torch.bool)
    need[:, :-1] = batch.loss_mask[:, 1:].bool()
    full = torch.logsumexp(online.target.compute_logits(fresh.hidden[need]).float(), -1)
    torch.testing.assert_close(hit.lse[need], full, rtol=1e-3, atol=1e-3)
    s_online, s_cached = online.train_step(), cached.train_step()
    for key in ("ce_num", "w_den") if method != "eagle3" else ("soft_ce_num",):
        if key in s_online:
            torch.testing.assert_close(s_cached[key], s_online[key], rtol=2e-2, atol=2e-2)
    for (n, a), b in zip(online.model.named_parameters(), cached.model.parameters()):
        if a.requires_grad:
            torch.testing.assert_close(b, a, rtol=1e-2, atol=2e-3, msg=n)
    assert float(s_cached["t_target_s"]) < 1.0
