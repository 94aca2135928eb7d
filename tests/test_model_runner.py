"""ModelRunner: a CPU step of more rows than one decoder-stack call takes runs as consecutive pieces
(`cut_rows`), each through the stack; its logits, taps and stored K/V equal, bit for bit, the same rows run as
small steps of their own, and one forward of the whole step (the per-layer modules) up to summation order."""

from __future__ import annotations

import pytest
import torch

from dspark import kernels
from dspark.worker.model_runner import HostBatch, ModelRunner, allocate_kv_pool, cut_rows
from dspark.models.attention import SeqSpec
from tests.conftest import TINY_LLAMA
from tests.engine_helpers import tiny_target


def _covers(pieces, seqs):
    """Each request's rows, piece by piece, are its rows in order: (num_cached, num_query) runs join up."""
    rows = sum(s.num_query for s in seqs)
    assert pieces[0][0] == 0 and pieces[-1][1] == rows
    assert all(a1 == b0 for (_, a1, _), (b0, _, _) in zip(pieces, pieces[1:]))
    parts: dict[int, list[tuple[int, int]]] = {}
    for a, b, piece in pieces:
        assert sum(s.num_query for s in piece) == b - a
        offset = 0
        for s in piece:
            assert s.token_offset == offset
            offset += s.num_query
            parts.setdefault(id(s.block_table), []).append((s.num_cached, s.num_query))
    for s in seqs:
        runs = parts[id(s.block_table)]
        assert runs[0][0] == s.num_cached and sum(n for _, n in runs) == s.num_query
        assert all(c0 + n0 == c1 for (c0, n0), (c1, _) in zip(runs, runs[1:]))


def test_cut_rows():
    tables = [[i] for i in range(4)]  # distinct lists: a request's identity in _covers
    seqs = [SeqSpec(tables[0], num_cached=0, num_query=300, token_offset=0),
            SeqSpec(tables[1], num_cached=20, num_query=1, token_offset=300),
            SeqSpec(tables[2], num_cached=40, num_query=8, token_offset=301, causal=False),  # a DSpark block
            SeqSpec(tables[3], num_cached=5, num_query=100, token_offset=309)]
    pieces = cut_rows(seqs, 128)
    assert [(a, b) for a, b, _ in pieces] == [(0, 128), (128, 256), (256, 384), (384, 409)]
    _covers(pieces, seqs)
    block = next(s for _, _, piece in pieces for s in piece if not s.causal)
    assert block.num_query == 8  # never cut: it starts a piece when it does not fit (here it fits)
    first, second = cut_rows(seqs, 305)[:2]  # 301 rows, then the block does not fit: it starts the next piece
    assert first[:2] == (0, 301) and not second[2][0].causal and second[2][0].token_offset == 0
    assert cut_rows([SeqSpec([0], 0, 200, 0, causal=False)], 128) is None  # uncuttable and too long
    assert cut_rows([SeqSpec([0], 0, 8, 3)], 128) is None  # rows out of request order


def test_step_in_pieces_equals_one_forward(monkeypatch):
    if kernels.ops() is None:
        pytest.skip("CPU kernels unavailable")
    cfg = TINY_LLAMA
    model, _ = tiny_target(cfg, seed=4)
    assert model.stack_rows() == kernels.MAX_ROWS
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(3, cfg.vocab_size, (400,), generator=g).tolist() for _ in range(3)]
    kv_block_size, per_req = 4, 100
    tables = [list(range(i * per_req, (i + 1) * per_req)) for i in range(3)]

    def host(chunks: list[tuple[int, int, int]]) -> HostBatch:  # (request, first position, rows)
        input_ids, positions, seqs, logits = [], [], [], []
        for r, start, n in chunks:
            seqs.append(SeqSpec(tables[r], num_cached=start, num_query=n, token_offset=len(input_ids)))
            logits.extend(range(len(input_ids), len(input_ids) + n))
            input_ids += ids[r][start:start + n]
            positions += range(start, start + n)
        return HostBatch(input_ids, positions, seqs, logits, [s.token_offset for s in seqs], [0] * len(seqs))

    steps = [[(0, 0, 300), (1, 0, 50)],  # 350 prompt rows: three pieces, request 0 cut twice
             [(0, 300, 1), (1, 50, 8), (2, 0, 200)]]  # a decode row, a verify window, a 200-row prompt
    # the twins: every request's rows as steps of their own of at most 50 rows (each through the stack, whose
    # rows do not depend on what shares their step), and one forward of the whole step (pieces off: past 128
    # rows the per-layer modules, whose torch products sum in another order)
    small = [[[(r, p, min(50, start + n - p))] for r, start, n in chunks for p in range(start, start + n, 50)]
             for chunks in steps]
    results = {}
    for name in ("pieces", "small steps", "one forward"):
        runner = ModelRunner(model, kv_caches=allocate_kv_pool([model.kv_spec] * model.num_kv_layers,
                                                               num_kv_blocks=3 * per_req, kv_block_size=kv_block_size,
                                                               dtype=torch.float32, device="cpu"),
                             kv_block_size=kv_block_size, device="cpu", tap_layer_ids=(-1, 0, cfg.num_hidden_layers - 1))
        calls = []
        forward = model.forward

        def counting(*args, **kw):
            calls.append(args[0].shape[0])
            return forward(*args, **kw)
        monkeypatch.setattr(model, "forward", counting)
        if name == "one forward":
            monkeypatch.setattr(runner, "_pieces", lambda batch: None)
        out = []
        for i, chunks in enumerate(steps):
            parts = [runner.forward(runner.to_device(host(c))) for c in small[i]] if name == "small steps" else \
                [runner.forward(runner.to_device(host(chunks)))]
            out.append(tuple(torch.cat(t) for t in zip(*parts)))  # (logits, taps) of the step's rows in order
        monkeypatch.undo()
        results[name] = (out, runner.kv_caches, calls)
    assert results["pieces"][2] == [128, 128, 94, 128, 81] and results["one forward"][2] == [350, 209]
    (pieced, kv_p, _), (small_out, kv_s, _), (whole, _, _) = (results[n] for n in ("pieces", "small steps", "one forward"))
    for (lp, tp), (ls, ts), (lw, tw) in zip(pieced, small_out, whole):
        assert torch.equal(tp, ts)  # every layer's rows (the taps: the embedding, layer 0 and the last layer)
        # the LM head multiplies the step's logits rows in one product: past 128 rows torch's, another order
        torch.testing.assert_close(lp, ls, atol=1e-5, rtol=0)
        torch.testing.assert_close(lp, lw, atol=1e-4, rtol=0)
        torch.testing.assert_close(tp, tw, atol=1e-4, rtol=0)
    for (kp, vp), (ks, vs) in zip(kv_p, kv_s):
        assert torch.equal(kp, ks) and torch.equal(vp, vs)
