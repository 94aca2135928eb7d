"""Tests for the two autoregressive drafters (dspark/drafters/eagle3*.py, draft_model.py) on a tiny
random Llama target:

* draft model = all target layers (a truncated view sharing the target's weights): its drafts are the
  target's own greedy continuation, through chunked context, partial commits and a propose-time catch-up;
* EAGLE-3 paged incremental propose (context in chunks, a pending last row, partial commits of rejected
  drafts, two requests) equals the dense TTT unroll `training_forward` at the anchor row, greedy and
  probabilistic (draft_probs);
* configuration checks fail before any weight loads, naming the field and both values;
* EAGLE-3 save → registry build round trip drafts the same;
* EAGLE-3 with a reduced draft vocabulary (d2t): its logits are the full-vocabulary drafter's on the d2t
  rows and −inf elsewhere, training scores only those rows, d2t survives save/load, bad maps are refused;
* end to end: greedy Engine output with either drafter == greedy output without a drafter.

    pytest tests/test_eagle3_draft_model.py -q
"""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

from conftest import PagedKV, TINY_LLAMA, TINY_QWEN3
from dspark.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from dspark.drafters import build_drafter, check_drafter
from dspark.drafters.base import ContextSegment, ContextUpdate, ProposeBatch, ProposeRequest
from dspark.drafters.draft_model import DraftModelDrafter, truncated_view
from dspark.drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Model, bind_to_target, save_eagle3
from dspark.worker.model_runner import allocate_kv_pool
from dspark.models import build_model
from dspark.sampling import SamplingParams

CFG = TINY_LLAMA  # 3 layers, d = 64, vocab 256
KV_BLOCK = 4
GREEDY = SamplingParams(temperature=0.0)


def random_target(seed: int = 0, cfg=CFG):
    gen = torch.Generator().manual_seed(seed)
    model = build_model(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:  # unit-scale activations and logits of std ~1: distinct argmaxes
                p.copy_(torch.randn(p.shape, generator=gen) / (p.shape[-1] ** 0.5 if p.dim() > 1
                                                                and "embed" not in name else 1.0))
    return model


def random_eagle3(target, seed: int = 1) -> Eagle3Model:
    taps = (0, 1, 2) if target.config.num_hidden_layers == 3 else (-1, 0, 1)
    cfg = Eagle3Config.from_target(target.config, tap_layer_ids=taps, num_draft_tokens=4)
    model = Eagle3Model(cfg).init_weights(std=0.15, seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
    return bind_to_target(model, target).eval()


class Harness:
    """Drives a drafter like the engine does: its own pool, one shuffled block table per request."""

    def __init__(self, drafter, num_requests: int, max_len: int = 48):
        per_req = -(-max_len // KV_BLOCK)
        ids = list(range(num_requests * per_req + 3))
        random.Random(0).shuffle(ids)
        self.tables = [ids[i * per_req:(i + 1) * per_req] for i in range(num_requests)]
        drafter.bind_kv(allocate_kv_pool(drafter.kv_layer_specs(), num_kv_blocks=len(ids),
                                         kv_block_size=KV_BLOCK, dtype=torch.float32, device="cpu"))
        self.drafter = drafter
        self.done = [0] * num_requests

    def extend(self, items: list[tuple[int, int, list[int], int | None, torch.Tensor | None]]):
        """items: (request, start_pos, token ids, next_token_id, taps [len, num_taps * d] or None)."""
        segs, taps, row = [], [], 0
        for r, start, toks, nxt, t in items:
            segs.append(ContextSegment(request_id=str(r), block_table=self.tables[r], start_pos=start,
                                       token_ids=toks, next_token_id=nxt,
                                       tap_rows=slice(row, row + len(toks))))
            row += len(toks)
            if t is not None:
                taps.append(t)
        update = ContextUpdate(segments=segs, taps=torch.cat(taps) if taps else None)
        out = self.drafter.extend_context(update)
        for r, start, toks, _, _ in items:
            self.done[r] = out.get(str(r), start + len(toks))

    def propose(self, items: list[tuple[int, list[int], SamplingParams]], method: str = "greedy"):
        """items: (request, all ids (the last is the anchor), params)."""
        reqs = [ProposeRequest(request_id=str(r), all_ids=ids, anchor_pos=len(ids) - 1,
                               block_table=self.tables[r], num_draft_computed=self.done[r], params=p,
                               generator=torch.Generator().manual_seed(7 + r)) for r, ids, p in items]
        return self.drafter.propose(ProposeBatch(requests=reqs, kv_block_size=KV_BLOCK,
                                                 draft_sample_method=method))


# -- draft model -------------------------------------------------------------------------------------

def target_greedy(target, ids: list[int], n: int) -> list[int]:
    """Plain greedy decoding with the target on its own pool."""
    kv = PagedKV.create(target, num_requests=1, max_len=len(ids) + n + 1, kv_block_size=KV_BLOCK)
    out, chunk, cached = [], list(ids), 0
    for _ in range(n):
        hidden, _ = kv.step(target, [(chunk, cached)])
        cached += len(chunk)
        out.append(int(target.compute_logits(hidden[-1:]).argmax()))
        chunk = out[-1:]
    return out


def test_truncated_view_shares_target_weights():
    target = random_target()
    view = truncated_view(target, 2)
    assert view.model.layers[1] is target.model.layers[1] and view.lm_head is target.lm_head
    assert len(view.model.layers) == 2 and view.num_kv_layers == 2
    target_ptrs = {p.data_ptr() for p in target.parameters()}
    assert all(p.data_ptr() in target_ptrs for p in view.parameters())


def test_draft_model_all_layers_proposes_target_greedy_continuation():
    gamma = 4
    target = random_target()
    drafter = build_drafter(SpecConfig(method="draft_model", draft_num_layers=CFG.num_hidden_layers,
                                       num_speculative_tokens=gamma),
                            target_config=CFG, target_model=target, dtype=torch.float32, device="cpu")
    assert isinstance(drafter, DraftModelDrafter) and len(drafter.kv_layer_specs()) == 3
    h = Harness(drafter, 2)
    rng = random.Random(3)
    seqs = [[rng.randrange(3, 256) for _ in range(11)], [rng.randrange(3, 256) for _ in range(6)]]
    # round 0: prompt of request 0 in two chunks (the first without the step's anchor), request 1 at once
    h.extend([(0, 0, seqs[0][:5], seqs[0][5], None)])
    h.extend([(0, 5, seqs[0][5:10], seqs[0][10], None), (1, 0, seqs[1][:5], seqs[1][5], None)])
    for round_ in range(4):
        props = h.propose([(r, seqs[r], GREEDY) for r in range(2)])
        assert props.draft_probs is None
        starts = [len(s) - 1 for s in seqs]
        for r in range(2):
            drafts = props.draft_ids[r].tolist()
            assert drafts == target_greedy(target, seqs[r], gamma), (round_, r)
            # verify outcome: request 0 keeps `round_` drafts, request 1 all of them; then a random
            # token (the drafter must follow any committed text; greedy text of a random model loops)
            kept = drafts[:round_ % gamma] if r == 0 else drafts
            seqs[r] = seqs[r] + kept + [rng.randrange(3, 256)]
        items = [(r, starts[r], seqs[r][starts[r]:-1], seqs[r][-1], None) for r in range(2)]
        h.extend(items if round_ != 2 else items[:1])  # round 3's propose catches request 1 up


def test_draft_model_probabilistic_sampling_returns_its_distribution():
    target = random_target()
    drafter = DraftModelDrafter(truncated_view(target, 1), num_draft_tokens=3)
    h = Harness(drafter, 2)
    ids = [5, 9, 17, 33, 65, 100]
    h.extend([(0, 0, ids[:-1], ids[-1], None), (1, 0, ids[:-1], ids[-1], None)])
    hot = SamplingParams(temperature=0.8, top_k=20)
    props = h.propose([(0, ids, hot), (1, ids, GREEDY)], method="probabilistic")
    assert props.draft_probs.shape == (2, 3, 256)
    torch.testing.assert_close(props.draft_probs.sum(-1), torch.ones(2, 3))
    assert ((props.draft_probs[0] > 0).sum(-1) <= 20).all()  # top-k applied
    for k in range(3):  # each draft lies in the support it was sampled from; greedy rows are one-hot
        assert props.draft_probs[0, k, props.draft_ids[0, k]] > 0
        assert props.draft_probs[1, k, props.draft_ids[1, k]] == 1.0


# -- EAGLE-3 -----------------------------------------------------------------------------------------

def dense_reference(model: Eagle3Model, ids: list[int], taps: torch.Tensor, drafts: list[int]):
    """Per draft step, the logits at the anchor's row a−1 of the TTT unroll over ids + drafts."""
    a, gamma = len(ids) - 1, len(drafts)
    seq = ids + drafts[:-1]
    full_taps = torch.cat([taps[:a], torch.zeros(len(seq) - a, taps.shape[1])])  # rows ≥ a unused
    with torch.no_grad():
        logits = model.training_forward(taps=full_taps[None], input_ids=torch.tensor([seq]),
                                        ttt_steps=gamma)
    return torch.stack([lg[0, a - 1] for lg in logits])  # [gamma, vocab]


@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
@pytest.mark.parametrize("target_cfg", [TINY_LLAMA, TINY_QWEN3], ids=["llama", "qwen3"])
def test_eagle3_paged_propose_matches_dense_ttt_unroll(method, target_cfg):
    gamma = 4
    target = random_target(cfg=target_cfg)
    model = random_eagle3(target)
    drafter = Eagle3Drafter(model, num_draft_tokens=gamma)
    assert len(drafter.tap_layer_ids) == 3
    assert drafter.kv_layer_specs() == [(target_cfg.num_key_value_heads, target_cfg.head_dim)]
    h = Harness(drafter, 2)
    gen = torch.Generator().manual_seed(5)
    rng = random.Random(4)
    seqs = [[rng.randrange(3, 256) for _ in range(11)], [rng.randrange(3, 256) for _ in range(8)]]
    taps = [torch.randn(64, 3 * 64, generator=gen) for _ in range(2)]  # truth: target taps per position
    params = [SamplingParams(temperature=1.0), GREEDY] if method == "probabilistic" else [GREEDY, GREEDY]
    # prompt of request 0 in two chunks without their next token: the first chunk's last row is
    # completed by the second chunk, the second's by propose (with the anchor)
    h.extend([(0, 0, seqs[0][:6], None, taps[0][:6])])
    assert h.done == [5, 0]
    h.extend([(0, 6, seqs[0][6:10], None, taps[0][6:10]), (1, 0, seqs[1][:7], seqs[1][7], taps[1][:7])])
    assert h.done == [9, 7]
    for round_ in range(4):
        props = h.propose([(r, seqs[r], params[r]) for r in range(2)], method=method)
        starts = [len(s) - 1 for s in seqs]
        for r in range(2):
            drafts = props.draft_ids[r].tolist()
            ref = dense_reference(model, seqs[r], taps[r], drafts)  # [gamma, vocab]
            assert drafts == ref.argmax(-1).tolist() or params[r].temperature > 0, (round_, r)
            if props.draft_probs is not None:
                torch.testing.assert_close(props.draft_probs[r], ref.softmax(-1) if r == 0 else
                                           torch.nn.functional.one_hot(ref.argmax(-1), 256).float(),
                                           atol=1e-5, rtol=1e-4)
            kept = drafts[:(round_ + r) % (gamma + 1)]  # partial commits, a full one, a zero one
            seqs[r] = seqs[r] + kept + [rng.randrange(3, 256)]
        items = []
        for r in range(2):
            new = seqs[r][starts[r]:-1]
            taps[r][starts[r]:starts[r] + len(new)] = torch.randn(len(new), 3 * 64, generator=gen)
            items.append((r, starts[r], new, seqs[r][-1], taps[r][starts[r]:starts[r] + len(new)]))
        h.extend(items)


def test_eagle3_training_forward_shapes_and_step1_is_causal():
    target = random_target()
    model = random_eagle3(target)
    ids = torch.randint(3, 256, (2, 9))
    taps = torch.randn(2, 9, 3 * 64)
    with torch.no_grad():
        out = model.training_forward(taps=taps, input_ids=ids, loss_mask=torch.ones(2, 9), ttt_steps=3)
        cut = model.training_forward(taps=taps[:, :5], input_ids=ids[:, :5], ttt_steps=3)
    assert len(out) == 3 and out[0].shape == (2, 9, 256)
    # rows whose tokens all exist in the cut sequence are unaffected by the tail
    for j in range(3):
        torch.testing.assert_close(out[j][:, :4 - j], cut[j][:, :4 - j], atol=1e-5, rtol=1e-4)
    model.requires_grad_(True)
    logits = model.training_forward(taps=taps, input_ids=ids, ttt_steps=2)
    loss = sum(lg.logsumexp(-1).mean() for lg in logits)
    loss.backward()
    assert model.fc.weight.grad is not None and target.lm_head.weight.grad is None


@pytest.mark.parametrize("target_cfg", [TINY_LLAMA, TINY_QWEN3], ids=["llama", "qwen3"])
def test_eagle3_chain_unroll_equals_dense_unroll_at_its_rows(target_cfg):
    """The trainer's sparse TTT (only the chains starting at sampled anchors) is the dense unroll."""
    model = random_eagle3(random_target(cfg=target_cfg))
    ids = torch.randint(3, 256, (2, 12))
    taps = torch.randn(2, 12, 3 * 64)
    anchors = torch.tensor([[0, 4, 9, 11], [2, 3, 7, -1]])
    with torch.no_grad():
        dense = model.training_forward(taps=taps, input_ids=ids, ttt_steps=4, return_hidden=True)
        chains = model.training_forward_chains(taps=taps, input_ids=ids, anchors=anchors, ttt_steps=4)
    keep = anchors >= 0
    rows = torch.arange(2).unsqueeze(1).expand_as(anchors)
    for j in range(4):
        assert chains[j].shape == (2, 4, 64)
        torch.testing.assert_close(chains[j][keep], dense[j][rows[keep], anchors[keep]], atol=1e-5, rtol=1e-4)
        assert (chains[j][~keep] == 0).all()


def test_eagle3_save_build_round_trip(tmp_path):
    target = random_target()
    model = random_eagle3(target)
    save_eagle3(model, model.config, str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["tap_layer_ids"] == [0, 1, 2]
    spec = SpecConfig(method="eagle3", model=str(tmp_path), num_speculative_tokens=3)
    check_drafter(spec, CFG)
    loaded = build_drafter(spec, target_config=CFG, target_model=target, dtype=torch.float32, device="cpu")
    taps = torch.randn(5, 3 * 64)
    assert torch.equal(_greedy_drafts(Eagle3Drafter(model, num_draft_tokens=3), taps),
                       _greedy_drafts(loaded, taps))


def _greedy_drafts(drafter, taps: torch.Tensor, ids=(4, 8, 15, 16, 23, 42)) -> torch.Tensor:
    """One request: context ids[:-1] with `taps`, anchor ids[-1] → its greedy draft ids [1, γ]."""
    ids = list(ids)
    h = Harness(drafter, 1)
    h.extend([(0, 0, ids[:-1], ids[-1], taps)])
    return h.propose([(0, ids, GREEDY)]).draft_ids


def test_eagle3_reduced_draft_vocab(tmp_path):
    target = random_target()
    full = random_eagle3(target)
    d2t = torch.tensor(sorted(random.Random(3).sample(range(256), 40)))
    cfg = Eagle3Config.from_dict({**full.config.to_dict(), "draft_vocab_size": 40})
    reduced = Eagle3Model(cfg)
    reduced.load_state_dict({k: v for k, v in full.state_dict().items() if k != "d2t"}, strict=False)
    reduced.d2t = d2t
    reduced = bind_to_target(reduced, target).eval()
    hidden = torch.randn(5, 64)
    with torch.no_grad():
        ref, got = full.compute_logits(hidden), reduced.compute_logits(hidden)  # [5, 256] each
        assert reduced.draft_logits(hidden).shape == (5, 40)
    torch.testing.assert_close(got[:, d2t], ref[:, d2t])
    outside = torch.ones(256, dtype=torch.bool)
    outside[d2t] = False
    assert torch.isneginf(got[:, outside]).all()
    ids, taps = torch.randint(3, 256, (1, 7)), torch.randn(1, 7, 3 * 64)
    with torch.no_grad():
        steps = reduced.training_forward(taps=taps, input_ids=ids, ttt_steps=2)
        ref_steps = full.training_forward(taps=taps, input_ids=ids, ttt_steps=2)
    assert steps[0].shape == (1, 7, 40)
    torch.testing.assert_close(steps[1], ref_steps[1][..., d2t])
    # d2t is written with the weights and read back; the drafts are target ids inside the draft vocab
    save_eagle3(reduced, cfg, str(tmp_path))
    spec = SpecConfig(method="eagle3", model=str(tmp_path), num_speculative_tokens=3)
    loaded = build_drafter(spec, target_config=CFG, target_model=target, dtype=torch.float32, device="cpu")
    assert torch.equal(loaded.model.d2t, d2t)
    seq_taps = torch.randn(5, 3 * 64)
    drafts = _greedy_drafts(Eagle3Drafter(reduced, num_draft_tokens=3), seq_taps)
    assert torch.equal(drafts, _greedy_drafts(loaded, seq_taps))
    assert set(drafts.flatten().tolist()) <= set(d2t.tolist())
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(tensors["d2t"], d2t - torch.arange(40))  # stored as offsets
    save_file({**tensors, "d2t": 7 - torch.arange(40)}, str(tmp_path / "model.safetensors"))  # every id 7
    with pytest.raises(ValueError, match="d2t .* must hold distinct target ids"):
        build_drafter(spec, target_config=CFG, target_model=target, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="draft_vocab_size=300"):
        Eagle3Config.from_dict({**cfg.to_dict(), "draft_vocab_size": 300})


# -- configuration checks ----------------------------------------------------------------------------

def test_config_checks_fail_before_weights_load(tmp_path):
    cfg = Eagle3Config.from_target(CFG, tap_layer_ids=(0, 1, 2)).to_dict()
    for field, value, msg in [("hidden_size", 32, "hidden_size=32"), ("vocab_size", 300, "vocab_size=300"),
                              ("target_num_hidden_layers", 5, "target_num_hidden_layers=5")]:
        (tmp_path / "config.json").write_text(json.dumps({**cfg, field: value}))  # no weights at all
        with pytest.raises(ValueError, match=msg) as e:
            check_drafter(SpecConfig(method="eagle3", model=str(tmp_path)), CFG)
        target_field = "num_hidden_layers" if field == "target_num_hidden_layers" else field
        assert f"{target_field}={getattr(CFG, target_field)}" in str(e.value)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="safetensors"):
        check_drafter(SpecConfig(method="eagle3", model=str(tmp_path)), CFG)
    with pytest.raises(ValueError, match="tap_layer_ids"):
        Eagle3Config.from_target(CFG, tap_layer_ids=(0, 3))
    with pytest.raises(ValueError, match="unknown EAGLE-3 config key"):
        Eagle3Config.from_dict({**cfg, "bogus": 1})
    with pytest.raises(ValueError, match="draft_num_layers=5"):
        check_drafter(SpecConfig(method="draft_model", draft_num_layers=5), CFG)
    with pytest.raises(ValueError, match="draft_num_layers"):
        check_drafter(SpecConfig(method="draft_model"), CFG)
    with pytest.raises(ValueError, match="not both"):
        check_drafter(SpecConfig(method="draft_model", model=str(tmp_path), draft_num_layers=1), CFG)


def test_draft_model_vocab_mismatch_fails_before_load(tmp_path):
    from dspark.models import loader
    if not hasattr(loader, "read_model_config"):
        pytest.skip("dspark.models.loader.read_model_config not available yet")
    hf = {**CFG.to_hf(), "vocab_size": 512, "num_hidden_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="vocab_size=512.*vocab_size=256"):
        check_drafter(SpecConfig(method="draft_model", model=str(tmp_path)), CFG)


# -- end to end --------------------------------------------------------------------------------------

def run_engine(target, spec: SpecConfig | None, drafter, prompts: list[list[int]], max_tokens: int = 12):
    from dspark.engine.engine import Engine

    config = EngineConfig(spec=spec, cache=CacheConfig(kv_block_size=KV_BLOCK, num_kv_blocks=96),
                          scheduler=SchedulerConfig(max_num_batched_tokens=24))
    engine = Engine(config, model=target, model_config=CFG, drafter=drafter, eos_token_ids=(2,))
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
           for p in prompts]
    out = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[i] for i in ids], engine.metrics


@pytest.mark.parametrize("method", ["draft_model", "eagle3", "eagle3-reduced"])
def test_engine_greedy_output_unchanged_by_drafter(method):
    target = random_target()
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 30, 13)]
    plain, _ = run_engine(target, None, None, prompts)
    if method == "draft_model":
        spec = SpecConfig(method="draft_model", draft_num_layers=CFG.num_hidden_layers,
                          num_speculative_tokens=3)
        drafter = build_drafter(spec, target_config=CFG, target_model=target, dtype=torch.float32,
                                device="cpu")
    else:
        spec = SpecConfig(method="eagle3", model="unused", num_speculative_tokens=3)
        model = random_eagle3(target)
        if method == "eagle3-reduced":  # half the vocabulary: some target tokens can never be drafted
            model = Eagle3Model(Eagle3Config.from_dict({**model.config.to_dict(), "draft_vocab_size": 128}))
            model.init_weights(std=0.15, seed=1).d2t = torch.arange(0, 256, 2)
            model = bind_to_target(model, target).eval()
        drafter = Eagle3Drafter(model, num_draft_tokens=3)
    spec_out, metrics = run_engine(target, spec, drafter, prompts)
    assert spec_out == plain
    assert metrics.num_drafts > 0 and metrics.num_draft_tokens > 0, "no drafts were proposed and verified"
    if method == "draft_model":  # the drafter is the target: every draft is accepted
        assert metrics.num_accepted_tokens == metrics.num_draft_tokens
        return
    # random EAGLE-3 weights get nothing accepted; with each proposal's first draft set to the plain
    # continuation (the drafter still runs, and extends its context over what was accepted) the accepting
    # path is exercised as well
    propose = drafter.propose

    def first_draft_from_plain(batch):
        out = propose(batch)
        ids = out.draft_ids.clone()  # [num_reqs, γ]
        for row, req in enumerate(batch.requests):
            for prompt, continuation in zip(prompts, plain):
                pos = len(req.all_ids) - len(prompt)
                if tuple(req.all_ids[:len(prompt)]) == tuple(prompt) and pos < len(continuation):
                    ids[row, 0] = continuation[pos]
        return dataclasses.replace(out, draft_ids=ids)
    drafter.propose = first_draft_from_plain
    spec_out, metrics = run_engine(target, spec, drafter, prompts)
    assert spec_out == plain
    assert metrics.num_accepted_tokens > 0, "the plain continuation drafted first was never accepted"
