"""Gemma 4 (`dspark.models.gemma4`) on two tiny random configs against transformers' Gemma4ForCausalLM (fp32,
eager attention): a dense one with sliding and full layers of different head sizes, proportional RoPE, K = V full
layers, KV shared by the last three layers (the pool holds 4 of 7 layers), per-layer inputs and the double-wide
MLP; a MoE one (router + experts beside the dense MLP, untied head, default RoPE on the full layers). Logits over
prompts longer than the sliding window, run whole, in chunks, in 4-token windows and one token at a time through the
paged pool (CPU kernels, torch, masked-only windows); a wrong KV owner or a dropped per-layer input breaks that
comparison; greedy output equal to `generate()`; speculative greedy output equal to plain (a scripted drafter that
rejects at every window position in turn, n-gram, a tiny Llama draft model) with prefix caching and forced
preemption; a chi-square test of the sampled law under speculation; text-only and multimodal checkpoint folders
through the loader; what is refused, by name.

    pytest tests/test_gemma4.py -q
"""

from __future__ import annotations

import functools
import itertools
import random
from dataclasses import replace

import pytest
import torch

from dspark import kernels
from dspark.config import SpecConfig
from dspark.drafters.base import DraftProposal, Drafter, ProposeBatch
from dspark.drafters.draft_model import DraftModelDrafter
from dspark.llm import LLM
from dspark.models import build_model
from dspark.models import gemma4
from dspark.models.attention import SeqSpec, build_attn_metadata, sliding_window_metadata
from dspark.models.config import ModelConfig
from tests.engine_helpers import (greedy, hf_greedy, make_engine, ngram_engine_args, run, two_token_law,
                                  two_token_samples)
from tests.stat_checks import assert_differs_from_distribution, assert_matches_distribution

ATOL = 1e-4
WINDOW = 8
S, F = "sliding_attention", "full_attention"
DENSE = ModelConfig(
    architecture="Gemma4ForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=7,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
    rope_scaling={"rope_type": "proportional", "partial_rotary_factor": 0.25}, max_position_embeddings=512,
    tie_word_embeddings=True, qk_norm=True, bos_token_id=2, eos_token_ids=(1,), hidden_activation="gelu_pytorch_tanh",
    layer_types=(S, F, S, S, F, S, F), sliding_window=WINDOW, rope_local_theta=10_000.0, query_pre_attn_scalar=1.0,
    final_logit_softcapping=30.0, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
    num_kv_shared_layers=3, hidden_size_per_layer_input=8, vocab_size_per_layer_input=256, use_double_wide_mlp=True)
MOE = replace(DENSE, num_hidden_layers=5, layer_types=(S, F, S, S, F), rope_scaling=None, tie_word_embeddings=False,
              final_logit_softcapping=None, num_global_key_value_heads=2, attention_k_eq_v=False, num_kv_shared_layers=0,
              hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, use_double_wide_mlp=False, num_experts=6,
              num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
CONFIGS = {"dense": DENSE, "moe": MOE}


def hf_gemma4(cfg: ModelConfig, *, seed: int = 0, multimodal: dict | None = None):
    """transformers' Gemma4ForCausalLM (or, with `multimodal` vision / audio configs, Gemma4ForConditionalGeneration)
    for `cfg`, fp32, eager, with non-trivial norms, router scales and layer scalars (so a missed one shows) and a
    final norm 4x as large (peaked logits)."""
    import transformers
    torch.manual_seed(seed)
    if multimodal is None:
        hf = transformers.Gemma4ForCausalLM(transformers.AutoConfig.for_model(**cfg.to_hf()))
    else:
        hf = transformers.Gemma4ForConditionalGeneration(transformers.Gemma4Config(text_config=cfg.to_hf(),
                                                                                   **multimodal))
    hf.config._attn_implementation = "eager"
    hf.config.get_text_config()._attn_implementation = "eager"
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or "scale" in name:
                p.add_(0.2 * torch.randn_like(p))
        for name, b in hf.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(1.0 + 0.3 * torch.randn_like(b))
        (hf.model.language_model if multimodal else hf.model).norm.weight.mul_(4.0)
    return hf.eval()


def target(cfg: ModelConfig, *, seed: int = 0):
    hf = hf_gemma4(cfg, seed=seed)
    model = build_model(cfg)
    with torch.inference_mode():
        model.load_weights(hf.state_dict().items())
    return model, hf


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request):
    return target(CONFIGS[request.param]) + (CONFIGS[request.param],)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


class Pool:
    """A paged pool with one entry per layer owning K/V (`kv_layer_specs`), shuffled block tables, unwritten slots
    NaN (a stray read shows) except block 0, the padding target of the metadata."""

    def __init__(self, model, *, num_requests: int, max_len: int, kv_block_size: int = 4, seed: int = 0) -> None:
        per = -(-max_len // kv_block_size)
        blocks = list(range(num_requests * per + 3))
        random.Random(seed).shuffle(blocks)
        self.tables = [blocks[i * per:(i + 1) * per] for i in range(num_requests)]
        self.kv_block_size = kv_block_size
        self.caches = [tuple(torch.full((len(blocks), kv_block_size, h, d), float("nan")) for _ in "kv")
                       for h, d in model.kv_layer_specs()]
        for k, v in self.caches:
            k[0].zero_()
            v[0].zero_()

    def step(self, model, chunks: list[tuple[list[int], int]], tap_layer_ids=()):
        """chunks[r] = (new ids of request r, its cached count) -> (logits [rows, vocab], taps)."""
        seqs, ids, pos = [], [], []
        for r, (tokens, cached) in enumerate(chunks):
            if tokens:
                seqs.append(SeqSpec(block_table=self.tables[r], num_cached=cached, num_query=len(tokens),
                                    token_offset=len(ids)))
                ids += tokens
                pos += range(cached, cached + len(tokens))
        meta = build_attn_metadata(seqs, num_tokens=len(ids), kv_block_size=self.kv_block_size)
        with torch.inference_mode():
            hidden, taps = model(torch.tensor(ids), torch.tensor(pos), meta, self.caches, tap_layer_ids=tap_layer_ids)
            return model.compute_logits(hidden), taps


def _run_plan(model, prompts: list[list[int]], sizes: list[int]) -> list[torch.Tensor]:
    """Every prompt cut into pieces of `sizes` (repeated), the requests' pieces sharing steps -> their logits."""
    pool = Pool(model, num_requests=len(prompts), max_len=max(map(len, prompts)), seed=len(sizes))
    cuts = []
    for p in prompts:
        bounds = itertools.accumulate(itertools.cycle(sizes))  # endless: cut where the prompt ends
        cuts.append([0, *itertools.takewhile(lambda b: b < len(p), bounds), len(p)])
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    for step in range(max(map(len, cuts)) - 1):
        chunks = [(p[c[step]:c[step + 1]], c[step]) if step + 1 < len(c) else ([], 0) for p, c in zip(prompts, cuts)]
        logits, _ = pool.step(model, chunks)
        start = 0
        for r, (tokens, _) in enumerate(chunks):
            rows[r].append(logits[start:start + len(tokens)])
            start += len(tokens)
    return [torch.cat(r) for r in rows]


# -- config -------------------------------------------------------------------------------------------
def test_config_round_trips_and_the_pool_holds_only_distinct_layers():
    import transformers
    for cfg in CONFIGS.values():
        hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf())
        assert ModelConfig.from_hf(hf_cfg.to_dict()) == cfg
    # the global_head_dim form (no per_layer_config) reads the same
    legacy = {k: v for k, v in DENSE.to_hf().items() if k != "per_layer_config"}
    assert ModelConfig.from_hf({**legacy, "global_head_dim": 32, "num_global_key_value_heads": 1}) == DENSE
    model = build_model(DENSE, device="meta")
    modes = transformers.AutoConfig.for_model(**DENSE.to_hf()).kv_sharing_modes
    assert model.num_kv_layers == 4 < DENSE.num_hidden_layers
    assert model.cache_index == [0, 1, 2, 3, 1, 3, 1]  # the last earlier layer of each kind
    assert {i for i, m in enumerate(modes) if m == "store"} == {1, 3}  # transformers' producers
    assert model.kv_layer_specs() == [(2, 16), (1, 32), (2, 16), (2, 16)]
    engine = make_engine(target(DENSE)[0], DENSE)
    assert [tuple(k.shape[2:]) for k, _ in engine.runner.kv_caches] == model.kv_layer_specs()
    shared = model.model.layers[5].self_attn
    assert not hasattr(shared, "k_norm") and list(shared.qkv_proj.shard_rows) == ["q"]
    assert list(model.model.layers[1].self_attn.qkv_proj.shard_rows) == ["q", "k"]  # K = V: no v_proj


# -- logits ------------------------------------------------------------------------------------------
@pytest.fixture(params=["kernels", "torch", "masked"])
def cpu_kernels(request, monkeypatch):
    """The CPU kernels; every op through torch; torch with the sliding layers' slot rows masked, not trimmed
    (the no-host-sync form a CUDA graph captures)."""
    if request.param != "kernels":
        monkeypatch.setattr(kernels, "ops", lambda: None)
    elif kernels.ops() is None:
        pytest.skip("CPU kernels unavailable")
    if request.param == "masked":
        monkeypatch.setattr(gemma4, "sliding_window_metadata", functools.partial(sliding_window_metadata, trim=False))
    return request.param


@pytest.mark.parametrize("sizes", [[64], [11, 9], [4], [1]], ids=["whole", "chunks", "windows", "tokens"])
def test_logits_match_hf_whole_chunked_windows_and_one_token_at_a_time(pair, sizes, cpu_kernels):
    model, hf, cfg = pair
    prompts = [_ids(30, 1), _ids(27, 2)]  # > 3 windows; the two requests share every step
    for ours, p in zip(_run_plan(model, prompts, sizes), prompts):
        err = (ours - _hf_logits(hf, p)).abs().max().item()
        assert err < ATOL, f"logits differ from HF by {err:.2e} ({sizes})"


def test_taps_match_hf_hidden_states(pair):
    model, hf, cfg = pair
    ids = _ids(20, 3)
    with torch.no_grad():
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    _, taps = Pool(model, num_requests=1, max_len=20).step(model, [(ids, 0)], tap_layer_ids=(-1, 1, 3))
    H = cfg.hidden_size
    for j, layer in enumerate((-1, 1, 3)):
        assert (taps[:, j * H:(j + 1) * H] - states[layer + 1][0]).abs().max() < ATOL, layer


def test_wrong_kv_sharing_or_a_dropped_per_layer_input_breaks_parity(monkeypatch):
    """The parity above can fail: a shared layer reading another sliding layer's K/V, or no per-layer input."""
    model, hf = target(DENSE, seed=4)
    ids = _ids(30, 5)
    want = _hf_logits(hf, ids)

    def err() -> float:
        return (_run_plan(model, [ids], [7])[0] - want).abs().max().item()

    assert err() < ATOL
    monkeypatch.setattr(model, "cache_index", [0, 1, 2, 3, 1, 2, 1])  # layer 5 reads layer 2, not 3
    assert err() > 1e-2
    monkeypatch.undo()
    monkeypatch.setattr(model.model, "per_layer_inputs", lambda ids, x: torch.zeros(x.shape[0], 7, 8))
    assert err() > 1e-2


# -- the engine ----------------------------------------------------------------------------------------
def test_greedy_output_equals_generate(pair):
    model, hf, cfg = pair
    engine = make_engine(model, cfg, budget=16)  # prompts of up to 33 tokens: chunked prefill
    prompts = [_ids(n, 10 + n) for n in (3, 9, 20, 33)]
    assert run(engine, prompts, greedy(12)) == [hf_greedy(hf, p, 12) for p in prompts]
    assert engine.block_manager.num_free_blocks == 256


def _looping_prompts(n: int, *, seed: int) -> list[list[int]]:
    """Prompts longer than the window with repeats (drafts get accepted) and shared prefixes (prefix-cache hits)."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 256, (12,), generator=g).tolist()
    out = []
    for i in range(n):
        motif = torch.randint(3, 256, (6,), generator=g).tolist()
        out.append((shared if i % 2 == 0 else []) + (motif * 5)[:20 + i] + _ids(4 + i, seed + i))
    return out


def _tiny_draft_model(cfg: ModelConfig, seed: int = 3):
    """A one-layer Llama with the target's vocabulary (a layer view of Gemma 4 is refused)."""
    from tests.conftest import hf_twin
    draft_cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=cfg.vocab_size, hidden_size=32,
                            intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=16, max_position_embeddings=512, bos_token_id=2, eos_token_ids=(1,))
    draft = build_model(draft_cfg)
    with torch.inference_mode():
        draft.load_weights(hf_twin(draft_cfg, seed=seed).state_dict().items())
    return draft


class ScriptedDrafter(Drafter):
    """Proposes the target's own greedy continuation (`refs`: prompt + output) with the n-th proposal's draft at
    position n % (K + 1) corrupted (K + 1: none), so windows end in a rejection at every position in turn."""

    def __init__(self, refs: list[list[int]], *, num_draft_tokens: int = 4) -> None:
        self.refs, self.num_draft_tokens, self.calls = refs, num_draft_tokens, 0

    def propose(self, batch: ProposeBatch) -> DraftProposal:
        K, rows = self.num_draft_tokens, []
        for r in batch.requests:
            ref = next(x for x in self.refs if x[:len(r.all_ids)] == r.all_ids)
            drafts = (ref[r.anchor_pos + 1:r.anchor_pos + 1 + K] + [3] * K)[:K]
            bad = self.calls % (K + 1)
            if bad < K:
                drafts[bad] = (drafts[bad] + 1) % 256
            self.calls += 1
            rows.append(drafts)
        return DraftProposal(draft_ids=torch.tensor(rows), draft_probs=None, confidence=None)


@pytest.mark.parametrize("drafter", ["scripted", "ngram", "draft_model"])
def test_speculative_greedy_equals_plain_with_prefix_cache_and_preemption(pair, drafter):
    model, _, cfg = pair
    prompts = _looping_prompts(6, seed=8)
    plain = run(make_engine(model, cfg, prefix=False), prompts, greedy(20))
    kw = {"scripted": lambda: {"drafter": ScriptedDrafter([p + o for p, o in zip(prompts, plain)]),
                               "spec": SpecConfig(method="ngram", num_speculative_tokens=4)},
          "ngram": ngram_engine_args,
          "draft_model": lambda: {"drafter": DraftModelDrafter(_tiny_draft_model(cfg), num_draft_tokens=3),
                                  "spec": SpecConfig(method="draft_model", model="tiny", num_speculative_tokens=3)},
          }[drafter]()
    # 36 blocks of 4 slots for 6 requests of up to ~60 tokens: preemption is forced; budget 20: chunking
    engine = make_engine(model, cfg, num_kv_blocks=36, budget=20, **kw)
    assert run(engine, prompts, greedy(20)) == plain
    m = engine.metrics
    assert m.num_preemptions > 0 and m.num_draft_tokens > 0
    if drafter == "scripted":  # windows ended in rejections at every position: some accepted 0, 1, 2, 3 drafts
        assert 0 < m.num_accepted_tokens < m.num_draft_tokens and all(n > 0 for n in m.accepted_per_pos[:3])
    again = LLM(engine=engine, tokenizer=None).generate([prompts[-1]], greedy(20))[0]
    assert again.num_cached_tokens >= 2 * WINDOW and again.token_ids == plain[-1]  # a prefix hit past the window
    assert engine.block_manager.num_free_blocks == 36
    engine.block_manager.check_invariants()


def test_sampled_law_under_speculation_matches_the_target():
    """Seeded sampling at temperature 0.7 through a draft model: the joint law of the first two tokens (the second
    verified against drafts) matches the target's; the same samples fail against the law at 1.0 (it can fail)."""
    model, hf = target(DENSE, seed=5)
    prompt, t = _ids(12, 6), 0.7
    top, law = two_token_law(hf, prompt, t)
    engine = make_engine(model, DENSE, budget=256, prefix=False, max_num_seqs=64,
                         drafter=DraftModelDrafter(_tiny_draft_model(DENSE), num_draft_tokens=2),
                         spec=SpecConfig(method="draft_model", model="tiny", num_speculative_tokens=2,
                                         draft_sample_method="probabilistic"))
    samples = two_token_samples(engine, prompt, 3000, top, t)
    assert_matches_distribution(samples, law, what="Gemma 4 target, draft-model speculation")
    assert_differs_from_distribution(samples, two_token_law(hf, prompt, 1.0)[1], what="the law at temperature 1.0")


# -- checkpoints and refusals -------------------------------------------------------------------------------
def _copy_tokenizer(path) -> None:
    import shutil
    from tests.tiny_checkpoint import write_tiny_checkpoint
    src = write_tiny_checkpoint(path / "tok")
    for f in src.glob("tokenizer*"):
        shutil.copy(f, path / f.name)
    shutil.rmtree(src)


def _loaded_logits(path, ids: list[int]) -> tuple[torch.Tensor, ModelConfig]:
    from dspark.models.loader import load_model
    model, cfg, _ = load_model(path, dtype=torch.float32, device="cpu")
    return Pool(model, num_requests=1, max_len=len(ids)).step(model, [(ids, 0)])[0], cfg


def test_checkpoint_folders_load_the_same_logits(tmp_path, caplog):
    """save_pretrained folders through the loader: Gemma4ForCausalLM (dense, and MoE with its stacked experts) and
    a multimodal Gemma4ForConditionalGeneration (tiny vision and audio towers, skipped with a log line) whose
    logits equal transformers' text-only forward of the whole model."""
    import logging
    ids = _ids(24, 7)
    for name, cfg in CONFIGS.items():
        hf = hf_gemma4(cfg, seed=9)
        hf.save_pretrained(tmp_path / name)
        _copy_tokenizer(tmp_path / name)
        logits, loaded = _loaded_logits(tmp_path / name, ids)
        assert loaded == cfg and (logits - _hf_logits(hf, ids)).abs().max() < ATOL, name
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=8, patch_size=4, position_embedding_size=64, pooling_kernel_size=2)
    audio = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[8, 4],
                 output_proj_dims=16, conv_kernel_size=3)
    hf = hf_gemma4(DENSE, seed=10, multimodal={"vision_config": vision, "audio_config": audio})
    hf.save_pretrained(tmp_path / "mm")
    _copy_tokenizer(tmp_path / "mm")
    with caplog.at_level(logging.INFO, logger="dspark.models.gemma4"):
        logits, loaded = _loaded_logits(tmp_path / "mm", ids)
    assert loaded == DENSE and "vision / audio towers" in caplog.text
    assert (logits - _hf_logits(hf, ids)).abs().max() < ATOL


def test_k_v_tensors_of_shared_layers_are_ignored_and_others_are_not():
    """Some checkpoints keep k/v projections and norms for KV-shared layers (transformers ignores them): they
    load and change nothing; a v_proj for a K = V layer is a checkpoint of another config and fails."""
    model, hf = target(DENSE, seed=6)
    ids = _ids(20, 8)
    extra = [(f"model.layers.5.self_attn.{n}.weight", torch.randn(*shape)) for n, shape in
             (("k_proj", (32, 64)), ("v_proj", (32, 64)), ("k_norm", (16,)))]
    with torch.inference_mode():
        model.load_weights(list(hf.state_dict().items()) + extra)
    assert (_run_plan(model, [ids], [20])[0] - _hf_logits(hf, ids)).abs().max() < ATOL
    with pytest.raises(ValueError, match="layers.1.self_attn.v_proj.*shards \\['q', 'k'\\]"):
        model.load_weights([("model.layers.1.self_attn.v_proj.weight", torch.zeros(32, 64))], strict=False)


def test_what_cannot_run_is_refused_by_name():
    from dspark.distributed.shard import check_shardable
    from dspark.drafters.draft_model import check
    with pytest.raises(ValueError, match="tensor parallelism over Gemma4ForCausalLM"):
        check_shardable(DENSE)
    with pytest.raises(ValueError, match="draft_num_layers.*Gemma4ForCausalLM"):
        check(SpecConfig(method="draft_model", draft_num_layers=2), DENSE)
    with pytest.raises(ValueError, match="no earlier full_attention layer"):
        build_model(replace(DENSE, layer_types=(S, S, S, S, F, S, F)), device="meta")
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelConfig.from_hf({**DENSE.to_hf(), "use_bidirectional_attention": "all"})
    with pytest.raises(ValueError, match="sliding layers"):
        ModelConfig.from_hf({**DENSE.to_hf(), "rope_parameters": {"sliding_attention": {"rope_type": "linear"}}})
    from dspark.server.protocol import ChatCompletionRequest
    from dspark.server.serving import APIError, chat_prompt_ids
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "image_url"}, {"type": "input_audio"}]}])
    with pytest.raises(APIError, match="image_url, input_audio"):
        chat_prompt_ids(req, tokenizer=None)


def test_a_gemma4_gguf_header_without_its_keys_is_refused_naming_what_it_lacks(tmp_path):
    """A Gemma 4 GGUF loads (tests/test_gguf_families.py: files of llama.cpp's own converter); a header that lacks
    what the config needs is refused, naming the file and the missing key, before any weight."""
    import gguf
    from dspark.models.files import CheckpointError
    from dspark.models.loader import read_model_config
    writer = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gemma4")
    writer.add_block_count(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match="g.gguf: lacks 'gemma4.attention.sliding_window_pattern'"):
        read_model_config(tmp_path / "g.gguf")


@pytest.mark.parametrize("method", ["dspark", "dflash", "eagle3"])
def test_tap_drafters_on_gemma4_are_lossless_with_prefix_cache(pair, method, tmp_path):
    """DSpark, DFlash and EAGLE-3 read the Gemma 4 stack's taps (the per-layer-input, KV-sharing config and the
    MoE one): random drafters saved and built as the engine builds them, greedy output equal to plain, with
    prefix caching on."""
    from tests.test_hybrid_drafters import _tap_drafter
    model, _, cfg = pair
    prompts = _looping_prompts(4, seed=9)
    plain = run(make_engine(model, cfg, prefix=False), prompts, greedy(16))
    drafter, spec = _tap_drafter(method, model, cfg, tmp_path / method)
    engine = make_engine(model, cfg, budget=24, num_kv_blocks=64, drafter=drafter, spec=spec)
    assert run(engine, prompts, greedy(16)) == plain
    assert engine.metrics.num_draft_tokens > 0
