"""Drafters from the GGUF files llama.cpp's own converter writes (`dspark/drafters/gguf_drafters.py`; the converter of
tests/llama_cpp_convert.py, skipped, saying why, without it). Tiny random HF checkpoints are saved and converted once
per module:

* Gemma 4's assistant (`Gemma4AssistantForCausalLM`, tests/test_gemma4_assistant.py's, the plain head) for a tiny
  Gemma 4 target, f32 and q8_0, and the same assistant with the centroid head (which the converter drops);
* a DSpark drafter in dspark's own format (Markov and confidence heads, a reduced vocabulary: `d2t`) and a z-lab
  DFlash one (`DFlashDraftModel`: no heads, the anchor predicts nothing) for a tiny Qwen3 target with the Qwen2
  vocabulary, converted with `--target-model-dir`.

Gemma 4 DSpark drafters (`Gemma4DSparkModel`), folders and files: tests/test_gemma4_dspark.py.

Checked: the file's config and tensors equal the HF folder's (f32 exactly; q8_0 within its rounding); greedy
speculative decoding with the file equals plain decoding and accepts exactly what the folder's drafter accepts; the
method is inferred from the file as from the folder; a wrong name mapping breaks the drafts; what dspark cannot run
(a GGUF of another architecture, a drafter file given to another method, what the Qwen3-style network lacks) is
refused by name before any tensor's data is read.

    pytest tests/test_gguf_drafters.py -q
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dspark.config import SpecConfig
from dspark.drafters import build_drafter, check_drafter, gguf_drafters
from dspark.drafters.checkpoint import load_tensors
from dspark.drafters.gemma4_assistant import read_assistant_config
from dspark.models import build_model
from tests.engine_helpers import greedy, make_engine, run
from tests.llama_cpp_convert import GEMMA4_VOCAB_SIZE, convert, converter_missing, gemma4_tokenizer, qwen_tokenizer

QWEN_VOCAB, QWEN_EOS, QWEN_MASK = 151936, 151643, 151669


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    missing = converter_missing()
    if missing:
        pytest.skip(missing)
    return tmp_path_factory.mktemp("gguf_drafters")


def _build(spec: SpecConfig, cfg, model):
    check_drafter(spec, cfg)
    return build_drafter(spec, target_config=cfg, target_model=model, dtype=torch.float32, device="cpu")


def _speculate(model, cfg, spec: SpecConfig, prompts, n: int = 14):
    """(greedy outputs, accepted tokens, accepted per draft position) of an engine drafting with `spec`."""
    engine = make_engine(model, cfg, drafter=_build(spec, cfg, model), spec=spec)
    out = run(engine, prompts, greedy(n))
    m = engine.metrics
    assert m.num_draft_tokens > 0
    return out, m.num_accepted_tokens, list(m.accepted_per_pos)


def _same_tensors(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def _refused_before_data(monkeypatch, call, match: str) -> None:
    monkeypatch.setattr(gguf_drafters, "gguf_values", lambda t: pytest.fail("a tensor's data was read"))
    with pytest.raises(ValueError, match=match):
        call()
    monkeypatch.undo()


# -- Gemma 4's assistant --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma(workdir):
    """(target model, its config, its folder, {name: (assistant folder, {outtype: GGUF})})."""
    from tests.test_gemma4 import DENSE, hf_gemma4
    from tests.test_gemma4_assistant import hf_assistant
    cfg = replace(DENSE, vocab_size=GEMMA4_VOCAB_SIZE, vocab_size_per_layer_input=GEMMA4_VOCAB_SIZE)
    hf = hf_gemma4(cfg, seed=2)
    folder = workdir / "gemma4"
    hf.save_pretrained(folder)
    gemma4_tokenizer(folder)
    model = build_model(cfg)
    with torch.inference_mode():
        model.load_weights(hf.state_dict().items())
    assistants = {}
    for name, ordered in (("plain", False), ("centroids", True)):
        path = workdir / f"assistant-{name}"
        hf_assistant(cfg, ordered=ordered).save_pretrained(path)
        gemma4_tokenizer(path)  # the converter writes the assistant's vocabulary
        assistants[name] = (path, {"f32": convert(path, "f32", workdir / f"assistant-{name}-f32.gguf")})
    return model, cfg, folder, assistants


def _assistant_spec(path, n: int = 3) -> SpecConfig:
    return SpecConfig.from_dict({"method": "mtp", "model": str(path), "num_speculative_tokens": n})


def _prompts(seed: int):
    from tests.test_gemma4 import _looping_prompts
    return _looping_prompts(3, seed=seed)


def test_assistant_file_reads_as_its_folder(gemma):
    """Config (the centroid head aside: the converter drops it) and every tensor, f32 exactly; the centroid
    assistant's file holds the rest of its folder's tensors and drafts with the full tied head."""
    _, _, _, assistants = gemma
    for name, (folder, files) in assistants.items():
        got, want = read_assistant_config(files["f32"]), read_assistant_config(folder)
        assert got.text == want.text and got.backbone_hidden_size == want.backbone_hidden_size, name
        assert not got.use_ordered_embeddings and want.use_ordered_embeddings == (name == "centroids")
        folder_tensors = {k: v for k, v in load_tensors(folder).items() if not k.startswith("masked_embedding.")}
        _same_tensors(load_tensors(files["f32"]), folder_tensors)


def test_assistant_file_drafts_and_speculates_as_its_folder(gemma):
    """The built drafters' weights are equal, so are their drafts and logits after a prompt (two requests, one
    batch); greedy speculative output with the file equals plain output and accepts what the folder's does."""
    from tests.test_gemma4_assistant import PROMPTS, dspark_drafts
    model, cfg, _, assistants = gemma
    folder, files = assistants["plain"]
    file_drafter = _build(_assistant_spec(files["f32"], 4), cfg, model)
    folder_drafter = _build(_assistant_spec(folder, 4), cfg, model)
    _same_tensors(file_drafter.model.state_dict(), folder_drafter.model.state_dict())
    anchors = [7, 300]
    got, want = (dspark_drafts(model, cfg, d, PROMPTS, anchors) for d in (file_drafter, folder_drafter))
    assert got[0] == want[0] and torch.equal(got[1], want[1])
    prompts = _prompts(4)
    from_file = _speculate(model, cfg, _assistant_spec(files["f32"]), prompts)
    assert from_file[0] == run(make_engine(model, cfg), prompts, greedy(14))
    assert _speculate(model, cfg, _assistant_spec(folder), prompts) == from_file


def test_assistant_q8_0_file_is_within_its_rounding_and_lossless(gemma, workdir):
    model, cfg, _, assistants = gemma
    folder, files = assistants["plain"]
    files.setdefault("q8_0", convert(folder, "q8_0", workdir / "assistant-plain-q8_0.gguf"))
    full, quant = load_tensors(files["f32"]), load_tensors(files["q8_0"])
    assert sorted(quant) == sorted(full)
    assert any(not torch.equal(quant[k], full[k]) for k in full)  # the matrices are Q8_0 blocks
    for name, want in full.items():  # half a step of a block's amax / 127
        assert float((quant[name] - want).abs().max()) <= float(want.abs().max()) / 200, name
    prompts = _prompts(5)
    assert _speculate(model, cfg, _assistant_spec(files["q8_0"]), prompts)[0] == \
        run(make_engine(model, cfg), prompts, greedy(14))


def test_assistant_file_through_build_engine_with_the_method_inferred(gemma):
    """The user's path: the target's folder and the assistant's GGUF (no method: inferred "mtp", as from the
    assistant's folder) through `build_engine`."""
    from dspark.config import CacheConfig, EngineConfig, SchedulerConfig
    from dspark.engine.build import build_engine
    _, _, target, assistants = gemma
    path = str(assistants["plain"][1]["f32"])
    spec = SpecConfig.from_dict({"model": path, "num_speculative_tokens": 3})
    assert spec.method == "mtp"

    def engine(spec):
        return build_engine(EngineConfig(model=str(target), spec=spec, cache=CacheConfig(
            kv_block_size=4, num_kv_blocks=64), scheduler=SchedulerConfig(max_num_batched_tokens=24)))[0]
    prompts = _prompts(6)
    spec_engine = engine(spec)
    assert run(spec_engine, prompts, greedy(12)) == run(engine(None), prompts, greedy(12))
    assert spec_engine.metrics.num_draft_tokens > 0


def test_another_architecture_is_refused_by_name_before_any_data(gemma, tmp_path, monkeypatch):
    import gguf
    _, cfg, _, _ = gemma
    path = tmp_path / "target.gguf"  # a target's file (the header of Gemma 4's) given as the assistant
    w = gguf.GGUFWriter(str(path), "gemma4")
    w.add_block_count(1)
    w.add_tensor("blk.0.attn_q.weight", torch.ones(4, 4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _refused_before_data(monkeypatch, lambda: check_drafter(_assistant_spec(path), cfg),
                         r"GGUF architecture 'gemma4' is not a drafter dspark reads; drafter GGUFs: 'dflash' .*"
                         r"'gemma4-assistant' \(Gemma 4 assistant, method 'mtp'\)")


# -- DFlash / DSpark ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen(workdir):
    """(target model, config, its folder, {name: (drafter folder, GGUF, method)}): a DSpark drafter in dspark's own
    format (heads, reduced vocabulary) and a z-lab DFlash one, each converted with the target's folder."""
    from dspark.drafters.dspark import save_dspark
    from dspark.drafters.dspark_config import dspark_config_for_target
    from tests.dspark_helpers import TARGET, random_model
    cfg = replace(TARGET, vocab_size=QWEN_VOCAB, bos_token_id=QWEN_EOS, eos_token_ids=(QWEN_EOS,))
    torch.manual_seed(0)
    model = build_model(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    target = workdir / "qwen3"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(cfg.to_hf()))
    (workdir / "qwen_tokenizer").mkdir()
    qwen_tokenizer(workdir / "qwen_tokenizer", target)
    drafters = {}
    for name, kw in (("dspark", dict(markov_rank=8, enable_confidence_head=True, draft_vocab_size=64, taps=(-1, 0, 2))),
                     ("dflash", dict(markov_rank=0, slot_layout="zlab", taps=(0, 2)))):
        dcfg = dspark_config_for_target(cfg, num_hidden_layers=2, block_size=4, mask_token_id=QWEN_MASK,
                                        tap_layer_ids=kw.pop("taps"), **kw)
        drafter = random_model(dcfg, seed=3)
        if dcfg.draft_vocab_size:  # the target's special ids and the prompts' range among the draft vocabulary
            ids = torch.randperm(5000, generator=torch.Generator().manual_seed(3))[:dcfg.draft_vocab_size - 1]
            drafter.reset_buffers(d2t=torch.cat([ids, torch.tensor([QWEN_EOS])]).sort().values)
        folder = workdir / name
        save_dspark(drafter, dcfg, folder, dtype="float32")
        if name == "dflash":
            _as_zlab(folder)
        drafters[name] = (folder, convert(folder, "f32", workdir / f"{name}-f32.gguf", target=target), name)
    return model, cfg, target, drafters


def _as_zlab(folder: Path) -> None:
    """dspark's config.json rewritten as z-lab's DFlash one (the converter's `DFlashDraftModel`)."""
    c = json.loads((folder / "config.json").read_text())
    nested = {"mask_token_id": c.pop("mask_token_id"), "target_layer_ids": c.pop("target_layer_ids")}
    for key in ("slot_layout", "sample_from_anchor", "markov_rank", "markov_head_type", "enable_confidence_head",
                "confidence_head_with_markov", "draft_vocab_size", "anchor_features"):
        c.pop(key)
    (folder / "config.json").write_text(json.dumps({**c, "architectures": ["DFlashDraftModel"],
                                                    "dflash_config": nested}))


def _block_spec(path, method: str, n: int = 3, **kw) -> SpecConfig:
    return SpecConfig(method=method, model=str(path), num_speculative_tokens=n, **kw)


def _qwen_prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(5, 5000, (5,), generator=g).tolist()
    return [motif * 3 + torch.randint(5, 5000, (4 + i,), generator=g).tolist() for i in range(3)]


@pytest.mark.parametrize("name", ["dspark", "dflash"])
def test_block_drafter_file_reads_as_its_folder(qwen, name):
    """The file's drafter config equals the folder's (the target's depth taken from the target, as for Speculators'
    files), its tensors the folder's (the d2t read as absolute ids by both), and the built drafters' weights."""
    from dspark.drafters.dspark_checkpoint import read_dspark_config
    from dspark.drafters.vocab import read_d2t
    model, cfg, _, drafters = qwen
    folder, path, method = drafters[name]
    assert read_dspark_config(path, num_target_layers=4) == read_dspark_config(folder, num_target_layers=4)
    with pytest.raises(ValueError, match=r"\(gguf-dflash\) does not name the target's depth"):
        read_dspark_config(path)
    _same_tensors(load_tensors(path, skip=("d2t",)), load_tensors(folder, skip=("d2t",)))
    if name == "dspark":
        assert torch.equal(read_d2t(path, vocab_size=QWEN_VOCAB, where="file"),
                           read_d2t(folder, vocab_size=QWEN_VOCAB, where="folder"))
    _same_tensors(_build(_block_spec(path, method), cfg, model).model.state_dict(),
                  _build(_block_spec(folder, method), cfg, model).model.state_dict())


def _proposal(drafter, seed: int = 2):
    """The drafter's greedy proposal for 3 requests after 8 context positions of random taps: (draft ids [3, k],
    confidences or None)."""
    from dspark.drafters.base import ContextSegment, ContextUpdate, ProposeBatch
    from tests.dspark_helpers import make_pool, propose_request
    make_pool(drafter, num_blocks=16, kv_block_size=4)
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(5, 5000, (9,), generator=g).tolist() for _ in range(3)]
    tables = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    taps = torch.randn(24, drafter.cfg.num_taps * drafter.cfg.hidden_size, generator=g)
    drafter.extend_context(ContextUpdate([ContextSegment(f"r{i}", tables[i], 0, ids[i][:8], None,
                                                         slice(8 * i, 8 * i + 8)) for i in range(3)], taps))
    out = drafter.propose(ProposeBatch([propose_request(f"r{i}", ids[i], 8, tables[i]) for i in range(3)], 4,
                                       "greedy"))
    return out.draft_ids, out.confidence


@pytest.mark.parametrize("name", ["dspark", "dflash"])
def test_block_drafter_file_drafts_and_speculates_as_its_folder(qwen, name):
    """Equal proposals (draft ids and, with the heads, confidences) from the same context; greedy speculative
    output with the file equals plain output and accepts what the folder's does."""
    model, cfg, _, drafters = qwen
    folder, path, method = drafters[name]
    (got_ids, got_conf), (want_ids, want_conf) = (_proposal(_build(_block_spec(p, method), cfg, model))
                                                  for p in (path, folder))
    assert torch.equal(got_ids, want_ids)
    assert (got_conf is None) == (want_conf is None) == (name == "dflash")
    assert got_conf is None or torch.equal(got_conf, want_conf)
    prompts = _qwen_prompts(1)
    plain = run(make_engine(model, cfg), prompts, greedy(14))
    from_file = _speculate(model, cfg, _block_spec(path, method), prompts)
    assert from_file[0] == plain
    assert _speculate(model, cfg, _block_spec(folder, method), prompts) == from_file


def test_block_drafter_method_and_drafts_are_inferred_from_the_file(qwen):
    """As from the folder: heads -> "dspark", none -> "dflash"; drafts per block: 4 (dspark layout), 3 (zlab)."""
    _, _, _, drafters = qwen
    for name, drafts in (("dspark", 4), ("dflash", 3)):
        folder, path, _ = drafters[name]
        got, want = SpecConfig.from_dict({"model": str(path)}), SpecConfig.from_dict({"model": str(folder)})
        assert (got.method, got.num_speculative_tokens) == (want.method, want.num_speculative_tokens) == (name, drafts)


def test_a_wrong_mapping_breaks_the_drafts(qwen, monkeypatch):
    """The parity above can fail: with the attention's input norm and the feed-forward one swapped, the file's
    confidences (and drafts) move off the folder's."""
    from dspark.drafters.gguf_drafters import _DFLASH_BLOCK
    model, cfg, _, drafters = qwen
    folder, path, method = drafters["dspark"]
    want = _proposal(_build(_block_spec(folder, method), cfg, model))
    assert torch.equal(_proposal(_build(_block_spec(path, method), cfg, model))[1], want[1])
    first = _DFLASH_BLOCK["attn_norm.weight"]
    monkeypatch.setitem(_DFLASH_BLOCK, "attn_norm.weight", _DFLASH_BLOCK["ffn_norm.weight"])
    monkeypatch.setitem(_DFLASH_BLOCK, "ffn_norm.weight", first)
    got = _proposal(_build(_block_spec(path, method), cfg, model))
    assert (got[1] - want[1]).abs().max() > 1e-3


def test_a_drafter_file_given_to_another_method_is_refused_by_name(qwen, gemma, monkeypatch):
    model, cfg, _, drafters = qwen
    path = drafters["dspark"][1]
    _refused_before_data(monkeypatch, lambda: check_drafter(_block_spec(path, "eagle3"), cfg),
                         r"a DFlash / DSpark drafter GGUF \(architecture 'dflash'\) drafts with methods 'dspark' and "
                         r"'dflash', not 'eagle3'")
    _refused_before_data(monkeypatch, lambda: check_drafter(_block_spec(drafters["dflash"][1], "dspark"), cfg),
                         "method 'dspark' needs a Markov head but the checkpoint has markov_rank 0")
    _, gcfg, _, assistants = gemma
    _refused_before_data(monkeypatch, lambda: check_drafter(_assistant_spec(path), gcfg),
                         r"drafts with methods 'dspark' and 'dflash', not 'mtp'")
    _refused_before_data(monkeypatch, lambda: check_drafter(_block_spec(assistants["plain"][1]["f32"], "dspark"),
                                                            gcfg), r"Gemma 4 assistant GGUF .* not 'dspark'")


# -- what dspark's block drafter network lacks, on synthetic headers ----------------------------------------------
def _synthetic_dflash(path: Path, *, keys: dict | None = None, tensors: tuple[str, ...] = (),
                      drop: tuple[str, ...] = (), values: dict | None = None) -> Path:
    """A dflash GGUF header (one layer, zero tensors) as the converter writes a z-lab DFlash drafter's, with `keys`
    added ({key: value}, the `dflash.` prefix implied), `tensors` added, `values` ({name: float32 array}) added with
    their data and `drop` left out."""
    import gguf
    w = gguf.GGUFWriter(str(path), "dflash")
    for key, value in {"block_count": 1, "context_length": 64, "embedding_length": 8, "feed_forward_length": 16,
                       "attention.head_count": 2, "attention.head_count_kv": 1, "attention.key_length": 4,
                       "block_size": 4, **(keys or {})}.items():
        if isinstance(value, str):
            w.add_string(f"dflash.{key}", value)
        elif isinstance(value, float):
            w.add_float32(f"dflash.{key}", value)
        else:
            w.add_uint32(f"dflash.{key}", value)
    w.add_array("dflash.target_layers", [1, 2])
    w.add_uint32("tokenizer.ggml.mask_token_id", 3)
    shapes = {"token_embd.weight": (16, 8), "fc.weight": (8, 16), "blk.0.attn_v.weight": (4, 8), **{
        n: (2,) for n in tensors}}
    for name, shape in shapes.items():
        if name not in drop:
            w.add_tensor(name, torch.zeros(shape).numpy())
    for name, data in (values or {}).items():
        w.add_tensor(name, data.astype("float32"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("edit, named", [
    (dict(keys={"hidden_activation": "gelu_pytorch_tanh"}), r"a GELU feed-forward \(hidden_activation\)"),
    (dict(keys={"hyper_connection.count": 4}), "DeepSeek-V4 DSpark stages"),
    (dict(tensors=("selector_hidden.weight",)), "DFlash2's convolutions and candidate selector"),
    (dict(tensors=("blk.0.attn_sinks.weight",)), "attention sinks"),
    (dict(keys={"attention.sliding_window": 8}), "sliding-window draft attention"),
    (dict(keys={"attention.causal": 1}), "causal draft attention"),
    (dict(drop=("blk.0.attn_v.weight",)), r"K = V draft attention \(no attn_v\)"),
    (dict(keys={"rope.dimension_count": 2}), "partial RoPE"),
    (dict(keys={"embedding_scale": 8.0}), "scaled embeddings"),
    (dict(keys={"attention.value_scale": 0.5}), "an attention value scale"),
    (dict(keys={"logit_scale": 2.0}), "a logit scale"),
    (dict(keys={"final_logit_softcapping": 30.0}), "final logit soft-capping"),
    (dict(tensors=("fc.scale",)), r"quantization scale tensors \(\*.scale\)"),
    (dict(keys={"rope.scaling.type": "yarn"}), "RoPE scaling 'yarn'"),
    (dict(tensors=("blk.0.attn_gate.weight",)), "GGUF tensor 'blk.0.attn_gate.weight' has no equivalent"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_what_the_network_lacks_is_refused_by_name(tmp_path, edit, named):
    from dspark.drafters.checkpoint import header_shapes, read_config
    base = read_config(_synthetic_dflash(tmp_path / "base.gguf"))
    assert (base["target_layer_ids"], base["slot_layout"], base["mask_token_id"], base["vocab_size"]) == \
        ([0, 1], "zlab", 3, 16)
    path = _synthetic_dflash(tmp_path / "edited.gguf", **edit)
    with pytest.raises(ValueError, match=named):
        read_config(path)
        header_shapes(path)
