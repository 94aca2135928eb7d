"""A small hybrid linear-attention target (Qwen3.5 layout, random weights: no real checkpoint can be had here) on
the CPU: greedy decode tok/s (prompts excluded) at batch 1 and with 8 concurrent requests, plain vs prompt lookup (n-gram) vs the
checkpoint's MTP layer, side by side in one run (each prompt set goes to each engine in turn, the order rotating);
and what keeping every position's recurrent state of a verification window costs, as a share of that step.

Random weights: the target's greedy text falls into loops, which prompt lookup predicts better than on real
text, and the MTP layer is untrained (its drafts are near chance): the MTP row measures the machinery's cost,
not a speed-up a trained layer would give.

The state-keeping share: one verification step of 8 requests x (1 + 3 drafts), timed with the states of every
window position stored (what rollback reads) and with the store skipped, alternating, medians.

    python benchmarks/bench_hybrid.py --threads 2 --out benchmarks/results/hybrid_decode.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from dspark.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from dspark.drafters import build_drafter
from dspark.engine.engine import Engine
from dspark.models import build_model
from dspark.models.config import ModelConfig
from dspark.sampling import SamplingParams

LAYERS = ("linear_attention",) * 3 + ("full_attention",)
CFG = ModelConfig(
    architecture="Qwen3_5ForCausalLM", vocab_size=32000, hidden_size=512, intermediate_size=1536,
    num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=2, head_dim=64, rope_theta=1e6,
    max_position_embeddings=4096, qk_norm=True, bos_token_id=1, eos_token_ids=(2,), layer_types=LAYERS * 3,
    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
    partial_rotary_factor=0.25, attn_output_gate=True)
SPECS = {"plain": None,
         "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
         "mtp": {"method": "mtp", "num_speculative_tokens": 3}}


def random_weights(model: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))  # (1 + w) norms
            elif name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g).log())
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)


def mtp_folder(path: Path) -> Path:
    """A folder holding only random `mtp.*` tensors with the HF names (what `method: mtp` reads) for CFG."""
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(1)
    d, hd, inter, h, kv = CFG.hidden_size, CFG.head_dim, CFG.intermediate_size, CFG.num_attention_heads, \
        CFG.num_key_value_heads
    shapes = {"fc.weight": (d, 2 * d), "self_attn.q_proj.weight": (2 * h * hd, d),
              "self_attn.k_proj.weight": (kv * hd, d), "self_attn.v_proj.weight": (kv * hd, d),
              "self_attn.o_proj.weight": (d, h * hd), "mlp.gate_proj.weight": (inter, d),
              "mlp.up_proj.weight": (inter, d), "mlp.down_proj.weight": (d, inter)}
    norms = {"norm.weight": d, "pre_fc_norm_embedding.weight": d, "pre_fc_norm_hidden.weight": d,
             "input_layernorm.weight": d, "post_attention_layernorm.weight": d, "self_attn.q_norm.weight": hd,
             "self_attn.k_norm.weight": hd}
    tensors = {}
    for name, shape in shapes.items():
        key = f"mtp.{name}" if name == "fc.weight" else f"mtp.layers.0.{name}"
        tensors[key] = torch.randn(shape, generator=g) * shape[-1] ** -0.5
    for name, n in norms.items():
        key = f"mtp.{name}" if name.startswith(("norm", "pre_fc")) else f"mtp.layers.0.{name}"
        tensors[key] = 0.1 * torch.randn(n, generator=g)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    return path


def engine_for(model, spec: dict | None, folder: Path, max_num_seqs: int) -> Engine:
    config = EngineConfig(cache=CacheConfig(kv_block_size=16, num_kv_blocks=512, enable_prefix_caching=False),
                          scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512))
    drafter = None
    if spec is not None:
        sc = SpecConfig(**{**spec, **({"model": str(folder)} if spec["method"] == "mtp" else {})})
        config = replace(config, spec=sc)
        drafter = build_drafter(sc, target_config=CFG, target_model=model, dtype=torch.float32, device="cpu")
    return Engine(config, model=model, model_config=CFG, drafter=drafter)


def generate(engine: Engine, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    """Decode tok/s (from the step in which every request has its first token: prompts excluded) and the
    outputs."""
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    out = {i: [] for i in ids}
    start, counted = None, 0
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            if start is not None:
                counted += len(o.new_token_ids)
        if start is None and all(out.values()):
            start = time.perf_counter()
    return counted / (time.perf_counter() - start), [out[i] for i in ids]


def keep_share(model, repeats: int) -> dict:
    """Median seconds of one 8 x 4-token verification step with every position's state kept and without."""
    from dspark.models import recurrent
    from dspark.models.attention import SeqSpec, build_attn_metadata
    model.allocate_state(num_slots=8, window=4, dtype=torch.float32, device="cpu")
    ctx, block = 64, 16
    kv = [(torch.zeros(8 * 8, block, *model.kv_spec), torch.zeros(8 * 8, block, *model.kv_spec))
          for _ in range(model.num_kv_layers)]
    seqs = [SeqSpec(list(range(8 * r, 8 * r + 8)), ctx, 4, 4 * r, state_slot=r) for r in range(8)]
    meta = build_attn_metadata(seqs, num_tokens=32, kv_block_size=block)
    ids, pos = torch.randint(3, CFG.vocab_size, (32,)), torch.arange(ctx, ctx + 4).repeat(8)
    keep = recurrent.LayerState.keep
    times = {"kept": [], "not_kept": []}
    with torch.inference_mode():
        for i in range(2 * repeats + 2):
            label = "kept" if i % 2 == 0 else "not_kept"
            recurrent.LayerState.keep = keep if label == "kept" else (lambda *a, **k: None)
            for s in model.states:
                for r in range(8):
                    s.claim(r, ctx - 1)
            t = time.perf_counter()
            model(ids, pos, meta, kv)
            if i >= 2:
                times[label].append(time.perf_counter() - t)
    recurrent.LayerState.keep = keep
    med = {k: statistics.median(v) for k, v in times.items()}
    return {**{f"{k}_ms": 1e3 * v for k, v in med.items()}, "share": 1 - med["not_kept"] / med["kept"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(CFG)
    random_weights(model)
    g = torch.Generator().manual_seed(7)
    prompt_sets = {n: [torch.randint(3, CFG.vocab_size, (96,), generator=g).tolist() for _ in range(n)]
                   for n in (1, 8)}
    results: dict = {"command": " ".join(["python", "benchmarks/bench_hybrid.py"] + sys.argv[1:]),
                     "date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
                     "config": "Qwen3.5 layout, random weights, 12 layers (9 Gated DeltaNet, 3 full attention), "
                               "hidden 512, vocab 32000, fp32", "threads": args.threads, "new_tokens": args.new}
    with tempfile.TemporaryDirectory() as tmp:
        folder = mtp_folder(Path(tmp) / "mtp")
        for n, prompts in prompt_sets.items():
            engines = {label: engine_for(model, spec, folder, n) for label, spec in SPECS.items()}
            for e in engines.values():
                generate(e, [prompts[0][:16]], 4)  # warm-up
            speeds: dict[str, list[float]] = {label: [] for label in engines}
            outputs: dict[str, list] = {}
            labels = list(engines)
            for r in range(args.rounds):
                for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                    tps, out = generate(engines[label], prompts, args.new)
                    speeds[label].append(tps)
                    outputs[label] = out
            m = {label: engines[label].metrics for label in labels}
            results[f"requests_{n}"] = {
                label: {"tok_s": statistics.median(v), "vs_plain": statistics.median(v) / statistics.median(
                    speeds["plain"]), "same_output_as_plain": outputs[label] == outputs["plain"],
                    "tau": (1 + m[label].num_accepted_tokens / m[label].num_drafts) if m[label].num_drafts else None}
                for label, v in speeds.items()}
            print(json.dumps({f"requests_{n}": results[f"requests_{n}"]}), flush=True)
    results["state_keeping"] = keep_share(model, repeats=20)
    line = json.dumps(results)
    if args.out:
        Path(args.out).write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
