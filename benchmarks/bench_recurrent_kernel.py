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

Medians over rounds: each round times every case once per path, the twin and the kernel in turns, so a case's
repeats spread over the whole run and load from other processes falls on both paths alike. The ring is 8 states
long (1 + 7 drafts); each repeat starts every request after position 99 (the step profiler's `claim`).

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


class Case:
    """One (shape, B, n): its ring, rows and inputs, and the paths timed on them."""

    def __init__(self, name: str, layer: GatedDeltaNet, B: int, n: int) -> None:
        self.name, self.layer, self.B, self.n = name, layer, B, n
        self.state = allocate_layer_state(num_slots=B, window=WINDOW, dtype=torch.float32, device="cpu",
                                          **layer.state_shape())
        self.rows = StateRows(slots=tuple(range(B)), starts=(START,) * B, lengths=(n,) * B,
                              offsets=tuple(range(0, B * n, n)))
        self.x = torch.randn(B * n, layer.in_proj.in_features, generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            self.qkv, self.z, self.b, self.a = layer.in_proj(self.x).split(layer.in_proj.split_sizes, dim=-1)
            self.beta = self.b.sigmoid()
            self.gate = -layer.A_log.exp() * torch.nn.functional.softplus(self.a + layer.dt_bias)
        self.core = self.x.new_empty(B * n, layer.num_v_heads, layer.head_v_dim)
        self.times: dict[str, list[float]] = {p: [] for p in PATHS}

    def run(self, path: str) -> None:
        layer, st, members = self.layer, self.state, list(range(self.B))
        if path == "recurrence_torch":
            layer._windows(self.n, members, self.qkv, self.gate, self.beta, self.rows, st, self.core)
        elif path == "recurrence_kernel":
            layer._windows_kernel(members, self.qkv, self.gate, self.beta, self.rows, st, self.core)
        elif path == "glue":
            self.b.float().sigmoid()
            -layer.A_log.float().exp() * torch.nn.functional.softplus(self.a.float() + layer.dt_bias.float())
            gated_rms_norm(self.core, self.z.reshape(self.B * self.n, layer.num_v_heads, -1), layer.norm_weight,
                           layer.eps)
        else:  # a whole layer forward, the recurrence through the kernel or the twin
            apply = window_kernel.windows_apply
            if path == "layer_torch":
                window_kernel.windows_apply = lambda *args: False
            try:
                layer(self.x, self.rows, st)
            finally:
                window_kernel.windows_apply = apply

    def time(self, path: str) -> float:
        for s in range(self.B):  # every repeat starts after position START - 1
            self.state.claim(s, START - 1)
        with torch.inference_mode():
            t = time.perf_counter()
            self.run(path)
            ms = (time.perf_counter() - t) * 1e3
        self.times[path].append(ms)
        return ms

    def result(self, linear_layers: int) -> dict:
        med = {p: statistics.median(t) for p, t in self.times.items()}
        rec = {k: med[f"recurrence_{k}"] for k in ("torch", "kernel")}
        whole = {k: med[f"layer_{k}"] for k in ("torch", "kernel")}
        return {
            "B": self.B, "n": self.n,
            "recurrence_ms": rec, "recurrence_speedup": rec["torch"] / rec["kernel"],
            "layer_ms": whole, "layer_speedup": whole["torch"] / whole["kernel"],
            "recurrence_share_of_layer": {k: min(1.0, rec[k] / whole[k]) for k in whole},
            "glue_ms": med["glue"], "glue_share_of_layer_with_kernel": med["glue"] / whole["kernel"],
            # per decode / verification step: every linear-attention layer's recurrence and whole layer
            "per_step_linear_layers_ms": {"recurrence": {k: v * linear_layers for k, v in rec.items()},
                                          "layer": {k: v * linear_layers for k, v in whole.items()}},
            "fastest_ms": {p: min(t) for p, t in self.times.items()},  # a check on the medians under shared cores
        }


PATHS = ("recurrence_torch", "recurrence_kernel", "layer_torch", "layer_kernel", "glue")


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
    cases = []
    for name in args.shapes.split(","):
        layer = layer_for(SHAPES[name])
        cases += [Case(name, layer, int(B), int(n)) for B in args.batches.split(",") for n in args.tokens.split(",")]
    for c in cases:  # warm-up
        for p in PATHS:
            c.time(p)
        c.times = {p: [] for p in PATHS}
    # rounds over every case, so each case's repeats spread over the whole run; within a case the two paths
    # alternate which goes first
    for i in range(args.repeats):
        for c in cases:
            for p in (PATHS if i % 2 == 0 else PATHS[1::-1] + PATHS[3:1:-1] + PATHS[4:]):
                c.time(p)
    results: dict[str, dict] = {}
    for c in cases:
        r = c.result(SHAPES[c.name]["linear_layers"])
        results.setdefault(c.name, {"shape": SHAPES[c.name], "cases": []})["cases"].append(r)
        print(f"{c.name} B={c.B} n={c.n}: recurrence torch {r['recurrence_ms']['torch']:.3f} ms, kernel "
              f"{r['recurrence_ms']['kernel']:.3f} ms ({r['recurrence_speedup']:.1f}x); layer torch "
              f"{r['layer_ms']['torch']:.3f} ms, kernel {r['layer_ms']['kernel']:.3f} ms ({r['layer_speedup']:.2f}x); "
              f"recurrence share of the layer {r['recurrence_share_of_layer']['torch']:.0%} -> "
              f"{r['recurrence_share_of_layer']['kernel']:.0%}; glue {r['glue_ms']:.3f} ms", flush=True)
    out = {"benchmark": "recurrent_kernel", "threads": args.threads, "repeats": args.repeats, "window": WINDOW,
           "activations": "fp32", "products": "bf16 (use_bf16_products)", "kernel_kind": kernels.kernel_kind(),
           "isa": kernels.isa(), "torch": torch.__version__, "python": platform.python_version(), "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
