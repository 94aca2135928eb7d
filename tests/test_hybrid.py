"""Hybrid linear-attention targets (Qwen3.5, Qwen3-Next, dense and MoE) on tiny random configs against transformers (fp32):
logits over prompts run whole, in chunks, one token at a time and in verification windows; greedy output
against `generate()`; the recurrence's fast paths against the one-token loop; state rollback after windows
ending in a rejection (a scripted drafter that corrupts a chosen position each round) equal to plain decoding,
with preemption and aborts (the MTP and tap drafters: tests/test_hybrid_drafters.py); the sampled law (chi-square) under speculation; no state slot or KV block left in
use after a soak; refusals of what does not run, by name and before weights."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dspark import kernels
from dspark.config import SpecConfig
from dspark.drafters.base import DraftProposal, Drafter, ProposeBatch
from dspark.drafters.draft_model import DraftModelDrafter
from dspark.models import build_model
from dspark.models.attention import SeqSpec, build_attn_metadata
from dspark.models.config import ModelConfig
from dspark.models.recurrent import causal_conv, delta_rule_chunked, delta_rule_tokens, prepare_qk
from tests.engine_helpers import (greedy, hf_greedy, make_engine, ngram_engine_args, run, tiny_target, two_token_law,
                                  two_token_samples)
from tests.stat_checks import assert_differs_from_distribution, assert_matches_distribution

ATOL = 1e-4
LAYERS = ("linear_attention", "linear_attention", "full_attention", "linear_attention")
TINY_QWEN3_5 = ModelConfig(
    architecture="Qwen3_5ForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=512,
    qk_norm=True, bos_token_id=1, eos_token_ids=(2,), layer_types=LAYERS, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
    partial_rotary_factor=0.5, attn_output_gate=True)
# Qwen3-Next: the grouped in_proj_qkvz / in_proj_ba checkpoint layout (dense MLPs: num_experts 0)
TINY_QWEN3_NEXT = replace(TINY_QWEN3_5, architecture="Qwen3NextForCausalLM")
# MoE: Qwen3-Next with a shared expert and a dense layer (mlp_only_layers); Qwen3.5-MoE routes every layer
TINY_QWEN3_NEXT_MOE = replace(TINY_QWEN3_NEXT, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                              norm_topk_prob=True, mlp_only_layers=(1,), shared_expert_intermediate_size=48)
TINY_QWEN3_5_MOE = replace(TINY_QWEN3_5, architecture="Qwen3_5MoeForCausalLM", intermediate_size=0, num_experts=6,
                           num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                           shared_expert_intermediate_size=48)
CONFIGS = {"qwen3_5": TINY_QWEN3_5, "qwen3_next": TINY_QWEN3_NEXT, "qwen3_next_moe": TINY_QWEN3_NEXT_MOE,
           "qwen3_5_moe": TINY_QWEN3_5_MOE}


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prompts(n: int) -> list[list[int]]:
    """Prompts with repeats (prompt lookup finds drafts) of lengths 9 to 41."""
    out = []
    for i in range(n):
        motif = _ids(5, 100 + i)
        out.append((_ids(4, 200 + i) + motif * 8)[:9 + 8 * (i % 5)])
    return out


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request):
    return tiny_target(CONFIGS[request.param]) + (CONFIGS[request.param],)


class Stepper:
    """Runs the model on one request's rows with a KV pool and a state slot (window = ring size)."""

    def __init__(self, model, *, window: int, num_slots: int = 2, max_len: int = 96, kv_block_size: int = 8):
        self.model, self.kv_block_size = model, kv_block_size
        model.allocate_state(num_slots=num_slots, window=window, dtype=torch.float32, device="cpu")
        blocks = -(-max_len // kv_block_size) * num_slots
        heads, dim = model.kv_spec
        self.kv = [(torch.zeros(blocks, kv_block_size, heads, dim), torch.zeros(blocks, kv_block_size, heads, dim))
                   for _ in range(model.num_kv_layers)]
        per = blocks // num_slots
        self.tables = [list(range(s * per, (s + 1) * per)) for s in range(num_slots)]

    def run(self, slot: int, ids: list[int], start: int) -> torch.Tensor:
        """Logits [len(ids), vocab] of positions start .. start + len - 1."""
        spec = SeqSpec(block_table=self.tables[slot], num_cached=start, num_query=len(ids), token_offset=0,
                       state_slot=slot)
        meta = build_attn_metadata([spec], num_tokens=len(ids), kv_block_size=self.kv_block_size)
        with torch.inference_mode():
            hidden, _ = self.model(torch.tensor(ids), torch.arange(start, start + len(ids)), meta, self.kv)
            return self.model.compute_logits(hidden)


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


# -- the recurrence: fast paths against the one-token loop ------------------------------------------------
def test_chunked_recurrence_and_conv_equal_their_slow_twins():
    g = torch.Generator().manual_seed(0)
    n, hk, hv, dk, dv = 150, 2, 4, 16, 8  # 150: two full blocks of 64 and a padded one
    q, k = torch.randn(n, hk, dk, generator=g), torch.randn(n, hk, dk, generator=g)
    v, gate = torch.randn(n, hv, dv, generator=g), -torch.rand(n, hv, generator=g)
    beta, state0 = torch.rand(n, hv, generator=g), torch.randn(hv, dk, dv, generator=g)
    q, k = prepare_qk(q, k, hv)
    out_tok, states = delta_rule_tokens(q, k, v, gate, beta, state0)
    out_chunk, last = delta_rule_chunked(q, k, v, gate, beta, state0)
    assert (out_chunk - out_tok).abs().max() < 1e-5 and (last - states[-1]).abs().max() < 1e-5
    # a window's states one by one: the state after token t of a window is the state after t one-token runs
    state = state0
    for t in range(6):
        _, one = delta_rule_tokens(q[t:t + 1], k[t:t + 1], v[t:t + 1], gate[t:t + 1], beta[t:t + 1], state)
        state = one[0]
        assert torch.equal(state, states[t])
    # two requests' windows at once (the engine's path for windows of one length) equal each run on its own
    both, both_states = delta_rule_tokens(torch.stack([q[:4], q[4:8]]), torch.stack([k[:4], k[4:8]]),
                                          torch.stack([v[:4], v[4:8]]), torch.stack([gate[:4], gate[4:8]]),
                                          torch.stack([beta[:4], beta[4:8]]), torch.stack([state0, states[3]]))
    for j, (a, b, init) in enumerate(((0, 4, state0), (4, 8, states[3]))):
        alone, alone_states = delta_rule_tokens(q[a:b], k[a:b], v[a:b], gate[a:b], beta[a:b], init)
        assert (both[j] - alone).abs().max() < 1e-6 and (both_states[j] - alone_states).abs().max() < 1e-6
    x, w, s = torch.randn(9, 5, generator=g), torch.randn(5, 4, generator=g), torch.randn(3, 5, generator=g)
    out, conv_states = causal_conv(x, s, w)
    full = torch.cat([s, x])
    for t in range(9):  # out_t = silu(sum_j w_j x_{t - 3 + j}); the state after t = the last 3 inputs
        assert torch.allclose(out[t], torch.nn.functional.silu((full[t:t + 4].t() * w).sum(-1)), atol=1e-6)
        assert torch.equal(conv_states[t], full[t + 1:t + 4])


# -- logits against transformers ---------------------------------------------------------------------------
def test_config_round_trips_and_unsupported_architectures_are_named():
    import transformers
    for cfg in CONFIGS.values():
        hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf())
        assert ModelConfig.from_hf(hf_cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="DeepseekV4ForCausalLM.*not supported"):
        ModelConfig.from_hf({"architectures": ["DeepseekV4ForCausalLM"]})  # before any field is read
    with pytest.raises(ValueError, match="linear_attention"):
        replace(TINY_QWEN3_5, architecture="Qwen3ForCausalLM")


def test_logits_match_hf_whole_chunked_windows_and_decode(pair):
    model, hf, cfg = pair
    ids = _ids(70, 1)  # longer than a 64-token block of the chunked recurrence
    ref = _hf_logits(hf, ids)
    st = Stepper(model, window=4, num_slots=4, max_len=80)
    whole = st.run(0, ids, 0)
    assert (whole - ref).abs().max() < ATOL
    chunked = torch.cat([st.run(1, ids[a:a + 20], a) for a in range(0, 70, 20)])  # chunks > the window
    assert (chunked - ref).abs().max() < ATOL
    mixed = [st.run(2, ids[:30], 0)]  # then windows of 4 (every state kept) and single tokens
    pos = 30
    for n in (4, 1, 3, 4, 1, 2, 4, 1, 4, 4, 4, 4, 4):
        mixed.append(st.run(2, ids[pos:pos + n], pos))
        pos += n
    assert (torch.cat(mixed) - ref[:pos]).abs().max() < ATOL


def test_a_window_rolls_back_to_the_accepted_position(pair):
    """A window of 4 where only j tokens are kept: the next step from position c + j reads the state after
    c + j - 1 and gives the logits (and the state) of plain one-token decoding, for every j."""
    model, hf, cfg = pair
    ids = _ids(40, 2)
    ref = _hf_logits(hf, ids)
    for j in range(1, 5):
        st = Stepper(model, window=4, num_slots=2)
        st.run(0, ids[:20], 0)
        wrong = [(t + 7) % 256 for t in ids[20 + j:24]]  # the rejected tail of the window
        st.run(0, ids[20:20 + j] + wrong, 20)
        after = st.run(0, ids[20 + j:30], 20 + j)
        assert (after - ref[20 + j:30]).abs().max() < ATOL, f"j={j}"
    # the state kept for the accepted position equals plain decoding's, on every linear layer
    st = Stepper(model, window=4, num_slots=1)
    st.run(0, ids[:20], 0)
    st.run(0, ids[20:22] + [5, 6], 20)  # j = 2 accepted
    spec_states = [(s.start(0, 22)) for s in model.states]
    plain = Stepper(model, window=1, num_slots=1)
    plain.run(0, ids[:20], 0)
    plain.run(0, ids[20:21], 20)
    plain.run(0, ids[21:22], 21)
    for (conv_a, rec_a), s in zip(spec_states, model.states):
        conv_b, rec_b = s.start(0, 22)
        if not cfg.num_experts and kernels.ops() is not None:  # the CPU kernels multiply each row on its own:
            assert torch.equal(conv_a, conv_b) and torch.equal(rec_a, rec_b)  # bit for bit
        else:  # torch's products (and a MoE expert's, over the rows routed to it) depend on the row count
            assert (conv_a - conv_b).abs().max() < 1e-6 and (rec_a - rec_b).abs().max() < 1e-6


def test_a_step_from_a_position_whose_state_was_not_kept_fails_loudly(pair):
    model, _, _ = pair
    st = Stepper(model, window=2, num_slots=1)
    st.run(0, _ids(10, 3), 0)
    with pytest.raises(RuntimeError, match="keeps no state after position 7"):
        st.run(0, [5], 8)  # a prompt chunk of 10 keeps the state after 9 only


def test_greedy_output_equals_generate(pair):
    model, hf, cfg = pair
    engine = make_engine(model, cfg, budget=16, prefix=False)  # prompts of up to 41 tokens: chunked
    prompts = _prompts(4)
    assert run(engine, prompts, greedy(10)) == [hf_greedy(hf, p, 10) for p in prompts]


def test_checkpoint_folders_load_the_same_logits(pair, tmp_path):
    """save_pretrained folders (Qwen3-Next's grouped projections, Qwen3.5's split ones) through the loader."""
    from dspark.models.loader import load_model
    model, hf, cfg = pair
    hf.save_pretrained(tmp_path)
    _copy_tokenizer(tmp_path)
    loaded, loaded_cfg, _ = load_model(tmp_path, dtype=torch.float32, device="cpu")
    assert loaded_cfg == cfg
    ids = _ids(30, 4)
    assert (Stepper(loaded, window=1, num_slots=1).run(0, ids, 0) - _hf_logits(hf, ids)).abs().max() < ATOL


def _copy_tokenizer(path) -> None:
    import shutil
    from tests.tiny_checkpoint import write_tiny_checkpoint
    src = write_tiny_checkpoint(path / "tok")
    for f in src.glob("tokenizer*"):
        shutil.copy(f, path / f.name)
    shutil.rmtree(src)


# -- speculation ---------------------------------------------------------------------------------------
class ScriptedDrafter(Drafter):
    """Proposes the target's own greedy continuation (`refs`: prompt + output) with round r's draft at position
    r % (K + 1) corrupted (K + 1: none), so windows end in a rejection at every position in turn."""

    def __init__(self, refs: list[list[int]], *, num_draft_tokens: int = 4):
        self.refs, self.num_draft_tokens, self.rounds = refs, num_draft_tokens, 0

    def propose(self, batch: ProposeBatch) -> DraftProposal:
        K, rows = self.num_draft_tokens, []
        for r in batch.requests:
            ref = next(x for x in self.refs if x[:len(r.all_ids)] == r.all_ids)
            drafts = (ref[r.anchor_pos + 1:r.anchor_pos + 1 + K] + [3] * K)[:K]
            bad = self.rounds % (K + 1)
            if bad < K:
                drafts[bad] = (drafts[bad] + 1) % 256
            self.rounds += 1
            rows.append(drafts)
        return DraftProposal(draft_ids=torch.tensor(rows), draft_probs=None, confidence=None)


def _tiny_draft_model(cfg: ModelConfig):
    draft_cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=cfg.vocab_size, hidden_size=32,
                            intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_ids=(2,))
    draft, _ = tiny_target(draft_cfg, seed=3)
    return draft


@pytest.mark.parametrize("drafter_kind", ["scripted", "ngram", "draft_model"])
def test_speculative_greedy_equals_plain(pair, drafter_kind):
    model, hf, cfg = pair
    prompts = _prompts(6)
    plain = run(make_engine(model, cfg, budget=16, prefix=False), prompts, greedy(16))
    if drafter_kind == "scripted":
        kw = {"drafter": ScriptedDrafter([p + o for p, o in zip(prompts, plain)]),
              "spec": SpecConfig(method="ngram", num_speculative_tokens=4)}
    elif drafter_kind == "ngram":
        kw = ngram_engine_args()
    else:
        kw = {"drafter": DraftModelDrafter(_tiny_draft_model(cfg), num_draft_tokens=3),
              "spec": SpecConfig(method="draft_model", model="tiny", num_speculative_tokens=3)}
    # prefix caching on (state snapshots: tests/test_hybrid_prefix_cache.py), a pool small enough to preempt
    engine = make_engine(model, cfg, budget=24, prefix=True, num_kv_blocks=24, **kw)
    assert engine.block_manager.enable_prefix_caching
    assert run(engine, prompts, greedy(16)) == plain
    if drafter_kind == "scripted":
        assert engine.metrics.num_preemptions > 0
        m = engine.metrics  # windows ended in rejections at every position: some accepted 0, 1, 2, 3 drafts
        assert 0 < m.num_accepted_tokens < m.num_draft_tokens and all(n > 0 for n in m.accepted_per_pos[:3])
    assert engine.block_manager.num_used_state_slots == 0
    assert engine.block_manager.num_free_blocks == len(engine.block_manager.blocks)


def test_aborts_mid_window_free_every_slot_and_block(pair):
    model, hf, cfg = pair
    prompts = _prompts(8)
    plain = run(make_engine(model, cfg, budget=16, prefix=False), prompts, greedy(12))
    engine = make_engine(model, cfg, budget=32, prefix=False, max_num_seqs=4,
                         drafter=ScriptedDrafter([p + o for p, o in zip(prompts, plain)]),
                         spec=SpecConfig(method="ngram", num_speculative_tokens=4))
    bm = engine.block_manager
    for rnd in range(3):  # a soak: requests abort at several steps while others finish
        ids = [engine.add_request(p, greedy(12)) for p in prompts]
        outs: dict[str, list[int]] = {i: [] for i in ids}
        step = 0
        while engine.has_unfinished():
            for o in engine.step():
                outs[o.request_id] += o.new_token_ids
            step += 1
            if step == 2 + rnd:
                for rid in ids[rnd::3]:
                    engine.abort(rid)
            assert bm.num_used_state_slots <= 4
        for i, rid in enumerate(ids):
            if rid not in ids[rnd::3]:
                assert outs[rid] == plain[i]
        assert bm.num_used_state_slots == 0 and bm.num_free_blocks == len(bm.blocks)
        bm.check_invariants()


def test_sampled_law_under_speculation_matches_the_target():
    """Seeded sampling at temperature 0.7 through a draft model: the joint law of the first two tokens
    (the second one verified against drafts) matches the target's; the same samples fail against the law
    at another temperature (the check can fail)."""
    cfg = TINY_QWEN3_5
    model, hf = tiny_target(cfg, seed=5)
    with torch.no_grad():  # a peaked head: the likeliest first tokens carry most of the mass
        hf.lm_head.weight.mul_(6.0)
        model.lm_head.weight.mul_(6.0)
    prompt, t = _ids(12, 6), 0.7
    top, law = two_token_law(hf, prompt, t)
    engine = make_engine(model, cfg, budget=256, prefix=False, max_num_seqs=64,
                         drafter=DraftModelDrafter(_tiny_draft_model(cfg), num_draft_tokens=2),
                         spec=SpecConfig(method="draft_model", model="tiny", num_speculative_tokens=2,
                                         draft_sample_method="probabilistic"))
    samples = two_token_samples(engine, prompt, 3000, top, t)
    assert_matches_distribution(samples, law, what="hybrid target, draft-model speculation")
    _, hotter = two_token_law(hf, prompt, 1.0)
    assert_differs_from_distribution(samples, hotter, what="the law at temperature 1.0")


# -- refusals ------------------------------------------------------------------------------------------
def test_what_cannot_run_is_refused_by_name():
    from dspark.drafters.draft_model import check, check_draft_config
    with pytest.raises(ValueError, match="draft_num_layers.*hybrid Qwen3_5ForCausalLM"):
        check(SpecConfig(method="draft_model", draft_num_layers=2), TINY_QWEN3_5)
    with pytest.raises(ValueError, match="hybrid draft model"):
        check_draft_config(TINY_QWEN3_5, TINY_QWEN3_5)
    from dspark.engine.build import _check_tensor_parallel
    from dspark.config import EngineConfig, ParallelConfig
    with pytest.raises(ValueError, match="tensor parallelism over the hybrid Qwen3_5ForCausalLM"):
        _check_tensor_parallel(EngineConfig(model="x", parallel=ParallelConfig(tensor_parallel_size=2)), "float32",
                               TINY_QWEN3_5)
    model = build_model(TINY_QWEN3_5)
    with pytest.raises(ValueError, match="state slots are not allocated"):
        model(torch.tensor([5]), torch.tensor([0]), None, [None])


def test_served_disconnects_free_the_state_slots():
    """A hybrid target behind the server: streams closed mid-generation leave no state slot, KV block or
    request behind (/metrics), and a completion after them equals the offline one."""
    from tests.server_harness import TINY, CharTokenizer, serve, slowed
    from tests.test_aborts import _open_and_close
    cfg = replace(TINY_QWEN3_5, vocab_size=TINY.vocab_size, max_position_embeddings=256)
    model, _ = tiny_target(cfg, seed=7)
    offline = run(make_engine(model, cfg, prefix=False), [CharTokenizer().encode("state")], greedy(6))[0]
    engine = slowed(make_engine(model, cfg, prefix=False, max_num_seqs=2, budget=16, **ngram_engine_args()), 0.02)
    with serve(engine) as srv:
        for content in ("first", "s" * 60):
            _open_and_close(srv, {"model": "tiny", "stream": True, "max_tokens": 40, "ignore_eos": True,
                                  "messages": [{"role": "user", "content": content}]}, 0.2)
        srv.wait_idle()
        m = srv.metrics()
        assert m[("vllm:num_state_slots", ())] == 2
        assert m[("vllm:num_state_slots_used", ())] == 0 and m[("vllm:kv_cache_usage_perc", ())] == 0
        out = srv.post("/v1/completions", json={"model": "tiny", "prompt": "state", "max_tokens": 6,
                                                "temperature": 0, "ignore_eos": True}).json()
        assert CharTokenizer().encode(out["choices"][0]["text"]) == offline


def test_the_step_profiler_prices_a_hybrid_step(pair):
    """`dspark profile` / cost_table "auto" on a hybrid target: verification steps of 1 to 32 tokens time
    (windows start where no state was computed: the profiler claims it, the values are never read)."""
    from dspark.engine.step_profiler import profile_engine
    model, _, cfg = pair
    engine = make_engine(model, cfg, prefix=False, max_num_seqs=8, **ngram_engine_args())
    table = profile_engine(engine, token_counts=(1, 8, 32), draft_num_reqs=(1,), context_len=24, repeats=1,
                           warmup=0)
    assert all(table.step_seconds(n) > 0 for n in (1, 8, 32)) and table.draft_seconds_for(1) > 0
    assert engine.block_manager.num_used_state_slots == 0


def test_a_multimodal_qwen3_5_folder_serves_its_text_decoder(tmp_path, caplog):
    """`Qwen3_5ForConditionalGeneration` (vision tower, `model.language_model.*`): the text decoder loads, its
    logits equal transformers' text-only forward of the whole model, the vision tensors are skipped with a log line."""
    import logging
    import transformers
    from dspark.models.loader import load_model
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, out_hidden_size=64,
                  temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=TINY_QWEN3_5.to_hf(), vision_config=vision)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    _copy_tokenizer(tmp_path)
    with caplog.at_level(logging.INFO, logger="dspark.models.qwen3_next"):
        model, cfg, _ = load_model(tmp_path)
    assert cfg == TINY_QWEN3_5 and "vision tower" in caplog.text
    ids = _ids(30, 9)
    assert (Stepper(model, window=1, num_slots=1).run(0, ids, 0) - _hf_logits(hf, ids)).abs().max() < ATOL


def test_training_features_of_a_hybrid_target(pair):
    """`prepare-data` / `dspark train` feature passes over a hybrid target: a batch of padded sequences gives each
    sequence's taps as a run of its own does (a state slot per sequence for the pass; the engine's slots kept)."""
    from dspark.train.features import _flat_features
    model, _, cfg = pair
    st = Stepper(model, window=2, num_slots=1)
    engine_states = model.states
    ids = torch.tensor([_ids(24, 10), _ids(17, 11) + [0] * 7])
    taps, _ = _flat_features(model, ids, [24, 17], (0, 2))
    assert model.states is engine_states
    for i, n in enumerate((24, 17)):
        spec = SeqSpec(block_table=st.tables[0], num_cached=0, num_query=n, token_offset=0, state_slot=0)
        with torch.inference_mode():
            _, alone = model(ids[i, :n], torch.arange(n), build_attn_metadata([spec], num_tokens=n, kv_block_size=8),
                             st.kv, tap_layer_ids=(0, 2))
        rows = taps[:24] if i == 0 else taps[24:]
        assert (rows - alone).abs().max() < 1e-5
