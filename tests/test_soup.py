"""Weight soup of drafter exports (`dspark.train.soup`): the float tensors are the mean of the sources in their
own dtype, integer buffers and configs must agree, and a soup of one export with itself is that export.

    pytest tests/test_soup.py -q
"""

from __future__ import annotations

import json

import pytest
import torch

from dspark.drafters.checkpoint import load_tensors, save_weights
from dspark.train.soup import main, soup


def _export(folder, *, seed: int, d2t=None, config=None):
    g = torch.Generator().manual_seed(seed)
    tensors = {"layers.0.w": torch.randn(8, 4, generator=g).to(torch.bfloat16),
               "fc.weight": torch.randn(4, 12, generator=g),
               "d2t": torch.arange(6) if d2t is None else d2t}
    folder.mkdir(parents=True)
    save_weights(tensors, folder, max_shard_bytes=600)  # sharded, as the trainer exports
    (folder / "config.json").write_text(json.dumps(config or {"model_type": "dspark", "block_size": 7}))
    (folder / "train_config.json").write_text(json.dumps({"seed": seed}))
    (folder / "calibration.json").write_text("{}")
    return tensors


def test_the_soup_is_the_mean_of_its_sources(tmp_path):
    a, b, c = (_export(tmp_path / n, seed=i) for i, n in enumerate("abc"))
    mixed = soup(tmp_path / "soup", [tmp_path / n for n in "abc"])
    back = load_tensors(tmp_path / "soup")
    for name in a:
        want = a[name] if name == "d2t" else ((a[name].double() + b[name].double() + c[name].double()) / 3).to(a[name].dtype)
        assert back[name].dtype == a[name].dtype and torch.equal(back[name], want) and torch.equal(mixed[name], want)
    assert json.loads((tmp_path / "soup" / "train_config.json").read_text()) == {"seed": 0}
    assert not (tmp_path / "soup" / "calibration.json").exists()  # confidences need their own fit
    soup(tmp_path / "same", [tmp_path / "a", tmp_path / "a"])
    assert all(torch.equal(t, a[k]) for k, t in load_tensors(tmp_path / "same").items())


def test_the_soup_refuses_exports_that_do_not_mix(tmp_path, capsys):
    _export(tmp_path / "a", seed=0)
    _export(tmp_path / "vocab", seed=1, d2t=torch.arange(6).flip(0))
    _export(tmp_path / "shape", seed=2, config={"model_type": "dspark", "block_size": 15})
    with pytest.raises(ValueError, match="d2t"):
        soup(tmp_path / "mix1", [tmp_path / "a", tmp_path / "vocab"])
    with pytest.raises(ValueError, match="config.json differs"):
        soup(tmp_path / "mix2", [tmp_path / "a", tmp_path / "shape"])
    with pytest.raises(SystemExit):
        main([str(tmp_path / "mix3"), str(tmp_path / "a")])
    assert "at least two" in capsys.readouterr().err
