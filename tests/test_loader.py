"""Loading: HF safetensors directories (single file and sharded index) round-trip into our modules,
bad checkpoints raise naming the key, the SmolLM2 GGUF header maps onto ModelConfig, the GGUF q/k row
un-permutation inverts llama.cpp's, and the tokenizer's chat template emits <|im_start|>."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import TINY_LLAMA, TINY_QWEN3, PagedKV, _require, hf_twin
from dspark.models.loader import (DEFAULT_MODEL, GGUFSource, SafetensorsSource, load_model,
                                  resolve_model_path, unpermute_rope_rows)

ATOL = 1e-5


def _save_tiny(cfg, tmp_path, *, max_shard_size=None):
    hf = hf_twin(cfg, seed=11)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    hf.save_pretrained(tmp_path, safe_serialization=True, **kwargs)
    return hf


def _check_same_logits(model, hf, vocab):
    ids = list(range(3, 3 + 11))
    kv = PagedKV.create(model, num_requests=1, max_len=len(ids), kv_block_size=4)
    hidden, _ = kv.step(model, [(ids, 0)])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    err = (model.compute_logits(hidden) - ref).abs().max().item()
    assert err < 1e-4, f"loaded model logits differ from the saved HF model by {err:.2e} (atol 1e-4)"


@pytest.mark.parametrize("cfg", [TINY_LLAMA, TINY_QWEN3], ids=["llama", "qwen3"])
def test_safetensors_roundtrip(cfg, tmp_path):
    hf = _save_tiny(cfg, tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    source = SafetensorsSource(tmp_path)
    assert source.config == cfg, f"config.json round trip changed the config: {source.config} vs {cfg}"
    from dspark.models import build_model
    model = build_model(source.config)
    model.load_weights(source.weights())
    _check_same_logits(model, hf, cfg.vocab_size)


def test_sharded_safetensors(tmp_path):
    hf = _save_tiny(TINY_LLAMA, tmp_path, max_shard_size="60KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "expected several shards"
    source = SafetensorsSource(tmp_path)
    from dspark.models import build_model
    model = build_model(source.config)
    model.load_weights(source.weights())
    _check_same_logits(model, hf, TINY_LLAMA.vocab_size)


def test_bad_checkpoint_keys_are_named(tmp_path):
    from safetensors.torch import load_file, save_file
    from dspark.models import build_model
    _save_tiny(TINY_LLAMA, tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    sd["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(KeyError, match=r"model\.layers\.0\.mlp\.extra_proj\.weight"):
        build_model(TINY_LLAMA).load_weights(SafetensorsSource(tmp_path).weights())
    del sd["model.layers.0.mlp.extra_proj.weight"]
    del sd["model.layers.2.mlp.up_proj.weight"]
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(KeyError, match=r"model\.layers\.2\.mlp\.up_proj\.weight"):
        build_model(TINY_LLAMA).load_weights(SafetensorsSource(tmp_path).weights())
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        SafetensorsSource(tmp_path)


def test_unpermute_inverts_llama_cpp_permutation():
    # llama.cpp's converter: reshape(heads, 2, hd/2, ...).swapaxes(1, 2) — interleave the two halves
    heads, hd, cols = 3, 8, 5
    w = torch.randn(heads * hd, cols)
    permuted = w.reshape(heads, 2, hd // 2, cols).transpose(1, 2).reshape(w.shape)
    assert torch.equal(unpermute_rope_rows(permuted, heads), w)


@pytest.fixture(scope="module")
def gguf_source():
    try:
        return GGUFSource(resolve_model_path(DEFAULT_MODEL))
    except FileNotFoundError as e:
        pytest.skip(str(e))


def test_smollm2_gguf_header(gguf_source):
    c = gguf_source.config
    assert (c.architecture, c.num_hidden_layers, c.hidden_size, c.intermediate_size) == \
        ("LlamaForCausalLM", 30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert (c.vocab_size, c.tie_word_embeddings, c.qk_norm) == (49152, True, False)
    assert c.rope_theta == 100000.0 and c.rms_norm_eps == 1e-5 and c.rope_scaling is None
    assert c.max_position_embeddings == 8192 and c.eos_token_ids == (2,) and c.bos_token_id == 1


def _same_header(ours, reader):
    """Every metadata field (its contents whole and indexed) and every tensor (its shape, type, place and
    values) of two parsed GGUF headers."""
    import gguf
    import numpy as np
    assert list(ours.fields) == list(reader.fields)
    for key, want in reader.fields.items():
        got = ours.fields[key]
        assert (got.offset, got.name, list(got.types)) == (want.offset, want.name, list(want.types)), key
        assert got.contents() == want.contents(), key
        if want.types[0] == gguf.GGUFValueType.ARRAY and want.data:
            for i in (0, len(want.data) - 1, -1, slice(1, 4), slice(None, None, 7)):
                assert got.contents(i) == want.contents(i), (key, i)
    assert (ours.data_offset, ours.alignment) == (reader.data_offset, reader.alignment)
    assert len(ours.tensors) == len(reader.tensors)
    for got, want in zip(ours.tensors, reader.tensors):
        assert (got.name, got.tensor_type, got.tensor_type.name, got.shape, got.n_elements, got.n_bytes,
                got.data_offset, got.data.shape, got.data.dtype) == \
            (want.name, want.tensor_type, want.tensor_type.name, tuple(int(d) for d in want.shape), want.n_elements,
             want.n_bytes, want.data_offset, want.data.shape, want.data.dtype), got.name
        assert np.array_equal(got.data, want.data), got.name


def test_gguf_file_reads_as_gguf_reader(tmp_path):
    """GGUFFile reads a header as gguf's own reader: strings, scalars of each type, arrays held whole (an empty
    one too), tensors of values and of blocks; and the shipped GGUF's vocabulary, merges and tensors."""
    import gguf
    import numpy as np
    from dspark.models.gguf_format import GGUFFile
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("s", "héllo")
    w.add_uint32("u", 7)
    w.add_int8("i8", -3)
    w.add_int64("i64", -2 ** 40)
    w.add_float32("f", 0.1)
    w.add_float64("f64", 0.1)
    w.add_bool("b", True)
    w.add_array("tokens", ["a", "", "ü€", "<0x0A>", "longer token"])
    w.add_array("scores", [0.5, -1.25, 3.0])
    w.add_array("types", [1, 2, 3, 6])
    w.add_array("flags", [True, False])
    w.add_array("empty", [])
    w.add_tensor("t", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("h", np.arange(6, dtype=np.float16).reshape(2, 3))
    q = np.linspace(-1, 1, 4 * 64, dtype=np.float32).reshape(4, 64)
    for name, qtype in (("q4_1", gguf.GGMLQuantizationType.Q4_1), ("q8_0", gguf.GGMLQuantizationType.Q8_0)):
        w.add_tensor(name, gguf.quantize(q, qtype), raw_dtype=qtype)
    k_blocks = np.random.default_rng(0).integers(0, 256, (3, 2 * 210), dtype=np.uint8)  # two Q6_K blocks a row
    w.add_tensor("q6_k", k_blocks, raw_dtype=gguf.GGMLQuantizationType.Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _same_header(GGUFFile(path), gguf.GGUFReader(str(path)))
    assert GGUFFile(path).fields["tokens"].contents(2) == "ü€"
    try:
        shipped = resolve_model_path(DEFAULT_MODEL)
    except FileNotFoundError:
        return
    _same_header(GGUFFile(shipped), gguf.GGUFReader(str(shipped)))


def test_gguf_types_are_ggufs_and_other_files_go_to_its_reader(tmp_path):
    """GGML_TYPES names and sizes the types as gguf.constants does; a file GGUFFile leaves (an array of
    arrays) is read by gguf's own reader."""
    import gguf
    import numpy as np
    from dspark.models.gguf_format import GGML_TYPES, gguf_reader
    for type_id, (name, block, size) in GGML_TYPES.items():
        qtype = gguf.GGMLQuantizationType(type_id)
        assert (qtype.name, *gguf.GGML_QUANT_SIZES[qtype]) == (name, block, size)
    path = tmp_path / "nested.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("nested", [[1, 2], [3]])
    w.add_tensor("t", np.zeros((2, 3), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf_reader(path)
    assert isinstance(reader, gguf.GGUFReader) and reader.fields["nested"].contents() == [1, 2, 3]


def test_serving_a_gguf_imports_no_gguf_package():
    """The header reads and the resident-as-quantized load of the default GGUF (what `dspark serve default`
    does) import no `gguf` (its import takes yaml and its writer along)."""
    import subprocess
    import sys
    _require(resolve_model_path, DEFAULT_MODEL)
    code = ("import sys\nfrom dspark.models.loader import load_model, q4_1_problem, read_model_config\n"
            f"read_model_config({DEFAULT_MODEL!r})\nassert q4_1_problem({DEFAULT_MODEL!r}) is None\n"
            f"load_model({DEFAULT_MODEL!r}, matmul_dtype='q4_1')\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'gguf'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-1] == "[]"


@pytest.mark.parametrize("name", [DEFAULT_MODEL, "gemma-3-270m"])
def test_cached_tokenizer_reads_no_model_config(name, tmp_path):
    """As transformers' tokenizer, the converted tokenizer loads from its cache folder without AutoTokenizer
    reading the fp32 conversion cache's config.json beside it (a Llama config imports transformers'
    model-loading stack, sympy among it),
    and without the class its tokenizer_config.json names rebuilding the Rust tokenizer (tokenizer.json goes
    straight into the generic fast class): the same encodings, decodings, token strings, vocabulary, special
    tokens, chat template and padding side as AutoTokenizer's."""
    import subprocess
    import sys
    from transformers import AutoTokenizer
    from conftest import copy_gguf_tokenizer
    from dspark.models.loader import read_model_config
    from dspark.models.tokenizer import _cached_tokenizer
    copy_gguf_tokenizer(name, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(read_model_config(name).to_hf()))
    ours = _cached_tokenizer(tmp_path, thin=False)  # transformers' (the engine's FastTokenizer: test_fast_tokenizer)
    auto = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    texts = ["Hello <|im_start|> world\n\n  ü€ 12345 \t tabs", "Hello , world . isn't it ?  don 't",
             "<start_of_turn>user\nhi<end_of_turn>\n<eos>", " lead\n", "<bos><pad><unk>x 你好 é"]
    for text in texts:
        ids = auto.encode(text)
        assert ours.encode(text) == ids and ours.convert_ids_to_tokens(ids) == auto.convert_ids_to_tokens(ids)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == auto.decode(ids, skip_special_tokens=skip)
    assert ours.get_vocab() == auto.get_vocab() and ours.chat_template == auto.chat_template
    assert ours.all_special_ids == auto.all_special_ids and ours.padding_side == auto.padding_side
    assert [ours.bos_token_id, ours.eos_token_id, ours.pad_token_id] == [auto.bos_token_id, auto.eos_token_id,
                                                                       auto.pad_token_id]
    assert {i: str(t) for i, t in ours.added_tokens_decoder.items()} == \
        {i: str(t) for i, t in auto.added_tokens_decoder.items()}
    code = (f"import sys; from pathlib import Path; from dspark.models.tokenizer import _cached_tokenizer; "
            f"_cached_tokenizer(Path({str(tmp_path)!r}), thin=False); assert 'sympy' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]


def test_resolve_default_and_missing():
    assert resolve_model_path("default") == resolve_model_path(DEFAULT_MODEL)
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        resolve_model_path("/no-such-model")


def test_smollm2_tokenizer_chat_template(smollm2):
    _, _, tok = smollm2
    assert tok.eos_token_ids == (2,) and tok.tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    im_start = tok.tokenizer.convert_tokens_to_ids("<|im_start|>")
    ids = tok.apply_chat_template([{"role": "user", "content": "Hello there"}])
    assert ids.count(im_start) >= 2, f"chat prompt should contain <|im_start|> ({im_start}) ids: {ids}"
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    assert tok.decode(tok.encode("Hello world")) == "Hello world"


def test_gguf_conversion_cache_matches_fresh_dequant(gguf_source, smollm2):
    """The smollm2 fixture may read the converted-weights cache; it must equal a fresh GGUF conversion."""
    model, _, _ = smollm2
    fresh = {}
    for name, t in gguf_source.weights():
        if name.startswith("model.layers.3.self_attn.") or name == "model.embed_tokens.weight":
            fresh[name] = t
        if name.startswith("model.layers.4."):
            break
    attn = model.model.layers[3].self_attn
    q, k, v = attn.qkv_proj.weight.split(attn.qkv_proj.split_sizes)
    assert torch.equal(q, fresh["model.layers.3.self_attn.q_proj.weight"])
    assert torch.equal(k, fresh["model.layers.3.self_attn.k_proj.weight"])
    assert torch.equal(v, fresh["model.layers.3.self_attn.v_proj.weight"])
    assert torch.equal(model.model.embed_tokens.weight, fresh["model.embed_tokens.weight"])


def test_load_model_from_hf_dir_with_tokenizer(tmp_path, smollm2):
    _, _, smol_tok = smollm2
    cfg = TINY_LLAMA
    from dataclasses import replace
    cfg = replace(cfg, vocab_size=len(smol_tok.tokenizer), eos_token_ids=(2,))
    hf = _save_tiny(cfg, tmp_path)
    smol_tok.tokenizer.save_pretrained(tmp_path)
    model, loaded_cfg, tok = load_model(str(tmp_path))
    assert loaded_cfg == cfg and tok.eos_token_ids == (2,)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        smol_tok.apply_chat_template([{"role": "user", "content": "hi"}])
    _check_same_logits(model, hf, cfg.vocab_size)
