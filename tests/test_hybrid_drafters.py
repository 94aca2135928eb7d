"""Drafters on hybrid linear-attention targets (tiny random Qwen3.5 / Qwen3-Next configs of tests/test_hybrid.py):
the checkpoint's own MTP layer (its drafts against a one-shot run of the layer, lossless speculation through
`build_engine`, vLLM's method names, a folder without one refused), and DSpark, DFlash and EAGLE-3 reading the
hybrid stack's taps, lossless."""

from __future__ import annotations

import pytest
import torch

from dspark.config import SpecConfig
from dspark.drafters.base import ProposeBatch
from dspark.models.attention import SeqSpec, build_attn_metadata
from dspark.models.config import ModelConfig
from tests.engine_helpers import greedy, make_engine, run, tiny_target
from tests.test_hybrid import CONFIGS, TINY_QWEN3_5, Stepper, _copy_tokenizer, _ids, _prompts


# -- the checkpoint's own MTP layer as a drafter ---------------------------------------------------------
def _mtp_tensors(cfg: ModelConfig, seed: int = 11) -> dict[str, torch.Tensor]:
    """Random `mtp.*` tensors with the HF names and shapes of a Qwen3-Next / Qwen3.5 MTP layer."""
    g = torch.Generator().manual_seed(seed)
    d, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes = {"fc.weight": (d, 2 * d), "norm.weight": (d,), "pre_fc_norm_embedding.weight": (d,),
              "pre_fc_norm_hidden.weight": (d,), "layers.0.input_layernorm.weight": (d,),
              "layers.0.post_attention_layernorm.weight": (d,),
              "layers.0.self_attn.q_proj.weight": (2 * cfg.num_attention_heads * hd, d),
              "layers.0.self_attn.k_proj.weight": (cfg.num_key_value_heads * hd, d),
              "layers.0.self_attn.v_proj.weight": (cfg.num_key_value_heads * hd, d),
              "layers.0.self_attn.o_proj.weight": (d, cfg.num_attention_heads * hd),
              "layers.0.self_attn.q_norm.weight": (hd,), "layers.0.self_attn.k_norm.weight": (hd,),
              "layers.0.mlp.gate_proj.weight": (inter, d), "layers.0.mlp.up_proj.weight": (inter, d),
              "layers.0.mlp.down_proj.weight": (d, inter)}
    if cfg.num_experts:  # the MTP layer of a MoE target is a MoE layer, per-expert names
        shapes = {k: v for k, v in shapes.items() if ".mlp." not in k}
        e_inter, s_inter = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        shapes["layers.0.mlp.gate.weight"] = (cfg.num_experts, d)
        for e in range(cfg.num_experts):
            shapes.update({f"layers.0.mlp.experts.{e}.gate_proj.weight": (e_inter, d),
                           f"layers.0.mlp.experts.{e}.up_proj.weight": (e_inter, d),
                           f"layers.0.mlp.experts.{e}.down_proj.weight": (d, e_inter)})
        shapes.update({"layers.0.mlp.shared_expert.gate_proj.weight": (s_inter, d),
                       "layers.0.mlp.shared_expert.up_proj.weight": (s_inter, d),
                       "layers.0.mlp.shared_expert.down_proj.weight": (d, s_inter),
                       "layers.0.mlp.shared_expert_gate.weight": (1, d)})
    return {f"mtp.{k}": 0.2 * torch.randn(s, generator=g) for k, s in shapes.items()}


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next_moe"])
def mtp_folder(request, tmp_path_factory):
    """A checkpoint folder that holds an MTP layer (dense Qwen3.5; MoE Qwen3-Next)."""
    from safetensors.torch import load_file, save_file
    cfg = CONFIGS[request.param]
    path = tmp_path_factory.mktemp(f"{request.param}_mtp")
    _, hf = tiny_target(cfg)
    hf.save_pretrained(path)
    _copy_tokenizer(path)
    tensors = load_file(path / "model.safetensors")
    save_file({**tensors, **_mtp_tensors(cfg)}, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_mtp_drafts_equal_a_one_shot_run_of_the_layer(mtp_folder):
    """The paged MTP drafter, fed the context in two segments, drafts what the layer computes over the whole
    context in one call (its hidden input the target's final-normed state, paired with the next token)."""
    from dspark.drafters.base import ContextSegment, ContextUpdate, ProposeRequest
    from dspark.drafters.mtp import build
    from dspark.models.loader import load_model
    model, cfg, _ = load_model(mtp_folder)
    drafter = build(SpecConfig(method="mtp", model=str(mtp_folder), num_speculative_tokens=2), target_config=cfg,
                    target_model=model, dtype=torch.float32, device="cpu")
    ids = _ids(21, 8)  # 20 context positions and the anchor
    st = Stepper(model, window=1, num_slots=1)
    spec = SeqSpec(block_table=st.tables[0], num_cached=0, num_query=20, token_offset=0, state_slot=0)
    with torch.inference_mode():
        _, taps = model(torch.tensor(ids[:20]), torch.arange(20),
                        build_attn_metadata([spec], num_tokens=20, kv_block_size=8), st.kv,
                        tap_layer_ids=drafter.tap_layer_ids)
    pool = [(torch.zeros(8, 8, *model.kv_spec), torch.zeros(8, 8, *model.kv_spec))]
    drafter.bind_kv(pool)
    table = list(range(8))
    drafter.extend_context(ContextUpdate([ContextSegment("r", table, 0, ids[:12], None, slice(0, 12))], taps[:12]))
    drafter.extend_context(ContextUpdate([ContextSegment("r", table, 12, ids[12:20], ids[20], slice(0, 8))],
                                         taps[12:20]))
    proposal = drafter.propose(ProposeBatch([ProposeRequest("r", ids, 20, table, 20, greedy(4), None)],
                                            kv_block_size=8, draft_sample_method="greedy"))
    # one shot: rows 0 .. 19 pair the hidden state at p with token p + 1, then row 20 recycles row 19's output
    fresh = [(torch.zeros(8, 8, *model.kv_spec), torch.zeros(8, 8, *model.kv_spec))]
    with torch.inference_mode():
        mtp = drafter.model
        meta = build_attn_metadata([SeqSpec(table, 0, 20, 0)], num_tokens=20, kv_block_size=8)
        out = mtp(torch.tensor(ids[1:21]), torch.arange(20), mtp.fuse(taps), meta, fresh[0])
        first = int(mtp.compute_logits(out[-1:]).argmax())
        meta = build_attn_metadata([SeqSpec(table, 20, 1, 0)], num_tokens=1, kv_block_size=8)
        second = int(mtp.compute_logits(mtp(torch.tensor([first]), torch.tensor([20]), out[-1:], meta,
                                            fresh[0])).argmax())
    assert proposal.draft_ids[0].tolist() == [first, second]


def test_mtp_speculation_is_lossless_and_named_as_vllm_names_it(mtp_folder):
    from dspark.config import CacheConfig, EngineConfig, SchedulerConfig
    from dspark.engine.build import build_engine
    from dspark.spec_schema import normalize
    assert normalize({"method": "qwen3_next_mtp", "num_speculative_tokens": 2})["method"] == "mtp"
    prompts = _prompts(5)

    def engine(spec):
        return build_engine(EngineConfig(model=str(mtp_folder), spec=spec, cache=CacheConfig(
            kv_block_size=8, num_kv_blocks=64), scheduler=SchedulerConfig(max_num_batched_tokens=24)))[0]
    plain = run(engine(None), prompts, greedy(14))
    spec_engine = engine(SpecConfig(method="mtp", num_speculative_tokens=3))
    assert run(spec_engine, prompts, greedy(14)) == plain
    assert spec_engine.metrics.num_draft_tokens > 0
    with pytest.raises(ValueError, match="no mtp"):
        from dspark.drafters.mtp import check
        folder = mtp_folder.parent / "no_mtp"
        folder.mkdir(exist_ok=True)
        from safetensors.torch import load_file, save_file
        save_file({k: v for k, v in load_file(mtp_folder / "model.safetensors").items()
                   if not k.startswith("mtp.")}, folder / "model.safetensors")
        check(SpecConfig(method="mtp", model=str(folder)), TINY_QWEN3_5)


# -- drafters that read the hybrid stack's taps -----------------------------------------------------------
def _tap_drafter(method: str, target, cfg: ModelConfig, path):
    """A random DSpark / DFlash / EAGLE-3 drafter for the target, saved and built as the engine builds it."""
    from dspark.drafters import build_drafter
    if method == "eagle3":
        from dspark.drafters.eagle3 import Eagle3Config, Eagle3Model, save_eagle3
        ecfg = Eagle3Config.from_target(cfg, tap_layer_ids=(0, 1, 3), num_draft_tokens=3)
        save_eagle3(Eagle3Model(ecfg).init_weights(std=0.15, seed=1), ecfg, str(path))
    else:
        from dspark.drafters.dspark import save_dspark
        from dspark.drafters.dspark_config import dspark_config_for_target
        from dspark.drafters.dspark_model import DSparkModel
        dcfg = dspark_config_for_target(cfg, num_hidden_layers=1, block_size=4, tap_layer_ids=(-1, 1, 2),
                                        markov_rank=8)
        torch.manual_seed(1)
        model = DSparkModel(dcfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
        save_dspark(model, dcfg, path, dtype="float32")
    spec = SpecConfig(method=method, model=str(path), num_speculative_tokens=3)
    return build_drafter(spec, target_config=cfg, target_model=target, dtype=torch.float32, device="cpu"), spec


@pytest.mark.parametrize("method", ["dspark", "dflash", "eagle3"])
@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next_moe", "qwen3_5_moe"])
def test_tap_drafters_on_a_hybrid_target_are_lossless(method, name, tmp_path):
    cfg = CONFIGS[name]
    model, _ = tiny_target(cfg)
    prompts = _prompts(5)
    plain = run(make_engine(model, cfg, budget=16, prefix=False), prompts, greedy(12))
    drafter, spec = _tap_drafter(method, model, cfg, tmp_path / method)
    engine = make_engine(model, cfg, budget=24, prefix=False, num_kv_blocks=40, drafter=drafter, spec=spec)
    assert run(engine, prompts, greedy(12)) == plain
    assert engine.metrics.num_draft_tokens > 0
