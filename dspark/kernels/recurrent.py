"""The Python side of the Gated DeltaNet window kernel (cpu_ops_recurrent.inc): the conv, the q/k preparation and the
one-token-at-a-time delta rule of a linear-attention layer's decode and verification windows, every request of a
step in one call, each position's conv and recurrent state written straight into the layer's state rings.

Its slow twin is the torch path of `dspark.models.qwen3_next.GatedDeltaNet._windows` (`causal_conv`, `prepare_qk`,
`delta_rule_tokens` and `LayerState.keep`); the tests compare the two position by position. The kernel applies to
CPU tensors outside autograd with fp32 or bf16 activations (the conv weight and the output in the activations'
dtype), fp32 or bf16 conv states and fp32 recurrent states; anything else, or the kernels off
(`DSPARK_CPU_KERNELS=0`), takes the twin.
"""

from __future__ import annotations

import torch

ROW_FIELDS = ("slot", "start", "length", "offset", "ring_source", "snapshot_source")  # the kernel's rows, in order
_ACTIVATIONS = (torch.float32, torch.bfloat16)


def available() -> bool:
    """Are the kernels built with the window kernel (and not switched off)?"""
    from dspark import kernels
    k = kernels.ops()
    return k is not None and hasattr(k, "gated_delta_windows_")


def windows_apply(qkv: torch.Tensor, conv_weight: torch.Tensor, conv_ring: torch.Tensor, rec_ring: torch.Tensor,
                  core: torch.Tensor) -> bool:
    """Would `gated_delta_windows` run the kernel on these tensors? (checked before the kernels are loaded, so a CUDA
    step never loads them)."""
    tensors = (qkv, conv_weight, conv_ring, rec_ring, core)
    if any(t.device.type != "cpu" for t in tensors) or (torch.is_grad_enabled() and qkv.requires_grad):
        return False
    if qkv.dtype not in _ACTIVATIONS or conv_weight.dtype != qkv.dtype or conv_ring.dtype not in _ACTIVATIONS:
        return False
    if rec_ring.dtype != torch.float32 or core.dtype != qkv.dtype or qkv.stride(-1) != 1 or not core.is_contiguous():
        return False
    return available()


def gated_delta_windows(
    qkv: torch.Tensor,  # [T, conv_dim] the step's q | k | v rows (the in_proj output's columns; rows may be strided)
    g: torch.Tensor,  # [T, Hv] fp32 log-decay
    beta: torch.Tensor,  # [T, Hv] fp32
    conv_weight: torch.Tensor,  # [conv_dim, K]
    conv_ring: torch.Tensor,  # [slots, W, K - 1, conv_dim]
    rec_ring: torch.Tensor,  # [slots, W, Hv, dk, dv] fp32
    snap_conv: torch.Tensor | None,  # [snapshots, K - 1, conv_dim] (None: no snapshots)
    snap_rec: torch.Tensor | None,  # [snapshots, Hv, dk, dv] fp32
    rows: list[tuple[int, int, int, int, int, int]],  # per request, ROW_FIELDS
    num_k_heads: int,
    core: torch.Tensor,  # [T, Hv, dv] in qkv's dtype: the windows' rows written
) -> bool:
    """Run the windows through the kernel; False (nothing done) where it does not apply, so the caller runs the twin.
    Each row names where its source state is (a ring entry of its slot, a snapshot entry, or neither: zeros); the
    states after positions start .. start + length - 1 go to ring entries (start + t) % W of its slot."""
    if not windows_apply(qkv, conv_weight, conv_ring, rec_ring, core):
        return False
    from dspark import kernels
    if snap_conv is None or snap_rec is None:
        snap_conv, snap_rec = conv_ring.new_empty(0), rec_ring.new_empty(0)
    table = torch.tensor(rows, dtype=torch.long).reshape(-1, len(ROW_FIELDS))  # [B, 6]
    kernels.ops().gated_delta_windows_(qkv, g.float().contiguous(), beta.float().contiguous(),
                                       conv_weight.contiguous(), conv_ring, rec_ring, snap_conv, snap_rec, table,
                                       num_k_heads, core)
    return True
