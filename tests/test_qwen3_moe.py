"""Qwen3-MoE on tiny random configs (4 layers, 8 experts, top-2, layer 1 dense through `mlp_only_layers`) against
transformers' Qwen3MoeForCausalLM (fp32, eager): prefill logits and taps of a folder written by
`save_pretrained` (per-expert names) and of hand-written files in both layouts (per-expert, stacked), chunked
prefill + decode, the engine's greedy output against `generate()`; the MoE block against a per-token slow twin
and against transformers' own blocks (with a shared expert: Qwen2-MoE's); greedy speculative output equal to
plain with the n-gram and the draft-model drafters; tensor parallelism refused by name; a wrong
`norm_topk_prob` caught by the same comparison."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from dspark import kernels
from dspark.config import SpecConfig
from dspark.drafters import build_drafter
from dspark.models import build_model
from dspark.models.config import ModelConfig
from dspark.models.loader import SafetensorsSource, read_model_config
from dspark.models.moe import SparseMoeBlock
from tests.conftest import PagedKV, hf_twin
from tests.engine_helpers import (greedy, hf_greedy, make_engine, ngram_engine_args, repetitive_prompts, run,
                                  run_one_at_a_time)

ATOL = 1e-4
TINY_QWEN3_MOE = ModelConfig(
    architecture="Qwen3MoeForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=96,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
    rope_theta=1_000_000.0, max_position_embeddings=256, tie_word_embeddings=False, qk_norm=True,
    bos_token_id=1, eos_token_ids=(2,), num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=(1,))
NORM = pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["norm_topk", "raw_topk"])


def _cfg(norm_topk_prob: bool = True) -> ModelConfig:
    return replace(TINY_QWEN3_MOE, norm_topk_prob=norm_topk_prob)


def _twin(cfg: ModelConfig, *, seed: int = 0):
    """transformers' model with random weights; the routers and experts scaled up (HF's init leaves routing
    near uniform and the experts' share of the residual stream small), so a routing slip shows in the logits.
    Its experts run transformers' eager loop (one expert at a time), the reference implementation."""
    hf = hf_twin(cfg, seed=seed)
    hf.config._experts_implementation = "eager"
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(8.0)
            elif ".mlp.experts." in name:
                p.mul_(4.0)
    return hf


def _ours(cfg: ModelConfig, weights) -> torch.nn.Module:
    model = build_model(cfg)
    with torch.inference_mode():
        model.load_weights(weights)
    return model


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefill_err(model, hf, ids: list[int]) -> float:
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    kv = PagedKV.create(model, num_requests=1, max_len=len(ids), kv_block_size=4)
    hidden, _ = kv.step(model, [(ids, 0)])
    return (model.compute_logits(hidden) - ref).abs().max().item()


def _write_folder(path, cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg.to_hf()))


def _per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' stacked expert tensors renamed per expert, as Hub checkpoints hold them."""
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            for e, w in enumerate(t):
                gate, up = w.chunk(2, dim=0)
                out[f"{name[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = gate
                out[f"{name[:-len('gate_up_proj')]}{e}.up_proj.weight"] = up
        elif name.endswith("mlp.experts.down_proj"):
            for e, w in enumerate(t):
                out[f"{name[:-len('down_proj')]}{e}.down_proj.weight"] = w
        else:
            out[name] = t
    return out


# ---------------------------------------------------------------------------------------------- config


def test_config_round_trips_and_moe_layers_follow_transformers():
    import transformers
    hf_cfg = transformers.AutoConfig.for_model(**TINY_QWEN3_MOE.to_hf())
    assert ModelConfig.from_hf(hf_cfg.to_dict()) == TINY_QWEN3_MOE  # `num_local_experts`, as to_dict writes
    assert ModelConfig.from_hf(TINY_QWEN3_MOE.to_hf()) == TINY_QWEN3_MOE  # `num_experts`, as Hub configs say
    stepped = replace(TINY_QWEN3_MOE, decoder_sparse_step=2, mlp_only_layers=(3,), num_hidden_layers=6)
    hf = transformers.Qwen3MoeForCausalLM(transformers.AutoConfig.for_model(**stepped.to_hf()))
    ours = build_model(stepped, device="meta")
    hf_moe = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf.model.layers]
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers] == hf_moe == \
        [stepped.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    assert ours.moe_layers == (1, 5) and ours.stack_rows() == 0
    dense = build_model(replace(TINY_QWEN3_MOE, architecture="Qwen3ForCausalLM", num_experts=0), device="meta")
    assert dense.moe_layers == () and not any(dense.config.is_moe_layer(i) for i in range(4))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        replace(TINY_QWEN3_MOE, num_experts_per_tok=9)


# ---------------------------------------------------------------------------------------------- logits


@NORM
def test_save_pretrained_folder_matches_hf(tmp_path, norm_topk_prob):
    """transformers' own `save_pretrained` folder through the loader: config, then prefill logits and taps of a
    40-token prompt within 1e-4 of transformers'."""
    from safetensors import safe_open
    cfg = _cfg(norm_topk_prob)
    hf = _twin(cfg, seed=1)
    hf.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in names  # this transformers writes per-expert names
    assert read_model_config(tmp_path) == cfg
    source = SafetensorsSource(tmp_path)
    model = _ours(source.config, source.weights())
    ids = _ids(40, 2)
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    kv = PagedKV.create(model, num_requests=1, max_len=len(ids), kv_block_size=4)
    hidden, taps = kv.step(model, [(ids, 0)], tap_layer_ids=(-1, 0, 2))
    err = (model.compute_logits(hidden) - out.logits[0]).abs().max().item()
    print(f"max |logit - HF| = {err:.2e}")
    assert err < ATOL, f"prefill logits differ from HF by {err:.2e}"
    H = cfg.hidden_size
    for j, layer_id in enumerate((-1, 0, 2)):
        err = (taps[:, j * H:(j + 1) * H] - out.hidden_states[layer_id + 1][0]).abs().max().item()
        assert err < ATOL, f"tap {layer_id} differs from HF by {err:.2e}"


@pytest.mark.parametrize("layout", ["per_expert", "stacked"])
def test_hand_written_checkpoint_layouts_load_alike(tmp_path, layout):
    """Files written by hand with per-expert names (Hub checkpoints) or the stacked [E, 2I, H] / [E, H, I]
    tensors (transformers 5.x's state_dict) load to the same model: logits within 1e-4 of transformers'."""
    hf = _twin(TINY_QWEN3_MOE, seed=2)
    state = hf.state_dict()
    _write_folder(tmp_path, TINY_QWEN3_MOE, _per_expert(state) if layout == "per_expert" else state)
    model = _ours(TINY_QWEN3_MOE, SafetensorsSource(tmp_path).weights())
    err = _prefill_err(model, hf, _ids(40, 3))
    assert err < ATOL, f"{layout}: prefill logits differ from HF by {err:.2e}"


def test_a_missing_expert_is_named():
    hf = _twin(TINY_QWEN3_MOE)
    weights = {k: v for k, v in _per_expert(hf.state_dict()).items() if k != "model.layers.2.mlp.experts.3.up_proj.weight"}
    with pytest.raises(KeyError, match=r"model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight"):
        _ours(TINY_QWEN3_MOE, weights.items())
    with pytest.raises(ValueError, match="expert 8 is out of range"):
        _ours(TINY_QWEN3_MOE, [("model.layers.0.mlp.experts.8.down_proj.weight", torch.zeros(64, 32))])


def test_a_wrong_norm_topk_prob_fails_the_comparison():
    """The same weights under the other `norm_topk_prob`: the comparison above fails by far (it can fail)."""
    hf = _twin(TINY_QWEN3_MOE, seed=4)
    ids = _ids(40, 5)
    assert _prefill_err(_ours(TINY_QWEN3_MOE, hf.state_dict().items()), hf, ids) < ATOL
    wrong = _ours(_cfg(norm_topk_prob=False), hf.state_dict().items())
    assert _prefill_err(wrong, hf, ids) > 100 * ATOL


@pytest.fixture(params=[True, False], ids=["kernels", "torch"])
def cpu_kernels(request, monkeypatch):
    if not request.param:  # every op through torch
        monkeypatch.setattr(kernels, "ops", lambda: None)
    elif kernels.ops() is None:
        pytest.skip("CPU kernels unavailable")
    return request.param


def test_chunked_prefill_and_decode_match_hf(cpu_kernels):
    """Two requests share steps: prompt chunks (one of 18 tokens), then decodes; every row within 1e-4."""
    hf = _twin(TINY_QWEN3_MOE, seed=3)
    model = _ours(TINY_QWEN3_MOE, hf.state_dict().items())
    a, b = _ids(32, 6), _ids(28, 7)
    kv = PagedKV.create(model, num_requests=2, max_len=32, kv_block_size=4, seed=5)
    rows_a, rows_b = [], []
    plan = [((0, 20), (0, 5)), ((20, 27), (5, 23))] + [((t, t + 1), (t - 4, t - 3)) for t in range(27, 32)]
    for (a0, a1), (b0, b1) in plan:
        h, _ = kv.step(model, [(a[a0:a1], a0), (b[b0:b1], b0)])
        rows_a.append(h[:a1 - a0])
        rows_b.append(h[a1 - a0:])
    for rows, ids, name in ((rows_a, a, "A"), (rows_b, b, "B")):
        logits = model.compute_logits(torch.cat(rows))
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0][:logits.shape[0]]
        err = (logits - ref).abs().max().item()
        assert err < ATOL, f"request {name}: chunked logits differ from HF by {err:.2e}"


def test_engine_greedy_equals_hf_generate():
    hf = _twin(TINY_QWEN3_MOE, seed=5)
    model = _ours(TINY_QWEN3_MOE, hf.state_dict().items())
    engine = make_engine(model, TINY_QWEN3_MOE, budget=16)
    prompts = [_ids(n, 20 + n) for n in (3, 9, 17, 30)]
    for p, o in zip(prompts, run_one_at_a_time(engine, prompts, greedy(16))):
        assert o == hf_greedy(hf, p, 16), len(p)
    assert engine.block_manager.num_free_blocks == 256


# ---------------------------------------------------------------------------------------------- the block


def _slow_moe(block: SparseMoeBlock, x: torch.Tensor, top_k: int, norm: bool) -> torch.Tensor:
    """A token at a time, each of its chosen experts in turn (the definition the batched block must equal)."""
    out = torch.zeros_like(x)
    e = block.experts
    inter = e.down_proj.shape[-1]
    for t in range(x.shape[0]):
        probs = torch.softmax(block.gate.weight @ x[t], dim=-1)  # [E]
        w, idx = torch.topk(probs, top_k)  # [k]
        if norm:
            w = w / w.sum()
        for weight, i in zip(w, idx.tolist()):
            gate, up = e.gate_up_proj[i][:inter] @ x[t], e.gate_up_proj[i][inter:] @ x[t]  # [I] each
            out[t] += weight * (e.down_proj[i] @ (F.silu(gate) * up))  # [hidden]
        if block.shared_expert is not None:
            s = block.shared_expert
            gate_up = s.gate_up_proj.weight @ x[t]  # [2 I_shared]
            half = gate_up.shape[0] // 2
            shared = s.down_proj.weight @ (F.silu(gate_up[:half]) * gate_up[half:])  # [hidden]
            out[t] += torch.sigmoid(block.shared_expert_gate.weight @ x[t]) * shared
    return out


def _random_block(cfg: ModelConfig, seed: int) -> SparseMoeBlock:
    block = SparseMoeBlock(cfg, dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # outputs of order 0.1-1, so 1e-6 is a few fp32 roundings; decisive routing
        for name, p in block.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if name == "gate.weight" else 0.1))
    return block


@NORM
@pytest.mark.parametrize("shared", [0, 48], ids=["routed", "shared_expert"])
def test_block_equals_its_slow_twin(norm_topk_prob, shared):
    cfg = replace(TINY_QWEN3_MOE, norm_topk_prob=norm_topk_prob, num_experts_per_tok=3,
                  shared_expert_intermediate_size=shared)
    block = _random_block(cfg, seed=6)
    x = torch.randn(37, cfg.hidden_size, generator=torch.Generator().manual_seed(7))  # [T, hidden]
    with torch.inference_mode():
        fast = block(x)
    assert (fast - _slow_moe(block, x, 3, norm_topk_prob)).abs().max().item() < 1e-6
    weights, experts = block.gate(x)
    assert len(set(experts.flatten().tolist())) > 4  # the tokens spread over the experts
    assert block(x[:0]).shape == (0, cfg.hidden_size)


@NORM
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_block_equals_transformers_blocks(norm_topk_prob, family):
    """Against transformers' Qwen3MoeSparseMoeBlock and (shared expert) Qwen2MoeSparseMoeBlock on the same
    weights: the same experts chosen, outputs within 1e-6."""
    import transformers
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    shared = 48 if family == "qwen2_moe" else 0
    cfg = replace(TINY_QWEN3_MOE, norm_topk_prob=norm_topk_prob, shared_expert_intermediate_size=shared)
    block = _random_block(cfg, seed=8)
    kw = dict(hidden_size=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
              norm_topk_prob=norm_topk_prob, experts_implementation="eager")
    if shared:
        ref = Qwen2MoeSparseMoeBlock(transformers.Qwen2MoeConfig(**kw, shared_expert_intermediate_size=shared))
    else:
        ref = Qwen3MoeSparseMoeBlock(transformers.Qwen3MoeConfig(**kw))
    with torch.no_grad():
        ref.gate.weight.copy_(block.gate.weight)
        ref.experts.gate_up_proj.copy_(block.experts.gate_up_proj)
        ref.experts.down_proj.copy_(block.experts.down_proj)
        if shared:
            gate, up = block.shared_expert.gate_up_proj.weight.chunk(2)
            ref.shared_expert.gate_proj.weight.copy_(gate)
            ref.shared_expert.up_proj.weight.copy_(up)
            ref.shared_expert.down_proj.weight.copy_(block.shared_expert.down_proj.weight)
            ref.shared_expert_gate.weight.copy_(block.shared_expert_gate.weight)
    x = torch.randn(1, 29, 64, generator=torch.Generator().manual_seed(9))  # [B, T, hidden]
    with torch.no_grad():
        want = ref(x)[0]
        _, ref_weights, ref_experts = ref.gate(x[0])
        weights, experts = block.gate(x[0])
        got = block(x[0])
    assert torch.equal(experts, ref_experts) and (weights - ref_weights).abs().max() < 1e-7
    assert (got - want).abs().max().item() < 1e-6


# ---------------------------------------------------------------------------------------------- engine


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_greedy_equals_plain(method):
    hf = _twin(TINY_QWEN3_MOE, seed=7)
    model = _ours(TINY_QWEN3_MOE, hf.state_dict().items())
    prompts = repetitive_prompts(5, 256, seed=8, length=30)
    plain = run_one_at_a_time(make_engine(model, TINY_QWEN3_MOE, prefix=False), prompts, greedy(20))
    if method == "ngram":
        kw = ngram_engine_args()
    else:  # the target's first two layers (MoE, then dense) as the draft model
        spec = SpecConfig(method="draft_model", draft_num_layers=2, num_speculative_tokens=4)
        kw = {"spec": spec, "drafter": build_drafter(spec, target_config=TINY_QWEN3_MOE, target_model=model,
                                                     dtype=torch.float32, device="cpu")}
    # 40 blocks of 4 slots for 5 requests of up to 50 tokens: preemption is forced; budget 20: chunking
    engine = make_engine(model, TINY_QWEN3_MOE, num_kv_blocks=40, budget=20, **kw)
    assert run(engine, prompts, greedy(20)) == plain
    assert engine.metrics.num_preemptions > 0, "the small pool must force preemption"
    assert engine.metrics.num_accepted_tokens > 0, "drafts must get accepted"
    assert engine.block_manager.num_free_blocks == 40


def test_tensor_parallelism_is_refused_by_name_before_loading(tmp_path, monkeypatch):
    from dspark.config import EngineConfig, ParallelConfig
    from dspark.distributed import shard
    from dspark.engine.build import build_engine
    from dspark.models import loader
    from tests.tiny_checkpoint import write_tiny_checkpoint
    write_tiny_checkpoint(tmp_path)  # the tokenizer files; the model is replaced by the MoE twin
    _twin(TINY_QWEN3_MOE).save_pretrained(tmp_path)
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("weights loaded before the refusal"))
    config = EngineConfig(model=str(tmp_path), device="cpu", parallel=ParallelConfig(tensor_parallel_size=2))
    with pytest.raises(ValueError, match=r"tensor parallelism over MoE layers \(Qwen3MoeForCausalLM\)"):
        build_engine(config)
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM"):
        shard.check_shardable(TINY_QWEN3_MOE)
    shard.check_shardable(replace(TINY_QWEN3_MOE, architecture="Qwen3ForCausalLM", num_experts=0))
