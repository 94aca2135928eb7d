"""GGUF matrices resident as quantized (`--matmul-dtype gguf`): every layer matrix, the embedding and the LM
head keep the file's own blocks, in whatever types the file mixes, and no dense copy.

`BlockMatrix` is one matrix [out, in] as row ranges (the shards of a merged projection may differ in type),
each held in the form its product reads:

| GGUF type | held as | product (kernel; torch twin with the kernels off) |
|---|---|---|
| Q4_1 | `kernels.pack_q4_1` tiles | Q4_1 x Q8_1 (cpu_ops.cpp); `blocks.q4_1_linear` |
| Q8_0 | `kernels.pack_q8_0` rows | Q8_0 x fp32 (cpu_ops.cpp); `blocks.q8_0_linear` |
| Q8_0, an LM head or embedding of rows in groups of 8 | `blocks.pack_q8_0x8` (rows interleaved by 8) | Q8_0 x Q8_0 (cpu_ops_head.inc); `ggml.q8_0_block_linear` |
| Q4_K, rows in groups of 16, on AVX-512 VNNI builds | `ggml.pack_k16` (16 rows' blocks as the products' tiles) | `ggml.product` (cpu_ops_kpacked.inc); `ggml.block_linear` on `ggml.unpack_k16` |
| Q5_0, Q4_K, Q6_K | the file's bytes | `ggml.product` (cpu_ops_blocks.inc); `ggml.block_linear` |
| F32 | fp32 | the fp32 product |
| any other (Q4_0, Q5_1, Q5_K, Q3_K, Q2_K, F16, BF16, ...) | bf16, dequantized at load | bf16 products (input rounded to bf16, as `--matmul-dtype bfloat16`) |

An embedding keeps its rows in the file's bytes whatever the type (`lookup` dequantizes only the rows it
reads, with gguf's own dequantization; Q8_0 from the interleaved rows, bit for bit the same values); a tied
head multiplies the same bytes where its type has a product, else holds a bf16 copy.

The LM head's Q8_0 product quantizes its input to Q8_0 blocks and sums integers, as llama.cpp does: with the
fp32 input it is compute-bound (gemma-3-270m's 262144 x 640 head), with the int8 input on
rows interleaved by 8 near the memory's speed (docs/models.md). The layers' Q8_0 parts keep the fp32 input:
they are a small share of the step, and their rounding, carried down the residual stream, moved gemma-3-270m's
logits further from the dense model's (mean KL 0.0060 -> 0.0093 nats on the test prompt) where the head's
rounding alone moves them by 0.0005 (tests/test_gemma3_270m.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import re
import warnings
from pathlib import Path

import numpy as np
import torch

from dspark import kernels
from dspark.kernels import blocks as qb
from dspark.kernels import ggml
from dspark.models.family import family_for_gguf, family_of
from dspark.models.gguf_format import GGMLType, gguf_model_config, gguf_reader, gguf_to_hf_name, unpermute_rope_rows

F32, F16, Q4_1, Q8_0, BF16 = (int(GGMLType[name]) for name in ("F32", "F16", "Q4_1", "Q8_0", "BF16"))
_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_PAGE = mmap.PAGESIZE
_LAYER_INDEX = re.compile(r"\.\d+\.")  # model.layers.<i>.…
Q8_0X8 = 1008  # not a GGML id: Q8_0 rows interleaved by 8 (`pack_q8_0x8`), multiplied with the input quantized


def _product_form(qtype: int, raw: torch.Tensor, q8_0_input: bool = False) -> tuple[int, torch.Tensor]:
    """GGUF rows [n, row bytes] uint8 (F32: [n, K] fp32) of `qtype` -> (the form's type id, its tensor).
    `q8_0_input`: Q8_0 rows in groups of 8 are interleaved for the product with the input quantized."""
    if qtype == Q4_1 and raw.shape[0] % 8 == 0:
        return Q4_1, qb.pack_q4_1(raw)
    if qtype == Q8_0 and q8_0_input and raw.shape[0] % 8 == 0:
        return Q8_0X8, qb.pack_q8_0x8(raw)
    if qtype == Q8_0:
        return Q8_0, qb.pack_q8_0(raw)
    if ggml.packable(raw, qtype):
        return ggml.Q4_KX16, ggml.pack_k16(raw)
    if qtype in ggml.BLOCK_TYPES:
        return qtype, raw.contiguous()
    if qtype == F32:
        return F32, raw.float().contiguous()
    return BF16, ggml.dequantize(raw, qtype).to(torch.bfloat16)


def _part_product(x: torch.Tensor, qtype: int, w: torch.Tensor) -> torch.Tensor:
    if qtype == Q4_1:
        out = kernels.linear(x, w)
        return qb.q4_1_linear(x, w) if out is None else out
    if qtype == Q8_0X8:
        out = ggml.q8_0_product(x, w)
        return ggml.q8_0_block_linear(x, w) if out is None else out
    if qtype == Q8_0:
        out = kernels.linear(x, w)
        return qb.q8_0_linear(x, w) if out is None else out
    if qtype == ggml.Q4_KX16:
        out = ggml.product(x, w, qtype)
        return ggml.block_linear(x, ggml.unpack_k16(w), 12) if out is None else out
    if qtype in ggml.BLOCK_TYPES:
        out = ggml.product(x, w, qtype)
        return ggml.block_linear(x, w, qtype) if out is None else out
    if qtype == BF16:
        out = kernels.linear(x, w)
        return qb.rows_product(x.to(torch.bfloat16).to(x.dtype), w.to(x.dtype)) if out is None else out
    out = kernels.linear(x, w)
    return qb.rows_product(x, w) if out is None else out


def _part_values(qtype: int, w: torch.Tensor) -> torch.Tensor:
    if qtype == Q4_1:
        return qb.q4_1_packed_values(w)
    if qtype == Q8_0:
        return qb.q8_0_packed_values(w)
    if qtype == Q8_0X8:
        return qb.q8_0x8_values(w)
    if qtype == ggml.Q4_KX16:
        return ggml.dequantize(ggml.unpack_k16(w), 12)
    if qtype in ggml.BLOCK_TYPES:
        return ggml.dequantize(w, qtype)
    return w.float()


class BlockMatrix:
    """A matrix [out_features, in_features] held as GGUF blocks: `parts` [(type id, tensor)] stacked along the
    output rows in order, each in its product's form (module docstring)."""

    def __init__(self, parts: list[tuple[int, torch.Tensor]], in_features: int,
                 input_order: torch.Tensor | None = None) -> None:
        self.parts, self.in_features = parts, in_features
        self.out_features = sum(w.shape[0] for _, w in parts)
        # [in] long or None: the file's columns are the model's in this order (a converter that reordered them:
        # the input is gathered into the file's order, which quantized rows cannot be re-cut to)
        self.input_order = input_order

    @classmethod
    def from_gguf(cls, pieces: list[tuple[int, torch.Tensor]], in_features: int, *,
                  q8_0_input: bool = False) -> "BlockMatrix":
        """pieces [(GGML type id, GGUF rows)] in output-row order; neighbours of one type are stacked.
        `q8_0_input`: Q8_0 parts multiply the input quantized to Q8_0 blocks (the LM head's) where their rows
        come in groups of 8."""
        merged: list[tuple[int, torch.Tensor]] = []
        for qtype, raw in pieces:
            if merged and merged[-1][0] == qtype:
                merged[-1] = (qtype, torch.cat([merged[-1][1], raw]))
            else:
                merged.append((qtype, raw))
        return cls([_product_form(t, raw, q8_0_input) for t, raw in merged], in_features)

    @property
    def nbytes(self) -> int:
        return sum(w.numel() * w.element_size() for _, w in self.parts)

    @property
    def types(self) -> tuple[int, ...]:
        return tuple(t for t, _ in self.parts)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] fp32 (x's dtype)."""
        if self.input_order is not None:
            x = x.index_select(-1, self.input_order)
        outs = [_part_product(x, t, w) for t, w in self.parts]
        return outs[0] if len(outs) == 1 else torch.cat(outs, -1)

    def dense(self) -> torch.Tensor:
        """The matrix's values [out, in] fp32 (dequantized now)."""
        values = torch.cat([_part_values(t, w) for t, w in self.parts])
        if self.input_order is None:
            return values
        return values.index_select(1, torch.argsort(self.input_order))


class BlockRows:
    """An embedding [vocab, hidden] kept as the GGUF's rows of one type; `lookup` dequantizes the rows read."""

    def __init__(self, qtype: int, raw: torch.Tensor, hidden: int) -> None:
        self.qtype, self.hidden = qtype, hidden
        if qtype == Q8_0:  # as a tied head's product reads them: interleaved by 8 where the rows allow
            self.qtype, self.data = _product_form(Q8_0, raw, q8_0_input=True)
        else:
            self.data = raw.contiguous()

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:  # [n] long -> [n, hidden] fp32
        if self.qtype == Q8_0X8:
            return qb.q8_0x8_values(self.data, ids)
        rows = self.data[ids]
        if self.qtype == Q8_0:
            return qb.q8_0_packed_values(rows)
        if self.qtype == F32:
            return rows.float()
        return ggml.dequantize(rows, self.qtype).reshape(-1, self.hidden)

    def product_matrix(self) -> BlockMatrix:
        """The same bytes as an LM head's BlockMatrix where its type has a product; else a bf16 copy."""
        if self.qtype in (Q8_0, Q8_0X8, *ggml.BLOCK_TYPES):
            return BlockMatrix([(self.qtype, self.data)], self.hidden)
        chunks = [self.lookup(torch.arange(i, min(i + 8192, self.data.shape[0]))).to(torch.bfloat16)
                  for i in range(0, self.data.shape[0], 8192)]
        return BlockMatrix([(BF16, torch.cat(chunks))], self.hidden)


def drop_mapped_pages(view: np.ndarray) -> None:
    """Drop a copied view's pages of the mapped file from this process (madvise MADV_DONTNEED: they stay in the
    page cache, a later read faults them back in), so a load holds each tensor once, not its copy and the
    file's pages too (peak resident memory near the file's size, not twice it)."""
    size = view.nbytes
    if size < _PAGE or not hasattr(_LIBC, "madvise"):
        return
    start = view.ctypes.data
    first = -(-start // _PAGE) * _PAGE  # whole pages inside the view only: a neighbour's bytes stay mapped
    length = (start + size - first) // _PAGE * _PAGE
    if length > 0:
        _LIBC.madvise(ctypes.c_void_p(first), ctypes.c_size_t(length), 4)  # 4: MADV_DONTNEED


def copy_dropping_pages(view: np.ndarray, chunk_bytes: int = 64 << 20) -> np.ndarray:
    """A copy of a mapped view, made `chunk_bytes` of rows at a time, each chunk's pages of the file dropped once
    copied (`drop_mapped_pages`): a large tensor (an embedding) holds its copy and at most a chunk of the
    mapping, not both whole."""
    out = np.empty(view.shape, dtype=view.dtype)
    if view.ndim == 0 or view.nbytes <= chunk_bytes:
        out[...] = view
    else:
        step = max(1, chunk_bytes // max(1, view[0].nbytes))  # rows a chunk
        for i in range(0, view.shape[0], step):
            out[i:i + step] = view[i:i + step]
            drop_mapped_pages(view[i:i + step])
    drop_mapped_pages(view)  # (the pages astride two chunks)
    return out


def gguf_rows(t, *, copy: bool = True) -> tuple[int, torch.Tensor]:
    """A gguf ReaderTensor -> (its GGML type id, its rows [n, row bytes] uint8, or [n, K] fp32 for F32).
    `copy=False`: a read-only view of the mapped file, for a caller that builds its own tensor from it (the
    Q8_0 embedding's packing) and keeps nothing of the view."""
    qtype = int(t.tensor_type)
    copied = copy or qtype == F32
    data = copy_dropping_pages(t.data) if copied else np.asarray(t.data)
    if qtype == F32:
        return qtype, torch.from_numpy(data.astype(np.float32)).reshape(-1, int(t.shape[0]))
    with warnings.catch_warnings():  # torch warns of a read-only view (copy=False); it is read, never written
        warnings.simplefilter("ignore", UserWarning)
        return qtype, torch.from_numpy(data.view(np.uint8).reshape(data.shape[0], -1))


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor `model` holds: parameters, buffers and the blocks of its BlockMatrix / BlockRows."""
    seen: dict[int, torch.Tensor] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[t.data_ptr()] = t
    for m in model.modules():
        for attr in ("blocks", "block_rows"):
            b = getattr(m, attr, None)
            for w in ([w for _, w in b.parts] if isinstance(b, BlockMatrix) else [b.data] if b is not None else []):
                seen[w.data_ptr()] = w
    return sum(t.numel() * t.element_size() for t in seen.values())


def load_gguf_matrices(model: torch.nn.Module, source) -> None:
    """Fill `model` from a GGUF (`loader.GGUFSource`) resident as quantized (`--matmul-dtype gguf`): every
    Linear gets a BlockMatrix of its GGUF tensors (merged projections stacked in shard order, Llama's q/k rows
    un-interleaved as the dense load does), the embedding a BlockRows, the head the embedding's bytes when
    tied (or its own tensor); the other tensors (norms, biases) load as usual. No dense copy is kept."""
    from dspark.models.layers import Linear, VocabEmbedding
    from dspark.utils.host import trim_heap
    config = source.config
    permute = family_of(config.architecture).gguf_qk_permuted
    arch = source.field("general.architecture")
    record = family_for_gguf(arch)
    family = record.gguf if record is not None else None  # Gemma 4, the hybrid Qwens: names, row / column orders
    tensors = {t.name: t for t in source.reader.tensors}
    pieces: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
    input_orders: dict[str, torch.Tensor] = {}
    # (name less its layer index, rows, cols) -> the family's (rows, cols) orders: the converter changes every
    # layer's matrix of one name and shape alike (its reorders follow the config's head counts)
    orders: dict[tuple[str, int, int], tuple[torch.Tensor | None, torch.Tensor | None]] = {}
    covered: set[str] = set()
    for t in source.reader.tensors:
        if t.name in ("token_embd.weight", "output.weight") or len(t.shape) != 2:
            continue
        hf = family.hf_name(t.name, config) if family is not None else gguf_to_hf_name(t.name, arch)
        if not hf or "*" in hf:
            continue  # held by the config, or stacked experts: the dense load
        name, shard = model._resolve(hf)
        module_name = name.rpartition(".")[0]
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            continue  # not a module of the target (the MTP layer's tensors): the dense load decides
        if isinstance(module, VocabEmbedding) and family is not None and name.endswith(".weight"):
            qtype, raw = gguf_rows(t)  # a second embedding (Gemma 4's per-layer inputs) keeps its rows too
            module.block_rows, module.weight = BlockRows(qtype, raw, int(t.shape[0])), None
            covered.add(t.name)
            continue
        if not isinstance(module, Linear) or not name.endswith(".weight"):
            continue
        qtype, raw = gguf_rows(t)
        if permute and name.endswith("qkv_proj.weight") and shard in ("q", "k"):
            raw = unpermute_rope_rows(raw, config.num_attention_heads if shard == "q" else config.num_key_value_heads)
        if family is not None:
            key = (_LAYER_INDEX.sub(".", hf, count=1), raw.shape[0], int(t.shape[0]))
            if key not in orders:
                orders[key] = family.orders(hf, config, key[1:])
            rows, cols = orders[key]
            if rows is not None:
                raw = raw.index_select(0, rows)
            if cols is not None:
                if shard:
                    raise ValueError(f"{source.path.name}: {t.name} has its columns reordered inside a merged "
                                     f"projection; load it with --matmul-dtype float32")
                input_orders[module_name] = torch.argsort(cols)
        start = module.shard_rows[shard][0] if shard else 0
        pieces.setdefault(module_name, []).append((start, qtype, raw))
        covered.add(t.name)
    for module_name in list(pieces):  # each module's copied rows freed once its blocks are made (Q4_1's repacked)
        parts = pieces.pop(module_name)
        module = model.get_submodule(module_name)
        parts.sort(key=lambda p: p[0])
        blocks = BlockMatrix.from_gguf([(q, r) for _, q, r in parts], module.in_features)
        blocks.input_order = input_orders.get(module_name)
        if blocks.out_features != module.out_features:
            raise ValueError(f"{source.path.name}: GGUF tensors cover {blocks.out_features} of the "
                             f"{module.out_features} rows of {module_name}")
        module.blocks, module.weight, module.weight_t = blocks, None, None
        trim_heap()  # the freed rows go back now, not stacked under the next modules' and the embedding's
    load_vocab_blocks(model, tensors, covered)
    model.load_weights(source.weights(skip=covered))
    model.matmul_dtype = "gguf"
    model._layer_weight_list = model._block_stack_list = None  # the fused stacks' lists pick the blocks up


def load_vocab_blocks(model: torch.nn.Module, tensors: dict, covered: set[str]) -> None:
    """The embedding as a BlockRows of the GGUF's `token_embd.weight` rows (Q8_0 packed straight from the mapped
    file, one copy at load; interleaved by 8 where the rows allow) and the LM head as the same bytes when tied,
    else as a BlockMatrix of `output.weight` with its Q8_0 input; neither keeps a dense weight. `tensors`: the
    GGUF's tensors by name; the names loaded are added to `covered`."""
    embed, head, hidden = model.model.embed_tokens, model.lm_head, model.config.hidden_size
    embed_tensor = tensors["token_embd.weight"]
    qtype, raw = gguf_rows(embed_tensor, copy=int(embed_tensor.tensor_type) != Q8_0)
    embed.block_rows = BlockRows(qtype, raw, hidden)
    del raw
    covered.add("token_embd.weight")
    if "output.weight" in tensors:
        head.blocks = BlockMatrix.from_gguf([gguf_rows(tensors["output.weight"])], hidden, q8_0_input=True)
        covered.add("output.weight")
    else:
        head.blocks = embed.block_rows.product_matrix()
    embed.weight, head.weight, head.weight_t = None, None, None


def takes_gguf_blocks(path) -> bool:
    """Does `--matmul-dtype auto` keep this model's GGUF blocks (`gguf`)? A GGUF of a family in
    family whose record says `gguf_blocks` (Llama, Qwen3, Gemma 3, Gemma 4, the hybrid Qwens), with a layer matrix
    in a type the kernels multiply, and the kernels built."""
    path = Path(path)
    if not (path.is_file() and path.suffix == ".gguf") or kernels.ops() is None:
        return False
    reader = gguf_reader(path)
    if not family_of(gguf_model_config(reader).architecture).gguf_blocks:
        return False
    products = {Q4_1, Q8_0, *ggml.BLOCK_TYPES}
    return any(t.name.startswith("blk.") and len(t.shape) == 2 and int(t.tensor_type) in products for t in reader.tensors)
