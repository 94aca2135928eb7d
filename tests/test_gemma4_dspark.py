"""DSpark drafters with Gemma 4 draft layers (`dspark/drafters/gemma4_dspark.py`): tiny random `Gemma4DSparkModel`
folders (the layout llama.cpp's converter reads) for a tiny Gemma 4 target, and the GGUF files the converter writes
from them (tests/llama_cpp_convert.py; skipped, saying why, without it). Two drafters: proportional RoPE with a Markov
and a confidence head (the anchor predicts), and default RoPE with a Markov head only, the anchor predicting nothing.

Checked: the file's config and tensors equal the folder's (f32 exactly) and so do the built drafters' weights; the
drafter's block forward, greedy Markov walk and confidences equal a slow twin written from the network's
specification (llama.cpp's dflash graph) in float64 on the file's weights, within 2e-5 (the twin with a wrong norm
convention, an unscaled embedding, a k-normed V or the usual attention scale misses by far more); greedy speculative
decoding with the file (methods dspark and dflash) and with the folder equals plain decoding; the method and drafts
are inferred from both; what still cannot run is refused by name, from a folder's config.json and from a file's
header before any tensor's data.

    pytest tests/test_gemma4_dspark.py -q
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark.config import SpecConfig
from dspark.drafters import build_drafter, check_drafter, gguf_drafters
from dspark.drafters.checkpoint import load_tensors, read_config
from dspark.drafters.dspark import DSparkDrafter
from dspark.drafters.dspark_checkpoint import load_dspark, read_dspark_config
from dspark.models import build_model
from tests.engine_helpers import greedy, make_engine, run
from tests.llama_cpp_convert import GEMMA4_VOCAB_SIZE, convert, converter_missing, gemma4_tokenizer
from tests.test_gguf_drafters import _refused_before_data, _synthetic_dflash

TOL = 2e-5  # the drafter (fp32) against the float64 twin: logits and confidences
HIDDEN, HEADS, HEAD_DIM, FFN, RANK, LAYERS, TAPS = 64, 4, 32, 96, 8, 2, (0, 3)
DRAFTERS = {  # name -> config.json keys of the folder
    "proportional": {"rope_parameters": {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                            "rope_theta": 1e6}},
                     "sample_from_anchor": True, "enable_confidence_head": True},
    "default": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}},
                "sample_from_anchor": False, "enable_confidence_head": False},
}


def gemma4_dspark_folder(folder: Path, *, vocab: int, heads: bool = True, confidence: bool = True,
                         seed: int = 0, **config) -> Path:
    """A tiny random `Gemma4DSparkModel` checkpoint in the layout the converter reads: K = V attention, the sandwich
    norms and layer scalars (non-trivial, so a missed one shows), the confidence head as `confidence_proj`, the mask
    and the taps in `dflash_config`, DeepSpec's head keys at the top."""
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)

    def r(*shape, around: float = 0.0):
        return around + (0.2 if around else 0.15) * torch.randn(*shape, generator=g)
    t = {"fc.weight": r(HIDDEN, len(TAPS) * HIDDEN), "hidden_norm.weight": r(HIDDEN, around=1.0),
         "norm.weight": r(HIDDEN, around=1.0)}
    if heads:
        t.update({"markov_head.markov_w1.weight": r(vocab, RANK), "markov_head.markov_w2.weight": r(vocab, RANK)})
    if confidence:
        t.update({"confidence_proj.weight": r(1, HIDDEN + RANK), "confidence_proj.bias": r(1)})
    for i in range(LAYERS):
        p = f"layers.{i}."
        t.update({p + "self_attn.q_proj.weight": r(HEADS * HEAD_DIM, HIDDEN), p + "self_attn.k_proj.weight":
                  r(HEAD_DIM, HIDDEN), p + "self_attn.o_proj.weight": r(HIDDEN, HEADS * HEAD_DIM),
                  p + "self_attn.q_norm.weight": r(HEAD_DIM, around=1.0),
                  p + "self_attn.k_norm.weight": r(HEAD_DIM, around=1.0), p + "layer_scalar": r(1, around=1.0),
                  p + "mlp.gate_proj.weight": r(FFN, HIDDEN), p + "mlp.up_proj.weight": r(FFN, HIDDEN),
                  p + "mlp.down_proj.weight": r(HIDDEN, FFN)})
        for norm in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            t[f"{p}{norm}_layernorm.weight"] = r(HIDDEN, around=1.0)
    folder.mkdir()
    save_file(t, folder / "model.safetensors", metadata={"format": "pt"})
    cfg = {"architectures": ["Gemma4DSparkModel"], "model_type": "gemma4_dspark", "vocab_size": vocab,
           "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
           "num_key_value_heads": 1, "head_dim": 16, "global_head_dim": HEAD_DIM, "num_global_key_value_heads": 1,
           "attention_k_eq_v": True, "layer_types": ["full_attention"] * LAYERS, "hidden_activation": "gelu_pytorch_tanh",
           "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "tie_word_embeddings": True, "block_size": 4,
           "markov_rank": RANK if heads else 0, "markov_head_type": "vanilla", "confidence_head_with_markov": True,
           "dflash_config": {"mask_token_id": 4, "target_layer_ids": list(TAPS)}, **config}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(target model, its config, {name: (drafter folder, its GGUF)})."""
    missing = converter_missing()
    if missing:
        pytest.skip(missing)
    from tests.test_gemma4 import DENSE, hf_gemma4
    work = tmp_path_factory.mktemp("gemma4_dspark")
    cfg = replace(DENSE, vocab_size=GEMMA4_VOCAB_SIZE, vocab_size_per_layer_input=GEMMA4_VOCAB_SIZE)
    hf = hf_gemma4(cfg, seed=2)
    hf.save_pretrained(work / "gemma4")
    gemma4_tokenizer(work / "gemma4")
    model = build_model(cfg)
    with torch.inference_mode():
        model.load_weights(hf.state_dict().items())
    drafters = {}
    for i, (name, keys) in enumerate(DRAFTERS.items()):
        folder = gemma4_dspark_folder(work / name, vocab=GEMMA4_VOCAB_SIZE, confidence=keys["enable_confidence_head"],
                                      seed=i, **keys)
        drafters[name] = (folder, convert(folder, "f32", work / f"{name}-f32.gguf", target=work / "gemma4"))
    return model, cfg, drafters


def _spec(path, method: str = "dspark", n: int = 3) -> SpecConfig:
    return SpecConfig(method=method, model=str(path), num_speculative_tokens=n)


def _build(spec: SpecConfig, cfg, model):
    check_drafter(spec, cfg)
    return build_drafter(spec, target_config=cfg, target_model=model, dtype=torch.float32, device="cpu")


# -- the file reads as its folder -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_file_reads_as_its_folder(gemma, name):
    """Config (Gemma 4 layers, the full layers' head shape and RoPE, the heads, the slot layout), every tensor f32
    exactly (under the folder's names), and the loaded networks' weights."""
    model, cfg, drafters = gemma
    folder, path = drafters[name]
    got, want = read_dspark_config(path, num_target_layers=7), read_dspark_config(folder, num_target_layers=7)
    assert got == want
    assert (want.draft_layers, want.head_dim, want.num_key_value_heads, want.markov_rank) == ("gemma4", 32, 1, 8)
    assert want.slot_layout == ("dspark" if name == "proportional" else "zlab")
    assert want.enable_confidence_head == (name == "proportional")
    assert want.rope_scaling == ({"rope_type": "proportional", "partial_rotary_factor": 0.25}
                                 if name == "proportional" else None)
    file_tensors, folder_tensors = load_tensors(path), load_tensors(folder)
    assert sorted(file_tensors) == sorted(folder_tensors)
    for key, tensor in folder_tensors.items():
        assert torch.equal(file_tensors[key], tensor), key
    (a, _), (b, _) = (load_dspark(p, target_model=model) for p in (path, folder))
    assert type(a).__name__ == "Gemma4DSparkModel"
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_method_and_drafts_are_inferred_from_file_and_folder(gemma):
    _, _, drafters = gemma
    for name, drafts in (("proportional", 4), ("default", 3)):
        for path in drafters[name]:
            spec = SpecConfig.from_dict({"model": str(path)})
            assert (spec.method, spec.num_speculative_tokens) == ("dspark", drafts), path


# -- the forward against a slow twin from the specification ------------------------------------------------------
def _rms(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float, factors: torch.Tensor) -> torch.Tensor:
    """NeoX RoPE with llama.cpp's per-pair frequency factors: x [n, heads, hd], pos [n]."""
    half = x.shape[-1] // 2
    inv = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1]) / factors  # [hd / 2]
    ang = pos.double()[:, None, None] * inv  # [n, 1, hd / 2]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1)


def twin(t: dict, c: dict, embed: torch.Tensor, taps: torch.Tensor, anchor: int, num_draft: int, flaw: str = ""):
    """One block of the Gemma 4 DSpark drafter, written from llama.cpp's dflash graph, in float64, position by position
    where attention mixes them: `t` the folder's tensors (its names), `c` its config.json, `embed` [vocab, hidden] the
    target's (tied) embedding, taps [n, num_taps * hidden] of context positions 0 .. n - 1, the anchor at n →
    (base logits [num_draft, vocab], greedy drafts [num_draft], confidences [num_draft] or None)."""
    t = {k: v.double() for k, v in t.items()}
    norm = (lambda w: w + 1.0) if flaw == "norm_plus_one" else (lambda w: w)
    hd, heads, kv = c["global_head_dim"], c["num_attention_heads"], c["num_global_key_value_heads"]
    rope = c["rope_parameters"]["full_attention"]
    pairs = int(rope.get("partial_rotary_factor", 1.0) * hd / 2) if rope["rope_type"] == "proportional" else hd // 2
    factors = torch.tensor([1.0] * pairs + [1e30] * (hd // 2 - pairs), dtype=torch.float64)
    scale = hd ** -0.5 if flaw == "attention_scale" else 1.0
    n, block, off = taps.shape[0], c["block_size"], 0 if c["sample_from_anchor"] else 1
    ctx = _rms(taps.double() @ t["fc.weight"].T, norm(t["hidden_norm.weight"]))  # [n, hidden]
    ids = [anchor] + [c["dflash_config"]["mask_token_id"]] * (block - 1)
    pos, ctx_pos = torch.arange(n, n + block), torch.arange(n)
    h = embed.double()[ids] * (1.0 if flaw == "unscaled_embedding" else math.sqrt(c["hidden_size"]))  # [block, hidden]
    for i in range(c["num_hidden_layers"]):
        p = lambda name: t[f"layers.{i}.{name}"]  # noqa: E731

        def kv_of(y, where):  # y [rows, hidden] -> K (k-normed, rotated), V (the raw projection's plain RMS)
            raw = (y @ p("self_attn.k_proj.weight").T).view(-1, kv, hd)
            k = _rope(_rms(raw, norm(p("self_attn.k_norm.weight"))), where, rope["rope_theta"], factors)
            return k, (_rms(raw, norm(p("self_attn.k_norm.weight"))) if flaw == "v_k_normed" else _rms(raw))
        x = _rms(h, norm(p("input_layernorm.weight")))
        q = _rope(_rms((x @ p("self_attn.q_proj.weight").T).view(block, heads, hd), norm(p("self_attn.q_norm.weight"))),
                  pos, rope["rope_theta"], factors)
        (kc, vc), (kb, vb) = kv_of(ctx, ctx_pos), kv_of(x, pos)
        keys, values = torch.cat([kc, kb]), torch.cat([vc, vb])  # [n + block, kv, hd]
        out = torch.zeros(block, heads, hd, dtype=torch.float64)
        for row in range(block):
            for head in range(heads):
                g = head // (heads // kv)
                weights = torch.softmax(keys[:, g] @ q[row, head] * scale, 0)  # [n + block]
                out[row, head] = weights @ values[:, g]
        h = h + _rms(out.reshape(block, -1) @ p("self_attn.o_proj.weight").T, norm(p("post_attention_layernorm.weight")))
        y = _rms(h, norm(p("pre_feedforward_layernorm.weight")))
        gate = y @ p("mlp.gate_proj.weight").T
        gelu = 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate ** 3)))
        ffn = (gelu * (y @ p("mlp.up_proj.weight").T)) @ p("mlp.down_proj.weight").T
        h = (h + _rms(ffn, norm(p("post_feedforward_layernorm.weight")))) * p("layer_scalar")
    final = _rms(h, norm(t["norm.weight"]))[off:off + num_draft]  # [num_draft, hidden]
    base = final @ embed.double().T  # [num_draft, vocab]
    w1, w2 = t["markov_head.markov_w1.weight"], t["markov_head.markov_w2.weight"]
    prev, drafts, conf = anchor, [], []
    for k in range(num_draft):
        if "confidence_proj.weight" in t:
            feature = torch.cat([final[k], w1[prev]])
            conf.append(torch.sigmoid(t["confidence_proj.weight"][0] @ feature + t["confidence_proj.bias"][0]))
        prev = int((base[k] + w2 @ w1[prev]).argmax())
        drafts.append(prev)
    return base, torch.tensor(drafts), torch.stack(conf) if conf else None


def _drafter_block(drafter: DSparkDrafter, taps: torch.Tensor, ids: list[int], num_draft: int):
    """The drafter's base logits [num_draft, vocab], greedy drafts [num_draft] and confidences after the context
    `ids[:-1]` (their taps), anchored at ids[-1]: one request through its paged pool."""
    from dspark.drafters.base import ContextSegment, ContextUpdate, ProposeBatch
    from tests.dspark_helpers import make_pool, propose_request
    make_pool(drafter, num_blocks=16, kv_block_size=4)
    n, table = len(ids) - 1, [1, 2, 3, 4]
    drafter.extend_context(ContextUpdate([ContextSegment("r", table, 0, ids[:n], None, slice(0, n))], taps))
    batch = ProposeBatch([propose_request("r", ids, n, table)], 4, "greedy")
    base = drafter.forward_blocks(batch)[0][0]
    out = drafter.propose(batch)
    return base, out.draft_ids[0], None if out.confidence is None else out.confidence[0]


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_forward_matches_the_slow_twin_and_the_twin_can_tell(gemma, name):
    """The file's drafter (fp32) against the twin on the folder's tensors: base logits and confidences within TOL,
    the same greedy drafts; each flaw of the twin moves the logits by more than 100 TOL."""
    model, cfg, drafters = gemma
    folder, path = drafters[name]
    net, _ = load_dspark(path, target_model=model)
    num_draft = net.cfg.max_draft_tokens
    drafter = DSparkDrafter(net, num_draft_tokens=num_draft)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(5, GEMMA4_VOCAB_SIZE, (10,), generator=g).tolist()
    taps = torch.randn(9, len(TAPS) * HIDDEN, generator=g)
    base, drafts, conf = _drafter_block(drafter, taps, ids, num_draft)
    tensors, config = load_tensors(folder), json.loads((folder / "config.json").read_text())
    embed = model.model.embed_tokens.weight.detach()
    want_base, want_drafts, want_conf = twin(tensors, config, embed, taps, ids[-1], num_draft)
    assert float((base.double() - want_base).abs().max()) < TOL
    assert torch.equal(drafts, want_drafts)
    assert (conf is None) == (want_conf is None) == (name == "default")
    assert conf is None or float((conf.double() - want_conf).abs().max()) < TOL
    for flaw in ("norm_plus_one", "unscaled_embedding", "v_k_normed", "attention_scale"):
        wrong = twin(tensors, config, embed, taps, ids[-1], num_draft, flaw=flaw)[0]
        assert float((base.double() - wrong).abs().max()) > 100 * TOL, flaw


# -- speculative decoding -----------------------------------------------------------------------------------------
def test_greedy_speculative_decoding_equals_plain(gemma):
    """Methods dspark (heads) and dflash (heads off) from the file, dspark from the folder: the output of plain
    greedy decoding, with drafts proposed."""
    from tests.test_gemma4 import _looping_prompts
    model, cfg, drafters = gemma
    folder, path = drafters["proportional"]
    prompts = _looping_prompts(3, seed=4)
    plain = run(make_engine(model, cfg), prompts, greedy(14))
    for spec in (_spec(path), _spec(path, "dflash"), _spec(folder), _spec(drafters["default"][1])):
        engine = make_engine(model, cfg, drafter=_build(spec, cfg, model), spec=spec)
        assert run(engine, prompts, greedy(14)) == plain, spec.model
        assert engine.metrics.num_draft_tokens > 0


# -- what still cannot run --------------------------------------------------------------------------------------
@pytest.mark.parametrize("edit, named", [
    (dict(attention_k_eq_v=False), r"a separate V projection \(attention_k_eq_v false"),
    (dict(layer_types=["sliding_attention", "full_attention"]), r"draft layers other than full attention"),
    (dict(hidden_activation="silu"), r"hidden_activation 'silu': only gelu_pytorch_tanh"),
    (dict(attention_bias=True), "attention biases"),
    (dict(enable_moe_block=True), r"a MoE block \(enable_moe_block\)"),
    (dict(draft_vocab_size=64), r"a reduced draft vocabulary \(draft_vocab_size\)"),
    (dict(final_logit_softcapping=30.0), "final logit soft-capping"),
    (dict(dflash_config={"mask_token_id": 4, "target_layer_ids": [0, 3], "use_swa": True, "swa_window_size": 8}),
     r"sliding-window draft attention \(use_swa\)"),
    (dict(is_causal=True), "causal draft attention"),
    (dict(rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 2.0}}), r"RoPE 'yarn': only default"),
    (dict(global_head_dim=None), "lacks 'global_head_dim'"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_a_folder_config_that_cannot_run_is_refused_by_name(tmp_path, edit, named):
    def folder(name: str, **edit) -> Path:
        config = {"architectures": ["Gemma4DSparkModel"], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
                  "num_hidden_layers": 2, "num_attention_heads": 4, "global_head_dim": 32,
                  "num_global_key_value_heads": 1, "attention_k_eq_v": True, "layer_types": ["full_attention"] * 2,
                  "block_size": 4, "dflash_config": {"mask_token_id": 4, "target_layer_ids": [0, 3]}}
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({k: v for k, v in {**config, **edit}.items()
                                                                 if v is not None}))
        return tmp_path / name
    assert read_dspark_config(folder("base"), num_target_layers=7).draft_layers == "gemma4"
    with pytest.raises(ValueError, match=named):
        read_dspark_config(folder("edited", **edit), num_target_layers=7)


_GEMMA4_HEADER = dict(keys={"hidden_activation": "gelu_pytorch_tanh", "embedding_scale": math.sqrt(8.0),
                            "attention.scale": 1.0, "sample_from_anchor": 1},
                      tensors=("blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight",
                               "blk.0.layer_output_scale.weight"), drop=("blk.0.attn_v.weight",))


def _gemma4_header(path: Path, *, keys=None, tensors=(), drop=(), values=None, keep_v: bool = False) -> Path:
    """A dflash header with Gemma 4 layers (one layer, hidden 8, key length 4), with edits (`keep_v`: attn_v too)."""
    base = _GEMMA4_HEADER
    return _synthetic_dflash(path, keys={**base["keys"], **(keys or {})}, tensors=base["tensors"] + tuple(tensors),
                             drop=(() if keep_v else base["drop"]) + tuple(drop), values=values)


def test_a_gemma4_header_reads_as_its_folder_config(tmp_path):
    c = read_config(_gemma4_header(tmp_path / "g.gguf", values={"rope_freqs.weight": np.array([1.0, 1e30])}))
    assert c["architectures"] == ["Gemma4DSparkModel"] and c["attention_k_eq_v"] and c["sample_from_anchor"]
    assert (c["global_head_dim"], c["num_global_key_value_heads"], c["target_layer_ids"]) == (4, 1, [0, 1])
    assert c["rope_parameters"]["full_attention"]["partial_rotary_factor"] == 0.5


@pytest.mark.parametrize("edit, named", [
    (dict(keep_v=True), r"a separate V projection \(attn_v\)"),
    (dict(keys={"hidden_activation": "gelu"}), "a feed-forward activation other than gelu_pytorch_tanh"),
    (dict(drop=("blk.0.post_ffw_norm.weight",)), "a Gemma 4 layer without all of its sandwich norms"),
    (dict(keys={"embedding_scale": 8.0}), r"an embedding scale other than sqrt\(embedding_length\)"),
    (dict(keys={"attention.scale": 0.5}), "an attention scale other than 1.0"),
    (dict(keys={"rope.dimension_count": 2}), "partial RoPE other than proportional RoPE's"),
    (dict(keys={"rope.scaling.type": "linear"}), "RoPE scaling"),
    (dict(tensors=("d2t",)), r"a reduced draft vocabulary \(d2t\)"),
    (dict(values={"rope_freqs.weight": np.array([1.0, 0.5])}), r"per-dimension RoPE frequencies \(rope_freqs\) other"),
    (dict(tensors=("blk.0.attn_sinks.weight",)), "attention sinks"),
    (dict(keys={"final_logit_softcapping": 30.0}), "final logit soft-capping"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_a_gemma4_file_that_cannot_run_is_refused_by_name(tmp_path, monkeypatch, edit, named):
    path = _gemma4_header(tmp_path / "edited.gguf", **edit)
    monkeypatch.setattr(gguf_drafters, "gguf_values", lambda t: pytest.fail("a tensor's data was read"))
    with pytest.raises(ValueError, match=named):
        read_config(path)


def test_a_gemma4_file_given_to_another_method_is_refused_by_name(gemma, monkeypatch):
    model, cfg, drafters = gemma
    path = drafters["proportional"][1]
    _refused_before_data(monkeypatch, lambda: check_drafter(_spec(path, "mtp"), cfg),
                         r"drafts with methods 'dspark' and 'dflash', not 'mtp'")
    _refused_before_data(monkeypatch, lambda: check_drafter(_spec(path, "eagle3"), cfg),
                         r"drafts with methods 'dspark' and 'dflash', not 'eagle3'")
