"""Several data folders as one training set (`dspark train --data A,B`, `feature_cache` "FA,FB"): stages of
sampled answers to one prompt pool share prompt keys, so each folder's keys carry its place in the list; each
folder's feature cache is filled from its own data and the caches read together; mismatched lists are refused
before the target loads.

    pytest tests/test_train_data_union.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dspark.train.data import TokenDataset, collate, data_roots, write_shard
from dspark.train.trainer import Trainer
from test_train_loop import _bf16_target, one_thread, tiny_config, toy_data  # noqa: F401 (one_thread: autouse)


def shifted_copy(src: Path, dst: Path, shift: int) -> Path:
    """The same prompt keys and split as `src`, other answers (every answer token moved by `shift`)."""
    ds_train, ds_val = TokenDataset(src, split="train"), TokenDataset(src, split="val")
    samples = []
    for s, is_val in [(s, False) for s in ds_train.samples] + [(s, True) for s in ds_val.samples]:
        ids = [t + shift if m else t for t, m in zip(s.input_ids.tolist(), s.loss_mask.tolist())]
        samples.append((s.key, ids, s.loss_mask.tolist(), is_val))
    dst.mkdir(parents=True)
    write_shard(dst / "shard-00000.safetensors", samples)
    return dst


def test_folders_read_as_one_set_with_their_keys_apart(tmp_path):
    a = toy_data(tmp_path / "a")
    b = shifted_copy(a, tmp_path / "b", 5)
    one_a, one_b = TokenDataset(a), TokenDataset(b)
    both = TokenDataset(f"{a},{b}")
    assert len(both) == len(one_a) + len(one_b) == 14
    assert [s.key for s in both.samples] == [f"0/{s.key}" for s in one_a.samples] + [f"1/{s.key}" for s in one_b.samples]
    for s, t in zip(both.samples, one_a.samples + one_b.samples):
        assert torch.equal(s.input_ids, t.input_ids) and torch.equal(s.loss_mask, t.loss_mask)
    assert [s.index for s in both.samples] == list(range(14))
    assert len(TokenDataset([a, b], split="val")) == 2  # each folder's held-out split, kept held out
    assert [s.key for s in TokenDataset(str(a)).samples] == [s.key for s in one_a.samples]  # one folder: as written
    with pytest.raises(ValueError, match="listed twice"):
        data_roots(f"{a},{a}")
    with pytest.raises(FileNotFoundError, match="prepare-data"):
        TokenDataset(f"{a},{tmp_path / 'missing'}")


def test_each_folders_cache_serves_the_joint_set_and_mismatches_are_refused(tmp_path, monkeypatch):
    a = toy_data(tmp_path / "a")
    b = shifted_copy(a, tmp_path / "b", 5)
    kw = dict(target_dtype="bfloat16", drafter_autocast="bfloat16", max_steps=2)
    singles = []
    for name, data in (("a", a), ("b", b)):
        t = Trainer(tiny_config(**kw, feature_cache=str(tmp_path / f"f{name}")), data_dir=data,
                    out_dir=tmp_path / f"run_{name}", target=_bf16_target(), show_progress=False)
        assert t.precompute_features()["samples"] == 8
        singles.append(t)
    joint = Trainer(tiny_config(**kw, feature_cache=f"{tmp_path / 'fa'},{tmp_path / 'fb'}"), data_dir=f"{a},{b}",
                    out_dir=tmp_path / "joint", target=_bf16_target(), show_progress=False)
    assert len(joint.cache) == 16 and all(s.key in joint.cache for s in joint.train_ds.samples)
    # the same answer key in the two folders: each folder's own features (the answers differ)
    for j, single in enumerate(singles):
        batch = collate([single.train_ds[i] for i in range(3)])
        mine = single.cache.get(batch.keys, batch.lengths)
        got = joint.cache.get([f"{j}/{k}" for k in batch.keys], batch.lengths)
        assert torch.equal(got.taps, mine.taps) and torch.equal(got.hidden, mine.hidden)
    other = singles[1].cache.get(collate([singles[0].train_ds[0]]).keys, collate([singles[0].train_ds[0]]).lengths)
    mine = singles[0].cache.get(collate([singles[0].train_ds[0]]).keys, collate([singles[0].train_ds[0]]).lengths)
    assert not torch.equal(other.hidden, mine.hidden)
    def no_target(*args, **kwargs):
        raise AssertionError("the target ran: a feature was missing from the caches")
    with monkeypatch.context() as m:  # every feature of a step from the caches
        m.setattr(joint.target, "forward", no_target)
        before = [p.detach().clone() for p in joint.params]
        stats = joint.train_step()
    assert torch.isfinite(stats["ce_num"]).all()
    assert any(not torch.equal(p, q) for p, q in zip(joint.params, before))
    assert joint.precompute_features() is None  # all cached: nothing to fill
    with pytest.raises(ValueError, match="fill each from its own data"):
        joint.cache.precompute(joint.target, joint.train_ds.samples, tap_layer_ids=joint.tap_layer_ids)
    with pytest.raises(ValueError, match="2 folders for 1 data folders"):  # before any target is loaded
        Trainer(tiny_config(**kw, feature_cache=f"{tmp_path / 'fa'},{tmp_path / 'fb'}"), data_dir=a,
                out_dir=tmp_path / "bad", target=None, show_progress=False)
    # one cache folder for several data folders: filled with the joint keys, read back the same
    one = Trainer(tiny_config(**kw, feature_cache=str(tmp_path / "fab")), data_dir=f"{a},{b}",
                  out_dir=tmp_path / "one", target=_bf16_target(), show_progress=False)
    assert one.precompute_features()["samples"] == 16
    batch = collate([one.train_ds[i] for i in (0, 9)])
    torch.testing.assert_close(one.cache.get(batch.keys, batch.lengths).hidden,
                               joint.cache.get(batch.keys, batch.lengths).hidden)


def test_cli_takes_several_data_folders_and_names_a_cache_mismatch(tmp_path, capsys):
    from dspark.cli import main
    a = toy_data(tmp_path / "a")
    b = shifted_copy(a, tmp_path / "b", 5)
    caches = f'"{tmp_path / "fa"},{tmp_path / "fb"},{tmp_path / "fc"}"'
    with pytest.raises(SystemExit, match="feature_cache names 3 folders for 2 data folders"):
        main(["train", "--data", str(a), str(b), "--out", str(tmp_path / "run"), "--set", f"feature_cache={caches}"])
    with pytest.raises(SystemExit, match="listed twice"):
        main(["train", "--data", f"{a},{a}", "--out", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()  # refused before a run folder or a weight
