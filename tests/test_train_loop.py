"""Drafter training loops on a tiny random target: a few steps reduce the loss for every method, process-τ
validation, warm starts from an export, EAGLE-3's loss against a dense unroll, resume is bit-exact,
selection by validation τ, 2 gloo processes give the single-process gradients of the same global batch,
the feature cache (written, read back, sharded) matches online features, anchor focus mines once, and feature
noise perturbs the training steps' taps only.

    pytest tests/test_train_loop.py -q
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from conftest import TINY_LLAMA
from dspark.models import build_model
from dspark.train import methods
from dspark.train.anchors import (sample_anchors,
                                  valid_anchor_mask)
from dspark.train.config import TrainConfig, load_train_config
from dspark.train.data import (collate, t2d_labels, write_shard)
from dspark.train.features import target_features
from dspark.train.losses import eagle3_loss
from dspark.train.trainer import Trainer

@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread is faster, and kinder to a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)



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


def test_feature_noise_perturbs_the_taps_of_training_steps_only(tmp_path):
    """feature_noise: each tap gets Gaussian noise of std scale × its RMS at that token (pads stay zero), the
    same noise for the same seed; the labels' hidden states are untouched; a noisy step moves the weights
    differently from a clean one, while validation reads exact taps; a negative scale is refused."""
    from dspark.train.features import TargetFeatures, noisy_taps
    g = torch.Generator().manual_seed(0)
    taps = torch.randn(2, 50, 3 * 64, generator=g) * torch.tensor([0.1, 1.0, 30.0]).repeat_interleave(64)
    taps[1, 40:] = 0  # padding
    feats = TargetFeatures(taps=taps, hidden=torch.randn(2, 50, 64, generator=g))
    out = noisy_taps(feats, num_taps=3, scale=0.2, seed=7)
    assert out.hidden is feats.hidden and torch.equal(out.taps, noisy_taps(feats, num_taps=3, scale=0.2, seed=7).taps)
    assert not torch.equal(out.taps, noisy_taps(feats, num_taps=3, scale=0.2, seed=8).taps)
    assert torch.equal(out.taps[1, 40:], taps[1, 40:])
    delta, ref = (out.taps - taps)[0].unflatten(-1, (3, 64)), taps[0].unflatten(-1, (3, 64))
    ratio = delta.pow(2).mean((0, 2)).sqrt() / ref.pow(2).mean((0, 2)).sqrt()  # [3]: every tap at its own scale
    assert torch.allclose(ratio, torch.full((3,), 0.2), rtol=0.1), ratio

    def one_step(noise: float):
        run = Trainer(tiny_config(feature_noise=noise, max_steps=1), data_dir=toy_data(tmp_path / "data"),
                      out_dir=tmp_path / f"run{noise}", target=tiny_target(), show_progress=False)
        before = run.evaluate()
        run.fit()
        weights = {k: v.clone() for k, v in run._trainable_state().items()}
        run.close()
        return before, weights
    (val0, clean), (val1, noisy) = one_step(0.0), one_step(0.5)
    assert val0["ce"] == val1["ce"]  # validation before any step: exact taps either way
    assert any(not torch.equal(clean[k], noisy[k]) for k in clean)
    with pytest.raises(ValueError, match="feature_noise"):
        tiny_config(feature_noise=-0.1)


def test_schedule_by_time_fits_the_lr_schedule_to_max_minutes(tmp_path, monkeypatch):
    """schedule_by_time: the steps after the first few are timed, and the cosine schedule then spans the steps
    that fit the rest of max_minutes (90% of them), so the run ends with the lr decayed, not cut mid-schedule;
    max_steps stays the cap, and a resumed run keeps the fitted length."""
    import dspark.train.trainer as trainer_mod
    clock = [0.0]
    monkeypatch.setattr(trainer_mod.time, "monotonic", lambda: clock[0])
    step = Trainer.train_step

    def timed_step(self):  # every step takes one (fake) second
        clock[0] += 1.0
        return step(self)

    monkeypatch.setattr(Trainer, "train_step", timed_step)
    data = toy_data(tmp_path / "data")
    cfg = tiny_config(max_steps=1000, max_minutes=1.0, schedule_by_time=True, ckpt_every=20)
    run = Trainer(cfg, data_dir=data, out_dir=tmp_path / "run", target=tiny_target(), show_progress=False)
    run.fit()  # timed over steps 20..50 (1 s each); then 50 + int(0.9 * 10 s / 1 s) = 59 steps
    assert run.schedule_fitted and run.total_steps == 59 and run.step == 59
    assert run.scheduler.get_last_lr()[0] == pytest.approx(cfg.lr * cfg.min_lr_frac, abs=1e-9)
    again = Trainer(cfg, data_dir=data, out_dir=tmp_path / "run", target=tiny_target(), show_progress=False)
    again.load_checkpoint()
    assert again.schedule_fitted and again.total_steps == 59
    capped = Trainer(tiny_config(max_steps=30, max_minutes=1.0, schedule_by_time=True), data_dir=data,
                     out_dir=tmp_path / "capped", target=tiny_target(), show_progress=False)
    capped.fit()
    assert capped.total_steps == 30 and capped.step == 30
    for t in (run, again, capped):
        t.close()
    with pytest.raises(ValueError, match="schedule_by_time needs max_minutes"):
        tiny_config(schedule_by_time=True)


@pytest.mark.parametrize("family", ["gemma4", "qwen3_5"])
def test_training_on_gemma4_and_hybrid_targets(tmp_path, family):
    """`dspark train` on a Gemma 4 target (KV sharing, per-layer inputs) and a hybrid Qwen3.5 one (recurrent state
    slots in the feature pass): a few steps reduce the loss, and the exported drafter serves the target losslessly."""
    from dspark.config import SpecConfig
    from dspark.drafters import build_drafter
    from tests.engine_helpers import greedy, make_engine, run
    if family == "gemma4":
        from tests.test_gemma4 import DENSE as model_cfg, target
        model, _ = target(model_cfg)
        with torch.no_grad():  # a peaked target (its final norm scales the tied head's input): learnable
            model.model.norm.weight.mul_(8.0)
    else:
        from tests.engine_helpers import tiny_target as hf_target
        from tests.test_hybrid import TINY_QWEN3_5 as model_cfg
        model, _ = hf_target(model_cfg)
        with torch.no_grad():
            model.lm_head.weight.mul_(8.0)
    cfg = tiny_config(method="dspark", max_steps=30, lr=3e-2, log_every=10)
    trainer = Trainer(cfg, data_dir=toy_data(tmp_path / "data"), out_dir=tmp_path / "run",
                      target=(model, model_cfg, model_cfg.eos_token_ids), show_progress=False)
    before = _fixed_loss(trainer)
    trainer.fit()
    after = _fixed_loss(trainer)
    trainer.export(tmp_path / "export")
    trainer.close()
    assert after < 0.9 * before, (before, after)
    spec = SpecConfig(method="dspark", model=str(tmp_path / "export"), num_speculative_tokens=3)
    drafter = build_drafter(spec, target_config=model_cfg, target_model=model, dtype=torch.float32, device="cpu")
    prompts = [[5, 9, 14, 20, 26, 32], [40, 3, 7, 7, 7]]
    plain = run(make_engine(model, model_cfg, prefix=False), prompts, greedy(12))
    engine = make_engine(model, model_cfg, prefix=False, drafter=drafter, spec=spec)
    assert run(engine, prompts, greedy(12)) == plain and engine.metrics.num_draft_tokens > 0
