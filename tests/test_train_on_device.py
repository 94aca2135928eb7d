"""scripts/train_on_device.sh end to end on the CPU with a tiny model (DEVICE=cpu): prepare-data with speculation
on (prompt lookup), deduplicated train prompts, a time-limited warm-started DSpark run, the weights exported as
safetensors shards within SHARD_MB (several here), and the export loads and drafts through the registry.
Also: the sharded writer's layout and limit.

    pytest tests/test_train_on_device.py -q -m slow
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dspark.drafters.checkpoint import INDEX_NAME, load_tensors, save_weights

ROOT = Path(__file__).resolve().parent.parent


def test_sharded_weights_layout_and_limit(tmp_path):
    tensors = {f"w{i}": torch.randn(64, 64) for i in range(5)}  # 16 KiB each in fp32
    files = save_weights(tensors, tmp_path, max_shard_bytes=40_000)
    assert len(files) == 3 and all(f.stat().st_size <= 40_000 for f in files)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert sorted(index["weight_map"]) == sorted(tensors)
    back = load_tensors(tmp_path)
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    save_weights(tensors, tmp_path)  # a plain re-export removes the shards and the index
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    with pytest.raises(ValueError, match="exceeds the shard limit"):
        save_weights({"big": torch.zeros(100, 100)}, tmp_path, max_shard_bytes=1000)


@pytest.mark.slow  # ~1 min on an idle 2-core machine (two engine builds, a feature pass, a short run)
def test_train_on_device_script_end_to_end_on_cpu(tmp_path):
    from tiny_checkpoint import write_tiny_checkpoint

    model = write_tiny_checkpoint(tmp_path / "tiny")
    prompts = tmp_path / "train"
    prompts.mkdir()
    words = "the cat dog sat ran on a mat park blue sky why is to".split()
    lines = [f"{a} {b} sat on the mat" for a in words[:6] for b in words[6:10]]  # 24 distinct prompts
    lines += [lines[3].upper(), lines[5] + "  ", lines[7]]  # duplicates (case, whitespace): generated once
    (prompts / "toy.jsonl").write_text("\n".join(json.dumps({"turns": [t]}) for t in lines))
    out = tmp_path / "run"
    extra = ["tap_layer_ids=[-1,0]", "num_draft_layers=1", "warm_start=\"target\"", "draft_vocab_size=null",
             "markov_rank=8", "num_anchors=4", "batch_size=4", "max_seq_len=96", "target_dtype=\"float32\"",
             "max_steps=4", "eval_every=2", "eval_batches=1", "log_every=1", "ckpt_every=2"]
    device = os.environ.get("DSPARK_TEST_DEVICE", "cpu")  # cuda: the same run on an accelerator
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "DEVICE": device, "MINUTES": "5",
           "MODEL": str(model), "PROMPTS": str(prompts), "MAX_TOKENS": "16", "MIN_ANSWER_TOKENS": "4", "MAX_PROMPT_TOKENS": "64",
           "BATCH": "16", "SPEC": '{"method": "ngram", "num_speculative_tokens": 4}', "HOLDOUT": "0.25",
           "OUT": str(out), "SHARD_MB": "0.02", "EXTRA": " ".join(extra)}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "train_on_device.sh")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "exported" in proc.stdout
    dropped = (out / "data" / "dropped.txt").read_text()
    assert dropped.count("duplicate_prompt") == 3
    shards = sorted((out / "export").glob("model-*.safetensors"))
    assert len(shards) > 1 and all(f.stat().st_size <= 0.02 * 2 ** 20 for f in shards)
    assert json.loads((out / "export" / "train_config.json").read_text())["device"] == device
    from dspark.config import EngineConfig, SpecConfig
    from dspark.llm import LLM
    llm = LLM(config=EngineConfig(model=str(model), spec=SpecConfig(method="dspark", model=str(out / "export"),
                                                                      num_speculative_tokens=4)))
    plain = LLM(str(model))
    from dspark.sampling import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert llm.generate("the cat sat", params)[0].token_ids == plain.generate("the cat sat", params)[0].token_ids


@pytest.mark.slow  # ~2 min on an idle 2-core machine (one data run, one feature pass, two short runs side by side)
def test_methods_side_by_side_take_equal_steps_from_one_feature_pass(tmp_path):
    """METHODS with STEPS: DSpark and DFlash from one data set and one feature cache, each exactly STEPS steps
    (no time-fitted schedule), each exported to OUT/export_M within SHARD_MB."""
    from tiny_checkpoint import write_tiny_checkpoint

    model = write_tiny_checkpoint(tmp_path / "tiny")
    prompts = tmp_path / "train"
    prompts.mkdir()
    words = "the cat dog sat ran on a mat park blue sky why is to".split()
    lines = [f"{a} {b} sat on the mat" for a in words[:6] for b in words[6:10]]
    (prompts / "toy.jsonl").write_text("\n".join(json.dumps({"turns": [t]}) for t in lines))
    out = tmp_path / "run"
    extra = ["tap_layer_ids=[-1,0]", "num_draft_layers=1", "warm_start=\"target\"", "draft_vocab_size=null",
             "num_anchors=4", "batch_size=4", "max_seq_len=96", "target_dtype=\"float32\"", "eval_every=100",
             "eval_batches=1", "log_every=1", "ckpt_every=100", "seed=0"]
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "DEVICE": "cpu", "MINUTES": "5",
           "MODEL": str(model), "PROMPTS": str(prompts), "MAX_TOKENS": "16", "MIN_ANSWER_TOKENS": "4",
           "MAX_PROMPT_TOKENS": "64", "BATCH": "16", "SPEC": "none", "HOLDOUT": "0.25", "OUT": str(out),
           "SHARD_MB": "0.05", "METHODS": "dspark dflash", "STEPS": "3", "EXTRA": " ".join(extra)}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "train_on_device.sh")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("exported") == 2
    assert (out / "features").is_dir() and any((out / "features").iterdir())
    for m in ("dspark", "dflash"):
        steps = [json.loads(line)["step"] for line in (out / f"train_{m}" / "metrics.jsonl").read_text().splitlines()
                 if '"lr"' in line]  # the training steps' records
        assert max(steps) == 3, (m, steps)
        cfg = json.loads((out / f"export_{m}" / "train_config.json").read_text())
        assert cfg["method"] == m and cfg["max_steps"] == 3 and not cfg["schedule_by_time"]
        assert "feature pass" not in (out / f"train_{m}.log").read_text()  # the shared pass filled the cache
