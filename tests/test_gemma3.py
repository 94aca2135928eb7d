"""Gemma 3 on tiny random configs against transformers' Gemma3ForCausalLM (fp32, eager attention) with a
small sliding window, so prompts cross it and local layers differ from global ones: logits and taps of
one-shot and chunked prefill, verify-window steps and decode, with the CPU kernels and through torch;
greedy output of the engine on 10 prompts; greedy speculative output equal to plain for the n-gram,
draft-model and n-gram-first draft-model drafters with prefix caching and forced preemption; the
sliding-window metadata against a dense mask."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dspark import kernels
from dspark.config import SpecConfig
from dspark.drafters import build_drafter
from dspark.drafters.ngram import NgramDrafter
from dspark.llm import LLM
from dspark.models.attention import SeqSpec, build_attn_metadata, sliding_window_metadata
from dspark.models.config import ModelConfig
from tests.conftest import GEMMA3_WINDOW as WINDOW, TINY_GEMMA3, PagedKV, hf_twin
from tests.engine_helpers import greedy, hf_greedy, make_engine, run, run_one_at_a_time, tiny_target

ATOL = 1e-4


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


@pytest.fixture(params=[True, False], ids=["kernels", "torch"])
def cpu_kernels(request, monkeypatch):
    if not request.param:  # the slow twin: every op through torch
        monkeypatch.setattr(kernels, "ops", lambda: None)
    elif kernels.ops() is None:
        pytest.skip("CPU kernels unavailable")
    return request.param


def test_config_round_trips_through_hf_and_rejects_bad_layers():
    import transformers
    hf_cfg = transformers.AutoConfig.for_model(**TINY_GEMMA3.to_hf())
    assert ModelConfig.from_hf(hf_cfg.to_dict()) == TINY_GEMMA3
    assert TINY_GEMMA3.attention_scale == 24.0 ** -0.5
    with pytest.raises(ValueError, match="sliding_window"):
        replace(TINY_GEMMA3, sliding_window=None)
    with pytest.raises(ValueError, match="layer_types"):
        replace(TINY_GEMMA3, layer_types=("sliding_attention",))


@pytest.mark.parametrize("kv_block_size", [4, 16])
def test_prefill_logits_and_taps_match_hf(kv_block_size, cpu_kernels):
    hf = hf_twin(TINY_GEMMA3)
    model, _ = tiny_target(TINY_GEMMA3)
    ids = _ids(41, 1)  # > 5 windows
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    kv = PagedKV.create(model, num_requests=1, max_len=len(ids), kv_block_size=kv_block_size)
    taps_ids = (-1, 0, 2)
    hidden, taps = kv.step(model, [(ids, 0)], tap_layer_ids=taps_ids)
    err = (model.compute_logits(hidden) - out.logits[0]).abs().max().item()
    assert err < ATOL, f"prefill logits differ from HF by {err:.2e}"
    H = TINY_GEMMA3.hidden_size
    for j, layer_id in enumerate(taps_ids):
        err = (taps[:, j * H:(j + 1) * H] - out.hidden_states[layer_id + 1][0]).abs().max().item()
        assert err < ATOL, f"tap {layer_id} differs from HF hidden_states[{layer_id + 1}] by {err:.2e}"


def test_the_window_matters():
    """The same weights with a window longer than the prompt give other logits: the local layers'
    window is in effect (the parity above is not vacuous)."""
    hf = hf_twin(TINY_GEMMA3)
    wide = hf_twin(replace(TINY_GEMMA3, sliding_window=64))
    wide.load_state_dict(hf.state_dict())
    ids = _ids(30, 2)
    assert (_hf_logits(hf, ids)[WINDOW:] - _hf_logits(wide, ids)[WINDOW:]).abs().max() > 1e-2
    assert torch.allclose(_hf_logits(hf, ids)[:WINDOW], _hf_logits(wide, ids)[:WINDOW], atol=ATOL)


@pytest.mark.parametrize("trim", [True, False], ids=["trimmed", "mask_only"])
def test_chunked_prefill_verify_windows_and_decode_match_one_shot(cpu_kernels, trim, monkeypatch):
    """Two requests share steps: prompt chunks (one > 16 tokens: a group of its own), 4-token
    verify-style windows whose positions straddle a window boundary, and decodes; the local layers'
    slot rows trimmed to the windows (CPU) or masked only (the form CUDA graphs capture)."""
    import functools

    from dspark.models import gemma3
    monkeypatch.setattr(gemma3, "sliding_window_metadata",
                        functools.partial(sliding_window_metadata, trim=trim))
    hf = hf_twin(TINY_GEMMA3, seed=3)
    model, _ = tiny_target(TINY_GEMMA3, seed=3)
    a, b = _ids(40, 4), _ids(36, 5)
    kv = PagedKV.create(model, num_requests=2, max_len=40, kv_block_size=4, seed=5)
    rows_a, rows_b = [], []
    plan = [((0, 19), (0, 3)), ((19, 23), (3, 22)), ((23, 27), (22, 26)), ((27, 30), (26, 27))]
    plan += [((t, t + 1), (t - 3, t - 2)) for t in range(30, 40)]
    for (a0, a1), (b0, b1) in plan:
        h, _ = kv.step(model, [(a[a0:a1], a0), (b[b0:b1], b0)])
        rows_a.append(h[:a1 - a0])
        rows_b.append(h[a1 - a0:])
    for rows, ids, name in ((rows_a, a, "A"), (rows_b, b, "B")):
        logits = model.compute_logits(torch.cat(rows))
        err = (logits - _hf_logits(hf, ids)[:logits.shape[0]]).abs().max().item()
        assert err < ATOL, f"request {name}: chunked logits differ from HF by {err:.2e}"


@pytest.mark.parametrize("inference", [False, True], ids=["grad_mode", "inference_mode"])
def test_one_call_stack_equals_the_layer_modules_bit_for_bit(inference):
    """`kernels.block_layers` (every decoder layer of a few-row step in one call) against the per-layer
    modules on the same steps: two requests' prompt chunks, verify-style windows of 2-8 rows and decodes
    past the sliding window, with taps; hidden states and taps bit for bit, and the stack did run. Two threads
    split each step's rows for the row-wise work, under torch.inference_mode (as the engine runs) and without."""
    if kernels.ops() is None or not kernels.ops().has_quant:
        pytest.skip("CPU kernels unavailable")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode(inference):
            _one_call_stack_equals_the_layer_modules()
    finally:
        torch.set_num_threads(threads)


def _one_call_stack_equals_the_layer_modules():
    model, _ = tiny_target(TINY_GEMMA3, seed=7)
    a, b = _ids(44, 8), _ids(40, 9)
    plan = [((0, 6), (0, 5)), ((6, 14), (5, 7)), ((14, 17), (7, 15))]
    plan += [((t, t + 1), (t - 2, t - 1)) for t in range(17, 30)] + [((30, 37), (28, 33)), ((37, 44), (33, 40))]
    results = {}
    for mode in ("modules", "stack"):
        model._block_stack_list = False if mode == "modules" else None
        kv = PagedKV.create(model, num_requests=2, max_len=44, kv_block_size=4, seed=6)
        results[mode] = [kv.step(model, [(a[a0:a1], a0), (b[b0:b1], b0)], tap_layer_ids=(-1, 1, 3))
                         for (a0, a1), (b0, b1) in plan]
    assert isinstance(model._block_stack_list, tuple)  # built, so every step above ran through the kernel
    for (h0, t0), (h1, t1) in zip(results["modules"], results["stack"]):
        assert torch.equal(h0, h1) and torch.equal(t0, t1)


@pytest.mark.parametrize("trim", [True, False], ids=["trimmed", "mask_only"])
def test_window_metadata_equals_dense_sliding_mask(trim):
    """Every query of a verify window, a prompt chunk and a decode reads exactly keys
    (p - window, p] (as transformers' sliding mask), through both the masked rows and the per-query
    rows the kernel reads; the untrimmed form (no host sync, for CUDA graphs) masks the same keys."""
    seqs = [SeqSpec(block_table=[3, 0, 5, 7, 2, 9], num_cached=13, num_query=4, token_offset=0),
            SeqSpec(block_table=[1, 4, 6, 8, 10, 11], num_cached=0, num_query=21, token_offset=4),
            SeqSpec(block_table=[12, 13], num_cached=5, num_query=1, token_offset=25)]
    meta = sliding_window_metadata(build_attn_metadata(seqs, num_tokens=26, kv_block_size=4), WINDOW, trim=trim)
    seen: dict[int, list[int]] = {}
    for g in meta.groups:
        mask = g.mask if g.mask is not None else torch.ones(*g.key_limit.shape, g.kv_slots.shape[1], dtype=torch.bool)
        mask = mask.reshape(*g.key_limit.shape, -1) if mask.dim() == 4 else mask
        for s in range(g.token_index.shape[0]):
            for j in range(g.token_index.shape[1]):
                if g.key_limit[s, j] > 0:
                    seen[int(g.token_index[s, j])] = g.kv_slots[s][mask[s, j]].tolist()
        if g.key_start is not None:
            tok, lim, slots = g.query_rows
            for r in range(tok.shape[0]):
                assert slots[r, :lim[r, 0]].tolist() == seen[int(tok[r, 0])]
    for s in seqs:
        for j in range(s.num_query):
            p = s.num_cached + j
            want = [s.block_table[k // 4] * 4 + k % 4 for k in range(max(0, p + 1 - WINDOW), p + 1)]
            assert seen[s.token_offset + j] == want, (s, j)


def test_engine_greedy_equals_hf_on_10_prompts():
    model, hf = tiny_target(TINY_GEMMA3)
    engine = make_engine(model, TINY_GEMMA3, budget=16)
    prompts = [_ids(n, 10 + n) for n in (3, 7, 8, 9, 15, 16, 17, 25, 33, 40)]
    ours = run_one_at_a_time(engine, prompts, greedy(20))
    for p, o in zip(prompts, ours):
        assert o == hf_greedy(hf, p, 20), len(p)
    assert engine.block_manager.num_free_blocks == 256


def _looping_prompts(n: int, *, seed: int) -> list[list[int]]:
    """Prompts longer than the window with repeats (lookup drafts get accepted) and shared prefixes
    (prefix-cache hits)."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 256, (12,), generator=g).tolist()
    out = []
    for i in range(n):
        motif = torch.randint(3, 256, (6,), generator=g).tolist()
        out.append((shared if i % 2 == 0 else []) + (motif * 5)[:20 + i] + _ids(4 + i, seed + i))
    return out


def _drafter(method: str, model):
    if method == "ngram":
        spec = SpecConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
        return spec, NgramDrafter(num_draft_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
    layers = TINY_GEMMA3.num_hidden_layers if method == "draft_model_all" else 2
    spec = SpecConfig(method="draft_model", draft_num_layers=layers, num_speculative_tokens=4,
                      ngram_first=method == "draft_model_ngram_first", prompt_lookup_min=1, prompt_lookup_max=3)
    return spec, build_drafter(spec, target_config=TINY_GEMMA3, target_model=model, dtype=torch.float32,
                               device="cpu")


@pytest.mark.parametrize("method", ["ngram", "draft_model", "draft_model_all", "draft_model_ngram_first"])
def test_speculative_greedy_equals_plain_with_prefix_cache_and_preemption(method):
    model, _ = tiny_target(TINY_GEMMA3, seed=7)
    prompts = _looping_prompts(6, seed=8)
    plain = run_one_at_a_time(make_engine(model, TINY_GEMMA3, prefix=False), prompts, greedy(24))
    spec, drafter = _drafter(method, model)
    # 36 blocks of 4 slots for 6 requests of up to ~60 tokens: preemption is forced; budget 20: chunking
    engine = make_engine(model, TINY_GEMMA3, drafter=drafter, spec=spec, num_kv_blocks=36, budget=20)
    outs = run(engine, prompts, greedy(24))
    assert outs == plain
    m = engine.metrics
    assert m.num_preemptions > 0, "the small pool must force preemption"
    assert m.num_accepted_tokens > 0, "drafts must get accepted"
    if method == "draft_model_all":  # the drafter is the target (windows included): every draft accepted
        assert m.num_accepted_tokens == m.num_draft_tokens
    # the last request's blocks were freed last: a prefix hit over more than two windows
    again = LLM(engine=engine, tokenizer=None).generate([prompts[-1]], greedy(24))[0]
    assert again.num_cached_tokens >= 2 * WINDOW and again.token_ids == plain[-1]
    assert engine.block_manager.num_free_blocks == 36
    engine.block_manager.check_invariants()


def test_hf_safetensors_folder_loads(tmp_path):
    """An HF Gemma3ForCausalLM folder (transformers' own save_pretrained: config.json + safetensors)
    gives the same config and logits."""
    from dspark.models import build_model
    from dspark.models.loader import SafetensorsSource, read_model_config
    hf = hf_twin(TINY_GEMMA3, seed=11)
    hf.save_pretrained(tmp_path)
    assert read_model_config(tmp_path) == TINY_GEMMA3
    source = SafetensorsSource(tmp_path)
    model = build_model(source.config)
    with torch.inference_mode():
        model.load_weights(source.weights())
    ids = _ids(20, 12)
    kv = PagedKV.create(model, num_requests=1, max_len=len(ids), kv_block_size=4)
    hidden, _ = kv.step(model, [(ids, 0)])
    assert (model.compute_logits(hidden) - _hf_logits(hf, ids)).abs().max().item() < ATOL


def test_dspark_drafter_for_gemma_starts_from_the_norm_it_applies_and_is_lossless(tmp_path):
    """A DSpark drafter built for a Gemma target by the trainer: its final norm starts at the factor the
    target's norm applies (1 + weight, not the stored weight), a warm start from Gemma's layers is refused, and
    greedy speculative output equals plain with the exported drafter."""
    from dspark.drafters.dspark import build as build_dspark
    from dspark.train import methods
    from dspark.train.config import TrainConfig

    model, _ = tiny_target(TINY_GEMMA3, seed=5)
    cfg = TrainConfig(method="dspark", num_draft_layers=2, block_size=4, tap_layer_ids=(0, 2), markov_rank=8,
                      draft_vocab_size=None)
    drafter, dcfg = methods.build(cfg, model, TINY_GEMMA3, None)
    assert torch.equal(drafter.norm.weight, model.model.norm.scale)
    assert not torch.equal(drafter.norm.weight, model.model.norm.weight)
    with pytest.raises(ValueError, match="not the drafter's"):
        methods.build(TrainConfig(**{**cfg.__dict__, "warm_start": "target"}), model, TINY_GEMMA3, None)
    methods.export_block_drafter(drafter, dcfg, tmp_path / "drafter")
    prompts = _looping_prompts(4, seed=2)
    plain = run(make_engine(model, TINY_GEMMA3), prompts, greedy(20))
    spec = SpecConfig(method="dspark", model=str(tmp_path / "drafter"), num_speculative_tokens=4)
    dspark = build_dspark(spec, target_config=TINY_GEMMA3, target_model=model, dtype=torch.float32, device="cpu")
    engine = make_engine(model, TINY_GEMMA3, drafter=dspark, spec=spec, budget=20)
    assert run(engine, prompts, greedy(20)) == plain
    assert engine.metrics.num_draft_tokens > 0


def test_rope_frequencies_stay_fp32_when_the_model_is_converted():
    """`.to(bfloat16)` converts the weights; the global and local RoPE frequencies stay fp32 (as HF computes
    them), so a bf16 model's cos/sin are the fp32 values rounded once."""
    from dspark.models.gemma3 import GemmaRotary
    rotary = GemmaRotary(TINY_GEMMA3, device="cpu")
    positions = torch.arange(0, 4000, 37)
    want = {kind: rotary.lookup(positions, kind, torch.float32) for kind in ("sliding_attention", "full_attention")}
    rotary.to(torch.bfloat16)
    assert rotary.inv_freq_global.dtype == rotary.inv_freq_local.dtype == torch.float32
    for kind, (cos, sin) in want.items():
        got_cos, got_sin = rotary.lookup(positions, kind, torch.bfloat16)
        assert torch.equal(got_cos, cos.bfloat16()) and torch.equal(got_sin, sin.bfloat16())
