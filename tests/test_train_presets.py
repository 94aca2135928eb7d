"""Every training preset under configs/ loads as a TrainConfig (unknown or misspelt keys are errors there), and
its drafter shape fits its target's config: tap layers inside the target, block drafters' warm start only
where the target's layers are the drafter's.

    pytest tests/test_train_presets.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dspark.train.config import load_train_config

PRESETS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("train_*.json"))
NUM_LAYERS = {"SmolLM2-135M-Instruct": 30, "gemma-3-270m": 18}


def test_there_are_presets():
    assert {p.name for p in PRESETS} >= {"train_dspark_smollm2.json", "train_dspark_gemma3.json"}


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_preset_loads_and_fits_its_target(path):
    cfg = load_train_config(path)
    assert cfg.model in NUM_LAYERS, f"{path.name}: add its target's depth to NUM_LAYERS"
    layers = NUM_LAYERS[cfg.model]
    assert cfg.tap_layer_ids and all(0 <= i < layers - 1 for i in cfg.tap_layer_ids), cfg.tap_layer_ids
    assert cfg.feature_cache, "presets share one feature cache per data set"
    if cfg.model == "gemma-3-270m":
        assert cfg.warm_start == "none"
