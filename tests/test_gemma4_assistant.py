"""Gemma 4's assistant as a drafter (`dspark/drafters/gemma4_assistant.py`, `method: "mtp"` on a Gemma 4 target) on
tiny random models against transformers: a `Gemma4AssistantForCausalLM` saved with `save_pretrained` and loaded
through the drafter registry proposes, after a prompt, the candidates (and the per-step logits) transformers'
`SinglePositionMultiTokenCandidateGenerator` proposes from the target's hidden states and shared K/V, for the dense
target (KV sharing, the centroid head) and the MoE one (plain head), two requests in one batch, prompts shorter and
longer than the sliding window; reading another target layer's K/V, or the target's sliding window instead of the
assistant's, breaks that; greedy speculative output equals plain output with prefix caching and forced preemption;
sampled drafts keep the target's law (chi-square; misreported draft probabilities fail it); target and assistant
folders through `build_engine`; what does not fit the target is refused by name before any weight loads; the
method name and folder inference (vLLM's "mtp", alias "gemma4_assistant").

    pytest tests/test_gemma4_assistant.py -q
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from dspark.config import SpecConfig
from dspark.drafters import build_drafter, check_drafter
from dspark.drafters.base import ContextSegment, ContextUpdate, ProposeBatch, ProposeRequest
from dspark.llm import LLM
from dspark.models.config import ModelConfig
from dspark.sampling import SamplingParams
from tests.engine_helpers import greedy, make_engine, run, two_token_law, two_token_samples
from tests.stat_checks import assert_differs_from_distribution, assert_matches_distribution
from tests.test_gemma4 import DENSE, MOE, WINDOW, Pool, _ids, _looping_prompts, target

K = 4


def hf_assistant(cfg: ModelConfig, *, seed: int = 1, ordered: bool = False, head_scale: float = 1.0, **text):
    """transformers' Gemma4AssistantForCausalLM for target `cfg` (its head shapes and RoPE, a 3-layer d=48 decoder,
    full / sliding / full), fp32, eager, non-trivial norms and layer scalars, a shuffled token ordering, the tied
    head times `head_scale` (peaked drafts)."""
    import transformers
    full = {"head_dim": cfg.global_head_dim, "num_key_value_heads": cfg.num_global_key_value_heads}
    text = dict(model_type="gemma4_text", vocab_size=cfg.vocab_size, hidden_size=48, intermediate_size=64,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=cfg.num_key_value_heads,
                head_dim=cfg.head_dim, layer_types=["full_attention", "sliding_attention", "full_attention"],
                sliding_window=WINDOW, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                per_layer_config={"0": full, "2": full}, rope_parameters=cfg.to_hf()["rope_parameters"], **text)
    config = transformers.Gemma4AssistantConfig(text_config=text, backbone_hidden_size=cfg.hidden_size,
                                                use_ordered_embeddings=ordered, num_centroids=16,
                                                centroid_intermediate_top_k=4)
    torch.manual_seed(seed)
    hf = transformers.Gemma4AssistantForCausalLM(config)
    hf.config._attn_implementation = hf.config.text_config._attn_implementation = "eager"
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
        for name, b in hf.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(1.0 + 0.3 * torch.randn_like(b))
        hf.model.embed_tokens.weight.mul_(head_scale)
        if ordered:
            hf.masked_embedding.token_ordering.copy_(torch.randperm(cfg.vocab_size))
    return hf.eval()


@pytest.fixture(scope="module", params=["dense-centroids", "moe-plain"])
def setup(request, tmp_path_factory):
    """(target model, its HF twin, its config, the HF assistant, the assistant's folder)."""
    cfg = DENSE if request.param.startswith("dense") else MOE
    model, hf = target(cfg, seed=2)
    assistant = hf_assistant(cfg, ordered=request.param.endswith("centroids"))
    path = tmp_path_factory.mktemp("assistant")
    assistant.save_pretrained(path)
    return model, hf, cfg, assistant, str(path)


def _spec(path: str, **kw) -> SpecConfig:
    return SpecConfig.from_dict({"method": "mtp", "model": path, "num_speculative_tokens": K, **kw})


def hf_candidates(hf, assistant, prompt: list[int]) -> tuple[list[int], torch.Tensor, int]:
    """transformers' first K candidates after `prompt` (the target's prefill, then its greedy token t): (drafts,
    their logits [K, vocab], t)."""
    from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), output_hidden_states=True, return_shared_kv_states=True, use_cache=True)
    t = int(out.logits[0, -1].argmax())
    config = copy.deepcopy(hf.generation_config)
    config.max_length = 1000
    assistant.generation_config.num_assistant_tokens = K
    gen = SinglePositionMultiTokenCandidateGenerator(assistant, hf.get_input_embeddings(), config)
    ids = torch.tensor([prompt + [t]])
    cand, logits = gen.get_candidates(ids, model_kwargs={"attention_mask": torch.ones_like(ids)}, model_outputs=out,
                                      is_first_iteration=False, n_last_matches=0)
    return cand[0, len(prompt) + 1:].tolist(), logits[0], t


def dspark_drafts(model, cfg, drafter, prompts: list[list[int]], anchors: list[int]):
    """The drafter's proposal after the target's prefill of `prompts` in one step of a paged pool (shuffled block
    tables), one batch -> (drafts [n, K], the per-step logits [n, K, vocab])."""
    pool = Pool(model, num_requests=len(prompts), max_len=max(map(len, prompts)) + K + 2)
    _, taps = pool.step(model, [(p, 0) for p in prompts], tap_layer_ids=drafter.tap_layer_ids)
    drafter.bind_target_kv(pool.caches, model.cache_index)
    segs, row = [], 0
    for i, (p, t) in enumerate(zip(prompts, anchors)):
        segs.append(ContextSegment(f"r{i}", pool.tables[i], 0, p, t, slice(row, row + len(p))))
        row += len(p)
    drafter.extend_context(ContextUpdate(segs, taps))
    seen, compute = [], drafter.model.compute_logits
    drafter.model.compute_logits = lambda y: seen.append(compute(y)) or seen[-1]
    try:
        reqs = [ProposeRequest(f"r{i}", p + [t], len(p), pool.tables[i], 0, SamplingParams(temperature=0.0), None)
                for i, (p, t) in enumerate(zip(prompts, anchors))]
        proposal = drafter.propose(ProposeBatch(reqs, pool.kv_block_size, "greedy"))
    finally:
        del drafter.model.compute_logits
    return proposal.draft_ids.tolist(), torch.stack(seen, dim=1)


def _max_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest logit difference over the tokens the head scored; inf unless the centroid head's unscored tokens
    (-inf here) are below every scored one there (another choice of clusters)."""
    scored = torch.isfinite(ours)
    if not scored.all() and ref[~scored].max() >= ref[scored].min():
        return float("inf")
    return (ours[scored] - ref[scored]).abs().max().item()


PROMPTS = [_ids(5, 1), _ids(30, 2)]  # shorter than the sliding window, and > 3 windows


def test_drafts_equal_transformers_candidates(setup):
    model, hf, cfg, assistant, path = setup
    drafter = build_drafter(_spec(path), target_config=cfg, target_model=model, dtype=torch.float32, device="cpu")
    refs = [hf_candidates(hf, assistant, p) for p in PROMPTS]
    drafts, logits = dspark_drafts(model, cfg, drafter, PROMPTS, [t for _, _, t in refs])
    for (want, ref_logits, _), got, ours in zip(refs, drafts, logits):
        assert got == want
        assert _max_err(ours, ref_logits) < 1e-3


def test_reading_another_layer_or_window_breaks_the_candidates(setup, monkeypatch):
    """The parity above can fail: the sliding layers reading an earlier sliding layer's K/V, or the target's own
    window (W keys, not transformers' W + 1)."""
    model, hf, cfg, assistant, path = setup
    drafter = build_drafter(_spec(path), target_config=cfg, target_model=model, dtype=torch.float32, device="cpu")
    want, ref_logits, t = hf_candidates(hf, assistant, PROMPTS[1])

    def err() -> float:
        return _max_err(dspark_drafts(model, cfg, drafter, [PROMPTS[1]], [t])[1][0], ref_logits)

    assert err() < 1e-3
    assert drafter.read_layers == {"sliding_attention": 3, "full_attention": 4 if cfg is MOE else 1}
    monkeypatch.setitem(drafter.read_layers, "sliding_attention", 2)
    assert err() > 1e-2
    monkeypatch.undo()
    for layer in drafter.model.model.layers:
        if layer.self_attn.window is not None:
            monkeypatch.setattr(layer.self_attn, "window", WINDOW)
    assert err() > 1e-2


def test_speculative_greedy_equals_plain_with_prefix_cache_and_preemption(setup):
    model, _, cfg, _, path = setup
    prompts = _looping_prompts(6, seed=8)
    plain = run(make_engine(model, cfg, prefix=False), prompts, greedy(20))
    spec = _spec(path, num_speculative_tokens=3)
    drafter = build_drafter(spec, target_config=cfg, target_model=model, dtype=torch.float32, device="cpu")
    engine = make_engine(model, cfg, num_kv_blocks=36, budget=20, drafter=drafter, spec=spec)
    assert run(engine, prompts, greedy(20)) == plain
    m = engine.metrics
    assert m.num_preemptions > 0 and m.num_draft_tokens > 0
    assert drafter.kv["full_attention"][0] is engine.runner.kv_caches[model.cache_index[drafter.read_layers[
        "full_attention"]]][0]  # the target's pool itself, bound by the engine
    again = LLM(engine=engine, tokenizer=None).generate([prompts[-1]], greedy(20))[0]
    assert again.num_cached_tokens >= 2 * WINDOW and again.token_ids == plain[-1]
    assert engine.block_manager.num_free_blocks == 36
    engine.block_manager.check_invariants()


def _sampled_pairs(model, spec: SpecConfig, prompt: list[int], top: list[int], t: float) -> torch.Tensor:
    """3000 seeded requests of two tokens at temperature t -> their categories (`two_token_law`'s)."""
    drafter = build_drafter(spec, target_config=DENSE, target_model=model, dtype=torch.float32, device="cpu")
    engine = make_engine(model, DENSE, budget=256, prefix=False, max_num_seqs=64, drafter=drafter, spec=spec)
    samples = two_token_samples(engine, prompt, 3000, top, t)
    assert engine.metrics.num_accepted_tokens > 0
    return samples


def test_sampled_law_under_speculation_matches_the_target(tmp_path, monkeypatch):
    """Seeded sampling at temperature 0.7 with sampled assistant drafts (their probabilities verified by rejection
    sampling): the joint law of the first two tokens (the second verified against drafts) matches the target's, and
    the same samples fail against the law at 1.0. A peaked target and peaked drafts give the check power: with the
    drafts' probabilities reported as uniform the law is refused."""
    from dspark.drafters.draft_sampling import DraftAccumulator
    model, hf = target(DENSE, seed=5)
    with torch.no_grad():
        hf.model.norm.weight.mul_(4.0)
        model.model.norm.weight.mul_(4.0)
    hf_assistant(DENSE, ordered=True, head_scale=10.0).save_pretrained(tmp_path)
    prompt, t = _ids(12, 6), 0.7
    top, law = two_token_law(hf, prompt, t)
    spec = _spec(str(tmp_path), num_speculative_tokens=2, draft_sample_method="probabilistic")
    samples = _sampled_pairs(model, spec, prompt, top, t)
    assert_matches_distribution(samples, law, what="Gemma 4 target, sampled assistant drafts")
    assert_differs_from_distribution(samples, two_token_law(hf, prompt, 1.0)[1], what="the law at temperature 1.0")
    proposal = DraftAccumulator.proposal

    def uniform(self):
        out = proposal(self)
        return dataclasses.replace(out, draft_probs=torch.full_like(out.draft_probs, 1 / 256))

    monkeypatch.setattr(DraftAccumulator, "proposal", uniform)
    assert_differs_from_distribution(_sampled_pairs(model, spec, prompt, top, t), law,
                                     what="drafts verified against uniform draft probabilities")


# -- refusals and names ---------------------------------------------------------------------------------
def _config_only(tmp_path, name: str, edit) -> str:
    """A folder with the assistant's config.json, edited, and no weights at all."""
    hf = json.loads((_saved(tmp_path) / "config.json").read_text())
    edit(hf)
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf))
    return str(folder)


def _saved(tmp_path):
    folder = tmp_path / "ok"
    if not folder.exists():
        hf_assistant(DENSE).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.update(backbone_hidden_size=32), "backbone_hidden_size=32 does not match the target's hidden_size=64"),
    (lambda c: c["text_config"].update(vocab_size=300), "vocab_size=300 does not match the target's vocab_size=256"),
    (lambda c: [o.update(head_dim=16) for o in c["text_config"]["per_layer_config"].values()],
     r"full_attention layers read \(num_key_value_heads, head_dim\)=\(1, 16\).*layer 1 .*\(1, 32\)"),
    (lambda c: c.update(model_type="gemma4_text", architectures=["Gemma4ForCausalLM"]),
     "drafts with a Gemma4AssistantForCausalLM checkpoint.*model_type='gemma4_text'"),
], ids=["hidden-size", "vocab", "head-dim", "not-an-assistant"])
def test_a_mismatched_assistant_is_refused_before_any_weight(tmp_path, edit, match):
    folder = _config_only(tmp_path, "bad", edit)  # no safetensors: a weight read would fail otherwise
    with pytest.raises(ValueError, match=match):
        check_drafter(_spec(folder), DENSE)


def test_missing_tensors_and_other_targets_are_refused_by_name(tmp_path):
    from safetensors.torch import load_file, save_file
    folder = _saved(tmp_path)
    check_drafter(_spec(str(folder)), DENSE)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(32, 48)  # unused by a Q-only layer: ignored
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    check_drafter(_spec(str(folder)), DENSE)
    del tensors["model.layers.1.self_attn.q_norm.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks tensor 'model.layers.1.self_attn.q_norm.weight'"):
        check_drafter(_spec(str(folder)), DENSE)
    with pytest.raises(ValueError, match="Gemma 4's assistant; LlamaForCausalLM has neither"):
        check_drafter(_spec(str(folder)), ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64,
                                                     intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                                                     num_key_value_heads=2, head_dim=16))


def test_served_through_build_engine_from_folders(tmp_path):
    """The user's path: a target folder and the assistant's folder (method inferred from it) through
    `build_engine`: greedy output equals plain; "mtp" without the assistant is refused by name."""
    from dspark.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfigError
    from dspark.engine.build import build_engine
    from tests.test_gemma4 import _copy_tokenizer, hf_gemma4
    hf_gemma4(DENSE, seed=9).save_pretrained(tmp_path / "target")
    _copy_tokenizer(tmp_path / "target")
    folder = str(_saved(tmp_path))

    def engine(spec):
        return build_engine(EngineConfig(model=str(tmp_path / "target"), spec=spec, cache=CacheConfig(
            kv_block_size=4, num_kv_blocks=64), scheduler=SchedulerConfig(max_num_batched_tokens=24)))[0]
    prompts = _looping_prompts(3, seed=3)
    plain = run(engine(None), prompts, greedy(12))
    spec_engine = engine(SpecConfig.from_dict({"model": folder, "num_speculative_tokens": 3}))
    assert run(spec_engine, prompts, greedy(12)) == plain and spec_engine.metrics.num_draft_tokens > 0
    with pytest.raises(SpecConfigError, match="model_type='gemma4_text'.*give the assistant's folder"):
        engine(SpecConfig(method="mtp", num_speculative_tokens=3))


def test_method_names_and_folder_inference(tmp_path):
    """vLLM's "mtp" (and "gemma4_assistant") name it; with no method the assistant's folder infers "mtp"."""
    folder = str(_saved(tmp_path))
    assert SpecConfig.from_dict({"method": "gemma4_assistant", "model": folder}).method == "mtp"
    spec = SpecConfig.from_dict({"model": folder, "num_speculative_tokens": 2})
    assert spec.method == "mtp" and spec.num_speculative_tokens == 2
    check_drafter(spec, DENSE)
