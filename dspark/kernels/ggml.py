"""GGUF block types beyond Q4_1 / Q8_0 (those: `kernels.blocks`): which types the CPU products multiply in
their own blocks (Q5_0: `cpu_ops_blocks.inc`; Q4_K, Q6_K: `cpu_ops_kquants.inc`; `block_mm`), the torch twins of those products, and the
dequantization every other type gets at load.

A matrix of a kernel type stays as the GGUF's bytes, [N, K / S * block bytes] uint8 (S weights a block).
The input is quantized per product in blocks of S (e = max |x| / 127, p = round(x / e) to nearest even —
the Q8_1 rule of the Q4_1 products over Q8_K's 256-long blocks for the K types; `quantize_input`), and
the kernel sums exact integer dot products per block, then fp32 block after block (cpu_ops_blocks.inc's
header gives each type's formula). `product_reference` repeats those steps in torch, bit for bit;
`block_linear` is the fast twin (the input's quantized values times the dequantized blocks, torch's
product), what a layer runs when the kernels are off.

A resident model's Q8_0 LM head multiplies the same way (`q8_0_product`, llama.cpp's Q8_0 x Q8_0): on the
rows `blocks.pack_q8_0x8` interleaves in groups of 8 (the embedding's, for a tied head), the input quantized in
blocks of 32, exact integer sums per block for 8 rows at once, then fp32 on 8 accumulators a row
(cpu_ops_head.inc); `q8_0_product_reference` and
`q8_0_block_linear` are its exact and fast twins. (The layers' Q8_0 parts keep the fp32 input:
`models.blocks`.)

Other common types (Q4_0, Q5_1, Q5_K, Q3_K, Q2_K, F16, BF16, ...) have no product here: the loader
dequantizes them (gguf's own dequantization) to bf16 at load (`DENSE_BF16`).
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch

from dspark.kernels.blocks import rows_product

# GGML type id -> (name, weights a block, bytes a block)
BLOCK_TYPES: dict[int, tuple[str, int, int]] = {6: ("Q5_0", 32, 22), 12: ("Q4_K", 256, 144), 14: ("Q6_K", 256, 210)}
TYPE_IDS = {name: t for t, (name, _, _) in BLOCK_TYPES.items()}


def ops() -> ModuleType | None:
    """The compiled kernels when they multiply blocks (cpu_ops.cpp with cpu_ops_blocks.inc), or None when the
    kernels are off, fail to build or the CPU lacks AVX2 / FMA / F16C."""
    from dspark import kernels
    k = kernels.ops()
    return k if k is not None and k.has_quant else None


def ops_variant(*defines: str) -> ModuleType:
    """The kernels built with preprocessor `defines` ("DSPARK_QUANT_AVX2": the AVX2 integer sums on an
    AVX512-VNNI CPU), for the tests that compare builds."""
    from dspark import kernels
    return kernels.ops_variant(*defines)


def type_id(qtype) -> int:
    return int(qtype)


def has_product(qtype) -> bool:
    """Do the built kernels multiply this GGML type in its own blocks?"""
    return type_id(qtype) in BLOCK_TYPES and ops() is not None


def block_cols(raw: torch.Tensor, qtype) -> int:
    """K (input columns) of a matrix of GGUF rows [N, row bytes] of `qtype`."""
    _, weights, nbytes = BLOCK_TYPES[type_id(qtype)]
    return raw.shape[1] // nbytes * weights


def product(x: torch.Tensor, raw: torch.Tensor, qtype) -> torch.Tensor | None:
    """x [..., K] fp32 @ the GGUF rows `raw` [N, row bytes]^T -> [..., N] through the kernel; None when it
    does not apply (kernels off, autograd, not fp32 CPU), so the caller takes `block_linear`."""
    k = ops()
    if (k is None or x.dtype != torch.float32 or x.device.type != "cpu"
            or (torch.is_grad_enabled() and x.requires_grad)):
        return None
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    return k.block_mm(x2, raw, type_id(qtype)).view(*x.shape[:-1], raw.shape[0])


def quantize_input(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (p [M, K / block, block] fp32 integers in -127..127, e [M, K / block] fp32), as the kernels
    quantize it: e = max |x| / 127, p = round(x * (1 / e)) to nearest even."""
    blocks = x.reshape(-1, x.shape[-1] // block, block).float()
    e = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(e != 0, 1.0 / e, 0.0)
    return torch.round(blocks * inv), e.squeeze(-1)


def dequantize(raw: torch.Tensor, qtype) -> torch.Tensor:
    """GGUF rows [N, row bytes] uint8 of any type gguf knows -> their weights [N, K] fp32 (gguf's own values)."""
    from gguf.quants import dequantize as gguf_dequantize
    import gguf
    values = gguf_dequantize(raw.numpy(), gguf.GGMLQuantizationType(type_id(qtype)))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def block_linear(x: torch.Tensor, raw: torch.Tensor, qtype) -> torch.Tensor:
    """The fast torch twin: the input's quantized values times the blocks' values (dequantized for this
    product), torch's fp32 product — the kernel's model up to summation order."""
    _, weights, _ = BLOCK_TYPES[type_id(qtype)]
    p, e = quantize_input(x.reshape(-1, x.shape[-1]), weights)
    xq = (p * e.unsqueeze(-1)).reshape(-1, x.shape[-1]).to(x.dtype)
    return rows_product(xq, dequantize(raw, qtype).to(x.dtype)).reshape(*x.shape[:-1], raw.shape[0])


def q8_0_product(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor | None:
    """x [..., K] fp32 @ interleaved Q8_0 rows [N, K / 32 * 34]^T (`blocks.pack_q8_0x8`) -> [..., N], the input
    quantized to Q8_0 blocks (cpu_ops_head.inc's `q8_0_mm`); None where the kernel does not apply (as
    `product`)."""
    k = ops()
    if (k is None or x.dtype != torch.float32 or x.device.type != "cpu"
            or (torch.is_grad_enabled() and x.requires_grad)):
        return None
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    return k.q8_0_mm(x2, packed).view(*x.shape[:-1], packed.shape[0])


def q8_0_block_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """The fast torch twin of `q8_0_product`: the input's Q8_0 values times the interleaved blocks' values
    (`blocks.q8_0_linear`, the fp32 input's twin, on the quantized input)."""
    from dspark.kernels.blocks import q8_0_linear, q8_0x8_values
    p, e = quantize_input(x.reshape(-1, x.shape[-1]), 32)
    xq = (p * e.unsqueeze(-1)).reshape(x.shape).to(x.dtype)
    return q8_0_linear(xq, packed, values=q8_0x8_values)


def q8_0_product_reference(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 times interleaved Q8_0 rows [N, K / 32 * 34] -> [M, N] fp32, bit for bit `q8_0_product`:
    exact integer block sums, then accumulator b % 8 of each output += (d e) * sum, group by group, the
    accumulators summed in the kernel's order."""
    from dspark.kernels.blocks import q8_0x8_fields
    q, d = q8_0x8_fields(packed)  # [N, nb, 32] int8, [N, nb] fp32
    p, e = quantize_input(x, 32)  # [M, nb, 32], [M, nb]
    M, N, nb = x.shape[0], packed.shape[0], d.shape[1]
    isum = torch.einsum("mbi,nbi->mnb", p.double(), q.double()).float()  # [M, N, nb], exact (|sum| < 2^24)
    val = (d[None] * e[:, None]) * isum  # [M, N, nb]: (d e), then times the sum, each rounded to fp32
    groups = -(-nb // 8)
    val = torch.cat([val, val.new_zeros(M, N, groups * 8 - nb)], -1).reshape(M, N, groups, 8)
    acc = torch.zeros(M, N, 8)
    for g in range(groups):
        acc = acc + val[:, :, g]
    a = acc.unbind(-1)
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))


# ------------------------------------------------------------------------------ the kernels' integers


def _half(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _q5_0(blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    """blocks [N, nb, 22] -> d [N, nb], q [N, nb, 32] (0..31)."""
    qh = blocks[..., 2:6].contiguous().view(torch.int32)  # [N, nb, 1]
    high = (qh >> torch.arange(32, dtype=torch.int32)) & 1  # [N, nb, 32]
    qs = blocks[..., 6:].int()
    low = torch.cat([qs & 0x0F, qs >> 4], -1)
    return {"d": _half(blocks[..., 0:2]), "q": low | (high << 4)}


def _q4_k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q4_K block's 12 scale bytes [..., 12] (an integer dtype wider than uint8) -> its 6-bit scales and mins
    [..., 8] (GGUF's get_scale_min_k4)."""
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], -1)
    mn = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    return sc, mn


def _q4_k(blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    """blocks [N, nb, 144] -> d, dmin [N, nb], sc, mn [N, nb, 8], q [N, nb, 8, 32] (0..15)."""
    sc, mn = _q4_k_scales(blocks[..., 4:16].int())
    qs = blocks[..., 16:].int().reshape(*blocks.shape[:2], 4, 32)
    q = torch.stack([qs & 0x0F, qs >> 4], -2).reshape(*blocks.shape[:2], 8, 32)
    return {"d": _half(blocks[..., 0:2]), "dmin": _half(blocks[..., 2:4]), "sc": sc, "mn": mn, "q": q}


def _q6_k(blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    """blocks [N, nb, 210] -> d [N, nb], sc [N, nb, 16] (int8), q [N, nb, 16, 16] (0..63)."""
    n, nb = blocks.shape[:2]
    ql = blocks[..., :128].int().reshape(n, nb, 2, 2, 32)  # [h, 32-byte half, 32]
    qh = blocks[..., 128:192].int().reshape(n, nb, 2, 1, 32)
    low = torch.stack([ql[..., 0, :] & 0x0F, ql[..., 1, :] & 0x0F, ql[..., 0, :] >> 4, ql[..., 1, :] >> 4], -2)
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.int32).view(4, 1)) & 3  # [N, nb, 2, 4, 32]
    q = (low | (high << 4)).reshape(n, nb, 16, 16)
    sc = blocks[..., 192:208].contiguous().view(torch.int8).int()
    return {"d": _half(blocks[..., 208:210]), "sc": sc, "q": q}


def product_reference(x: torch.Tensor, raw: torch.Tensor, qtype) -> torch.Tensor:
    """x [M, K] fp32 times the GGUF rows `raw` [N, row bytes] of `qtype` -> [M, N] fp32, bit for bit the
    kernel's: the integer sums exact in fp64, the fp32 steps of cpu_ops_blocks.inc's formulas in its order."""
    name, weights, nbytes = BLOCK_TYPES[type_id(qtype)]
    M, N = x.shape[0], raw.shape[0]
    blocks = raw.reshape(N, -1, nbytes)
    nb = blocks.shape[1]
    p, e = quantize_input(x, weights)  # [M, nb, S], [M, nb]
    p16 = p.reshape(M, nb, weights // 16, 16)
    psum16 = p16.sum(-1).double()  # [M, nb, S / 16] exact
    acc = torch.zeros(M, N)
    if name == "Q5_0":
        f = _q5_0(blocks)
        isum = torch.einsum("mbi,nbi->mnb", p.double(), f["q"].double()) - 16 * psum16.sum(-1)[:, None]
        for b in range(nb):
            acc = acc + (f["d"][None, :, b] * e[:, None, b]) * isum[..., b].float()
        return acc
    if name == "Q4_K":
        f = _q4_k(blocks)
        dots = torch.einsum("mbjs,nbjs->mnbj", p.reshape(M, nb, 8, 32).double(), f["q"].double())
        i1 = (dots * f["sc"].double()[None]).sum(-1)  # [M, N, nb]
        psum32 = psum16.reshape(M, nb, 8, 2).sum(-1)  # [M, nb, 8]
        i2 = torch.einsum("mbj,nbj->mnb", psum32, f["mn"].double())
        for b in range(nb):
            acc = acc + (f["d"][None, :, b] * e[:, None, b]) * i1[..., b].float()
            acc = acc - (f["dmin"][None, :, b] * e[:, None, b]) * i2[..., b].float()
        return acc
    f = _q6_k(blocks)  # Q6_K
    dots = torch.einsum("mbjs,nbjs->mnbj", p16.double(), f["q"].double()) - 32 * psum16[:, None]
    isum = (dots * f["sc"].double()[None]).sum(-1)
    for b in range(nb):
        acc = acc + (f["d"][None, :, b] * e[:, None, b]) * isum[..., b].float()
    return acc


def block_values(raw: torch.Tensor, qtype) -> torch.Tensor:
    """The weights [N, K] of GGUF rows of a kernel type from the fields the kernels read (the tests check
    them against gguf's dequantization, which the fast twin uses)."""
    name, _, nbytes = BLOCK_TYPES[type_id(qtype)]
    blocks = raw.reshape(raw.shape[0], -1, nbytes)
    n = raw.shape[0]
    if name == "Q5_0":
        f = _q5_0(blocks)
        return (f["d"].unsqueeze(-1) * (f["q"] - 16).float()).reshape(n, -1)
    if name == "Q4_K":
        f = _q4_k(blocks)
        d = (f["d"].unsqueeze(-1) * f["sc"].float()).unsqueeze(-1)
        dm = (f["dmin"].unsqueeze(-1) * f["mn"].float()).unsqueeze(-1)
        return (d * f["q"].float() - dm).reshape(n, -1)
    f = _q6_k(blocks)
    d = (f["d"].unsqueeze(-1) * f["sc"].float()).unsqueeze(-1)
    return (d * (f["q"] - 32).float()).reshape(n, -1)


# --------------------------------------------------------------------- Q4_K rows packed by 16 (cpu_ops_kpacked.inc)

Q4_KX16 = 1012  # not a GGML id: Q4_K rows packed in groups of 16 (`pack_k16`), the kernels' kQ4_KX16
K_PACK_ROWS = 16
_GROUP_BYTES = 2368  # a block of 16 packed rows


def k_group_rows() -> int:
    """Rows a packed Q4_K group the built kernels read (cpu_ops_kpacked.inc): 16 on AVX-512 VNNI builds, 0 where
    the build multiplies the file's rows only."""
    k = ops()
    return int(getattr(k, "k_quant_group_rows", 0)) if k is not None else 0


def packable(raw: torch.Tensor, qtype) -> bool:
    """Would the built kernels read these rows packed (Q4_K, whole groups of 16, a build that reads them)?"""
    return type_id(qtype) == 12 and raw.shape[0] % K_PACK_ROWS == 0 and k_group_rows() == K_PACK_ROWS


def pack_k16(raw: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_K rows [N, K / 256 * 144] (N a multiple of 16) -> the groups of 16 rows laid out block by block as
    cpu_ops_kpacked.inc's header gives, [N, K / 256 * 148] uint8. Moved as int16 / int32 pieces (d and dmin,
    scale pairs, 4 quant bytes), one copy of the matrix at a time."""
    G, nb = raw.shape[0] // K_PACK_ROWS, raw.shape[1] // 144
    r = raw.reshape(G, K_PACK_ROWS, nb, 144)
    sc, mn = _q4_k_scales(r[..., 4:16].short())  # [G, 16, nb, 8]
    pairs = lambda t: (t[..., 0::2] | (t[..., 1::2] << 8)).permute(0, 2, 3, 1)  # noqa: E731 [G, nb, 4, 16]
    fields = [r[..., 0:4].contiguous().view(torch.int16).permute(0, 2, 3, 1),  # [G, nb, 2, 16]: d, dmin
              pairs(sc), pairs(mn),  # [G, nb, 4, 16] int16: scales (mins) 2k, 2k + 1 as bytes
              r[..., 16:].contiguous().view(torch.int32).permute(0, 2, 3, 1)]  # [G, nb, 32, 16]: 4 quant bytes
    packed = torch.cat([f.contiguous().view(torch.uint8).reshape(G, nb, -1) for f in fields], -1)
    return packed.reshape(raw.shape[0], -1)


def unpack_k16(packed: torch.Tensor) -> torch.Tensor:
    """`pack_k16`'s inverse: the GGUF Q4_K rows [N, K / 256 * 144], byte for byte the file's."""
    G, nb = packed.shape[0] // K_PACK_ROWS, packed.shape[1] * K_PACK_ROWS // _GROUP_BYTES
    p = packed.reshape(G, nb, _GROUP_BYTES)
    rows = lambda t, *dims: t.reshape(G, nb, *dims)  # noqa: E731
    pairs = lambda t: rows(t, 4, 16, 2).permute(0, 1, 3, 2, 4).reshape(G, nb, 16, 8).int()  # noqa: E731 [.., r, 8]
    sc, mn = pairs(p[..., 64:192]), pairs(p[..., 192:320])
    scales = torch.cat([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
                        (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)], -1).to(torch.uint8)  # GGUF's 12 bytes
    qs = rows(p[..., 320:], 4, 8, 16, 4).permute(0, 1, 4, 2, 3, 5).reshape(G, nb, 16, 128)
    out = torch.cat([rows(p[..., 0:32], 16, 2), rows(p[..., 32:64], 16, 2), scales, qs], -1)  # [G, nb, r, 144]
    return out.permute(0, 2, 1, 3).reshape(G * K_PACK_ROWS, nb * 144).contiguous()
