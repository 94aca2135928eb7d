"""Tensor-parallel sharding of a loaded target model, in place, by structure rather than by family.

Every attention module with a merged `qkv_proj` (q | k | v shards), an `o_proj` and `num_heads`,
`num_kv_heads`, `head_dim` keeps the query heads of its KV heads [kv0, kv0 + n) (KV heads split as evenly
as the count allows: SmolLM2's 3 over 2 ranks are 2 + 1, its 9 query heads 6 + 3), its `o_proj` becomes
row-parallel (the columns of those heads, summed over the ranks by all-reduce). Every MLP with a merged
`gate_up_proj` and a `down_proj` keeps a contiguous range of the intermediate columns (gate and up rows
alike), `down_proj` row-parallel. The vocabulary embedding and the LM head keep rows [v0, v0 + V / size)
(padded so each rank's logits have one width): the embedding zeroes ids outside its range and all-reduces,
the head's logits are gathered to rank 0 (dspark.distributed.runner), or only each row's slice winner on a
greedy-only step (dspark.distributed.vocab_argmax). Norms, rotary tables and per-head q/k norms are
replicated: the residual stream is whole on every rank after each all-reduce, so the taps the drafters read
are whole on rank 0.

Llama, Qwen3 and any family built from the same modules (the Gemma 3 decoder reuses them) shard alike.
Products on a shard run through the same `linear` as on one process (the fp32/bf16 CPU kernels where they
apply); the fused one-call decoder stack does not run under tensor parallelism (an all-reduce sits between
its layers), nor Q4_1 blocks (the ranks multiply slices of the dequantized weights: the loader keeps
Q4_1 for a single process). Mixture-of-experts models (Qwen3-MoE) are refused by `check_shardable`, before any
weight loads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark.distributed.group import TPGroup, even_split
from dspark.models.family import family_of
from dspark.models.layers import LMHead, Linear, MergedLinear, VocabEmbedding


def _param(t: torch.Tensor) -> nn.Parameter:
    """A Parameter of its own storage (a slice never aliases the unsharded weight a drafter may keep)."""
    return nn.Parameter(t.clone(memory_format=torch.contiguous_format), requires_grad=False)


class RowParallel(nn.Module):
    """A Linear whose input features are split over the ranks: each rank multiplies its slice of the input
    by its columns of the weight, the partial sums are all-reduced, the bias is added once after."""

    def __init__(self, inner: Linear, tp: TPGroup) -> None:
        super().__init__()
        self.inner, self.tp = inner, tp
        self.bias = inner.bias
        inner.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in / size] -> [T, out]
        out = self.tp.all_reduce(self.inner(x))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + rows) of the embedding; other ids give zeros, summed over the ranks."""

    def __init__(self, weight: torch.Tensor, start: int, tp: TPGroup) -> None:
        super().__init__()
        self.weight, self.start, self.tp = _param(weight), start, tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.tp.all_reduce(x * inside.unsqueeze(-1).to(x.dtype))


def _slice_rows(linear: Linear, ranges: list[tuple[int, int]]) -> None:
    """Keep the output rows of `ranges` (start, count) of a (merged) Linear, in order."""
    w = torch.cat([linear.weight[s:s + n] for s, n in ranges])
    linear.weight = _param(w)
    if linear.bias is not None:
        linear.bias = _param(torch.cat([linear.bias[s:s + n] for s, n in ranges]))
    linear.out_features = w.shape[0]


def _slice_cols(linear: Linear, start: int, count: int) -> None:
    linear.weight = _param(linear.weight[:, start:start + count])
    linear.in_features = count


def _set_merged(linear: MergedLinear, shards: list[tuple[str, int]]) -> None:
    linear.shard_rows, start = {}, 0
    for name, rows in shards:
        linear.shard_rows[name] = (start, rows)
        start += rows
    linear.split_sizes = [n for _, n in shards]


def _shard_attention(attn: nn.Module, tp: TPGroup) -> int:
    heads, kv_heads, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    if kv_heads < tp.size:
        raise ValueError(f"tensor_parallel_size {tp.size} exceeds the model's {kv_heads} KV heads (each rank "
                         f"keeps whole KV heads)")
    group = heads // kv_heads
    kv0, n_kv = even_split(kv_heads, tp.size)[tp.rank]
    q_rows = (kv0 * group * hd, n_kv * group * hd)
    q_size, kv_size = heads * hd, kv_heads * hd
    _slice_rows(attn.qkv_proj, [q_rows, (q_size + kv0 * hd, n_kv * hd), (q_size + kv_size + kv0 * hd, n_kv * hd)])
    _set_merged(attn.qkv_proj, [("q", q_rows[1]), ("k", n_kv * hd), ("v", n_kv * hd)])
    attn.num_heads, attn.num_kv_heads = n_kv * group, n_kv
    attn.qk_size = (n_kv * group + n_kv) * hd
    if hasattr(attn, "q_size"):  # families that keep the query width too (Gemma 3)
        attn.q_size = q_rows[1]
    _slice_cols(attn.o_proj, *q_rows)
    attn.o_proj = RowParallel(attn.o_proj, tp)
    return n_kv


def _shard_mlp(mlp: nn.Module, tp: TPGroup) -> None:
    inter = mlp.down_proj.in_features
    start, n = even_split(inter, tp.size)[tp.rank]
    _slice_rows(mlp.gate_up_proj, [(start, n), (inter + start, n)])
    _set_merged(mlp.gate_up_proj, [("gate", n), ("up", n)])
    _slice_cols(mlp.down_proj, start, n)
    mlp.down_proj = RowParallel(mlp.down_proj, tp)


def vocab_range(vocab_size: int, tp: TPGroup) -> tuple[int, int]:
    """(first row, rows per rank): every rank's slice has ceil(V / size) rows, the last padded with zeros."""
    per = -(-vocab_size // tp.size)
    return tp.rank * per, per


def _vocab_slice(weight: torch.Tensor, tp: TPGroup) -> tuple[torch.Tensor, int]:
    start, per = vocab_range(weight.shape[0], tp)
    part = weight[start:start + per]
    if part.shape[0] < per:
        part = torch.cat([part, part.new_zeros(per - part.shape[0], part.shape[1])])
    return part, start


def check_shardable(config) -> None:
    """Refuse what `shard_model` cannot split (a `ModelConfig`, read from the checkpoint's header): MoE layers,
    whose stacked experts the MLP sharding above does not know; a family whose record gives `no_tensor_parallel`
    (Gemma 4: per-kind head shapes, KV sharing and per-layer inputs it does not split)."""
    reason = family_of(config.architecture).no_tensor_parallel  # the family's record says why it cannot split
    if reason:
        raise ValueError(f"tensor parallelism over {config.architecture} is not supported ({reason}); run it with "
                         f"tensor_parallel_size 1")
    if config.num_experts:
        raise ValueError(f"tensor parallelism over MoE layers ({config.architecture}) is not supported; "
                         "run it with tensor_parallel_size 1")


def shard_model(model: nn.Module, tp: TPGroup) -> nn.Module:
    """Shard `model` (weights loaded, products not yet specialised) for rank `tp.rank` of `tp.size`."""
    if tp.size == 1:
        return model
    check_shardable(model.config)
    num_kv = set()
    for module in list(model.modules()):
        if hasattr(module, "qkv_proj") and hasattr(module, "o_proj") and hasattr(module, "num_kv_heads"):
            num_kv.add(_shard_attention(module, tp))
        elif hasattr(module, "gate_up_proj") and hasattr(module, "down_proj"):
            _shard_mlp(module, tp)
    inner = model.model
    embed, head = inner.embed_tokens, model.lm_head
    if not isinstance(embed, VocabEmbedding) or not isinstance(head, LMHead):
        raise TypeError(f"{type(model).__name__}: no vocabulary embedding / LM head to shard")
    part, start = _vocab_slice(embed.weight, tp)
    inner.embed_tokens = VocabParallelEmbedding(part, start, tp)
    tied = head.weight is embed.weight
    new_head = LMHead(part.shape[0], part.shape[1], tied_to=inner.embed_tokens if tied else None,
                      dtype=part.dtype, device="meta")  # a new module: the unsharded one stays whole
    if not tied:
        new_head.weight = _param(_vocab_slice(head.weight, tp)[0])
    model.lm_head = new_head
    if len(num_kv) > 1:
        raise ValueError(f"layers keep different KV-head counts under tensor parallelism: {sorted(num_kv)}")
    model.tp = tp
    model.tp_num_kv_heads = num_kv.pop()
    model.full_vocab_size = embed.weight.shape[0]
    model.vocab_start = start  # this rank's first vocabulary row (its logits' column 0)
    return model


class FullVocabView(nn.Module):
    """What a drafter reads of the target under tensor parallelism, on rank 0: the whole embedding and LM
    head (kept from before sharding) and the config. Drafters share these weights with the target on one
    process; on the sharded target they would see a vocabulary slice."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.config = model.config
        self.model = nn.Module()
        self.model.embed_tokens = model.model.embed_tokens
        self.lm_head = model.lm_head
        self.matmul_dtype = getattr(model, "matmul_dtype", "float32")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
