"""The vocabulary-parallel argmax (dspark.distributed.vocab_argmax): the merge of the ranks' slice winners
picks torch.argmax's answer over the whole row (lowest index on ties, within a slice and across slices;
the last slice's padding never wins; NaN / +inf / -inf rows carry over to the fault check), in process;
and with gloo, two processes: greedy output equals one process's and the gathered path's, with and without
speculation, an all-greedy step gathers [rows, 2] per rank and never the logits slices, a step with a
logprobs or a sampled request gathers the slices."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from dspark.config import SpecConfig
from dspark.distributed.group import TPGroup
from dspark.distributed.vocab_argmax import gather_argmax, merge_winners, slice_winners
from dspark.engine.build import build_engine
from dspark.engine.faults import isolate_target_faults
from dspark.llm import LLM
from dspark.sampling import RowArgmax, SamplingParams
from tests.test_tensor_parallel import GREEDY, PROMPTS, QWEN3_UNEVEN, engine_config, torch_path, write_checkpoint


def slices(full: torch.Tensor, size: int) -> tuple[list[torch.Tensor], int]:
    """The head's slices of `full` [rows, V]: ceil(V / size) columns each, the last padded as the sharded
    head pads it (zero weight rows: logit 0)."""
    vocab = full.shape[1]
    per = -(-vocab // size)
    padded = torch.cat([full, full.new_zeros(full.shape[0], per * size - vocab)], dim=1)
    return [padded[:, r * per:(r + 1) * per] for r in range(size)], per


def merged(full: torch.Tensor, size: int) -> RowArgmax:
    parts, per = slices(full, size)
    winners = [slice_winners(p, r * per, full.shape[1]) for r, p in enumerate(parts)]  # [rows, 2] each
    return merge_winners(torch.stack(winners, dim=1))


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("vocab", [10, 11, 251, 256])
def test_merge_is_the_argmax_of_the_whole_row(size, vocab):
    """Negative logits of a few values (ties everywhere, and padding at logit 0 above every real one)."""
    g = torch.Generator().manual_seed(vocab * 10 + size)
    full = -torch.randint(1, 4, (64, vocab), generator=g).float()  # [64, vocab] in {-3, -2, -1}
    got = merged(full, size)
    assert got.indices.tolist() == full.argmax(dim=-1).tolist()
    assert torch.equal(got.values, full.max(dim=-1).values)


def test_ties_across_slices_and_padding():
    """V = 10 over 3 ranks: slices [0, 4), [4, 8), [8, 10) + 2 padding columns (logit 0)."""
    ninf = float("-inf")
    rows = torch.full((7, 10), -5.0)
    rows[0, [3, 4]] = -1.0  # the same maximum at the end of slice 0 and the start of slice 1 -> 3
    rows[1, [5, 9]] = -1.0  # slices 1 and 2 -> 5
    # row 2: -5 everywhere -> 0
    rows[3, 8] = -2.0  # every real logit negative, the padding's 0 above them all -> 8, not 10 or 11
    rows[4] = ninf  # masked throughout -> -inf (a fault), index 0
    rows[5, [8, 9]] = 7.0  # within the last slice -> 8
    rows[6, [1, 2, 6]] = 3.0  # within slice 0 and then slice 1 -> 1
    got = merged(rows, 3)
    assert got.indices.tolist() == [3, 5, 0, 8, 0, 8, 1]
    assert got.indices.tolist() == rows.argmax(dim=-1).tolist()
    assert got.values.tolist() == [-1.0, -1.0, -5.0, -2.0, ninf, 7.0, 3.0]


def test_nonfinite_rows_fail_their_request_as_the_rows_would():
    rows = torch.randn(4, 11)
    rows[1, 9] = float("nan")  # in the last slice
    rows[2, 0] = float("inf")
    rows[3] = float("-inf")
    got = merged(rows, 2)
    assert got.values.isnan().tolist() == [False, True, False, False]
    assert got.values[2] == float("inf") and got.values[3] == float("-inf")
    items = [SimpleNamespace(num_logits=1, request=SimpleNamespace(request_id=f"r{i}")) for i in range(4)]
    from_rows = isolate_target_faults(items, rows)[1]
    isolated, from_argmax = isolate_target_faults(items, got)
    assert set(from_argmax) == set(from_rows) == {"r1", "r2", "r3"}
    assert isolated.indices.tolist() == [int(rows[0].argmax()), 0, 0, 0] and isolated.values[1:].eq(0).all()


def test_one_rank_gathers_its_own_winners():
    full = torch.randn(5, 33)
    got = gather_argmax(TPGroup.single(), full, 0, 33)
    assert got.indices.tolist() == full.argmax(dim=-1).tolist()


# -- two processes (gloo) ---------------------------------------------------------------------------------

QWEN3_ODD = dataclasses.replace(QWEN3_UNEVEN, vocab_size=251)  # slices of 126: the last padded by one


def run_tp(config, requests):
    """[(prompts, params)] through one engine in turn -> (outputs per entry, the head's output of every
    step, the last-dim width of every tensor rank 0 gathered)."""
    engine, _ = build_engine(config)
    steps, widths = [], []
    forward = engine.runner.forward

    def recording(batch, **kw):
        out, taps = forward(batch, **kw)
        steps.append(out.clone())
        return out, taps

    engine.runner.forward = recording
    tp = getattr(engine.runner.model, "tp", None)  # (one process: no group)
    if tp is not None:
        gather = tp.gather_cat
        tp.gather_cat = lambda x: (widths.append(x.shape[-1]), gather(x))[1]
    llm = LLM(engine=engine, tokenizer=None)
    try:
        outputs = [[o.token_ids for o in llm.generate(prompts, params)] for prompts, params in requests]
    finally:
        if getattr(engine, "workers", None) is not None:
            engine.workers.close()
    return outputs, steps, widths


@pytest.fixture(scope="module")
def odd_checkpoint(tmp_path_factory):
    return write_checkpoint(QWEN3_ODD, tmp_path_factory.mktemp("qwen3_odd"))


def test_tp2_argmax_equals_one_process_and_the_gathered_rows(odd_checkpoint, monkeypatch):
    """Every step's merged (max, argmax) is one process's row max and argmax (the torch path: within 1e-5);
    the output equals one process's and the gathered path's, which gathered the 126-wide slices."""
    torch_path(monkeypatch)
    (one,), one_steps, _ = run_tp(engine_config(odd_checkpoint, 1), [(PROMPTS, GREEDY)])
    (two,), two_steps, two_widths = run_tp(engine_config(odd_checkpoint, 2), [(PROMPTS, GREEDY)])
    (rows,), _, rows_widths = run_tp(engine_config(odd_checkpoint, 2, vocab_parallel_argmax=False),
                                     [(PROMPTS, GREEDY)])
    assert two == one and rows == one
    assert len(two_steps) == len(one_steps)
    for full, top in zip(one_steps, two_steps):
        assert isinstance(top, RowArgmax) and len(top) == full.shape[0]
        assert top.indices.tolist() == full.argmax(dim=-1).tolist()
        torch.testing.assert_close(top.values, full.max(dim=-1).values, atol=1e-5, rtol=0)
    assert set(two_widths) == {2} and set(rows_widths) == {126}


def test_tp2_argmax_speculative_greedy_equals_one_process(odd_checkpoint):
    """Prompt lookup drafts verified against the merged argmax (CPU kernels where built)."""
    prompts = PROMPTS + [[40, 41, 42, 43] * 6]
    (one,), _, _ = run_tp(engine_config(odd_checkpoint, 1), [(prompts, GREEDY)])
    spec = SpecConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
    (two,), _, widths = run_tp(engine_config(odd_checkpoint, 2, spec=spec), [(prompts, GREEDY)])
    assert two == one
    assert set(widths) == {2}


def test_tp2_gathers_the_rows_only_for_steps_that_read_them(odd_checkpoint):
    """All greedy: [rows, 2] per rank, the gathered bytes 8 per row; a logprobs request (greedy) or a
    sampled one in the step: the 126-wide slices."""
    logprobs = dataclasses.replace(GREEDY, logprobs=2)
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
    engine, _ = build_engine(engine_config(odd_checkpoint, 2))
    tp = engine.runner.model.tp
    llm = LLM(engine=engine, tokenizer=None)
    try:
        widths, gather = [], tp.gather_cat
        tp.gather_cat = lambda x: (widths.append(x.shape[-1]), gather(x))[1]
        before = tp.gathered_bytes
        greedy_out = llm.generate(PROMPTS[:2], GREEDY)
        rows = sum(len(o.token_ids) for o in greedy_out)  # one logits row per token: no speculation
        assert set(widths) == {2} and tp.gathered_bytes - before == rows * 2 * 4
        for params in (logprobs, sampled):
            widths.clear()
            out = llm.generate(PROMPTS[:1], params)[0]
            assert widths and set(widths) == {126}, params
        assert out.token_ids
    finally:
        engine.workers.close()
