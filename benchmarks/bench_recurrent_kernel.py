"""The Gated DeltaNet window kernel (dspark/kernels/cpu_ops_recurrent.inc) against its torch twin at the Qwen3.5-2B and
Qwen3.5-4B linear-attention shapes (random weights), side by side in one process: per layer, for B requests of n new
tokens each (decode: n = 1; verification windows: n = 4, 8),

  recurrence  the part the kernel replaces: the causal conv + SiLU, the q/k preparation, the gated delta rule with
              every position's state kept in the ring (`GatedDeltaNet._windows` against `_windows_kernel`; fp32
              activations, as the engine runs on the CPU);
  layer       one whole GatedDeltaNet layer forward with bf16 products (`use_bf16_products`: in_proj, out_proj),
              the recurrence through the kernel or the twin, and the recurrence's share of it;
  glue        the torch ops around the recurrence a further fusion could take in: beta = sigmoid(b),
              g = -exp(A_log) softplus(a + dt_bias) and the gated RMSNorm.

Medians of alternating repeats (the two paths take turns, so load from other processes falls on both). The ring is
8 states long (1 + 7 drafts); each repeat starts every request after position 99 (the step profiler's `claim`).

    python benchmarks/bench_recurrent_kernel.py --threads 2 --out benchmarks/results/recurrent_kernel.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from dspark import kernels
from dspark.kernels import recurrent as window_kernel
from dspark.models.config import ModelConfig
from dspark.models.layers import use_bf16_products
from dspark.models.qwen3_next import GatedDeltaNet
from dspark.models.recurrent import StateRows, allocate_layer_state, gated_rms_norm

WINDOW = 8
START = 100
# the linear-attention layers of Qwen3.5-2B and -4B as their configs state them (every fourth layer full attention)
SHAPES = {
    "qwen3.5-2b": {"hidden": 2048, "layers": 24, "linear_layers": 18, "k_heads": 16, "v_heads": 16},
    "qwen3.5-4b": {"hidden": 2560, "layers": 32, "linear_layers": 24, "k_heads": 16, "v_heads": 32},
}
BASE = ModelConfig(architecture="Qwen3_5ForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=64,
                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   layer_types=("linear_attention",) * 3 + ("full_attention",), linear_key_head_dim=128,
                   linear_value_head_dim=128, linear_conv_kernel_dim=4, attn_output_gate=True, qk_norm=True)


def layer_for(shape: dict) -> GatedDeltaNet:
    cfg = replace(BASE, hidden_size=shape["hidden"], linear_num_key_heads=shape["k_heads"],
                  linear_num_value_heads=shape["v_heads"])
    layer = GatedDeltaNet(cfg, dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":
                p.copy_(torch.rand(p.shape, generator=g).log())
            elif name in ("dt_bias", "norm_weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    use_bf16_products(layer)
    return layer.eval()


def timed(fn, before) -> float:
    before()
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


FASTEST: dict[str, float] = {}  # the same runs' minimum per path (a check on the medians under shared cores)


def side_by_side(paths: dict, before, repeats: int, tag: str = "") -> dict[str, float]:
    """Median ms of each path, the paths alternating (one warm-up call each)."""
    times: dict[str, list[float]] = {name: [] for name in paths}
    for name, fn in paths.items():
        timed(fn, before)
    for i in range(repeats):
        for name in (list(paths) if i % 2 == 0 else list(paths)[::-1]):
            times[name].append(timed(paths[name], before))
    FASTEST.update({f"{tag}{name}": min(t) for name, t in times.items()})
    return {name: statistics.median(t) for name, t in times.items()}


def case(layer: GatedDeltaNet, B: int, n: int, repeats: int) -> dict:
    state = allocate_layer_state(num_slots=B, window=WINDOW, dtype=torch.float32, device="cpu",
                                 **layer.state_shape())
    rows = StateRows(slots=tuple(range(B)), starts=(START,) * B, lengths=(n,) * B,
                     offsets=tuple(range(0, B * n, n)))
    members = list(range(B))

    def claim():
        for s in range(B):
            state.claim(s, START - 1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B * n, layer.in_proj.in_features, generator=g)
    with torch.inference_mode():
        qkv, z, b, a = layer.in_proj(x).split(layer.in_proj.split_sizes, dim=-1)
        beta = b.sigmoid()
        gate = -layer.A_log.exp() * torch.nn.functional.softplus(a + layer.dt_bias)
        core = x.new_empty(B * n, layer.num_v_heads, layer.head_v_dim)
        recurrence = side_by_side({
            "torch": lambda: layer._windows(n, members, qkv, gate, beta, rows, state, core),
            "kernel": lambda: layer._windows_kernel(members, qkv, gate, beta, rows, state, core),
        }, claim, repeats, "recurrence_")
        apply = window_kernel.windows_apply

        def forward(use_kernel: bool):
            window_kernel.windows_apply = apply if use_kernel else (lambda *args: False)
            try:
                layer(x, rows, state)
            finally:
                window_kernel.windows_apply = apply
        whole = side_by_side({"torch": lambda: forward(False), "kernel": lambda: forward(True)}, claim, repeats,
                             "layer_")

        def glue():
            b.float().sigmoid()
            -layer.A_log.float().exp() * torch.nn.functional.softplus(a.float() + layer.dt_bias.float())
            gated_rms_norm(core, z.reshape(B * n, layer.num_v_heads, -1), layer.norm_weight, layer.eps)
        glue_ms = side_by_side({"glue": glue}, claim, repeats, "")["glue"]
    return {
        "B": B, "n": n,
        "recurrence_ms": recurrence, "recurrence_speedup": recurrence["torch"] / recurrence["kernel"],
        "layer_ms": whole, "layer_speedup": whole["torch"] / whole["kernel"],
        "recurrence_share_of_layer": {k: min(1.0, recurrence[k] / whole[k]) for k in whole},
        "glue_ms": glue_ms, "glue_share_of_layer_with_kernel": glue_ms / whole["kernel"],
        "fastest_ms": dict(FASTEST),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--tokens", default="1,4,8")
    ap.add_argument("--out", default="benchmarks/results/recurrent_kernel.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not window_kernel.available():
        sys.exit("the CPU kernels are off or failed to build: nothing to compare")
    results = {}
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        layer = layer_for(shape)
        rows = []
        for B in (int(v) for v in args.batches.split(",")):
            for n in (int(v) for v in args.tokens.split(",")):
                r = case(layer, B, n, args.repeats)
                # per decode / verification step: every linear-attention layer's recurrence and whole layer
                r["per_step_linear_layers_ms"] = {
                    part: {k: v * shape["linear_layers"] for k, v in r[f"{part}_ms"].items()}
                    for part in ("recurrence", "layer")}
                rows.append(r)
                print(f"{name} B={B} n={n}: recurrence torch {r['recurrence_ms']['torch']:.3f} ms, kernel "
                      f"{r['recurrence_ms']['kernel']:.3f} ms ({r['recurrence_speedup']:.1f}x); layer torch "
                      f"{r['layer_ms']['torch']:.3f} ms, kernel {r['layer_ms']['kernel']:.3f} ms "
                      f"({r['layer_speedup']:.2f}x); recurrence share of the layer "
                      f"{r['recurrence_share_of_layer']['torch']:.0%} -> {r['recurrence_share_of_layer']['kernel']:.0%}; glue "
                      f"{r['glue_ms']:.3f} ms",
                      flush=True)
        results[name] = {"shape": shape, "cases": rows}
    out = {"benchmark": "recurrent_kernel", "threads": args.threads, "repeats": args.repeats, "window": WINDOW,
           "activations": "fp32", "products": "bf16 (use_bf16_products)", "kernel_kind": kernels.kernel_kind(),
           "isa": kernels.isa(), "torch": torch.__version__, "python": platform.python_version(), "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
