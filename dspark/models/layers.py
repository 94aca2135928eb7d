"""Building blocks shared by the target-model families: RMSNorm, rotary embeddings (default / linear /
llama3 scaling, cos/sin computed per step from the positions), SiLU-and-mul, plain and merged (fused qkv, gate_up) linear
layers, the vocab embedding and the LM head.

Every parameter that a checkpoint fills carries a `weight_loader(param, tensor, shard_id=None)`, so the
loader never needs to know how a module packs its weights: a merged linear copies each HF projection into
its rows. All modules are stateless across calls; per-step data (positions, KV, metadata) are arguments.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from dspark import kernels
from dspark.kernels.blocks import q4_1_linear, q4_1_packed_values, q8_0_linear, q8_0_packed_values


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: str | None = None) -> None:
    """Copy a checkpoint tensor into a parameter of the same shape (casting dtype/device)."""
    if shard_id is not None:
        raise ValueError(f"parameter of shape {tuple(param.shape)} is not packed; got shard {shard_id!r}")
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    with torch.no_grad():
        param.copy_(loaded)


def _set_loader(param: nn.Parameter, loader: Callable[..., None]) -> nn.Parameter:
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


# ---------------------------------------------------------------------------------------------- norms


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight over the last dim (HF Llama/Qwen3 semantics)."""

    def __init__(self, size: int, *, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.shape = (size,)
        self.weight = _set_loader(nn.Parameter(torch.ones(size, dtype=dtype, device=device),
                                               requires_grad=False), default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., size] -> [..., size]
        if x.dtype == torch.float32:
            return kernels.rms_norm(x, self.weight, self.eps)
        # half precision: normalise in fp32, cast back, then scale (the HF order of operations)
        return self.weight * F.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, its norm); fp32 CPU adds in place into `residual` in the same pass as the norm."""
        if x.dtype == torch.float32:
            return kernels.add_rms_norm(x, residual, self.weight, self.eps)
        residual = residual + x
        return residual, self.forward(residual)


# ---------------------------------------------------------------------------------------------- rope


def _inv_freq_default(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # [hd/2]


def _inv_freq_linear(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    return _inv_freq_default(head_dim, theta, scaling) / float(scaling["factor"])


def _inv_freq_llama3(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling: long wavelengths are divided by `factor`, short ones are
    kept, and the band between is interpolated linearly in (context / wavelength)."""
    inv_freq = _inv_freq_default(head_dim, theta, scaling)
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_ctx / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_ctx / low, inv_freq / factor, interpolated)
    return torch.where(wavelen < old_ctx / high, inv_freq, out)


ROPE_INIT: dict[str, Callable[[int, float, dict[str, Any]], torch.Tensor]] = {
    "default": _inv_freq_default,
    "linear": _inv_freq_linear,
    "llama3": _inv_freq_llama3,
}


def rope_type(scaling: dict[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def drafter_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """A new drafter's RoPE scaling from its target's: the target's where `RotaryEmbedding` has it, default RoPE
    where it has not (Gemma 4's proportional RoPE of its full layers): a drafter's layers are attention of their
    own, trained with the RoPE they have."""
    return scaling if rope_type(scaling) in ROPE_INIT else None


class Fp32Buffers(nn.Module):
    """A module whose buffers named in `fp32_buffers` move with it but stay fp32 whatever it is converted to
    (`.to(bfloat16)`): the RoPE frequencies, computed in fp32 as HF computes them."""
    fp32_buffers: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        kept = {name: getattr(self, name) for name in self.fp32_buffers}
        super()._apply(fn, recurse)
        for name, t in kept.items():
            setattr(self, name, t.to(getattr(self, name).device))
        return self


class RotaryEmbedding(Fp32Buffers):
    """Neox-style (rotate-half) RoPE, cos/sin computed per forward from the positions (a table of every
    position would hold 4 MiB for SmolLM2's 8192 positions, 64 MiB at 32k and head_dim 256; the per-step values
    are the same elementwise fp32 products and functions as such a table's).

    `lookup(positions)` is called once per forward; `apply_rope` then costs three ops per tensor.
    """
    fp32_buffers = ("inv_freq",)

    def __init__(self, *, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        kind = rope_type(scaling)
        if kind not in ROPE_INIT:
            raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: {', '.join(ROPE_INIT)}")
        self.max_positions = max_positions
        self.register_buffer("inv_freq", ROPE_INIT[kind](head_dim, theta, dict(scaling or {})).to(device),
                             persistent=False)  # [hd/2] fp32 whatever the module is converted to
        # cos/sin come out in this empty buffer's dtype, which follows the module's conversions (`.to(bf16)`)
        self.register_buffer("out_like", torch.empty(0, dtype=dtype, device=device), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens] -> (cos, sin), each [num_tokens, 1, head_dim] (`rope_cos_sin`)."""
        return rope_cos_sin(positions, self.inv_freq, self.out_like.dtype)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T], inv_freq [hd/2] fp32 -> (cos, sin), each [T, 1, hd] in `dtype`, rotate-half layout with
    its sign folded into sin (rotate_half(x) * sin == cat(x2, x1) * cat(-sin, sin)); HF's fp32 product."""
    freqs = positions.float().unsqueeze(1) * inv_freq  # [T, hd/2]
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((cos, cos), -1).to(dtype).unsqueeze(1), torch.cat((-sin, sin), -1).to(dtype).unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, num_heads, head_dim] (may be a strided view) -> rotated, contiguous."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), -1)  # [num_tokens, num_heads, head_dim]
    return torch.addcmul(x * cos, swapped, sin)


# ---------------------------------------------------------------------------------------------- mlp


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2 * d] (gate | up) -> [num_tokens, d]."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


# ---------------------------------------------------------------------------------------------- linear

# On CPU (MKL), few-row products (1-8 rows of an LM head or an MLP) run faster as W @ x^T than as
# F.linear's x @ W^T; many-row products are the same either way. In fp32
# up to kernels.MAX_ROWS rows go to dspark.kernels' small_mm first.
SMALL_M = 16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           weight_t: torch.Tensor | None = None, weight_bf16: torch.Tensor | None = None,
           weight_q4: torch.Tensor | None = None, weight_q8: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] @ weight[out, in]^T (+ bias) -> [rows, out] contiguous.

    `weight_t` [in, out] (see `add_decode_layout`): a one-row product streams it faster than the
    [out, in] layout on CPU (a large LM head most).
    `weight_bf16` (see `use_bf16_products`): the product of x rounded to bf16 with the bf16 weight,
    accumulated in fp32 — the kernel's when it applies, else the same values in fp32 through torch
    (`weight` holds the bf16-rounded values), so every path computes one model. `weight_q4` (see
    `use_q4_1_products`): the same with the GGUF's Q4_1 blocks (`weight` holds their exact values).
    `weight_q8` (see `loader.load_gguf_blocks`): the GGUF's Q8_0 blocks with the fp32 input — the fp32 product
    (`weight` holds the blocks' exact values), in 1.1 bytes a weight. Resident as quantized (`drop_dense_weights`)
    `weight` is None and the torch path dequantizes the blocks for the product (`kernels.blocks`)."""
    if weight_q8 is not None:
        out = kernels.linear(x, weight_q8)
        if out is None:
            out = F.linear(x, weight) if weight is not None else q8_0_linear(x, weight_q8)
        return out if bias is None else out + bias
    if weight_q4 is not None:
        out = kernels.linear(x, weight_q4)
        if out is None:
            out = (F.linear(kernels.q8_1_dequantized(x), weight) if weight is not None
                   else q4_1_linear(x, weight_q4))
        return out if bias is None else out + bias
    if weight_bf16 is not None:
        out = kernels.linear(x, weight_bf16)
        if out is None:
            out = F.linear(x.to(torch.bfloat16).to(x.dtype), weight if weight is not None else weight_bf16.to(x.dtype))
        return out if bias is None else out + bias
    out = kernels.linear(x, weight)
    if out is not None:
        return out if bias is None else out + bias
    if weight_t is not None and x.dim() == 2 and x.shape[0] == 1:
        out = torch.mm(x, weight_t)
        return out if bias is None else out + bias
    if x.dim() == 2 and x.shape[0] <= SMALL_M and x.device.type == "cpu":
        out = torch.mm(weight, x.t()).t()  # [rows, out] view of [out, rows]
        if x.shape[0] > 1:
            out = out.contiguous()
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)



class Linear(nn.Module):
    """y = x W^T (+ b), weight in the HF [out_features, in_features] layout."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _set_loader(nn.Parameter(torch.empty(out_features, in_features, dtype=dtype,
                                                           device=device), requires_grad=False),
                                  self.weight_loader)
        self.bias = None
        if bias:
            self.bias = _set_loader(nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device),
                                                 requires_grad=False), self.weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        default_weight_loader(param, loaded, shard_id)

    blocks = None  # a models.blocks.BlockMatrix under `--matmul-dtype gguf` (the weight is then None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [num_tokens, out]
        if self.blocks is not None:
            out = self.blocks.matmul(x)
            return out if self.bias is None else out + self.bias
        return linear(x, self.weight, self.bias, getattr(self, "weight_t", None),
                      getattr(self, "weight_bf16", None), getattr(self, "weight_q4", None))

    def dense_weight(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weight [out, in] (or its `rows`) the products multiply by, in fp32: `weight` itself, or the
        blocks' values dequantized now when the module is resident as quantized."""
        return dense_weight(self, rows)


class MergedLinear(Linear):
    """Several HF projections with the same input stacked along the output dim (qkv, gate_up).

    `shards` names each part and its number of output rows, in order; the weight loader copies an HF
    projection (`shard_id` = its name) into its rows.
    """

    def __init__(self, in_features: int, shards: tuple[tuple[str, int], ...], *, bias: bool,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(in_features, sum(n for _, n in shards), bias=bias, dtype=dtype, device=device)
        self.shard_rows: dict[str, tuple[int, int]] = {}
        start = 0
        for name, rows in shards:
            self.shard_rows[name] = (start, rows)
            start += rows
        self.split_sizes = [n for _, n in shards]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        if shard_id not in self.shard_rows:
            raise ValueError(f"merged linear has shards {list(self.shard_rows)}; got {shard_id!r}")
        start, rows = self.shard_rows[shard_id]
        default_weight_loader(param.narrow(0, start, rows), loaded)


# ---------------------------------------------------------------------------------------------- vocab


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, *, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.matrix_shape = (vocab_size, hidden_size)
        self.weight = _set_loader(nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype,
                                                           device=device), requires_grad=False),
                                  default_weight_loader)

    block_rows = None  # a models.blocks.BlockRows under `--matmul-dtype gguf` (the weight is then None)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., hidden]
        if self.weight is not None:
            return F.embedding(input_ids, self.weight)
        ids = input_ids.reshape(-1)
        return dense_weight(self, ids).view(*input_ids.shape, -1)  # only the rows looked up, dequantized

    def dense_weight(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        return dense_weight(self, rows)


class LMHead(nn.Module):
    """hidden -> fp32 logits; shares the embedding matrix when the checkpoint ties them."""

    def __init__(self, vocab_size: int, hidden_size: int, *, tied_to: VocabEmbedding | None,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.matrix_shape = (vocab_size, hidden_size)
        if tied_to is not None:
            self.weight = tied_to.weight  # the same Parameter: loads once, listed once
        else:
            self.weight = _set_loader(nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype,
                                                               device=device), requires_grad=False),
                                      default_weight_loader)

    blocks = None  # a models.blocks.BlockMatrix under `--matmul-dtype gguf` (the weight is then None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [num_rows, hidden] -> [num_rows, vocab]
        if self.blocks is not None:
            return self.blocks.matmul(hidden).float()
        return linear(hidden, self.weight, None, getattr(self, "weight_t", None),
                      getattr(self, "weight_bf16", None), None, getattr(self, "weight_q8", None)).float()

    def dense_weight(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        return dense_weight(self, rows)


def dense_weight(module: nn.Module, rows: torch.Tensor | None = None) -> torch.Tensor:
    """A Linear / VocabEmbedding / LMHead's matrix [out, in] (or the rows `rows`) as its products see it,
    fp32: `weight` where the module keeps it, else its blocks' values dequantized for this call (Q8_0, Q4_1)
    or its bf16 copy widened — bit for bit the values the dense model held."""
    w = module.weight
    if w is not None:
        return w if rows is None else w[rows]
    if getattr(module, "block_rows", None) is not None:
        ids = torch.arange(module.matrix_shape[0]) if rows is None else rows
        return module.block_rows.lookup(ids)
    if getattr(module, "blocks", None) is not None:
        return module.blocks.dense() if rows is None else module.blocks.dense()[rows]
    for name, values in (("weight_q8", q8_0_packed_values), ("weight_bf16", lambda t: t.float()),
                         ("weight_q4", q4_1_packed_values)):
        t = getattr(module, name, None)
        if t is not None:
            if name == "weight_q4" and rows is not None:
                return values(t)[rows]  # packed in tiles of rows: dequantize all, keep the rows
            return values(t if rows is None else t[rows])
    raise ValueError(f"{type(module).__name__} holds neither a weight nor its blocks")


def drop_dense_weights(model: nn.Module) -> int:
    """Resident as quantized: drop the dense weight of every Linear / VocabEmbedding / LMHead that holds its
    products' blocks or copy (`weight_q4`, `weight_q8`, `weight_bf16`), so only those stay in memory; the
    torch paths dequantize per product and `dense_weight` gives the values on demand. Returns the bytes
    freed."""
    freed, seen = 0, set()
    for module in model.modules():
        if not isinstance(module, (Linear, VocabEmbedding, LMHead)) or module.weight is None:
            continue
        if not any(getattr(module, n, None) is not None for n in ("weight_q4", "weight_q8", "weight_bf16")):
            continue
        if id(module.weight) not in seen:
            seen.add(id(module.weight))
            freed += module.weight.numel() * module.weight.element_size()
        module.weight = None
        module.weight_t = None
    return freed


def add_decode_layout(model: nn.Module) -> int:
    """Give every Linear and LMHead a transposed [in, out] copy of its weight for one-row (batch-1
    decode) products. Costs the weights' memory once more; returns the bytes added. CPU only: GPU
    GEMV kernels read the [out, in] layout at full bandwidth. The loader applies it only where the
    CPU kernels (dspark.kernels) are off or do not serve the dtype."""
    added = 0
    for module in model.modules():
        if isinstance(module, (Linear, LMHead)) and module.weight.device.type == "cpu":
            module.weight_t = module.weight.detach().t().contiguous()
            added += module.weight_t.numel() * module.weight_t.element_size()
    return added


def use_q4_1_products(model: nn.Module, packed: dict[str, torch.Tensor], *, head_bf16: bool) -> int:
    """Make the products of the Linear layers of `model` Q4_1 products: `packed` maps each Linear's
    module name to its weight in the kernels' packed Q4_1 layout ([out, in * 10 / 16] uint8,
    `kernels.pack_q4_1`), kept as `weight_q4`; the weight itself must already hold those blocks' exact
    values (the torch twin multiplies by it). Inputs are quantized to Q8_1 blocks per product (integer
    dot products, as llama.cpp), sums stay fp32.
    `head_bf16`: the LM head takes bf16 products (`use_bf16_products` for it alone: where the kernels
    multiply bf16, half the head's bytes), else it stays fp32. Every Linear must be covered (a missing
    one raises ValueError naming it). Returns the bytes added."""
    added = 0
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            w = packed.get(name)
            if w is None:
                raise ValueError(f"Q4_1 products: no Q4_1 weight for {name}")
            if w.dtype != torch.uint8 or w.shape[0] != module.out_features or \
                    kernels.q4_1_packed_cols(w) != module.in_features:
                raise ValueError(f"Q4_1 products: {name} is [{module.out_features}, {module.in_features}], "
                                 f"its packed weight {tuple(w.shape)} {w.dtype}")
            module.register_buffer("weight_q4", w.contiguous(), persistent=False)
            module.weight_t = None
            added += w.numel()
    for module in model.modules():
        if isinstance(module, LMHead) and head_bf16:
            added += use_bf16_products(module)
    model.matmul_dtype = "q4_1"
    model._layer_weight_list = model._block_stack_list = None  # the fused stacks' lists pick the packed weights up
    return added


def use_bf16_products(model: nn.Module) -> int:
    """Make every matrix product of `model` (its Linear layers and LM head) a bf16 product: each weight
    is rounded to bf16 in place (a tied embedding with it) and gets a bf16 copy, `weight_bf16`, that the
    CPU kernels stream; inputs are rounded to bf16 per product and the sums stay fp32. Norms, attention,
    the residual stream and the KV cache stay fp32. Every path computes the same rounded products: the
    kernel (in 128-row chunks for prompt chunks) and the fused stack bit for bit whatever the batch,
    torch (kernels off) up to summation order — so plain and speculative decoding see one model. Apply
    after the weights are loaded. Returns the bytes added."""
    added, rounded = 0, set()
    for module in model.modules():
        if isinstance(module, (Linear, LMHead)):
            w = module.weight
            if w.dtype != torch.float32:
                raise ValueError(f"bf16 products need float32 weights, got {w.dtype}")
            if id(w) not in rounded:
                with torch.no_grad():
                    w.copy_(w.to(torch.bfloat16))
                rounded.add(id(w))
            module.register_buffer("weight_bf16", w.detach().to(torch.bfloat16).contiguous(), persistent=False)
            module.weight_t = None
            added += module.weight_bf16.numel() * 2
    model.matmul_dtype = "bfloat16"
    model._layer_weight_list = model._block_stack_list = None  # the fused stacks' lists pick the bf16 copies up
    return added
