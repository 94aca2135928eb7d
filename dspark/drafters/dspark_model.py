"""DSparkModel: the DSpark / DFlash drafter network (reference §1, §2) with DeepSpec's parameter names
(§3.3), and its dense training forward.

    H_ctx  = hidden_norm(fc(concat taps))                     shared by all draft layers, never
                                                              input-layernormed
    layer: x = input_layernorm(h); q from x; k = [k_norm(W_k H_ctx) ; k_norm(W_k x)], v likewise
           (RoPE at absolute target positions); h += o_proj(attn); h += mlp(post_attention_layernorm(h))
    base logits = lm_head(norm(h)); the Markov / RNN head adds its bias; the confidence head reads
    [norm(h) ; W1[prev]].

The same layer code serves training (`training_forward`: context K/V computed densely, block-sparse
boolean mask, SDPA) and inference (`dspark.DSparkDrafter`: context K/V precomputed into the engine's
paged pool by `context_kv`, the block attends to the gathered context). `embed_tokens` and `lm_head` are
frozen and, when the shapes and dtype match, alias the target's tensors (no second copy).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dspark import kernels
from dspark.kernels import Linear  # nn.Linear; few-row fp32 inference through the CPU kernel

from dspark.drafters.dspark_config import DSparkConfig
from dspark.drafters.dspark_fused import FusedInference
from dspark.drafters.heads import build_heads, embedding
from dspark.models.layers import ROPE_INIT, rope_type

IGNORE_INDEX = -100


@dataclass
class DSparkTrainOutput:
    draft_logits: torch.Tensor  # [batch, num_anchors, num_draft, draft_vocab] float32, head-corrected
    base_logits: torch.Tensor  # [batch, num_anchors, num_draft, draft_vocab] float32, before the head
    confidence_logits: torch.Tensor | None  # [batch, num_anchors, num_draft] float32, or None
    labels: torch.Tensor  # [batch, num_anchors, num_draft] long draft-vocab ids, -100 = not supervised
    target_label_ids: torch.Tensor  # [batch, num_anchors, num_draft] long target ids, -100 = none


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return kernels.rms_norm(x.contiguous(), self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class _MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None, table: dict = ROPE_INIT) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, from the target models' own RoPE table (`table`: by default
    `models.layers.ROPE_INIT`, default / linear / llama3), so drafter and target rotate alike."""
    kind = rope_type(scaling)
    if kind not in table:
        raise ValueError(f"rope type {kind!r} unsupported for the DSpark drafter; "
                         f"supported: {', '.join(table)}")
    return table[kind](head_dim, theta, dict(scaling or {})).float()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., n, heads, head_dim]; cos/sin [..., n, head_dim] (rotate-half convention)."""
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DSparkAttention(nn.Module):
    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_attention_heads,
                                                            cfg.num_key_value_heads, hd)
        self.scale = hd ** -0.5  # the attention scale
        self.q_proj = Linear(d, self.num_heads * hd, bias=False)
        self.k_proj = Linear(d, self.num_kv_heads * hd, bias=False)
        self.v_proj = Linear(d, self.num_kv_heads * hd, bias=False)
        self.o_proj = Linear(self.num_heads * hd, d, bias=False)
        self.q_norm = _RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = _RMSNorm(hd, cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [..., n, hidden] (H_ctx or the normed block) → k, v [..., n, kv_heads, head_dim]."""
        shape = (*x.shape[:-1], self.num_kv_heads, self.head_dim)
        k = _apply_rope(self.k_norm(self.k_proj(x).view(shape)), cos, sin)
        return k, self.v_proj(x).view(shape)

    def forward(
        self,
        x: torch.Tensor,  # [batch, num_query, hidden] input-layernormed block hidden
        *,
        cos: torch.Tensor, sin: torch.Tensor,  # [batch, num_query, head_dim]
        k_ctx: torch.Tensor, v_ctx: torch.Tensor,  # [batch, num_ctx, kv_heads, head_dim]
        mask: torch.Tensor | None,  # [batch, 1, num_query or 1, num_ctx + num_query] bool, True = see
    ) -> torch.Tensor:  # [batch, num_query, hidden]
        batch, num_query = x.shape[:2]
        q = self.q_proj(x).view(batch, num_query, self.num_heads, self.head_dim)
        q = _apply_rope(self.q_norm(q), cos, sin)
        k_blk, v_blk = self.kv(x, cos, sin)
        k = torch.cat([k_ctx.to(x.dtype), k_blk], dim=1).transpose(1, 2)  # [batch, kv_heads, keys, hd]
        v = torch.cat([v_ctx.to(x.dtype), v_blk], dim=1).transpose(1, 2)
        q = q.transpose(1, 2)
        if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
            # training under bf16 autocast: bf16 SDPA on CPU is very slow, so attention runs in fp32
            with torch.autocast("cpu", enabled=False):
                out = F.scaled_dot_product_attention(
                    q.float(), k.float(), v.float(), attn_mask=mask, scale=self.scale,
                    enable_gqa=self.num_heads != self.num_kv_heads)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads)  # [batch, heads, num_query, head_dim]
        return self.o_proj(out.transpose(1, 2).reshape(batch, num_query, -1))


class DSparkDecoderLayer(nn.Module):
    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.input_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DSparkAttention(cfg)
        self.post_attention_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = _MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h, *, cos, sin, k_ctx, v_ctx, mask):  # h [batch, num_query, hidden]
        h = h + self.self_attn(self.input_layernorm(h), cos=cos, sin=sin, k_ctx=k_ctx, v_ctx=v_ctx,
                               mask=mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DSparkModel(FusedInference, nn.Module):
    """The network with Qwen3-style draft layers; a subclass changes the layers (`layer_cls`), the norm (`make_norm`),
    the RoPE table (`rope_table`) and the block rows' input (`embed`): `gemma4_dspark.Gemma4DSparkModel`."""

    layer_cls: type[nn.Module] = DSparkDecoderLayer
    rope_table: dict = ROPE_INIT

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.cfg = cfg
        d, vocab, draft_vocab = cfg.hidden_size, cfg.vocab_size, cfg.effective_draft_vocab_size
        self.embed_tokens = embedding(vocab, d)
        self.layers = nn.ModuleList(self.layer_cls(cfg) for _ in range(cfg.num_hidden_layers))
        self.fc = Linear(cfg.num_taps * d, d, bias=False)
        self.hidden_norm = self.make_norm(d)
        self.anchor_proj = Linear(d, d, bias=False) if cfg.anchor_features else None
        self.norm = self.make_norm(d)
        self.lm_head = Linear(d, draft_vocab, bias=False)
        self.markov_head, self.confidence_head = build_heads(cfg)
        for p in (self.embed_tokens.weight, self.lm_head.weight):
            p.requires_grad_(False)
        # d2t: draft id → target id (persistent only for a reduced vocab); t2d: target id → draft id or -1
        self.register_buffer("d2t", torch.empty(draft_vocab, dtype=torch.long),
                             persistent=cfg.draft_vocab_size is not None)
        self.register_buffer("t2d", torch.zeros(vocab, dtype=torch.long), persistent=False)
        self.register_buffer("inv_freq", torch.zeros(cfg.head_dim // 2), persistent=False)
        self.reset_buffers()  # d2t the identity

    def make_norm(self, size: int) -> nn.Module:
        """The context-feature and final norms' module (RMSNorm over `size`)."""
        return _RMSNorm(size, self.cfg.rms_norm_eps)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Block token ids [...] → their input rows [..., hidden] in the activations' dtype."""
        return self.embed_tokens(ids).to(self.norm.weight.dtype)

    def reset_buffers(self, *, d2t: torch.Tensor | None = None, device=None) -> None:
        """(Re)compute the derived buffers: after loading a reduced-vocab `d2t`, or after building on the
        meta device. For the meta device they are computed on the CPU and moved: torch's meta `arange` and
        index assignment are Python decompositions whose first call imports ~500 modules (sympy among them,
        ~35 MiB resident for the rest of a served process that built its drafter on the meta device).
        d2t [draft_vocab] long (None: identity)."""
        device = torch.device(device if device is not None else self.fc.weight.device)
        meta = device.type == "meta"
        work = torch.device("cpu") if meta else device
        if d2t is None:
            d2t = torch.arange(self.cfg.effective_draft_vocab_size, device=work)
        if d2t.shape != (self.cfg.effective_draft_vocab_size,):
            raise ValueError(f"d2t shape {list(d2t.shape)} != [{self.cfg.effective_draft_vocab_size}]")
        d2t = d2t.to(device=work, dtype=torch.long)
        t2d = torch.full((self.cfg.vocab_size,), -1, dtype=torch.long, device=work)
        t2d[d2t] = torch.arange(len(d2t), device=work)
        self.d2t, self.t2d = d2t.to(device), t2d.to(device)  # t2d [vocab_size]
        cfg = self.cfg
        with torch.device("cpu") if meta else contextlib.nullcontext():
            self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, self.rope_table).to(device)

    def share_target_weights(self, *, embed_weight: torch.Tensor | None = None,
                             lm_head_weight: torch.Tensor | None = None) -> None:
        """Use the target's frozen embedding [vocab, hidden] and/or LM head [vocab, hidden]: aliased (no
        copy) when dtype and device match; for a reduced draft vocab the head is the target's rows `d2t`
        (a small copy). A target module in place of a weight (a target resident as quantized: it holds
        the matrix as blocks) is used itself by an fp32 drafter (its lookups and products, no copy), else
        its values are dequantized into the drafter's dtype; reduced-vocab rows are dequantized."""
        if isinstance(lm_head_weight, nn.Module) and self.cfg.draft_vocab_size is not None:
            lm_head_weight = lm_head_weight.dense_weight(self.d2t.cpu())
        elif lm_head_weight is not None and self.cfg.draft_vocab_size is not None:
            lm_head_weight = lm_head_weight[self.d2t.to(lm_head_weight.device)]
        for attr, weight in (("embed_tokens", embed_weight), ("lm_head", lm_head_weight)):
            module = getattr(self, attr)
            if weight is None:
                continue
            mine = module.weight
            if isinstance(weight, nn.Module):
                if tuple(weight.matrix_shape) != tuple(mine.shape):
                    raise ValueError(f"target weight shape {list(weight.matrix_shape)} != drafter {list(mine.shape)}")
                if mine.dtype == torch.float32:
                    setattr(self, attr, weight)  # the target's own module: its blocks, its products
                    continue
                weight = weight.dense_weight()
            if tuple(weight.shape) != tuple(mine.shape):
                raise ValueError(f"target weight shape {list(weight.shape)} != drafter {list(mine.shape)}")
            weight = weight.detach()
            if weight.dtype != mine.dtype or (weight.device != mine.device and not mine.is_meta):
                device = weight.device if mine.is_meta else mine.device
                weight = weight.to(device=device, dtype=mine.dtype)
            module.weight = nn.Parameter(weight, requires_grad=False)  # shares storage with `weight`

    # -- pieces shared by training and inference ---------------------------------------------------
    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] long → cos, sin [..., head_dim] float32."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [..., head_dim / 2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    def context_features(self, taps: torch.Tensor) -> torch.Tensor:
        """H_ctx = hidden_norm(fc(taps)): [..., num_taps * hidden] → [..., hidden]."""
        return self.hidden_norm(self.fc(taps.to(self.norm.weight.dtype)))

    def context_kv(self, taps: torch.Tensor, positions: torch.Tensor, *, h_ctx: torch.Tensor | None = None
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k, v) [..., n, kv_heads, head_dim] of context rows (vLLM's
        precompute_and_store_context_kv): taps [..., n, num_taps * hidden], positions [..., n]; `h_ctx`:
        their context features where already computed."""
        h_ctx = self.context_features(taps) if h_ctx is None else h_ctx
        cos, sin = self.rope(positions)
        return [layer.self_attn.kv(h_ctx, cos, sin) for layer in self.layers]

    def backbone(
        self,
        block_ids: torch.Tensor,  # [batch, num_query] long
        positions: torch.Tensor,  # [batch, num_query] long
        *,
        # layer i → context k, v [batch, num_ctx, kv_heads, head_dim]
        layer_context_kv: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor | None,  # [batch, 1, num_query or 1, num_ctx + num_query] bool
        anchor_input: torch.Tensor | None = None,  # [batch, num_query, hidden] added to the rows' input
    ) -> torch.Tensor:  # [batch, num_query, hidden] final-normed
        h = self.embed(block_ids)  # the activations' dtype
        if anchor_input is not None:
            h = h + anchor_input.to(h.dtype)
        cos, sin = self.rope(positions)
        for i, layer in enumerate(self.layers):
            k_ctx, v_ctx = layer_context_kv(i)
            h = layer(h, cos=cos, sin=sin, k_ctx=k_ctx, v_ctx=v_ctx, mask=mask)
        return self.norm(h)

    def block_ids(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """[...] anchor ids → [..., block_size] = [anchor, mask × (block_size - 1)]."""
        ids = torch.full((*anchor_ids.shape, self.cfg.block_size), self.cfg.mask_token_id,
                         dtype=torch.long, device=anchor_ids.device)
        ids[..., 0] = anchor_ids
        return ids

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] → [..., draft_vocab] float32 base logits."""
        return self.lm_head(hidden).float()

    # -- training -----------------------------------------------------------------------------------
    def training_forward(
        self,
        *,
        taps: torch.Tensor,  # [batch, seq_len, num_taps * hidden] target taps of every position
        input_ids: torch.Tensor,  # [batch, seq_len] long
        anchor_positions: torch.Tensor,  # [batch, num_anchors] long, -1 = invalid block
    ) -> DSparkTrainOutput:
        """All blocks of a batch in one pass (reference §4.3): block b sees context keys j < anchor_b
        and its own block both ways, never other blocks. Heads are teacher-forced with the true
        predecessors [anchor, y_1 .. y_{γ-1}]. Invalid blocks see only themselves (no NaN rows) and get
        label -100."""
        cfg = self.cfg
        batch, seq_len = input_ids.shape
        num_anchors, num_slots, off = anchor_positions.shape[1], cfg.block_size, cfg.slot_offset
        num_draft, dev = cfg.max_draft_tokens, input_ids.device
        valid = anchor_positions >= 0  # [batch, num_anchors]
        anchor = anchor_positions.clamp(min=0)  # [batch, num_anchors]
        anchor_ids = torch.where(valid, input_ids.gather(1, anchor), cfg.mask_token_id)
        block_ids = self.block_ids(anchor_ids).view(batch, -1)  # [batch, num_anchors * num_slots]
        slot = torch.arange(num_slots, device=dev)
        positions = (anchor.unsqueeze(-1) + slot).view(batch, -1)  # [batch, num_anchors * num_slots]

        ctx_seen = (torch.arange(seq_len, device=dev) < anchor.unsqueeze(-1)) & valid.unsqueeze(-1)
        ctx_seen = ctx_seen.repeat_interleave(num_slots, dim=1)  # [batch, num_anchors * num_slots, seq_len]
        block_of = torch.arange(num_anchors, device=dev).repeat_interleave(num_slots)  # [queries]
        same_block = (block_of.unsqueeze(1) == block_of.unsqueeze(0)).expand(batch, -1, -1)
        # [batch, 1, queries, seq_len + queries], queries = num_anchors * num_slots
        mask = torch.cat([ctx_seen, same_block], dim=-1).unsqueeze(1)

        h_ctx = self.context_features(taps)  # [batch, seq_len, hidden]
        ctx_kv = self.context_kv(taps, torch.arange(seq_len, device=dev).expand(batch, -1), h_ctx=h_ctx)
        anchor_input = None
        if self.anchor_proj is not None:  # the newest context feature (anchor - 1) into each of its block's rows
            newest = h_ctx.gather(1, (anchor - 1).clamp(min=0).unsqueeze(-1).expand(-1, -1, h_ctx.shape[-1]))
            newest = newest * ((anchor > 0) & valid).unsqueeze(-1)  # [batch, num_anchors, hidden]: none at 0
            anchor_input = self.anchor_proj(newest).repeat_interleave(num_slots, dim=1)
        hidden = self.backbone(block_ids, positions, layer_context_kv=ctx_kv.__getitem__, mask=mask,
                               anchor_input=anchor_input)
        # [batch, num_anchors, num_draft, hidden]: the predicting slots only
        hidden = hidden.view(batch, num_anchors, num_slots, -1)[:, :, off:]
        base_logits = self.compute_logits(hidden)  # [batch, anchors, num_draft, draft_vocab]

        k = torch.arange(num_draft, device=dev)
        label_pos = anchor.unsqueeze(-1) + k + 1  # [batch, num_anchors, num_draft]: predicts anchor+k+1
        in_range = (label_pos < seq_len) & valid.unsqueeze(-1)
        target_label_ids = torch.where(in_range, _gather_pos(input_ids, label_pos), IGNORE_INDEX)
        draft_ids = self.t2d[target_label_ids.clamp(min=0)]
        labels = torch.where(in_range & (draft_ids >= 0), draft_ids, IGNORE_INDEX)
        prev_ids = _gather_pos(input_ids, anchor.unsqueeze(-1) + k)  # [anchor, y_1 .. y_{num_draft-1}]
        prev_ids = torch.where(valid.unsqueeze(-1), prev_ids, cfg.mask_token_id)
        return DSparkTrainOutput(
            draft_logits=self.head_logits(base_logits, hidden=hidden, prev_ids=prev_ids),
            base_logits=base_logits,
            confidence_logits=self.confidence_logits(hidden, prev_ids=prev_ids),
            labels=labels, target_label_ids=target_label_ids)

    def head_logits(self, base_logits: torch.Tensor, *, hidden: torch.Tensor,
                    prev_ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced head correction; identity without a sequential head (DFlash)."""
        if self.markov_head is None:
            return base_logits
        return self.markov_head.block_logits(base_logits=base_logits, hidden=hidden, prev_ids=prev_ids)

    def confidence_logits(self, hidden: torch.Tensor, *, prev_ids: torch.Tensor) -> torch.Tensor | None:
        """[..., hidden] and predecessor target ids [...] → raw confidence logits [...] fp32, or None."""
        if self.confidence_head is None:
            return None
        prev_embed = self.markov_head.embed_prev(prev_ids) if self.confidence_head.with_markov else None
        return self.confidence_head(hidden=hidden, prev_embed=prev_embed)


def _gather_pos(input_ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """input_ids [batch, seq_len], pos [batch, ...] (clamped into range) → ids [batch, ...]."""
    flat = pos.clamp(max=input_ids.shape[1] - 1).reshape(pos.shape[0], -1)
    return input_ids.gather(1, flat).view(pos.shape)
