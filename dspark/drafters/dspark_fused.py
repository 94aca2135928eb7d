"""The DSpark drafter network's inference fast paths on the CPU (a mixin of `DSparkModel`): the block forward
through the target's fused decoder stack (`fused_backbone`, `kernels.decoder_layers`) and the whole greedy
proposal in one kernel call (`fused_proposal`, `kernels.draft_block`: block forward, final norm, LM head, vanilla
Markov walk and confidence head). Their slow twin is the model's own module path (`DSparkModel.backbone`,
`compute_logits`, `MarkovHead.step`, `confidence_logits`), which they equal (the stack: attention and RoPE within
~1e-6; the proposal after the stack: bit for bit). `freeze` makes an engine's drafter gather what they read once.
"""

from __future__ import annotations

import torch

from dspark import kernels
from dspark.kernels import Linear


def stacked_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """The row-wise concatenation of `parts`: a view where they are consecutive row ranges of one
    contiguous buffer (`DSparkModel.pack_layer_products`, or a single contiguous matrix), else a copy."""
    first = parts[0]
    step = first.element_size() * first[0].numel() if first.shape[0] else 0
    adjacent = all(p.is_contiguous() and p.shape[1:] == first.shape[1:] and p.dtype == first.dtype
                   and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for p in parts)
    offset = first.data_ptr()
    for p in parts:
        adjacent = adjacent and p.data_ptr() == offset
        offset += p.shape[0] * step
    if not adjacent:
        return torch.cat(parts).contiguous()
    rows = sum(p.shape[0] for p in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


ROW_CACHE = 4096  # anchor embeddings a frozen drafter keeps (`anchor_rows`): 9 MiB at hidden 576


class FusedInference:
    """Mixed into `DSparkModel` (reads its layers, norms, heads and config)."""

    def fused_backbone(
        self,
        anchor_ids: torch.Tensor,  # [batch] long: each block's anchor (its other rows are mask tokens)
        anchor_pos: torch.Tensor,  # [batch] long: the anchor's position (the block covers .. + block_size - 1)
        tables: torch.Tensor,  # [batch, width] long: block tables covering each block's positions
        *,
        kv_block_size: int,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer the paged pool's (k, v)
        anchor_input: torch.Tensor | None = None,  # [batch, hidden] added to every row of the block
        context_window: int | None = None,  # the block reads the last N context positions only (None: all)
    ) -> torch.Tensor | None:  # [batch, block_size, hidden] final-normed, or None
        """`backbone` for inference in one CPU kernel call (`kernels.decoder_layers`, the target's fused
        decoder stack): the block's own K/V are stored into the pool past each committed context (which a
        later context extension overwrites) and each block row attends to its request's keys and its own
        block. The same products as the module path (norms, matrices, SiLU), attention and RoPE rounded
        differently (the kernel's, ~1e-6). None where it does not apply (kernels off, more than MAX_ROWS rows,
        weights the kernels do not take): the caller runs `backbone`."""
        stack = self._stack_inputs(anchor_ids, anchor_pos, tables, kv_block_size, kv_caches, anchor_input,
                                   context_window)
        if stack is None or not kernels.decoder_layers(stack[0], *stack[1:], **self._stack_sizes()):
            return None
        return self.norm(stack[0]).view(anchor_ids.shape[0], self.cfg.block_size, -1)

    def _stack_inputs(self, anchor_ids, anchor_pos, tables, kv_block_size, kv_caches, anchor_input=None,
                      context_window: int | None = None) -> tuple | None:
        """The fused stack's positional arguments (x [T, hidden] fp32, weights, K caches, V caches, cos, sin [T,
        head_dim] with the rotate-half sign folded into sin, slot mapping, token index, key limit, kv slots), the
        rows, RoPE and indices built from the block tables in one call (`kernels.draft_inputs`), or None where the
        kernels do not apply (kernels off, more than MAX_ROWS rows, weights they do not take)."""
        weights = self._fused_weights()
        if weights is None or anchor_ids.shape[0] * self.cfg.block_size > kernels.MAX_ROWS or not kernels.enabled():
            return None
        mask_row = getattr(self, "_mask_row", None)
        if mask_row is None:  # not frozen: looked up each call
            mask_row = self.embed_tokens(torch.tensor([self.cfg.mask_token_id], device=anchor_ids.device)).float()
        built = kernels.draft_inputs(self.anchor_rows(anchor_ids), mask_row[0], anchor_input, anchor_pos,
                                     tables, kv_block_size, self.inv_freq, self.cfg.block_size)
        if built is None:
            return None
        x, cos, sin, slots, token_index, key_limit, kv_slots = built
        if context_window is not None:
            key_limit, kv_slots = _windowed_keys(key_limit, kv_slots, anchor_pos, context_window)
        return (x, weights, [k for k, _ in kv_caches], [v for _, v in kv_caches], cos, sin, slots, token_index,
                key_limit, kv_slots)

    def anchor_rows(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """The anchors' embeddings [batch, hidden] fp32 (anchor_ids [batch] long). A frozen model keeps the rows it
        looked up, up to ROW_CACHE tokens (the target's quantized embedding dequantizes a row per lookup, ~10 ops):
        the same values."""
        cache = getattr(self, "_row_cache", None)
        if cache is None:
            return self.embed_tokens(anchor_ids).float()
        ids = anchor_ids.tolist()
        missing = [t for t in dict.fromkeys(ids) if t not in cache]
        if missing:
            if len(cache) + len(missing) > ROW_CACHE:
                cache.clear()
            looked = self.embed_tokens(torch.tensor(missing, device=anchor_ids.device)).float()  # [missing, hidden]
            cache.update(zip(missing, looked))
        return torch.stack([cache[t] for t in ids])

    def _stack_sizes(self) -> dict:
        attn = self.layers[0].self_attn
        return dict(num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, eps=self.cfg.rms_norm_eps,
                    scale=attn.head_dim ** -0.5)

    def fused_context_kv(self, taps: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                         kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        """`context_kv` for inference in one kernel call (`kernels.draft_context`), its K/V stored into each layer's
        pool at `slot_mapping` [n] → the context features H_ctx [n, hidden]; None where the kernels do not apply
        (the caller runs `context_kv` and stores). The per-op path's products and norms; RoPE rounded once per
        element (within an ulp). taps [n, num_taps * hidden], positions [n]."""
        weights = self._context_weights(taps.shape[0])
        if weights is None or taps.dtype != torch.float32 or kv_caches[0][0].dtype != torch.float32:
            return None
        fc, kv = weights
        cos, sin = self.rope(positions)  # [n, head_dim]
        sin[:, :sin.shape[-1] // 2].neg_()  # the rotate-half sign folded in
        return kernels.draft_context(
            taps.contiguous(), fc, self.hidden_norm.weight, self.cfg.rms_norm_eps, kv,
            [layer.self_attn.k_norm.weight for layer in self.layers], cos, sin, slot_mapping,
            [k for k, _ in kv_caches], [v for _, v in kv_caches])

    def _context_weights(self, num_rows: int) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """(fc's product matrix, per layer k_proj's and v_proj's stacked) as `Linear.forward` multiplies them for
        `num_rows` rows through the kernel (`_kernel_matrix`), or None where one of them does not. The stacks are
        built once per set of matrices (a view where the packed copies are adjacent: `pack_layer_products`)."""
        mats = [self.fc] + [m for layer in self.layers for m in (layer.self_attn.k_proj, layer.self_attn.v_proj)]
        sources = [_kernel_matrix(m, num_rows) for m in mats]
        if any(w is None for w in sources) or self.norm.weight.dtype != torch.float32:
            return None
        key = tuple((id(w), w._version) for w in sources)  # a replaced or updated matrix restacks
        cached = getattr(self, "_context_cache", None)
        if cached is None or cached[0] != key:
            sources = [w.detach() for w in sources]
            cached = (key, (sources[0], [stacked_rows(sources[i:i + 2]) for i in range(1, len(sources), 2)]))
            self._context_cache = cached
        return cached[1]

    def fused_proposal_applies(self, num_rows: int) -> bool:
        """Does `fused_proposal` compute what the per-op greedy path does for `num_rows` predicting rows, given a
        vanilla Markov head whose walk runs in the kernel (the drafter's `_walks_in_kernel`): an LM head whose product
        the per-op path takes through the kernel with these weights (`_kernel_matrix`), and a confidence head over
        [h ; W1[prev]] with an fp32 product, or none?"""
        conf = self.confidence_head
        return (_kernel_matrix(self.lm_head, num_rows) is not None
                and (conf is None or (conf.with_markov and conf.proj.weight.dtype == torch.float32
                                      and getattr(conf.proj, "lowp_weight", None) is None and conf.proj.bias is not None)))

    def fused_proposal(self, anchor_ids: torch.Tensor, anchor_pos: torch.Tensor, tables: torch.Tensor, *,
                       kv_block_size: int, kv_caches, num_draft: int, anchor_input: torch.Tensor | None = None,
                       context_window: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The greedy proposal of the blocks anchored at `anchor_ids` [batch] (positions `anchor_pos` [batch], block
        tables `tables` [batch, width]) in one kernel call after its inputs (`kernels.draft_block`) → (drafts [batch,
        num_draft] target ids, confidence logits [batch, num_draft] fp32 or None), the per-op path's
        (`fused_backbone`, `compute_logits`, the Markov walk, `confidence_logits`) bit for bit; None where the
        kernels do not apply (`fused_proposal_applies` first). anchor_input, context_window: as `fused_backbone`'s."""
        stack = self._stack_inputs(anchor_ids, anchor_pos, tables, kv_block_size, kv_caches, anchor_input,
                                   context_window)
        if stack is None:
            return None
        conf = self.confidence_head
        return kernels.draft_block(
            *stack, **self._stack_sizes(), norm=self.norm.weight, offset=self.cfg.slot_offset, num_draft=num_draft,
            head=_kernel_matrix(self.lm_head, anchor_ids.shape[0] * num_draft), w1=self.markov_head.markov_w1.weight,
            w2=self.markov_head.markov_w2.weight, d2t=self.d2t, anchor=anchor_ids,
            conf_weight=None if conf is None else conf.proj.weight, conf_bias=None if conf is None else conf.proj.bias)

    def freeze(self) -> None:
        """Inference only (an engine's drafter, its product copies made): no weight changes from here on, so the
        fused stack's weights are gathered once instead of checked on every call, the mask token's embedding
        (every block row past the anchor) is looked up once and anchors' embeddings are kept (`anchor_rows`)."""
        self.requires_grad_(False)
        self._frozen = False
        self._fused_weights()
        self._mask_row = self.embed_tokens(torch.tensor([self.cfg.mask_token_id], device=self.norm.weight.device)).float()
        self._row_cache: dict[int, torch.Tensor] = {}  # token id -> its embedding [hidden] fp32 (`anchor_rows`)
        self._frozen = True

    def _fused_weights(self) -> list[torch.Tensor] | None:
        """The 8 tensors per layer `kernels.decoder_layers` reads (norms; q|k|v and gate|up stacked), each
        matrix in its product dtype (the `lowp_weight` copy where `set_matmul_dtype` gave one); rebuilt
        when a weight changed in place (training; a frozen model's are gathered once), None for product
        dtypes the kernels do not take."""
        if getattr(self, "_frozen", False):
            return self._fused_cache[1]
        parts = []  # per layer the 8 entries, each a tuple of the tensors it is made of (the matrices' product copies)
        for layer in self.layers:
            a, mlp = layer.self_attn, layer.mlp
            parts += [(layer.input_layernorm.weight,), product_sources(a.q_proj, a.k_proj, a.v_proj),
                      (a.q_norm.weight,), (a.k_norm.weight,), product_sources(a.o_proj),
                      (layer.post_attention_layernorm.weight,), product_sources(mlp.gate_proj, mlp.up_proj),
                      product_sources(mlp.down_proj)]
        key = tuple((id(t), t._version) for part in parts for t in part)  # a replaced or updated tensor rebuilds
        cached = getattr(self, "_fused_cache", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        weights: list[torch.Tensor] | None = [
            stacked_rows([t.detach() for t in part]) if i % 8 in (1, 4, 6, 7) else part[0].detach()
            for i, part in enumerate(parts)]
        takes = {torch.float32: True, torch.bfloat16: kernels.has_bf16_kernels() or kernels.has_bf16w_kernels(),
                 torch.uint8: kernels.has_q4_1_kernels()}  # uint8: Q4_1 blocks (`set_q4_1_products`)
        matrices = [w for i, w in enumerate(weights) if i % 8 in (1, 4, 6, 7)]
        if (any(w.device.type != "cpu" for w in weights) or self.norm.weight.dtype != torch.float32
                or not all(takes.get(w.dtype, False) for w in matrices)):
            weights = None
        self._fused_cache = (key, weights)
        return weights

    def pack_layer_products(self) -> None:
        """Put each layer's q|k|v and gate|up low-precision copies (`lowp_weight`) in one buffer, each
        module's copy a row range of it, so that the fused stack (`_fused_weights`) reads them in place
        instead of concatenating a second copy. Inference only, after `set_matmul_dtype` /
        `set_q4_1_products`."""
        for layer in self.layers:
            a, mlp = layer.self_attn, layer.mlp
            for group in ((a.q_proj, a.k_proj, a.v_proj), (mlp.gate_proj, mlp.up_proj)):
                copies = [getattr(m, "lowp_weight", None) for m in group]
                if any(c is None for c in copies):
                    continue
                packed = torch.cat(copies)  # [sum of rows, ...]
                start = 0
                for m, c in zip(group, copies):
                    m.register_buffer("lowp_weight", packed[start:start + c.shape[0]], persistent=False)
                    start += c.shape[0]

def product_sources(*linears: Linear) -> tuple[torch.Tensor, ...]:
    """The tensors a fused matrix is stacked from: each module's low-precision copy where it has one, else its weight."""
    return tuple(getattr(m, "lowp_weight", m.weight) for m in linears)


def _kernel_matrix(linear, num_rows: int) -> torch.Tensor | None:
    """The matrix a `Linear`'s inference product of `num_rows` rows multiplies through the kernel (`Linear.forward`):
    its Q4_1 blocks at any rows, or its fp32 weight (no copy) up to MAX_ROWS rows; None for anything else (bf16 copies,
    whose path depends on the row count, a bias, weights off the CPU, or a module that is no `Linear`, such as the
    target's own head)."""
    if not isinstance(linear, Linear) or linear.bias is not None:
        return None
    lowp = getattr(linear, "lowp_weight", None)
    if lowp is not None:
        return lowp if lowp.dtype == torch.uint8 and lowp.device.type == "cpu" else None
    weight = linear.weight
    fits = weight is not None and weight.dtype == torch.float32 and weight.device.type == "cpu"
    return weight if fits and num_rows <= kernels.MAX_ROWS else None


def _windowed_keys(key_limit: torch.Tensor,  # [R, S] long: each block row reads keys [0, limit)
                   kv_slots: torch.Tensor,  # [R, max_kv] long: the pool slot of each key position
                   anchor_pos: torch.Tensor,  # [R] long
                   window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys from anchor_pos - window on (the block's own after them): each row's slots shifted left by its
    window's start and its limit lowered by as much → (key_limit [R, S], kv_slots [R, width])."""
    start = (anchor_pos.to(kv_slots.device) - window).clamp(min=0)  # [R]
    limit = key_limit - start.unsqueeze(1)  # [R, S]
    width = max(1, int(limit.max()))
    cols = (start.unsqueeze(1) + torch.arange(width, device=kv_slots.device)).clamp(max=kv_slots.shape[1] - 1)
    return limit.contiguous(), kv_slots.gather(1, cols).contiguous()
