"""The Python side of the kernels' products on a GGUF's own Q4_1 and Q8_0 blocks: the packings the kernels
read, the blocks' values (dequantization in torch, bit for bit gguf's), and the torch twins of the products.

Two twins per product. The fast one (`q4_1_linear`, `q8_0_linear`: what a layer runs when the kernels are
off) dequantizes the blocks per product and lets torch multiply — the same model up to summation order.
The exact one (`q4_1_product_reference`, `q8_0_product_reference`, for the tests) repeats the kernel's
arithmetic operation for operation: integer dot products per block (exact in fp64), then the fp32 sums
in the kernel's order with its fused multiply-adds (`fma32`), so kernel and twin agree bit for bit.

Q4_1 x Q8_1 (cpu_ops.cpp, "Q4_1 products"): the input's blocks of 32 as llama.cpp's Q8_1 (e = max |x| / 127,
p = round(x / e) to nearest even, fp32), per output lane acc = fma(sum_i q_i p_i, d e, acc), then
acc = fma(m, e sum_i p_i, acc), block after block. Q8_0 (fp32 input): 8 lanes, per block a lane's
t = fma(q, x, t) over its 4 elements, acc = fma(t, d, acc); the 8 lanes summed ((0+4)+(2+6))+((1+5)+(3+7)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Q4_1_BLOCK_BYTES = 20  # llama.cpp Q4_1: fp16 d, fp16 m, 16 bytes of nibbles for 32 weights
Q8_0_BLOCK_BYTES = 34  # llama.cpp Q8_0: fp16 d, 32 int8 weights


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 a * b + c rounded once (a fused multiply-add), in torch: the product of two fp32 values is exact
    in fp64; the fp64 sum is made round-to-odd (TwoSum's error term decides, `nextafter` moves an even
    result one ulp toward it), and an fp64 round-to-odd value rounds to fp32 as the exact value would."""
    p = a.double() * b.double()
    c64 = c.double()
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)  # s + err == p + c exactly
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf")))
    return torch.where((err != 0) & even, torch.nextafter(s, toward), s).float()


def rows_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N] for the fast twins: up to 16 rows on the CPU as w @ x^T (the dense
    layers' small-row product, `models.layers.linear`), whose rows do not depend on how many there are, so a
    verification's rows equal the decode's with the kernels off too; else torch's F.linear."""
    if x.dim() == 2 and x.shape[0] <= 16 and x.device.type == "cpu":
        return torch.mm(w, x.t()).t().contiguous()
    return F.linear(x, w)


# ------------------------------------------------------------------------------------------- Q4_1


def q4_1_group_rows() -> int:
    """Rows per packing group the built kernels read (cpu_ops.cpp, "Q4_1 products"): 16 with AVX512-VNNI (a
    pair of 8-row tiles, their blocks interleaved), else 8."""
    from dspark.kernels.compiled import ops
    k = ops()
    return int(getattr(k, "q4_1_group_rows", 8)) if k is not None else 8


def pack_q4_1(blocks: torch.Tensor, group_rows: int | None = None) -> torch.Tensor:
    """GGUF Q4_1 rows [N, K / 32 * 20] uint8 (per block of 32: fp16 d, fp16 m, 16 bytes of nibbles) -> the
    kernels' packed rows [N, K / 32 * 20] uint8 (cpu_ops.cpp, "Q4_1 products"): tiles of 8 rows, per block
    the 8 rows' nibble bytes 4 at a time (4 units of 32 bytes), then their 8 d, then their 8 m; with
    `group_rows` 16 (default: what the built kernels read, `q4_1_group_rows`) each pair of tiles interleaved,
    per block: unit by unit the first tile's then the second's, then the 16 d, then the 16 m (an odd last
    tile stays as it is). The same weights and bytes, reordered; N must be a multiple of 8."""
    n, row = blocks.shape
    if blocks.dtype != torch.uint8 or row % Q4_1_BLOCK_BYTES or n % 8:
        raise ValueError(f"Q4_1 products need uint8 rows of whole blocks, in a multiple of 8 rows; got "
                         f"{tuple(blocks.shape)} {blocks.dtype}")
    group_rows = _group_rows(group_rows)
    nb = row // Q4_1_BLOCK_BYTES
    b = blocks.contiguous().view(n // 8, 8, nb, Q4_1_BLOCK_BYTES)  # [tiles, rows, blocks, 20]
    nibbles = b[..., 4:].reshape(n // 8, 8, nb, 4, 4).permute(0, 2, 3, 1, 4).reshape(n // 8, nb, 128)
    d = b[..., 0:2].permute(0, 2, 1, 3).reshape(n // 8, nb, 16)
    m = b[..., 2:4].permute(0, 2, 1, 3).reshape(n // 8, nb, 16)
    tiles = torch.cat([nibbles, d, m], -1)  # [tiles, blocks, 160]
    if group_rows == 16:  # per group and block: units [4, 2 tiles, 32], d [2, 16], m [2, 16]; odd last tile as is
        g = n // 16
        pair = tiles[:2 * g].view(g, 2, nb, 160).transpose(1, 2)  # [groups, blocks, 2, 160]
        units = pair[..., :128].reshape(g, nb, 2, 4, 32).transpose(2, 3).reshape(g, nb, 256)
        grouped = torch.cat([units, pair[..., 128:144].reshape(g, nb, 32), pair[..., 144:].reshape(g, nb, 32)], -1)
        tiles = torch.cat([grouped.reshape(2 * g, nb, 160), tiles[2 * g:]])
    return tiles.reshape(n, row).contiguous()


def unpack_q4_1(packed: torch.Tensor, group_rows: int | None = None) -> torch.Tensor:
    """The inverse of `pack_q4_1` (the same `group_rows`): packed rows [N, K / 32 * 20] -> GGUF Q4_1 rows."""
    n, row = packed.shape
    group_rows = _group_rows(group_rows)
    nb = row // Q4_1_BLOCK_BYTES
    tiles = packed.contiguous().view(n // 8, nb, 160)
    if group_rows == 16:
        g = n // 16
        grouped = tiles[:2 * g].reshape(g, nb, 320)
        units = grouped[..., :256].reshape(g, nb, 4, 2, 32).transpose(2, 3).reshape(g, nb, 2, 128)
        pair = torch.cat([units, grouped[..., 256:288].reshape(g, nb, 2, 16),
                          grouped[..., 288:].reshape(g, nb, 2, 16)], -1)  # [groups, blocks, 2, 160]
        tiles = torch.cat([pair.transpose(1, 2).reshape(2 * g, nb, 160), tiles[2 * g:]])
    nibbles = tiles[..., :128].reshape(n // 8, nb, 4, 8, 4).permute(0, 3, 1, 2, 4).reshape(n // 8, 8, nb, 16)
    d = tiles[..., 128:144].reshape(n // 8, nb, 8, 2).permute(0, 2, 1, 3)
    m = tiles[..., 144:].reshape(n // 8, nb, 8, 2).permute(0, 2, 1, 3)
    return torch.cat([d, m, nibbles], -1).reshape(n, row).contiguous()


def _group_rows(group_rows: int | None) -> int:
    group_rows = q4_1_group_rows() if group_rows is None else group_rows
    if group_rows not in (8, 16):
        raise ValueError(f"Q4_1 packing groups are 8 or 16 rows, got {group_rows}")
    return group_rows


def q4_1_packed_cols(packed: torch.Tensor) -> int:
    """K (input columns) of a packed Q4_1 matrix [N, K / 32 * 20]."""
    return packed.shape[1] // Q4_1_BLOCK_BYTES * 32


def q4_1_fields(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q4_1 rows [N, nb * 20] -> (d [N, nb], m [N, nb] fp32, q [N, nb, 32] uint8 in 0..15)."""
    n = raw.shape[0]
    b = raw.contiguous().view(n, -1, Q4_1_BLOCK_BYTES)
    d = b[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    m = b[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
    q = torch.cat([b[..., 4:] & 0x0F, b[..., 4:] >> 4], -1)  # byte j: q_j low, q_{j+16} high
    return d, m, q


def q4_1_values(raw: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_1 rows [N, K / 32 * 20] -> their weights [N, K] fp32 (d * q + m: bit for bit gguf's)."""
    d, m, q = q4_1_fields(raw)
    return (d.unsqueeze(-1) * q.float() + m.unsqueeze(-1)).reshape(raw.shape[0], -1)


def q4_1_packed_values(packed: torch.Tensor) -> torch.Tensor:
    """The weights [N, K] fp32 of kernel-packed Q4_1 rows (packed with this build's `q4_1_group_rows`)."""
    return q4_1_values(unpack_q4_1(packed))


def quantize_q4_1(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, K] -> (packed Q4_1 rows [N, K * 10 / 16] uint8 for the kernels, the blocks' values [N, K]
    fp32): gguf's (llama.cpp's reference) Q4_1 quantizer on the weight's values."""
    import gguf
    import numpy as np
    w = weight.detach().float().cpu().numpy()
    raw = torch.from_numpy(np.ascontiguousarray(gguf.quantize(w, gguf.GGMLQuantizationType.Q4_1)))
    return pack_q4_1(raw), q4_1_values(raw).reshape(weight.shape)


def q8_1_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The input of a Q4_1 product as the kernels quantize it (`q4_prepare`): each row's blocks of 32 as
    llama.cpp's Q8_1 -> (p [rows, K / 32, 32] fp32 integers in -127..127, e [rows, K / 32] fp32):
    e = max |x| / 127, p = round(x / e) to nearest even (x times 1 / e, in fp32)."""
    blocks = x.reshape(-1, x.shape[-1] // 32, 32).float()  # [rows, K / 32, 32]
    e = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(e != 0, 1.0 / e, 0.0)  # (1 / 0 = inf is not taken)
    return torch.round(blocks * inv), e.squeeze(-1)


def q8_1_dequantized(x: torch.Tensor) -> torch.Tensor:
    """The input of a Q4_1 product as the kernels see it: `q8_1_quantize`'s p * e, x's shape and dtype
    (the products with it: x @ w^T in any exact-enough summation)."""
    p, e = q8_1_quantize(x)
    return (p * e.unsqueeze(-1)).reshape(x.shape).to(x.dtype)


def q4_1_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """The fast torch twin of the Q4_1 product: the input's Q8_1 values times the blocks' values (torch's
    fp32 product of the dequantized blocks, dequantized for this product only)."""
    return rows_product(q8_1_dequantized(x), q4_1_packed_values(packed).to(x.dtype))


def q4_1_product_reference(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 times kernel-packed Q4_1 rows [N, ...] -> [M, N] fp32, bit for bit the kernel's."""
    d, m, q = q4_1_fields(unpack_q4_1(packed))  # [N, nb] x2, [N, nb, 32]
    p, e = q8_1_quantize(x)  # [M, nb, 32], [M, nb]
    isum = torch.einsum("mbi,nbi->mnb", p.double(), q.double()).float()  # exact integers [M, N, nb]
    es = e * p.sum(-1)  # [M, nb] e * sum p (the integer sum, exact in fp32)
    acc = torch.zeros(x.shape[0], packed.shape[0])
    for b in range(d.shape[1]):
        acc = fma32(isum[..., b], d[None, :, b] * e[:, None, b], acc)
        acc = fma32(m[None, :, b].expand_as(acc), es[:, None, b].expand_as(acc), acc)
    return acc


# ------------------------------------------------------------------------------------------- Q8_0


def q8_0_row_blocks(blocks: torch.Tensor) -> tuple[int, int]:
    """(rows, blocks a row) of GGUF Q8_0 rows [N, K / 32 * 34] uint8; a ValueError for anything else."""
    n, row = blocks.shape
    if blocks.dtype != torch.uint8 or row % Q8_0_BLOCK_BYTES:
        raise ValueError(f"Q8_0 rows must be uint8 with whole blocks; got {tuple(blocks.shape)} {blocks.dtype}")
    return n, row // Q8_0_BLOCK_BYTES


def pack_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """GGUF Q8_0 rows [N, K / 32 * 34] uint8 (per block of 32: fp16 d, 32 int8 q) -> the kernels' packed
    rows [N, K * 9 / 8] int8: the K q in order, then the K / 32 scales as fp32 bytes. The same weights."""
    n, nb = q8_0_row_blocks(blocks)
    k = nb * 32
    out = torch.empty(n, k + 4 * nb, dtype=torch.int8)
    for i in range(0, n, 8192):  # in chunks of rows: no whole-matrix temporaries (a 262144-row embedding)
        b = blocks[i:i + 8192].contiguous().view(-1, nb, Q8_0_BLOCK_BYTES)
        out[i:i + 8192, :k] = b[..., 2:].contiguous().view(torch.int8).reshape(-1, k)  # [rows, K]
        d = b[..., 0:2].contiguous().view(torch.float16).reshape(-1, nb).float()  # [rows, nb]
        out[i:i + 8192, k:] = d.view(torch.int8)
    return out


def q8_0_packed_cols(packed: torch.Tensor) -> int:
    """K (input columns) of a packed Q8_0 matrix [N, K * 9 / 8]."""
    return packed.shape[1] * 8 // 9


def q8_0_fields(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed Q8_0 rows [N, K * 9 / 8] int8 -> (q [N, K / 32, 32] int8, d [N, K / 32] fp32)."""
    n, k = packed.shape[0], q8_0_packed_cols(packed)
    return packed[:, :k].reshape(n, k // 32, 32), packed[:, k:].contiguous().view(torch.float32)


def pack_q8_0x8(blocks: torch.Tensor) -> torch.Tensor:
    """GGUF Q8_0 rows [N, K / 32 * 34] uint8, N a multiple of 8 -> the Q8_0 x Q8_0 head's interleaved rows
    [N, K / 32 * 34] int8 (cpu_ops_head.inc): per group of 8 rows and block of 32 columns, 8 chunks of [8 rows x
    4 bytes] (chunk c: each row's q of columns 4c .. 4c + 3), then the 8 rows' scales d as fp16. The file's
    bytes, reordered."""
    n, nb = q8_0_row_blocks(blocks)
    if n % 8:
        raise ValueError(f"interleaved Q8_0 needs rows in groups of 8; got {n}")
    row = blocks.shape[1]
    out = torch.empty(n, row, dtype=torch.int8)
    for i in range(0, n, 8192):  # in chunks of rows: no whole-matrix temporaries
        b = blocks[i:i + 8192].contiguous().view(torch.int8).view(-1, 8, nb, Q8_0_BLOCK_BYTES)  # [groups, 8, nb, 34]
        q = b[..., 2:].reshape(-1, 8, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(-1, nb, 256)  # [groups, nb, c r 4]
        d = b[..., :2].permute(0, 2, 1, 3).reshape(-1, nb, 16)  # [groups, nb, 8 rows x fp16]
        out[i:i + 8192] = torch.cat([q, d], -1).reshape(-1, row)
    return out


def q8_0x8_fields(packed: torch.Tensor, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Interleaved Q8_0 rows (`pack_q8_0x8`) [N, K / 32 * 34] -> (q [n, K / 32, 32] int8, d [n, K / 32] fp32)
    of all rows, or of `rows` (long ids) only."""
    n, nb = packed.shape[0], packed.shape[1] // Q8_0_BLOCK_BYTES
    groups = packed.view(n // 8, nb, 8 * Q8_0_BLOCK_BYTES)
    ids = torch.arange(n) if rows is None else rows.reshape(-1).long()
    q = groups[..., :256].view(n // 8, nb, 8, 8, 4)[ids // 8, :, :, ids % 8]  # [n, nb, 8, 4]
    d = groups[..., 256:].view(torch.float16)[ids // 8, :, ids % 8]  # [n, nb] (a view: no copy of all scales)
    return q.reshape(-1, nb, 32), d.float()


def q8_0x8_values(packed: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The weights [n, K] fp32 of interleaved Q8_0 rows (all, or `rows`): d * q, bit for bit gguf's."""
    q, d = q8_0x8_fields(packed, rows)
    return (q.float() * d.unsqueeze(-1)).reshape(q.shape[0], -1)


def q8_0_packed_values(packed: torch.Tensor) -> torch.Tensor:
    """The weights [N, K] fp32 of packed Q8_0 rows (d * q, exact: bit for bit gguf's); pass a row subset
    (`packed[ids]`) to dequantize only those rows (the embedding lookup)."""
    q, d = q8_0_fields(packed)
    return (q.float() * d.unsqueeze(-1)).reshape(packed.shape[0], -1)


def q8_0_linear(x: torch.Tensor, packed: torch.Tensor, values=q8_0_packed_values) -> torch.Tensor:
    """The fast torch twin of the Q8_0 product: the fp32 input times the blocks' values (dequantized in
    chunks of rows, so no whole fp32 copy of a large head is ever held). `values`: the layout's
    dequantization (`q8_0x8_values` for rows interleaved by 8; the chunks are whole groups)."""
    x2 = x.reshape(-1, x.shape[-1])
    out = x2.new_empty(x2.shape[0], packed.shape[0])
    for n0 in range(0, packed.shape[0], 8192):
        out[:, n0:n0 + 8192] = rows_product(x2, values(packed[n0:n0 + 8192]).to(x.dtype))
    return out.reshape(*x.shape[:-1], packed.shape[0])


def q8_0_product_reference(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 times packed Q8_0 rows [N, K * 9 / 8] -> [M, N] fp32, bit for bit the kernel's."""
    q, d = q8_0_fields(packed)  # [N, nb, 32], [N, nb]
    M, N, nb = x.shape[0], packed.shape[0], d.shape[1]
    xs = x.float().reshape(M, 1, nb, 4, 8)
    qs = q.float().reshape(1, N, nb, 4, 8)
    acc = torch.zeros(M, N, 8)
    for b in range(nb):
        t = torch.zeros(M, N, 8)
        for c in range(4):
            t = fma32(qs[:, :, b, c].expand_as(t), xs[:, :, b, c].expand_as(t), t)
        acc = fma32(t, d[None, :, b, None].expand_as(t), acc)
    a = acc.unbind(-1)
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
