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


class _ClockLLM:
    """Answers like test_train's stub, writes Magpie requests ("please explain topic N", one in three too short
    to keep), and moves a fake clock 40 s a call."""

    def __init__(self, clock):
        from test_train import _StubTokenizer

        class _Tok(_StubTokenizer):
            def render_chat(self, conv, add_generation_prompt=False):
                return "<user>" + conv[-1]["content"] + "</user>"

            def encode(self, text, add_special_tokens=False):
                return [ord(c) % 50 + 3 for c in text]

        self.tokenizer, self.clock, self.calls, self.magpie_calls = _Tok(), clock, 0, 0

    def generate(self, prompt_ids, params):
        from types import SimpleNamespace
        self.clock[0] += 40.0
        if params[0].max_tokens == 128:  # Magpie: the header continued into a request
            self.magpie_calls += len(prompt_ids)
            texts = ["hm" if p.seed % 3 == 0 else f"please explain topic {p.seed}" for p in params]
            return [SimpleNamespace(text=t, outputs=[SimpleNamespace(finish_reason="stop")]) for t in texts]
        self.calls += len(prompt_ids)
        return [SimpleNamespace(prompt_token_ids=p, token_ids=[(p[1] + k) % 60 + 3 for k in range(19)] + [2])
                for p in prompt_ids]


def test_max_minutes_stops_between_batches_and_a_rerun_goes_on(tmp_path, monkeypatch):
    """--max-minutes: no batch starts after the limit, the manifest covers what was written, and a rerun
    writes the rest; the Magpie requests written before the limit are reused, never asked for again."""
    import dspark.train.prepare_data as prep
    clock = [0.0]
    monkeypatch.setattr(prep.time, "monotonic", lambda: clock[0])
    texts = [f"question {i}" for i in range(10)]
    cfg = PrepareConfig(out=str(tmp_path / "data"), model="stub", prompts=str(_prompts(tmp_path, texts)),
                        batch_size=4, holdout=0.0, magpie=6, max_minutes=2.0)
    llm = _ClockLLM(clock)
    manifest = prepare(cfg, llm=llm)  # Magpie calls at 0 s and 40 s (< half of 120 s), answers at 80 s; 120 s: stop
    assert llm.magpie_calls == 6 and llm.calls == 4 and manifest["num_samples"]["train"] == 4
    rows = [json.loads(line) for line in (tmp_path / "data" / prep.MAGPIE_FILE).read_text().splitlines()]
    assert len(rows) == 6 and sum(r["text"] is None for r in rows) == 2  # seeds 0 and 3: too short
    manifest = prepare(PrepareConfig(**{**cfg.__dict__, "max_minutes": None}), llm=llm)
    assert llm.magpie_calls == 6  # reused from magpie.jsonl
    assert llm.calls == 14 and manifest["num_samples"]["train"] == 14  # 10 questions + 4 kept requests
    assert {k for k in done_keys(cfg.out) if k.startswith("magpie:")} == {f"magpie:{i}" for i in (1, 2, 4, 5)}


def test_magpie_requests_take_at_most_half_of_max_minutes(tmp_path, monkeypatch):
    """With --max-minutes, no batch of Magpie requests starts past half of it: the answers get the rest."""
    import dspark.train.prepare_data as prep
    clock = [0.0]
    monkeypatch.setattr(prep.time, "monotonic", lambda: clock[0])
    cfg = PrepareConfig(out=str(tmp_path / "data"), model="stub", prompts=str(_prompts(tmp_path, ["question 0"])),
                        batch_size=2, holdout=0.0, magpie=20, max_minutes=3.0)
    llm = _ClockLLM(clock)
    prepare(cfg, llm=llm)  # Magpie calls at 0, 40, 80 s (< 90 s), not at 120 s; answers at 120 s (< 180 s)
    assert llm.magpie_calls == 6 and llm.calls > 0
