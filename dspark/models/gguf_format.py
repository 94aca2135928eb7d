"""GGUF headers and names: the parsed reader (once per file version), llama.cpp -> HF tensor names, the
ModelConfig a header implies, and llama.cpp's q/k row interleave. Shared by the dense loader
(`models.loader`) and the resident-block loader (`models.blocks`), which import it, never each other."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import torch

from dspark.models.config import ModelConfig


def gguf_reader(path: str | Path):
    """gguf.GGUFReader for the file at `path` (`_compact_reader_class`: metadata arrays held whole), parsed
    once per process and file version (the config check, the Q4_1 blocks and the head read it)."""
    path = Path(path).resolve()
    stat = path.stat()
    return _gguf_reader(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _gguf_reader(path: str, mtime_ns: int, size: int):
    return _compact_reader_class()(path)


@functools.cache
def _compact_reader_class():
    """A gguf.GGUFReader whose metadata arrays (the vocabulary, merges, scores, token types) are held as one
    view of the file each (`PackedArrayField`), not as the two numpy memmaps per element gguf's own reader
    makes: for gemma-3-270m's 262144 tokens and 514906 merges those were ~700 MiB of Python objects (and ~5 s
    of parsing); for SmolLM2's 49152 ~150 MiB. Fields' `contents()` and the tensors are as gguf's. A file
    of the other byte order, or an array of arrays, is parsed by gguf's own code."""
    import struct

    import gguf
    import numpy as np

    STRING, ARRAY = gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY

    class PackedArrayField(gguf.ReaderField):
        """A metadata array as [..., item type, length, the items' bytes]; `contents()` decodes on demand."""
        __slots__ = ()

        def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
            region, count = self.parts[-1], int(self.parts[-2][0])
            if self.types[-1] != STRING:
                return region.tolist()[index_or_slice]
            buf, offs, items = memoryview(region), 0, []
            for _ in range(count):
                (n,) = struct.unpack_from("<Q", buf, offs)
                items.append(str(bytes(buf[offs + 8:offs + 8 + n]), encoding="utf-8"))
                offs += 8 + n
            return items[index_or_slice]

    class CompactGGUFReader(gguf.GGUFReader):
        def _build_fields(self, offs: int, count: int) -> int:
            """gguf's own loop over the metadata key/values, with `_packed_array` for arrays."""
            for _ in range(count):
                orig_offs = offs
                kv_klen, kv_kdata = self._get_str(offs)
                offs += int(kv_klen.nbytes + kv_kdata.nbytes)
                raw_kv_type = self._get(offs, np.uint32)
                offs += int(raw_kv_type.nbytes)
                packed = self._packed_array(offs) if raw_kv_type[0] == ARRAY else None
                size, parts, idxs, types = packed or self._get_field_parts(offs, raw_kv_type[0])
                field_class = PackedArrayField if packed else gguf.ReaderField
                self._push_field(field_class(orig_offs, str(bytes(kv_kdata), encoding="utf-8"),
                                             [kv_klen, kv_kdata, raw_kv_type, *parts], [i + 3 for i in idxs],
                                             types), skip_sum=True)
                offs += size
            return offs

        def _packed_array(self, start: int):
            """The array at `start` -> (its size, [item type, length, one view of the items' bytes], [2],
            [ARRAY, item type]); None for an array of arrays or a file of the other byte order."""
            raw_itype, alen = self._get(start, np.uint32), self._get(start + 4, np.uint64)
            itype, count, begin = gguf.GGUFValueType(int(raw_itype[0])), int(alen[0]), start + 12
            nptype = self.gguf_scalar_to_np.get(itype)
            if self.byte_order != "I" or (nptype is None and itype != STRING):
                return None
            if nptype is not None:
                region = self._get(begin, nptype, count)
            else:
                buf, end = memoryview(self.data), begin
                for _ in range(count):
                    end += 8 + struct.unpack_from("<Q", buf, end)[0]
                region = self._get(begin, np.uint8, end - begin)
            size = begin + int(region.nbytes) - start
            return size, [raw_itype, alen, region], [2], [ARRAY, itype]

    return CompactGGUFReader


GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
# llama.cpp tensor name -> HF name; {i} is the block index
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# Gemma 3 (llama.cpp's names): four norms a layer, and ffn_norm is the pre-feed-forward one
_GGUF_GEMMA3_BLOCK_NAMES = {
    **_GGUF_BLOCK_NAMES, "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def gguf_to_hf_name(name: str, arch: str = "llama") -> str:
    """llama.cpp tensor name -> HF name, for the GGUF architecture `arch` (general.architecture)."""
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    block_names = _GGUF_GEMMA3_BLOCK_NAMES if arch == "gemma3" else _GGUF_BLOCK_NAMES
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
    """ModelConfig from a GGUF header (`<arch>.*` keys, tokenizer ids, presence of output.weight)."""
    arch = gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(GGUF_ARCHITECTURES)}")

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
    gemma: dict[str, Any] = {}
    if arch == "gemma3":
        gemma = _gguf_gemma3_fields(get, hidden, heads, int(get("block_count")))
        if scaling is not None:
            scaling = {**scaling, "rope_type": "linear"}  # llama.cpp scales the global layers only
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
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
        qk_norm=arch in ("qwen3", "gemma3"),
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        **gemma,
    )


def _gguf_gemma3_fields(get: Any, hidden: int, heads: int, layers: int) -> dict[str, Any]:
    """The Gemma 3 ModelConfig fields a GGUF header implies, as llama.cpp reads them: every 6th layer
    global, local RoPE base 10000, attention scale 1/sqrt(head_dim) except gemma-3-27b (62 layers:
    1/sqrt(hidden / heads)), GELU-tanh, no logit softcapping (Gemma 3 has none)."""
    head_dim = int(get("attention.key_length", hidden // heads))
    return dict(
        hidden_activation="gelu_pytorch_tanh",
        layer_types=tuple("sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)),
        sliding_window=int(get("attention.sliding_window")),
        rope_local_theta=10_000.0,
        query_pre_attn_scalar=float(hidden // heads if layers == 62 else head_dim),
        final_logit_softcapping=get("final_logit_softcapping", None),
    )
