"""GGUF headers and names: the file's header parsed without the `gguf` package (`GGUFFile`, once per file
version), llama.cpp -> HF tensor names, the ModelConfig a header implies, and llama.cpp's q/k row interleave.
Shared by the dense loader (`models.loader`) and the resident-block loader (`models.blocks`), which import it,
never each other. The `gguf` package (its import takes yaml and its writer's stack along) is left to writing
files, dequantizing types other than F32, first-time conversion, and the files `GGUFFile` leaves to it."""

from __future__ import annotations

import functools
import math
import re
import struct
from enum import IntEnum
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from dspark.models.config import ModelConfig
from dspark.models.family import family_for_gguf, gguf_names

# GGML tensor type id -> (name, weights a block, bytes a block): gguf.constants' GGMLQuantizationType names
# and GGML_QUANT_SIZES (test_loader checks the two agree)
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}
GGMLType = IntEnum("GGMLType", {name: i for i, (name, _, _) in GGML_TYPES.items()})
# the types whose tensors read as arrays of their values (as gguf reads them); every other type as its bytes
_VALUE_DTYPES = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}
# GGUF metadata value types (gguf.GGUFValueType): the scalars' struct codes, then the two composite types
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
UINT32, UINT64, STRING, ARRAY = 4, 10, 8, 9


def gguf_reader(path: str | Path):
    """The parsed header of the GGUF file at `path` (`GGUFFile`), parsed once per process and file version
    (the config check, the Q4_1 blocks and the head read it)."""
    path = Path(path).resolve()
    stat = path.stat()
    return _gguf_reader(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _gguf_reader(path: str, mtime_ns: int, size: int):
    try:
        return GGUFFile(path)
    except _LeftToGGUF:  # another byte order, an array of arrays, a type GGML_TYPES lacks
        import gguf
        return gguf.GGUFReader(path)


class _LeftToGGUF(Exception):
    """A file GGUFFile leaves to gguf's own reader."""


class GGUFField:
    """A metadata key and value as gguf's ReaderField reads them (`offset`, `name`, `types`, `contents()`); an
    array's items are held as one view of the file and decoded on demand (gguf's own reader holds two numpy
    memmaps per item: for gemma-3-270m's 262144 tokens and 514906 merges ~700 MiB of Python objects)."""
    __slots__ = ("offset", "name", "types", "value", "count")

    def __init__(self, offset: int, name: str, types: list[int], value: Any, count: int = 0) -> None:
        self.offset, self.name, self.types, self.value, self.count = offset, name, types, value, count

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        if self.types[0] != ARRAY:
            return self.value
        if self.types[-1] != STRING:
            return self.value.tolist()[index_or_slice]
        buf, offs, items = memoryview(self.value), 0, []
        for _ in range(self.count):
            (n,) = struct.unpack_from("<Q", buf, offs)
            items.append(str(bytes(buf[offs + 8:offs + 8 + n]), encoding="utf-8"))
            offs += 8 + n
        return items[index_or_slice]


class GGUFTensor(NamedTuple):
    """A tensor of the file: `shape` in GGUF order (the reverse of `data`'s), `data` a read-only view of the
    mapped file, shaped as gguf's reader shapes it (values for F32 / F16 / integer types, else bytes)."""
    name: str
    tensor_type: GGMLType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class GGUFFile:
    """A GGUF (version 2 or 3, little-endian) file's header: `fields` {key: GGUFField} (gguf's GGUF.version,
    GGUF.tensor_count and GGUF.kv_count first), `tensors` [GGUFTensor], `alignment`, `data_offset`; the file
    mapped once (`data`), as gguf.GGUFReader reads it."""

    def __init__(self, path: str | Path) -> None:
        self.data = np.memmap(path, mode="r")
        self._buf = memoryview(self.data)
        magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", self._buf, 0)
        if magic != b"GGUF":
            raise ValueError("GGUF magic invalid")
        if version & 0xFFFF == 0:
            raise _LeftToGGUF("the other byte order")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported")
        self.fields = {"GGUF.version": GGUFField(4, "GGUF.version", [UINT32], version),
                       "GGUF.tensor_count": GGUFField(8, "GGUF.tensor_count", [UINT64], n_tensors),
                       "GGUF.kv_count": GGUFField(16, "GGUF.kv_count", [UINT64], n_kv)}
        offs = 24
        for _ in range(n_kv):
            start = offs
            key, offs = self._string(offs)
            field, offs = self._field(start, key, self._unpack("<I", offs), offs + 4)
            if key in self.fields:
                raise KeyError(f"Duplicate {key} already in list at offset {start}")
            self.fields[key] = field
        infos = []
        for _ in range(n_tensors):
            name, offs = self._string(offs)
            n_dims = self._unpack("<I", offs)
            dims = struct.unpack_from(f"<{n_dims}Q", self._buf, offs + 4)
            offs += 4 + 8 * n_dims
            infos.append((name, dims, *struct.unpack_from("<IQ", self._buf, offs)))
            offs += 12
        align = self.fields.get("general.alignment")
        self.alignment = 32 if align is None else align.value
        if align is not None and (align.types != [UINT32] or self.alignment & (self.alignment - 1) or not self.alignment):
            raise ValueError("Bad general.alignment field")
        self.data_offset = offs + -offs % self.alignment
        self.tensors = [self._tensor(*info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("GGUF file names a tensor twice")

    def _unpack(self, fmt: str, offs: int) -> Any:
        return struct.unpack_from(fmt, self._buf, offs)[0]

    def _string(self, offs: int) -> tuple[str, int]:
        n = self._unpack("<Q", offs)
        return str(bytes(self._buf[offs + 8:offs + 8 + n]), encoding="utf-8"), offs + 8 + n

    def _field(self, start: int, key: str, vtype: int, offs: int) -> tuple[GGUFField, int]:
        """The value of type `vtype` at `offs` -> (its field, the offset after it)."""
        if vtype == STRING:
            text, end = self._string(offs)
            return GGUFField(start, key, [STRING], text), end
        if vtype in _SCALARS:
            code = "<" + _SCALARS[vtype]
            return GGUFField(start, key, [vtype], self._unpack(code, offs)), offs + struct.calcsize(code)
        if vtype != ARRAY:
            raise ValueError(f"GGUF field {key!r} has the unknown value type {vtype}")
        itype, count = struct.unpack_from("<IQ", self._buf, offs)
        begin = end = offs + 12
        if itype == STRING:
            for _ in range(count):
                end += 8 + self._unpack("<Q", end)
            region = self.data[begin:end]
        elif itype in _SCALARS:
            dtype = np.dtype("<" + _SCALARS[itype])
            end = begin + count * dtype.itemsize
            region = self.data[begin:end].view(dtype)
        else:
            raise _LeftToGGUF("an array of arrays")
        return GGUFField(start, key, [ARRAY, itype] if count else [ARRAY], region, count), end

    def _tensor(self, name: str, dims: tuple[int, ...], type_id: int, offset: int) -> GGUFTensor:
        if type_id not in GGML_TYPES:
            raise _LeftToGGUF(f"GGML type {type_id}")
        _, block, size = GGML_TYPES[type_id]
        n = math.prod(dims)
        start, n_bytes, shape = self.data_offset + offset, n * size // block, tuple(reversed(dims))
        region = self.data[start:start + n_bytes]
        if type_id in _VALUE_DTYPES:
            data = region.view(_VALUE_DTYPES[type_id]).reshape(shape)
        elif shape[-1] % block:
            raise ValueError(f"GGUF tensor {name!r}: {shape[-1]} columns are not whole blocks of {block}")
        else:
            data = region.reshape(*shape[:-1], shape[-1] // block * size)
        return GGUFTensor(name, GGMLType(type_id), tuple(dims), n, n_bytes, start, data)


def gguf_values(t) -> np.ndarray:
    """A GGUF tensor's values as gguf's dequantize gives them: an F32 tensor as stored (without importing gguf),
    every other type through gguf.quants."""
    if int(t.tensor_type) == GGMLType.F32:
        return t.data.view(np.float32)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    return dequantize(t.data, GGMLQuantizationType(int(t.tensor_type)))


# llama.cpp tensor name -> HF name; {i} is the block index
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# a block's tensors (a family's record may give its own, `ModelFamily.gguf_tensor_names`)
GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def gguf_to_hf_name(name: str, arch: str = "llama") -> str:
    """llama.cpp tensor name -> HF name, for the GGUF architecture `arch` (general.architecture)."""
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    family = family_for_gguf(arch)
    block_names = (family and family.gguf_tensor_names) or GGUF_BLOCK_NAMES
    m = _BLOCK_RE.match(name)
    if m and m.group(2) in block_names:
        return f"model.layers.{m.group(1)}.{block_names[m.group(2)]}.{m.group(3)}"
    raise KeyError(f"GGUF tensor {name!r} has no known HF equivalent")


def unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Invert llama.cpp's q/k permutation: within each head it stores rows as interleaved (even, odd)
    rotary pairs; HF keeps the two halves of the head contiguous (rotate-half layout).
    w: [num_heads * head_dim, ...] -> same shape."""
    head_dim = w.shape[0] // num_heads
    return (w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape))


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_model_config(reader: Any) -> ModelConfig:
    """ModelConfig from a GGUF header (`<arch>.*` keys, tokenizer ids, presence of output.weight); the families
    of `gguf_families` (Gemma 4, the hybrid Qwens) through their records; the family's record (`ModelFamily`)
    names the architecture and what its header adds."""
    arch = gguf_field(reader, "general.architecture")
    family = family_for_gguf(arch)
    if family is None:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(gguf_names())}")
    if family.gguf is not None:
        return family.gguf.model_config(reader, arch)

    def get(key: str, default: Any = KeyError) -> Any:
        value = gguf_field(reader, f"{arch}.{key}", None)
        if value is None:
            if default is KeyError:
                raise KeyError(f"GGUF header lacks {arch}.{key}")
            return default
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    tensor_names = {t.name for t in reader.tensors}
    vocab = get("vocab_size", None)
    if vocab is None:
        vocab = len(gguf_field(reader, "tokenizer.ggml.tokens"))
    scaling = None
    kind = get("rope.scaling.type", "none")
    if kind == "linear":
        scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif kind not in ("none", None):
        raise ValueError(f"GGUF rope scaling {kind!r} is not supported")
    eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
    extra = {} if family.gguf_fields is None else family.gguf_fields(get, hidden, heads, int(get("block_count")))
    return ModelConfig(
        architecture=family.architecture,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        rms_norm_eps=float(f"{get('attention.layer_norm_rms_epsilon', 1e-6):.7g}"),  # undo fp32 storage
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(get("context_length", 8192)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm=family.qk_norm,
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        **extra,
    )

