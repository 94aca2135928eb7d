"""The lookup corpus (`"lookup_corpus"`, dspark/drafters/corpus.py, `dspark build-corpus`):

* `LookupCorpus.lookup` against a brute-force scan of every document (the longest suffix of 1..max_n tokens,
  then token by token the most frequent continuation, the smallest id on a tie, stopping at a document's end),
  on random corpora over small vocabularies (many matches, ties and document ends);
* the file: written and loaded; a missing file, a corpus of another vocabulary size and token ids outside
  it are refused with messages naming them, before any weight loads (`check_drafter`; the CLI names
  --speculative-config, as for a missing cost table); the key is refused without prompt lookup;
* `build-corpus` takes the answers (loss-mask tokens, each after its prompt's last `--prompt-tokens`) of the train split only, and refuses eval/ data;
  it grows an earlier corpus file by new folders (the same documents as building from all folders), keeps a
  repeated document once, and refuses a corpus file of another split or prompt-token count;
* in the engine (tiny random Llama, DSpark with prompt lookup first, no cross-request cache): prompts whose
  answers are in the corpus draft from it (its own acceptance class), accepted, with greedy output equal to
  plain decoding.

    pytest tests/test_lookup_corpus.py -q
"""

# ruff: noqa: F811  (the module-scoped fixtures of test_scheduled_verification are imported and reused)
from __future__ import annotations

import argparse
import collections
import random

import numpy as np
import pytest
import torch

from dspark.cli import main
from dspark.config import SpecConfig
from dspark.drafters import check_drafter
from dspark.drafters.corpus import SEP, LookupCorpus, check_corpus, write_corpus
from dspark.drafters.ngram import CORPUS, OWN, NgramDrafter
from dspark.train import corpus_cli
from dspark.train.data import write_shard
from tests.engine_helpers import greedy
from tests.scheduled_helpers import (  # noqa: F401  (fixtures)
    ARRIVAL_STEPS, MAX_TOKENS, POLICIES, TINY_LLAMA, _mismatches, _prompts, _spec_engine, drafter_dir,
    plain_outputs, run_staged, target)


def _brute_force(docs: list[list[int]], ids: list[int], *, min_n: int, max_n: int, width: int):
    for n in range(min(max_n, len(ids)), min_n - 1, -1):
        occ = [(d, q) for d, doc in enumerate(docs) for q in range(n - 1, len(doc)) if doc[q - n + 1:q + 1] == ids[-n:]]
        if not occ:
            continue
        out = []
        for step in range(1, width + 1):
            nxt = [docs[d][q + step] if q + step < len(docs[d]) else SEP for d, q in occ]
            counts = collections.Counter(nxt)
            best = min(counts, key=lambda t: (-counts[t], t))
            if best == SEP:
                break
            out.append(best)
            occ = [o for o, t in zip(occ, nxt) if t == best]
        return out, n
    return [], 0


@pytest.mark.parametrize("vocab,max_n,spread,stride", [(3, 5, 1, 16), (6, 4, 1, 3), (20, 5, 1, 1), (50, 2, 1, 16),
                                                       (20, 5, 20011, 5), (6, 5, 2 ** 20, 16), (6, 5, 2 ** 20, 2)])
def test_lookup_matches_brute_force(vocab, max_n, spread, stride, monkeypatch):
    """`spread` multiplies every token id: large ids leave room for fewer tokens in a packed key (depth 3 and 2
    of max_n 5), so the longer suffixes are narrowed inside the keys' range, and a context's id past the
    corpus's largest may not fit a key at all; ids past 65,534 need 32-bit codes. `stride`: every key kept
    (1) or one in a few, so range ends fall on and between the kept keys."""
    monkeypatch.setattr("dspark.drafters.corpus.STRIDE", stride)
    rng = random.Random(vocab * 10 + max_n)
    docs = [[rng.randrange(vocab) * spread for _ in range(rng.randint(1, 40))] for _ in range(25)]
    corpus = LookupCorpus(np.array([t for d in docs for t in (*d, SEP)]), max_n=max_n, num_draft_tokens=6)
    assert corpus.num_documents == 25 and corpus.num_tokens == sum(map(len, docs))
    assert corpus.depth == (max_n if spread == 1 else 3 if spread < 2 ** 20 else 2)
    assert corpus.codes.dtype == (np.uint16 if spread * vocab < 2 ** 16 else np.uint32)
    assert len(corpus.kept_keys) == -(-corpus.num_tokens // stride)
    for trial in range(300):
        ids = [rng.randrange(vocab + 2) * spread for _ in range(rng.randint(1, 8))]  # ids past the corpus's too
        if trial % 3 == 0:  # a context ending in a corpus n-gram
            d = rng.choice(docs)
            ids = ids + d[:rng.randint(1, len(d))]
        if trial % 5 == 1:  # an id too large for any key, somewhere in the last few
            ids[-rng.randint(1, min(4, len(ids)))] = 2 ** 30 + 3
        for min_n in (1, 2):
            assert corpus.lookup(ids, min_n=min_n) == _brute_force(docs, ids, min_n=min_n, max_n=max_n, width=6), ids


def test_corpus_file_and_its_refusals(tmp_path):
    path = tmp_path / "c.safetensors"
    meta = write_corpus(path, [[1, 2, 3, 4, 1], [2, 3, 4]], vocab_size=10, model="m", source="s")
    assert meta["documents"] == "2" and meta["tokens"] == "8"
    corpus = LookupCorpus.load(path, vocab_size=10, max_n=3, num_draft_tokens=2)
    assert corpus.lookup([9, 2]) == ([3, 4], 1)  # 2 -> 3 -> 4 in both
    assert corpus.lookup([9, 3, 4]) == ([], 2)  # 1 and a document's end tie: the end (the smaller) wins
    with pytest.raises(ValueError, match="written for a 10-token vocabulary; the target has 12"):
        check_corpus(path, vocab_size=12)
    with pytest.raises(FileNotFoundError, match="build-corpus"):
        check_corpus(tmp_path / "none.safetensors", vocab_size=10)
    with pytest.raises(ValueError, match="outside the 10-token vocabulary"):
        write_corpus(tmp_path / "bad.safetensors", [[1, 10]], vocab_size=10, model="m", source="s")
    with pytest.raises(ValueError, match="lookup_corpus applies"):
        SpecConfig(method="dspark", model="x", lookup_corpus=str(path))
    # validated with the drafter, before any weight loads: the tiny target has another vocabulary size
    with pytest.raises(ValueError, match=f"the target has {TINY_LLAMA.vocab_size}"):
        check_drafter(SpecConfig(method="ngram", lookup_corpus=str(path)), TINY_LLAMA)
    with pytest.raises(SystemExit, match="error: --speculative-config: lookup_corpus .*no such file"):
        main(["generate", "hi", "--max-tokens", "2", "--speculative-config",
              f'{{"method": "ngram", "lookup_corpus": "{tmp_path / "none.safetensors"}"}}'])
    with pytest.raises(SystemExit, match="error: --speculative-config: cost_table .*does not exist"):
        main(["generate", "hi", "--max-tokens", "2", "--speculative-config",  # the length policy's check alike
              '{"method": "dspark", "model": "dspark/assets/drafters/dspark-smollm2-135m", "length_policy": "prefix", '
              f'"cost_table": "{tmp_path / "none.json"}"}}'])
    drafter = NgramDrafter(num_draft_tokens=2, prompt_lookup_min=1, corpus=corpus)
    assert drafter.lookup_with_source([9, 2]) == ([3, 4], 1, CORPUS)
    assert drafter.lookup_with_source([2, 3, 5, 2, 3]) == ([5, 2], 2, OWN)  # the own context first
    two = NgramDrafter(num_draft_tokens=2, prompt_lookup_min=2, corpus=corpus)  # prompt_lookup_min bounds it too
    assert two.lookup_with_source([9, 2]) == ([], 0, OWN) and two.lookup_with_source([1, 2]) == ([3, 4], 2, CORPUS)


def test_build_corpus_takes_train_answers_only(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    write_shard(data / "shard-00000.safetensors", [("a", [5, 6, 7, 8], [0, 0, 1, 1], False),
                                                  ("b", [5, 9, 9, 9], [0, 1, 1, 1], True)])  # b: held out
    out = tmp_path / "corpus.safetensors"
    monkeypatch.setattr("dspark.models.loader.read_model_config", lambda model: TINY_LLAMA)
    for prompt_tokens, doc in [(0, [7, 8]), (1, [6, 7, 8]), (5, [5, 6, 7, 8])]:  # the answer after its prompt's tail
        assert corpus_cli.run_cli(argparse.Namespace(data=[str(data)], out=str(out), split="train", model="tiny",
                                                     prompt_tokens=prompt_tokens)) == 0
        corpus = LookupCorpus.load(out, vocab_size=TINY_LLAMA.vocab_size, max_n=2, num_draft_tokens=3)
        assert (corpus.codes[corpus.codes != 0] - 1).tolist() == doc
    with pytest.raises(SystemExit, match="--prompt-tokens"):
        corpus_cli.run_cli(argparse.Namespace(data=[str(data)], out=str(out), split="train", model="tiny",
                                              prompt_tokens=-1))
    evil = tmp_path / "datasets" / "eval"
    evil.mkdir(parents=True)
    with pytest.raises(AssertionError, match="evaluation prompts"):
        corpus_cli.answers(evil, split="train")
    with pytest.raises(SystemExit, match="error: --data .*evaluation prompts"):
        corpus_cli.run_cli(argparse.Namespace(data=[str(evil)], out=str(out), split="train", model="tiny",
                                              prompt_tokens=5))
    with pytest.raises(SystemExit, match="error: --data .*prepare-data"):
        corpus_cli.run_cli(argparse.Namespace(data=[str(tmp_path)], out=str(out), split="train", model="tiny",
                                              prompt_tokens=5))


def test_build_corpus_grows_a_corpus_file_and_drops_repeats(tmp_path, monkeypatch):
    monkeypatch.setattr("dspark.models.loader.read_model_config", lambda model: TINY_LLAMA)
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    write_shard(first / "shard-00000.safetensors", [("a", [5, 6, 7, 8], [0, 0, 1, 1], False),
                                                   ("b", [5, 9, 9, 9], [0, 1, 1, 1], True)])  # b: held out
    write_shard(second / "shard-00000.safetensors", [("a", [5, 6, 7, 8], [0, 0, 1, 1], False),  # a repeat
                                                    ("c", [4, 6, 3, 2, 1], [0, 0, 1, 1, 1], False),
                                                    ("d", [9, 9, 3, 3], [0, 0, 1, 1], False)])

    def build(data, out, split="train", prompt_tokens=1):
        return corpus_cli.run_cli(argparse.Namespace(data=[str(d) for d in data], out=str(out), split=split,
                                                     model=None, prompt_tokens=prompt_tokens))

    def documents(path):
        docs, _, _ = corpus_cli.corpus_documents(path, split="train", prompt_tokens=1)
        return docs

    assert build([first], tmp_path / "old.safetensors") == 0
    assert build([tmp_path / "old.safetensors", second], tmp_path / "grown.safetensors") == 0
    assert build([first, second], tmp_path / "whole.safetensors") == 0
    assert documents(tmp_path / "grown.safetensors") == documents(tmp_path / "whole.safetensors") == [
        [6, 7, 8], [6, 3, 2, 1], [9, 3, 3]]  # the repeat of a kept once, b held out
    meta = check_corpus(tmp_path / "grown.safetensors", vocab_size=TINY_LLAMA.vocab_size)
    assert (meta["documents"], meta["tokens"], meta["repeats_dropped"]) == ("3", "10", "1")
    assert meta["source"] == f"{first},{second} (train split, 1 prompt tokens before each answer)", \
        "a corpus input is named by the folders it was built from"
    with pytest.raises(SystemExit, match="error: --data .*old.safetensors: holds the train split with 1 prompt tokens"):
        build([tmp_path / "old.safetensors", second], tmp_path / "x.safetensors", prompt_tokens=0)
    assert build([first], tmp_path / "all.safetensors", split="all") == 0
    with pytest.raises(SystemExit, match="holds the all split"):
        build([tmp_path / "all.safetensors"], tmp_path / "x.safetensors")
    write_corpus(tmp_path / "bare.safetensors", [[1, 2]], vocab_size=TINY_LLAMA.vocab_size, model="tiny", source="x")
    with pytest.raises(SystemExit, match="not a corpus file from `dspark build-corpus`"):
        build([tmp_path / "bare.safetensors"], tmp_path / "x.safetensors")


def test_engine_drafts_from_the_corpus_with_parity(target, drafter_dir, plain_outputs, tmp_path):
    path = tmp_path / "answers.safetensors"
    write_corpus(path, [list(o) for o in plain_outputs], vocab_size=TINY_LLAMA.vocab_size, model="tiny", source="t")
    make_policy, cost = POLICIES["fixedG"]
    engine = _spec_engine(target, drafter_dir, make_policy(), cost=cost, ngram_first=True, lookup_cache_entries=0,
                          lookup_corpus=str(path))
    drafter = engine.drafter
    staged = run_staged(engine, _prompts(), greedy(MAX_TOKENS), ARRIVAL_STEPS)
    assert _mismatches(staged.outputs, plain_outputs) == 0
    rows = np.s_[:, 2 * drafter.cache_class + 1:, 0]  # rounds counted per corpus match class
    reached, accepted = drafter.acceptance.reached[rows].sum(), drafter.acceptance.accepted[rows].sum()
    assert reached > 0 and accepted / reached > 0.5, (reached, accepted)
    assert drafter.lookup.cache is None


def test_corpus_sampling_of_a_large_range_stays_on_real_continuations(monkeypatch):
    """Past SAMPLE occurrences the continuation is counted over evenly spaced ones: still a path the corpus
    holds, here the majority one."""
    monkeypatch.setattr("dspark.drafters.corpus.SAMPLE", 8)
    docs = [[1, 2, 3]] * 30 + [[1, 4, 5]] * 10
    corpus = LookupCorpus(np.array([t for d in docs for t in (*d, SEP)]), max_n=2, num_draft_tokens=3)
    assert corpus.lookup([1]) == ([2, 3], 1)
    assert torch.equal(torch.tensor(corpus.lookup([0, 1])[0]), torch.tensor([2, 3]))
