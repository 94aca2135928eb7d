"""`dspark prepare-data` (dspark/train/prepare_data.py) beyond test_train.py's shard/resume checks:

* duplicate prompts (case and whitespace folded) are generated once and recorded as duplicate_prompt, also on
  a resumed run;
* the eval/ folder is refused (never read for training data);
* with speculation on (`speculative_config`, prompt lookup here on a tiny HF checkpoint) the engine writes the
  same greedy data as without it.

    pytest tests/test_prepare_data.py -q
"""

from __future__ import annotations

import json

import pytest

from dspark.train.data import DROPPED, TokenDataset, done_keys
from dspark.train.prepare_data import PrepareConfig, dedupe, prepare
from test_train import _StubLLM


def _prompts(tmp_path, texts):
    folder = tmp_path / "train"
    folder.mkdir(exist_ok=True)
    (folder / "toy.jsonl").write_text("\n".join(json.dumps({"turns": [t]}) for t in texts))
    return folder


def test_duplicate_prompts_are_generated_once(tmp_path):
    texts = [f"question {i}" for i in range(10)] + ["Question  3", "question 3 ", "QUESTION 7"]
    cfg = PrepareConfig(out=str(tmp_path / "data"), model="stub", prompts=str(_prompts(tmp_path, texts)),
                        batch_size=4, holdout=0.0)
    llm = _StubLLM()
    manifest = prepare(cfg, llm=llm)
    assert llm.calls == 10 and manifest["num_samples"]["train"] == 10
    lines = (tmp_path / "data" / DROPPED).read_text().splitlines()
    assert sorted(line.split("\t")[1] for line in lines) == ["duplicate_prompt"] * 3
    prepare(cfg, llm=llm)  # resumed: nothing new, duplicates not recorded twice
    assert llm.calls == 10 and len((tmp_path / "data" / DROPPED).read_text().splitlines()) == 3
    assert len(done_keys(cfg.out)) == 13
    kept, dropped = dedupe([("a", "x  y"), ("b", "X y"), ("c", "z")])
    assert kept == [("a", "x  y"), ("c", "z")] and dropped == ["b"]


def test_eval_prompts_are_refused(tmp_path):
    eval_dir = tmp_path / "datasets" / "eval"
    eval_dir.mkdir(parents=True)
    (eval_dir / "gsm8k.jsonl").write_text(json.dumps({"turns": ["2+2?"]}))
    cfg = PrepareConfig(out=str(tmp_path / "data"), model="stub", prompts=str(eval_dir))
    llm = _StubLLM()
    with pytest.raises(AssertionError, match="evaluation prompts"):
        prepare(cfg, llm=llm)
    assert llm.calls == 0


def test_speculation_on_writes_the_same_greedy_data(tmp_path):
    from tiny_checkpoint import write_tiny_checkpoint

    model = write_tiny_checkpoint(tmp_path / "tiny")
    prompts = _prompts(tmp_path, ["the cat sat on the mat", "a dog ran to the park", "why is the sky blue"])
    base = dict(model=str(model), prompts=str(prompts), max_tokens=24, batch_size=3, holdout=0.0,
                min_answer_tokens=1, max_prompt_tokens=64)
    prepare(PrepareConfig(out=str(tmp_path / "plain"), **base))
    prepare(PrepareConfig(out=str(tmp_path / "spec"), speculative_config='{"method": "ngram", '
                          '"num_speculative_tokens": 4}', **base))
    plain, spec = TokenDataset(tmp_path / "plain", split="train"), TokenDataset(tmp_path / "spec", split="train")
    assert len(plain) == len(spec) == 3
    for a, b in zip(sorted((plain[i] for i in range(3)), key=lambda s: s.key),
                    sorted((spec[i] for i in range(3)), key=lambda s: s.key)):
        assert a.key == b.key and a.input_ids.tolist() == b.input_ids.tolist()
