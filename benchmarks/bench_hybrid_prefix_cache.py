"""Prefix caching on a hybrid target: time to first token of a second request that shares a long prefix with the
first, with prefix caching (the prefix's K/V from the block cache, the recurrence resumed from the state snapshot
at the prefix's end) and without (the whole prompt computed again). Target: with / without <= 0.2 at a 2k-token
prefix.

The target is benchmarks/bench_hybrid.py's Qwen3.5-layout hybrid with random weights (12 layers, 9 Gated DeltaNet
and 3 full attention, hidden 512, vocabulary 32000; no real checkpoint can be had here), fp32 on the CPU, one
request at a time, 16-token KV blocks and the default snapshot settings (a snapshot every 512 tokens and at each
prompt's last full block). Each repeat draws a new prefix and two suffixes; both engines get the same prompts,
the order alternating; the first request of each pair warms the cache (its TTFT is the cold one), the second is
timed. Greedy first tokens are checked equal across the engines. The JSON also states a snapshot's bytes at this
shape and at Qwen3.5-2B's (arithmetic: the state of every linear layer, one position).

    python benchmarks/bench_hybrid_prefix_cache.py --threads 2 --prefix-tokens 2048 --repeats 5 \\
        --out benchmarks/results/hybrid_prefix_cache.json
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_hybrid import CFG, random_weights  # noqa: E402
from dspark.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from dspark.engine.engine import Engine  # noqa: E402
from dspark.models import build_model  # noqa: E402
from dspark.sampling import SamplingParams  # noqa: E402

# Qwen3.5-2B's text decoder as its config states it: 24 layers, every fourth full attention (18 Gated DeltaNet),
# 16 key and 16 value heads of 128 in the linear layers, a conv kernel of 4, 2 KV heads of 256 in the full ones
QWEN3_5_2B = {"linear_layers": 18, "attention_layers": 6, "num_k_heads": 16, "num_v_heads": 16, "head_k_dim": 128,
              "head_v_dim": 128, "kernel": 4, "kv_heads": 2, "head_dim": 256}


def snapshot_bytes(*, linear_layers: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                   kernel: int, act_bytes: int, **_) -> int:
    """One snapshot: per linear layer the last kernel - 1 conv inputs (activation dtype) and the fp32 recurrence."""
    conv_dim = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim
    return linear_layers * ((kernel - 1) * conv_dim * act_bytes + num_v_heads * head_k_dim * head_v_dim * 4)


def kv_block_bytes(*, attention_layers: int, kv_heads: int, head_dim: int, act_bytes: int, block: int = 16, **_) -> int:
    return attention_layers * 2 * block * kv_heads * head_dim * act_bytes


def engine_for(model, cfg, *, prefix_caching: bool, max_len: int, budget: int) -> Engine:
    blocks = 4 * (-(-max_len // 16)) + 8  # both requests of a pair and a spare
    config = EngineConfig(cache=CacheConfig(kv_block_size=16, num_kv_blocks=blocks, enable_prefix_caching=prefix_caching),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, coalesce_steps=0))
    return Engine(config, model=model, model_config=cfg)


def first_token(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    """(seconds from add_request to the first output token, that token)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    rid = engine.add_request(prompt, params)
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid and o.new_token_ids:
                seconds = time.perf_counter() - start
                token = o.new_token_ids[0]
    return seconds, token


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--suffix-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens (prompt chunk per step)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/hybrid_prefix_cache.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    max_len = args.prefix_tokens + args.suffix_tokens + 8
    cfg = replace(CFG, max_position_embeddings=max(CFG.max_position_embeddings, max_len))
    model = build_model(cfg, dtype=torch.float32)
    random_weights(model)
    g = torch.Generator().manual_seed(0)
    runs: dict[str, dict[str, list[float]]] = {k: {"cold": [], "second": []} for k in ("cached", "uncached")}
    snapshots = {}
    for rep in range(args.repeats):
        prefix = torch.randint(3, CFG.vocab_size, (args.prefix_tokens,), generator=g).tolist()
        first, second = (prefix + torch.randint(3, CFG.vocab_size, (args.suffix_tokens,), generator=g).tolist()
                         for _ in range(2))
        tokens = {}
        order = ("cached", "uncached") if rep % 2 == 0 else ("uncached", "cached")
        for kind in order:  # a fresh engine per pair: nothing cached before the first request
            engine = engine_for(model, cfg, prefix_caching=kind == "cached", max_len=max_len, budget=args.budget)
            cold, _ = first_token(engine, first)
            warm, tokens[kind] = first_token(engine, second)
            runs[kind]["cold"].append(cold)
            runs[kind]["second"].append(warm)
            if kind == "cached":
                bm = engine.block_manager
                snapshots = {"hits": bm.num_snapshot_hits, "stored": bm.num_snapshots_stored,
                             "evicted": bm.num_snapshots_evicted,
                             "cached_tokens_of_second": engine.scheduler.num_prefix_cache_hits}
        assert tokens["cached"] == tokens["uncached"], f"first tokens differ: {tokens}"
        print(f"repeat {rep}: second request TTFT {1e3 * runs['cached']['second'][-1]:.1f} ms cached, "
              f"{1e3 * runs['uncached']['second'][-1]:.1f} ms uncached", flush=True)
    med = {kind: {k: statistics.median(v) for k, v in r.items()} for kind, r in runs.items()}
    ratio = med["cached"]["second"] / med["uncached"]["second"]
    ours = {"linear_layers": sum(t == "linear_attention" for t in CFG.layer_types),
            "attention_layers": sum(t == "full_attention" for t in CFG.layer_types),
            "num_k_heads": CFG.linear_num_key_heads, "num_v_heads": CFG.linear_num_value_heads,
            "head_k_dim": CFG.linear_key_head_dim, "head_v_dim": CFG.linear_value_head_dim,
            "kernel": CFG.linear_conv_kernel_dim, "kv_heads": CFG.num_key_value_heads, "head_dim": CFG.head_dim}
    assert snapshot_bytes(**ours, act_bytes=4) == model.state_bytes_per_slot(1, torch.float32)
    result = {
        "what": "TTFT of a second request sharing a prefix: hybrid prefix caching on / off",
        "command": " ".join(sys.argv), "machine": platform.platform(), "processor": platform.processor(),
        "torch_threads": args.threads, "torch": torch.__version__,
        "model": {"layers": CFG.num_hidden_layers, "hidden_size": CFG.hidden_size, "vocab_size": CFG.vocab_size,
                  **ours, "weights": "random", "dtype": "float32"},
        "prefix_tokens": args.prefix_tokens, "suffix_tokens": args.suffix_tokens, "repeats": args.repeats,
        "budget": args.budget, "runs_s": runs, "median_s": med, "ttft_ratio_second": ratio, "target_ratio": 0.2,
        "meets_target": ratio <= 0.2, "snapshots_last_repeat": snapshots,
        "snapshot_bytes": {"this_shape_fp32": snapshot_bytes(**ours, act_bytes=4),
                           "qwen3_5_2b_bf16": snapshot_bytes(**QWEN3_5_2B, act_bytes=2)},
        "kv_block_bytes_16_tokens": {"this_shape_fp32": kv_block_bytes(**ours, act_bytes=4),
                                     "qwen3_5_2b_bf16": kv_block_bytes(**QWEN3_5_2B, act_bytes=2)},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"second-request TTFT: {1e3 * med['cached']['second']:.1f} ms cached / "
          f"{1e3 * med['uncached']['second']:.1f} ms uncached = {ratio:.3f} (target <= 0.2) -> {out}")


if __name__ == "__main__":
    main()
