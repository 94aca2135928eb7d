"""CPU kernels for few-row steps (batch-1 decode, verification and draft blocks), and their torch twins.

Activations are fp32; the matrix products take fp32 weights or, on CPUs with AVX512-BF16, bf16 weights
(the input rounded to bf16, fp32 accumulation: twice the arithmetic per instruction, half the bytes),
or, on CPUs with AVX2 + FMA + F16C, a GGUF's own Q4_1 blocks (`pack_q4_1`; the input quantized to Q8_1
blocks, integer dot products: llama.cpp's Q4_1 x Q8_1 product) and Q8_0 blocks (`pack_q8_0`; fp32 input)
— the file's exact weights in 0.63 and 1.1 bytes each.

`cpu_ops.cpp` (with the parts it includes, `cpu_ops_*.inc`) is compiled once per machine with torch's C++ extension builder (g++ and ninja; ~30 s on two
cores) into `~/.cache/dspark/kernels/<source hash>/`; `scripts/setup.sh` does it ahead of time with
`python -m dspark.kernels`. Every op has a pure-torch twin here, used when the kernels are off and by
the tests as the reference. The kernels are used only for fp32 CPU tensors without autograd; anything
else takes the torch path. `decoder_layers` runs a whole Llama/Qwen3 decoder stack of a decode or
verification step in one call, and `block_layers` a Llama or Gemma 3 stack whose matrices are GGUF block
parts (Q5_0 / Q4_K / Q6_K: `ggml.py`); their twin is the model's own per-layer modules (bit-identical
results). `row_argmax` is torch.max(x, -1)'s answer for the greedy step. `draft_block` and `draft_context` run the
DSpark drafter's greedy proposal and its context extension each in one call (their twin: the drafter's op-by-op
path, `drafters/dspark_fused.py`). `recurrent.py` is the Python side of `gated_delta_windows_`, the Gated DeltaNet
layers' decode and verification windows in one call (its twin: the model's torch loop, `models/qwen3_next.py`).

Switch: `DSPARK_CPU_KERNELS=0` turns them off (the slow twin), `=1` (the default) builds and uses them
and, when the build fails, logs the compiler's message once and falls back to torch — the output is the
same, only slower; `=require` makes a failed build an error.

Level: `DSPARK_CPU_ISA` (`compiled.ISA_MARCH`) picks the instruction set they are compiled for, a forced level in
a folder of its own (`<source hash>-<level>`): `native` (the default), `avx2` (Haswell: Q4_1 / Q8_0 / block
products, bf16 weights widened), `avx512` (Skylake-SP: no VNNI, no bf16 products, so a bf16 copy keeps its
fp32 weight for the few-row products: `release_dense_weights`), `avx512_bf16` (Cooper Lake: bf16 dot products)
and `amx` (Sapphire Rapids). `cpu_has_bf16_dot` and `cpu_has_amx_bf16` read the CPU at the same level; a level
the CPU cannot run is refused (`supported_isas()`).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from dspark.kernels.blocks import (Q4_1_BLOCK_BYTES, Q8_0_BLOCK_BYTES, pack_q4_1, pack_q8_0, q4_1_group_rows,  # noqa: F401
                                   q4_1_packed_cols, q4_1_packed_values, q8_1_dequantized, quantize_q4_1)
from dspark.kernels.compiled import (ISA_CPU_FLAGS, ISA_MARCH, MAX_ROWS, SOURCE, _load, _mode, build,  # noqa: F401
                                     build_dir, cflags, cpu_flags, isa, isa_cpu_flags, ops, ops_variant,
                                     source_files, supported_isas)

logger = logging.getLogger(__name__)

def enabled() -> bool:
    return ops() is not None


def _eligible(*tensors: torch.Tensor) -> bool:
    """fp32 CPU tensors outside autograd (no_grad / inference_mode, or nothing requires grad)."""
    grad = torch.is_grad_enabled()
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and not (grad and t.requires_grad)
               for t in tensors)


# ------------------------------------------------------------------------------------------ ops


# weight dtypes the kernels multiply with any number of input rows, and the build flag each needs:
# bf16 copies, Q4_1-packed (`pack_q4_1`) and Q8_0-packed (`pack_q8_0`) blocks
LOWP_FLAGS = {torch.bfloat16: "has_bf16", torch.uint8: "has_q4_1", torch.int8: "has_q8_0"}


def linear(x: torch.Tensor, weight: torch.Tensor, *, fp32_input: bool = False) -> torch.Tensor | None:
    """x [..., in] @ weight[out, in]^T through the kernel when it applies (fp32 CPU input, no autograd;
    fp32 weights up to MAX_ROWS rows in all; any number of rows for bf16 weights on a CPU with bf16 dot
    products — the input then rounded to bf16, the products accumulated in fp32 — Q4_1-packed uint8 ones
    [out, in * 10 / 16] (`pack_q4_1`; the input quantized to Q8_1 blocks, `q8_1_dequantized`) or
    Q8_0-packed int8 ones [out, in * 9 / 8] (`pack_q8_0`, fp32 input); None otherwise, so the caller uses torch. `fp32_input` with bf16 weights: the unrounded input
    times the widened weights — the fp32 product of the bf16 values, bitwise the fp32 kernel's on them —
    where the kernels have that path (`has_bf16w_kernels`: AVX2 without bf16 dot products), else None."""
    rows = x.numel() // max(1, x.shape[-1])
    flag = (("has_bf16w" if fp32_input and weight.dtype == torch.bfloat16 else LOWP_FLAGS.get(weight.dtype))
            if weight.device.type == "cpu" else None)
    lowp = flag is not None
    if (rows > MAX_ROWS and not lowp) or rows == 0 or not (_eligible(x) if lowp else _eligible(x, weight)):
        return None
    k = ops()
    if k is None or not weight.is_contiguous() or (lowp and not getattr(k, flag, False)):
        return None
    x2 = x.reshape(rows, x.shape[-1]).contiguous()
    # bf16 / Q4_1 / Q8_0 past MAX_ROWS rows: the kernel runs chunks of MAX_ROWS rows into one output (faster
    # than torch's fp32 product of the rounded values, and a row's result stays the same in a prompt chunk as
    # in a decode step)
    return k.small_mm(x2, weight).view(*x.shape[:-1], weight.shape[0])


def cpu_has_amx_bf16() -> bool:
    """Does this CPU have AMX tiles for bf16 (at the level `DSPARK_CPU_ISA`: "amx" or native)? torch's bf16
    products (oneDNN) use them."""
    return "amx_bf16" in isa_cpu_flags()


def bf16_kernel_rows() -> int:
    """Up to how many input rows `Linear`'s bf16 copies multiply through the kernel (beyond: torch's bf16
    product). With AMX, oneDNN's tiles beat the kernel's dot products past about 16 rows, increasingly so
    as the rows grow; else up to MAX_ROWS."""
    if BF16_KERNEL_ROWS is not None:
        return BF16_KERNEL_ROWS
    return Linear.LOWP_MIN_ROWS if cpu_has_amx_bf16() else MAX_ROWS


BF16_KERNEL_ROWS: int | None = None  # overrides bf16_kernel_rows() (side-by-side benchmarks)


def row_bucket(rows: int) -> int:
    """The row count a many-row torch product is padded to: a multiple of a quarter of the power of two
    at or below `rows` (at least 16), so at most 25% padding past 64 rows and four sizes an octave."""
    step = max(16, (1 << (rows.bit_length() - 1)) // 4)
    return -(-rows // step) * step


def bucketed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x in weight's dtype, weight, bias) [..., out] with the rows zero-padded to `row_bucket`.
    oneDNN (torch's CPU bf16 products) builds a primitive for every new input shape, which costs many
    times the product itself, so products whose row count follows the load (prompt chunks
    through the drafter's context, proposals for a changing number of requests) would pay that on most
    calls; the buckets bound the shapes. Each output row is its own row's product (padding rows are
    dropped)."""
    rows = x.numel() // max(1, x.shape[-1])
    padded = row_bucket(rows) if rows else 0
    x2 = x.reshape(rows, x.shape[-1])
    if padded != rows:
        buf = x2.new_zeros(padded, x2.shape[1], dtype=weight.dtype)  # [padded, in]
        buf[:rows] = x2
        x2 = buf
    out = F.linear(x2.to(weight.dtype), weight, bias)[:rows]  # [rows, out]
    return out.reshape(*x.shape[:-1], weight.shape[0])


class Linear(torch.nn.Linear):
    """`nn.Linear` (trainable, autograd as usual) whose few-row fp32 inference products take the kernel.

    With a low-precision copy of the weight (`set_matmul_dtype`: bf16 for a drafter on a CPU with bf16
    dot products), inference products multiply in that dtype: a bf16 copy through the kernel's bf16
    products up to `bf16_kernel_rows()` rows (MAX_ROWS; 16 with AMX) (fp32 input rounded per product,
    fp32 out), torch's bf16 product above (input and output in bf16, rows padded to `row_bucket`; faster
    there than the kernel in chunks); other low-precision
    copies through torch beyond `LOWP_MIN_ROWS` rows, fewer rows keeping the fp32 kernel. On AVX2 (no
    bf16 dot products) a bf16 copy takes the kernel's widening path up to MAX_ROWS rows (`linear`,
    fp32_input: the fp32 product of the same values, half the bytes) and the fp32 weight above. Once
    `release_dense_weights` freed the weight, the kernel takes the rows the fp32 weight took. The DSpark
    drafter's step runs faster so than with fp32 kernel products up to 16 rows and torch's bf16 above,
    most at one request."""

    LOWP_MIN_ROWS = 16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lowp = getattr(self, "lowp_weight", None)
        weight = self.weight  # None once `release_dense_weights` freed it: the copy alone serves
        inference = lowp is not None and not (torch.is_grad_enabled() and weight is not None and weight.requires_grad)
        if inference and lowp.dtype == torch.uint8:  # Q4_1 blocks (`set_q4_1_products`): any number of rows
            out = linear(x, lowp)
            if out is None:  # the twin: the input's Q8_1 values times the blocks' values
                out = F.linear(q8_1_dequantized(x), self.dense_weight())
            return out if self.bias is None else out + self.bias
        widened = inference and lowp.dtype == torch.bfloat16 and has_bf16w_kernels()
        to_torch = inference and not widened and x.numel() > self.LOWP_MIN_ROWS * x.shape[-1]
        if inference and lowp.dtype == torch.bfloat16 and (x.numel() <= bf16_kernel_rows() * x.shape[-1]
                                                            or (weight is None and not to_torch)):
            out = linear(x, lowp, fp32_input=widened)  # without the dense weight: at any number of rows
            if out is not None:
                return out if self.bias is None else out + self.bias
        if to_torch:
            bias = None if self.bias is None else self.bias.to(lowp.dtype)
            return bucketed_linear(x, lowp, bias).to(x.dtype)
        out = linear(x, weight) if weight is not None else None
        if out is None:
            return F.linear(x, self.dense_weight().to(x.dtype), self.bias)
        return out if self.bias is None else out + self.bias

    def dense_weight(self) -> torch.Tensor:
        """The weight; where `release_dense_weights` freed it, the values of its low-precision copy (made per
        call: only the paths no kernel serves read it)."""
        if self.weight is not None:
            return self.weight
        lowp = self.lowp_weight
        return q4_1_packed_values(lowp) if lowp.dtype == torch.uint8 else lowp.float()


def release_dense_weights(module: torch.nn.Module) -> int:
    """Inference only: free the weight of every `Linear` under `module` whose low-precision copy
    (`set_matmul_dtype`, `set_q4_1_products`) the kernels multiply at every row count (`kernels_serve`), so
    only the copy its products read stays in memory (the paths no kernel serves, such as an input that
    needs autograd, dequantize it per call, `Linear.dense_weight`). A copy the kernels do not multiply (bf16
    on an AVX-512 CPU without BF16 or with the kernels off, float16, a copy off the CPU) keeps its weight:
    the few-row products take the fp32 weight there, as without the copy. Such a module cannot be trained
    or re-quantized afterwards. Returns the bytes freed."""
    freed = 0
    for m in module.modules():
        lowp = getattr(m, "lowp_weight", None) if isinstance(m, Linear) else None
        if lowp is not None and m.weight is not None and kernels_serve(lowp):
            freed += m.weight.numel() * m.weight.element_size()
            m.weight = None
    return freed


def kernels_serve(copy: torch.Tensor) -> bool:
    """Do the built kernels multiply the low-precision copy `copy` at every row count `Linear` gives them:
    bf16 with bf16 dot products (AVX512-BF16) or AVX2's widening, Q4_1 blocks with the Q4_1 kernels?"""
    if copy.device.type != "cpu":
        return False
    if copy.dtype == torch.bfloat16:
        return has_bf16_kernels() or has_bf16w_kernels()
    return copy.dtype == torch.uint8 and has_q4_1_kernels()


def set_q4_1_products(module: torch.nn.Module, *, skip: tuple = ()) -> int:
    """Quantize every `Linear` under `module` (except under the modules in `skip`) to Q4_1 blocks for its
    inference products: `lowp_weight` holds the packed blocks (the kernels' Q4_1 x Q8_1 product, as the
    target's `--matmul-dtype q4_1`) and the weight itself becomes the blocks' values (what the torch twin
    multiplies; the module is then the quantized model, not the checkpoint's). Needs the Q4_1 kernels,
    input widths in multiples of 32 and output rows in multiples of 8 (a ValueError names the first
    layer that is not). Returns how many."""
    if not has_q4_1_kernels():
        raise ValueError("Q4_1 products need the CPU kernels with AVX2, FMA and F16C")
    misfit = q4_1_misfit(module, skip=skip)
    if misfit is not None:
        raise ValueError(f"Q4_1 products: {misfit}; they need input widths in multiples of 32 and output rows in "
                         "multiples of 8")
    skipped = {id(m) for s in skip if s is not None for m in s.modules()}
    layers = [m for m in module.modules() if isinstance(m, Linear) and id(m) not in skipped]
    for m in layers:
        packed, values = quantize_q4_1(m.weight)
        with torch.no_grad():
            m.weight.copy_(values.to(m.weight.dtype))
        m.register_buffer("lowp_weight", packed, persistent=False)
    return len(layers)


def q4_1_misfit(module: torch.nn.Module, *, skip: tuple = ()) -> str | None:
    """The first `Linear` under `module` (outside `skip`) whose shape Q4_1 blocks cannot hold, as "name is [out,
    in]"; None where every one fits (input widths in multiples of 32, output rows in multiples of 8)."""
    skipped = {id(m) for s in skip if s is not None for m in s.modules()}
    for name, m in module.named_modules():
        if isinstance(m, Linear) and id(m) not in skipped and (m.in_features % 32 or m.out_features % 8):
            return f"{name} is [{m.out_features}, {m.in_features}]"
    return None


def set_matmul_dtype(module: torch.nn.Module, dtype: torch.dtype, *, skip: tuple = ()) -> int:
    """Give every `Linear` under `module` (except under the modules in `skip`) a copy of its weight in
    `dtype` (a non-persistent buffer `lowp_weight`) for its many-row products; activations and the
    weight itself keep their dtype. Returns how many."""
    skipped = {id(m) for s in skip if s is not None for m in s.modules()}
    count = 0
    for m in module.modules():
        if isinstance(m, Linear) and id(m) not in skipped and m.weight.dtype != dtype:
            m.register_buffer("lowp_weight", m.weight.detach().to(dtype), persistent=False)
            count += 1
    return count


def has_q8_0_kernels() -> bool:
    """Do the built kernels multiply Q8_0 weights (AVX2 + FMA + F16C)?"""
    k = ops()
    return k is not None and bool(getattr(k, "has_q8_0", False))


def has_q4_1_kernels() -> bool:
    """Do the built kernels multiply Q4_1 weights (AVX2 + FMA + F16C)?"""
    k = ops()
    return k is not None and bool(getattr(k, "has_q4_1", False))


def has_bf16w_kernels() -> bool:
    """Do the built kernels multiply bf16 weights by an unrounded fp32 input (AVX2 + FMA without AVX-512;
    `linear(..., fp32_input=True)`)?"""
    k = ops()
    return k is not None and bool(getattr(k, "has_bf16w", False))


def has_bf16_kernels() -> bool:
    """Do the built kernels multiply bf16 weights (the CPU has AVX512-BF16)?"""
    k = ops()
    return k is not None and bool(getattr(k, "has_bf16", False))


def kernel_kind() -> str:
    """Which of the kernels' instruction paths this machine runs, the part of the hardware a profiled step
    cost depends on beyond the dtype: "avx512" (bf16 dot products; VNNI integer sums in pairs of Q4_1 tiles
    where the CPU has them), "avx2" (Q4_1/Q8_0 integer and BF16W products), "torch" (no kernels)."""
    k = ops()
    if k is None:
        return "torch"
    return "avx512" if getattr(k, "has_bf16", False) else ("avx2" if getattr(k, "has_q4_1", False) else "torch")


def cpu_has_bf16_dot() -> bool:
    """Does this CPU multiply bf16 natively (AVX512-BF16 or AMX-BF16) at the level `DSPARK_CPU_ISA` (a forced
    avx2 or avx512 level: no, whatever the CPU has)?"""
    return bool({"avx512_bf16", "amx_bf16"} & isa_cpu_flags())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d] / rms(x) * weight (fp32)."""
    k = ops() if _eligible(x, weight) else None  # never loaded for CUDA (or other non-CPU) tensors
    if k is not None and x.is_contiguous() and weight.is_contiguous():
        return k.rms_norm(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def row_argmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """x [R, V] -> (each row's maximum [R], the index of its first occurrence [R] long), torch.max(x, -1)'s
    answer (NaN: the first NaN), through the kernel; None when it does not apply (not fp32 CPU, or off)."""
    k = ops() if _eligible(x) else None
    if k is None or x.dim() != 2 or x.shape[1] == 0 or not x.is_contiguous():
        return None
    return k.row_argmax(x)


def markov_walk(base: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, d2t: torch.Tensor, anchor: torch.Tensor
                ) -> torch.Tensor | None:
    """DSpark's greedy walk with the vanilla Markov head over a drafted block in one kernel call: position by
    position the bias W2 · W1[prev] (W1's rows fp32 or bf16 widened, W2 fp32), the first argmax of base + bias
    and prev = d2t[that draft id]. base [R, G, V] fp32 (R <= MAX_ROWS), w1 [target_vocab, rank], w2 [V, rank],
    d2t [V] long, anchor [R] long target ids → the drafts' target ids [R, G] long: what the per-position loop
    (`MarkovHead.step`, `greedy_ids`) drafts. None when it does not apply (not CPU, autograd, off)."""
    k = ops() if _eligible(base, w2) else None
    if (k is None or base.dim() != 3 or not 1 <= base.shape[0] <= MAX_ROWS or w1.dtype not in (torch.float32, torch.bfloat16)
            or w1.device.type != "cpu" or (torch.is_grad_enabled() and w1.requires_grad)):
        return None
    return k.markov_walk(base.contiguous(), w1.contiguous(), w2.contiguous(), d2t.contiguous(), anchor.contiguous())


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + x, its rms_norm) (fp32). The kernel adds in place into `residual` (outside autograd
    only); the torch twin allocates the sum, so a residual saved for backward is never mutated."""
    k = ops() if _eligible(x, residual, weight) else None
    if (k is not None and x.is_contiguous() and residual.is_contiguous()
            and weight.is_contiguous() and x.shape == residual.shape):
        return residual, k.add_rms_norm_(x, residual, weight, eps)
    residual = residual + x
    return residual, F.rms_norm(residual, (residual.shape[-1],), weight, eps)


def short_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_flat: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_flat: torch.Tensor,
    token_index: torch.Tensor,  # [num_seqs, max_q] long: flat row of each query
    key_limit: torch.Tensor,  # [num_seqs, max_q] long: query j reads keys [0, limit); 0 = padding
    kv_slots: torch.Tensor,  # [num_seqs, max_kv] long: pool slot of each key
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], written at the valid queries' rows
    scale: float,
) -> bool:
    """Fill `out` through the kernel; False (nothing written) when it does not apply."""
    if not (short_attention_applies(q, k_flat, v_flat) and out.is_contiguous()):
        return False
    ops().short_attention(q, k_flat, v_flat, token_index, key_limit, kv_slots, out, scale)
    return True


def short_attention_applies(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor) -> bool:
    """Would `short_attention` run the kernel on these tensors (fp32 CPU, contiguous, the kernels built)?
    The tensors are checked first, so a CUDA step never loads the CPU kernels."""
    return (_eligible(q, k_flat, v_flat) and q.is_contiguous() and k_flat.is_contiguous()
            and v_flat.is_contiguous() and ops() is not None)


def decoder_layers(
    x: torch.Tensor,  # [T, hidden] residual stream, updated in place
    weights: list[torch.Tensor],  # 8 per layer, see cpu_ops.cpp (q/k norm: an empty tensor when absent)
    k_caches: list[torch.Tensor],  # per layer [num_kv_blocks, kv_block_size, num_kv_heads, head_dim]
    v_caches: list[torch.Tensor],
    cos: torch.Tensor,  # [T, head_dim]
    sin: torch.Tensor,  # [T, head_dim], rotate-half sign folded in
    slot_mapping: torch.Tensor,  # [T] long, every row stored
    token_index: torch.Tensor,  # [num_seqs, max_q] long: the step's one short attention group
    key_limit: torch.Tensor,
    kv_slots: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    scale: float,
    taps: torch.Tensor | None = None,  # [T, n * hidden]
    tap_layers: tuple[int, ...] = (),  # taps[:, tap_cols[i]:+hidden] = output of layer tap_layers[i]
    tap_cols: tuple[int, ...] = (),
) -> bool:
    """Run every decoder layer of a few-row step in one kernel call; False (nothing done) when the kernels
    do not apply, so the caller runs its per-op path, which computes the same numbers."""
    k = ops() if _eligible(x, *k_caches[:1]) else None
    if k is None or x.shape[0] > MAX_ROWS or not x.is_contiguous():
        return False
    k.decoder_layers_(x, weights, k_caches, v_caches, cos, sin, slot_mapping, token_index, key_limit, kv_slots,
                      num_heads, num_kv_heads, eps, scale, list(tap_layers), list(tap_cols),
                      taps if taps is not None else torch.empty(0))
    return True


def draft_inputs(anchor_rows: torch.Tensor, mask_row: torch.Tensor, add: torch.Tensor | None, anchor_pos: torch.Tensor,
                 tables: torch.Tensor, kv_block_size: int, inv_freq: torch.Tensor, block_size: int
                 ) -> tuple[torch.Tensor, ...] | None:
    """The fused decoder stack's inputs for R DSpark draft blocks in one call (cpu_ops_draft.inc): anchor_rows [R,
    hidden] fp32 (each block's first row; the others `mask_row` [hidden]; `add` [R, hidden] added to every row of a
    block, or None), the anchors' positions [R] and block tables [R, width] long → (x [R * block_size, hidden], cos,
    sin [R * block_size, head_dim] with the rotate-half sign folded into sin, slot mapping [R * block_size], token
    index, key limit [R, block_size], kv slots [R, max keys]): `attention.build_attn_metadata`'s indices for those
    non-causal, stored blocks. None where the kernels do not apply."""
    k = ops() if _eligible(anchor_rows, mask_row) else None
    if k is None:
        return None
    return tuple(k.draft_inputs_(anchor_rows.contiguous(), mask_row.contiguous(),
                                 add.float().contiguous() if add is not None else torch.empty(0), anchor_pos.contiguous(),
                                 tables.contiguous(), kv_block_size, inv_freq.float().contiguous(), block_size))


def draft_block(x, weights, k_caches, v_caches, cos, sin, slot_mapping, token_index, key_limit, kv_slots, *,
                num_heads: int, num_kv_heads: int, eps: float, scale: float, norm: torch.Tensor, offset: int,
                num_draft: int, head: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, d2t: torch.Tensor,
                anchor: torch.Tensor, conf_weight: torch.Tensor | None, conf_bias: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """DSpark's greedy proposal in one kernel call (cpu_ops_draft.inc): `decoder_layers`' arguments for the blocks'
    rows (x [R * S, hidden], updated in place), then per block the `num_draft` rows from `offset` final-normed by
    `norm`, times `head` (fp32 [V, hidden] or Q4_1 blocks: `small_mm`), the vanilla Markov walk from `anchor` [R]
    (`markov_walk`: W1 [target vocab, rank] fp32 or bf16, W2 [V, rank] fp32, d2t [V]) and the confidence logits
    [h ; W1[prev]] @ conf_weight^T + conf_bias (fp32 [1, hidden + rank]) → (drafts [R, num_draft] target ids,
    confidence logits [R, num_draft] or None); None (nothing done) where the kernels do not apply."""
    k = ops() if _eligible(x, *k_caches[:1]) else None
    if k is None or x.shape[0] > MAX_ROWS or not x.is_contiguous() or anchor.shape[0] > MAX_ROWS:
        return None
    drafts, conf = k.draft_block_(
        x, weights, k_caches, v_caches, cos, sin, slot_mapping, token_index, key_limit, kv_slots, num_heads,
        num_kv_heads, eps, scale, norm, offset, num_draft, head, w1.contiguous(), w2.contiguous(), d2t.contiguous(),
        anchor.contiguous(), conf_weight if conf_weight is not None else torch.empty(0),
        float(conf_bias) if conf_bias is not None else 0.0)
    return drafts, (conf if conf_weight is not None else None)


def draft_context(taps: torch.Tensor, fc: torch.Tensor, hidden_norm: torch.Tensor, eps: float,
                  kv_weights: list[torch.Tensor], k_norms: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                  slot_mapping: torch.Tensor, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]
                  ) -> torch.Tensor | None:
    """DSpark's context extension in one kernel call (cpu_ops_draft.inc): H = rms_norm(taps @ fc^T) by `hidden_norm`
    (taps [n, in] fp32; fc fp32 or Q4_1 blocks), then per draft layer H @ kv_weights[l]^T (k_proj's rows then
    v_proj's), the keys k-normed and rotated (cos, sin [n, head_dim], the rotate-half sign folded into sin) into
    k_caches[l] at `slot_mapping`, the values into v_caches[l] → H [n, hidden]; None (nothing done) where the
    kernels do not apply."""
    k = ops() if _eligible(taps, *k_caches[:1]) else None
    if k is None or not taps.is_contiguous() or taps.dim() != 2:
        return None
    return k.draft_context_(taps, fc, hidden_norm, eps, kv_weights, k_norms, cos, sin, slot_mapping, k_caches, v_caches)


def block_layers(
    x: torch.Tensor,  # [T, hidden] residual stream, updated in place
    norms: list[torch.Tensor],  # 6 per layer, see cpu_ops_block_layers.inc (an empty tensor when absent)
    matrices: list[list[tuple[int, torch.Tensor]]],  # 4 per layer (qkv, o, gate_up, down): [(GGML type, part)]
    k_caches: list[torch.Tensor],  # per layer [num_kv_blocks, kv_block_size, num_kv_heads, head_dim]
    v_caches: list[torch.Tensor],
    rope: dict[bool, tuple[torch.Tensor, torch.Tensor]],  # local? -> (cos, sin) [T, head_dim]
    slot_mapping: torch.Tensor,  # [T] long, every row stored
    rows: dict[bool, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],  # local? -> (token_index, key_limit, kv_slots)
    local: list[bool],  # per layer
    *,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    scale: float,
    gelu_tanh: bool,
    taps: torch.Tensor | None = None,  # [T, n * hidden]
    tap_layers: tuple[int, ...] = (),
    tap_cols: tuple[int, ...] = (),
) -> bool:
    """Every decoder layer of a few-row step whose matrices are GGUF block parts (or fp32) in one kernel call;
    False (nothing done) when the kernels do not apply, so the caller runs its per-op path (the same numbers)."""
    k = ops() if _eligible(x, *k_caches[:1]) else None
    if k is None or not k.has_quant or x.shape[0] > MAX_ROWS or not x.is_contiguous():
        return False
    k.block_layers_(x, norms, [w for m in matrices for _, w in m], [t for m in matrices for t, _ in m],
                    [len(m) for m in matrices], k_caches, v_caches, *rope[False], *rope[True], slot_mapping,
                    list(rows[False]), list(rows[True]), [int(v) for v in local], num_heads, num_kv_heads, eps, scale,
                    gelu_tanh, list(tap_layers), list(tap_cols), taps if taps is not None else torch.empty(0))
    return True


def short_attention_reference(q, k_flat, v_flat, token_index, key_limit, kv_slots, out, scale) -> None:
    """The torch twin of `short_attention`: one query at a time, plain softmax."""
    num_heads, num_kv_heads = q.shape[1], k_flat.shape[1]
    group = num_heads // num_kv_heads
    for s in range(token_index.shape[0]):
        for j in range(token_index.shape[1]):
            limit = int(key_limit[s, j])
            if limit <= 0:
                continue
            slots = kv_slots[s, :limit]
            keys = k_flat[slots].repeat_interleave(group, dim=1)  # [limit, H, hd]
            values = v_flat[slots].repeat_interleave(group, dim=1)
            row = int(token_index[s, j])
            scores = torch.einsum("hd,khd->hk", q[row], keys) * scale  # [H, limit]
            out[row] = torch.einsum("hk,khd->hd", scores.softmax(-1), values)
