"""What DSpark would cost, and could gain, on this machine at the shapes users run: a projection with random weights.

A target with random weights at a named shape (Qwen3-4B, Gemma 4 E4B) is built with dspark's own model classes,
and a DSpark drafter of DeepSpec's published shape for it (5 draft layers, block 7, five tap layers, Markov head of
rank 256 and confidence head), once over the full vocabulary and once over a reduced draft vocabulary (32768 target
ids). On one engine per drafter (paged KV pool, batch 1, ~512 positions of context) `StepProfiler` times, side by
side and alternating (the order rotating per round, medians over rounds):

* a target step of 1, 4 and 8 tokens (plain decoding; a verification of 3 and of 7 drafts),
* one drafter proposal for 1 request (block forward, Markov walk, confidences), full and reduced vocabulary,
* one drafter context update of 5 rows (~the paper's τ: the accepted drafts + 1 each round add their taps).

Reported per shape: those seconds, the proposal's share of a 1-token step and of a 4- and 8-token verification,
and the projected speed-up over plain decoding,

    speed-up = τ / (8-token verification + proposal) × 1-token step,

for the accepted lengths τ (bonus token included) the DSpark paper reports at block 7 (the 8-token window),
with and without the context update; `break_even_tau` is the τ at which speculation starts to pay. Where the
1-token step is slower than a 4- or 8-token one (`step_1_over_step_4` > 1: torch's one-row bf16 product on some
CPUs), the formula flatters speculation; `projected_speedup_conservative` takes the fastest step as the baseline
(and counts the context update).

This is a projection, not a measurement of speculative decoding: the weights are random (no checkpoint is loaded,
nothing is accepted here); the step costs do not depend on the weights' values, the acceptance lengths are the
paper's, measured on GPUs with trained drafters at temperature 1 (Table 1 of the DSpark paper, deepseek-ai/DeepSpec).
The drafter drafts greedily (the served default). Context K/V are zeros (same cost as real ones).

    python benchmarks/bench_projection.py --shape qwen3-4b --out benchmarks/results/projection_qwen3_4b.json
    python benchmarks/bench_projection.py --shape gemma4-e4b --no-decode-layout \
        --out benchmarks/results/projection_gemma4_e4b.json   # ~19 GB; with the decode layout ~28 GB
    python benchmarks/bench_projection.py --shape tiny        # a few-MB Qwen3 layout: a smoke test in seconds

Shapes: `qwen3-4b` (Qwen3ForCausalLM, hidden 2560, 36 layers, 32/8 heads of 128, MLP 9728, vocab 151936, tied;
DeepSpec's `dspark_qwen3_4b_block7` drafter: taps [1, 9, 17, 25, 33], mask 151669). `gemma4-e4b` (google/gemma-4-E4B
text decoder: hidden 2560, 42 layers, 8 heads, 2 KV heads of 256 / 512 on full layers, MLP 10240, vocab 262144,
per-layer inputs of 256, the last 18 layers sharing KV); DeepSpec publishes no E4B drafter, so its Gemma 4 recipe
(`config/dflash/dflash_gemma4_12b.py`, `deepspec/modeling/dspark/gemma4/config.py`: 5 full-attention layers at the
target's `global_head_dim`, block 7, mask 4) is applied to E4B, as dspark's Qwen3-style DSpark network (GELU, the
extra norms and soft-capping of DeepSpec's Gemma 4 drafter are elementwise and not modelled; taps evenly spaced);
and the paper reports no E4B τ, so Gemma4-12B's stands in (said in the output). `tiny`, `tiny-gemma4`: few-MB
layouts of the two for smoke tests (their τ is the full shape's, the speed-up figures meaningless).

Memory (bf16): qwen3-4b ~20 GB (8.0 GB of weights, 8.0 GB more for the one-row [in, out] copies dspark's loader
adds to a bf16 CPU model, 2.6 GB for the two drafters), gemma4-e4b ~28 GB (14.9 GB, 9.3 GB, 2.8 GB);
`--no-decode-layout` leaves the copies out (~12 GB and ~19 GB; only the 1-token step reads them) where memory is
short: the output says which. `--dtype float32`: fp32 target products, twice the weight bytes (qwen3-4b ~19 GB).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from dspark.bench.report import run_info
from dspark.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from dspark.drafters.base import ContextSegment, ContextUpdate
from dspark.drafters.dspark import DSparkDrafter, resolve_matmul_dtype
from dspark.drafters.dspark_checkpoint import target_shared_weights
from dspark.drafters.dspark_config import DSparkConfig, default_tap_layer_ids, dspark_config_for_target
from dspark.drafters.dspark_model import DSparkModel
from dspark.engine.engine import Engine
from dspark.engine.step_profiler import StepProfiler
from dspark.kernels import release_dense_weights, set_matmul_dtype
from dspark.models import build_model
from dspark.models.config import ModelConfig
from dspark.models.gemma4_hf import gemma4_fields
from dspark.models.layers import add_decode_layout
from dspark.request import Request
from dspark.sampling import SamplingParams

TAU_SOURCE = ("DSpark paper (deepseek-ai/DeepSpec, DSpark_paper.pdf) Table 1: accepted length tau incl. the bonus "
              "token, temperature 1.0, chain drafting, block 7 (8-token verification); transcribed in "
              "docs/dspark-reference.md section 10 of the project's shared notes")
BENCHES = ("GSM8K", "MATH", "AIME25", "MBPP", "HumanEval", "LCB", "MT-Bench", "Alpaca", "Arena-Hard")
DOMAINS = {"math": ("GSM8K", "MATH", "AIME25"), "code": ("MBPP", "HumanEval", "LCB"),
           "chat": ("MT-Bench", "Alpaca", "Arena-Hard")}
PAPER_TAU = {  # DSpark rows of Table 1
    "Qwen3-4B": (6.11, 5.70, 4.89, 5.13, 5.38, 4.86, 3.64, 3.54, 3.29),
    "Gemma4-12B": (6.05, 5.78, 5.12, 5.11, 5.64, 4.51, 3.49, 3.35, 2.92),
}
STEP_TOKENS = (1, 4, 8)
CONTEXT_ROWS = 5  # rows of one context update: the accepted drafts + 1, ~the paper's macro tau (4.7)
# DeepSpec's DSpark recipe (reference section 1.1 / 3.2: dspark_qwen3_4b_block7's config.json)
RECIPE = dict(num_hidden_layers=5, block_size=7, markov_rank=256, markov_head_type="vanilla",
              enable_confidence_head=True, confidence_head_with_markov=True)

QWEN3_4B = ModelConfig(
    architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
    num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
    rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=True, qk_norm=True,
    bos_token_id=None, eos_token_ids=(151645,))
# google/gemma-4-E4B's text_config (the fields transformers' Gemma4TextConfig defaults differently)
GEMMA4_E4B_HF = dict(vocab_size=262144, hidden_size=2560, intermediate_size=10240, num_hidden_layers=42,
                     num_attention_heads=8, num_key_value_heads=2, head_dim=256, global_head_dim=512,
                     hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144, num_kv_shared_layers=18,
                     sliding_window=512, final_logit_softcapping=30.0, attention_k_eq_v=False,
                     use_double_wide_mlp=False)
TINY = replace(QWEN3_4B, vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048)
TINY_GEMMA4_HF = dict(GEMMA4_E4B_HF, vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=12,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, global_head_dim=64,
                      hidden_size_per_layer_input=16, vocab_size_per_layer_input=4096, num_kv_shared_layers=3,
                      sliding_window=64, max_position_embeddings=2048)

SHAPES = {
    "qwen3-4b": dict(target=lambda: QWEN3_4B, taps=(1, 9, 17, 25, 33), mask=151669, gemma=False, tau="Qwen3-4B",
                     drafter_source="DeepSpec dspark_qwen3_4b_block7 (config.json: 5 layers, block 7, taps "
                                    "[1,9,17,25,33], markov_rank 256 vanilla, confidence head with Markov input)"),
    "gemma4-e4b": dict(target=lambda: ModelConfig(**gemma4_fields(GEMMA4_E4B_HF)), taps=None, mask=4, gemma=True,
                       tau="Gemma4-12B",
                       drafter_source="no published E4B drafter: DeepSpec's Gemma 4 recipe (5 full-attention layers "
                                      "at global_head_dim, block 7, mask 4; markov_rank 256 and the confidence head "
                                      "as its Qwen3 DSpark) applied to E4B; taps evenly spaced (DeepSpec's 12B: "
                                      "[5,17,29,41,46] of 48)"),
    "tiny": dict(target=lambda: TINY, taps=None, mask=None, gemma=False, tau="Qwen3-4B",
                 drafter_source="tiny smoke-test layout with DeepSpec's recipe"),
    "tiny-gemma4": dict(target=lambda: ModelConfig(**gemma4_fields(TINY_GEMMA4_HF)), taps=None, mask=4, gemma=True,
                        tau="Gemma4-12B", drafter_source="tiny smoke-test layout with DeepSpec's Gemma 4 recipe"),
}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def random_init_(module: torch.nn.Module, *, seed: int, skip: tuple[str, ...] = ()) -> None:
    """Every matrix ~ N(0, 1 / fan_in) (activations stay O(1) through the layers), every vector (norms, scalars,
    biases) 1.0; parameters named in `skip` keep their values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name in skip:
                continue
            if p.ndim < 2:
                p.fill_(1.0)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=g)


def build_target(cfg: ModelConfig, dtype: torch.dtype, *, decode_layout: bool, seed: int) -> torch.nn.Module:
    model = build_model(cfg, dtype=dtype)
    random_init_(model, seed=seed)
    if decode_layout:  # what dspark's loader adds to a CPU model the fp32 kernels do not serve
        add_decode_layout(model)
    return model


def drafter_config(target: ModelConfig, spec: dict, draft_vocab: int | None) -> DSparkConfig:
    taps = spec["taps"] or default_tap_layer_ids(target.num_hidden_layers)
    cfg = dspark_config_for_target(target, tap_layer_ids=taps, mask_token_id=spec["mask"],
                                   draft_vocab_size=draft_vocab, **RECIPE)
    if spec["gemma"]:  # DeepSpec's Gemma 4 drafter: full-attention layers, so the full layers' head shape
        cfg = replace(cfg, head_dim=target.global_head_dim or target.head_dim,
                      num_key_value_heads=target.num_global_key_value_heads or target.num_key_value_heads,
                      rope_scaling=None)  # proportional partial RoPE: the same cost as the default
    return cfg


def build_drafter(cfg: DSparkConfig, target: torch.nn.Module, dtype: torch.dtype, *, seed: int) -> DSparkDrafter:
    """A DSparkModel of `cfg` with random weights, the target's embedding and LM head (rows) shared as
    `dspark.drafters.dspark.build` shares them, and the same product dtype choice."""
    with torch.device("meta"):
        model = DSparkModel(cfg).to(dtype)
    d2t = None
    if cfg.draft_vocab_size is not None:  # a sorted subset of the target ids (a real one: the most frequent)
        g = torch.Generator().manual_seed(seed)
        d2t = torch.randperm(cfg.vocab_size, generator=g)[:cfg.draft_vocab_size].sort().values
    model.reset_buffers(d2t=d2t, device="cpu")
    embed, head = target_shared_weights(target)
    model.share_target_weights(embed_weight=embed, lm_head_weight=head)
    for module in model.modules():  # the rest: fresh storage
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                module._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=False)
    random_init_(model, seed=seed, skip=("embed_tokens.weight", "lm_head.weight"))
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers())), "a drafter tensor left on meta"
    matmul_dtype = resolve_matmul_dtype("auto", dtype=dtype, device="cpu")
    if matmul_dtype != dtype:  # as `build`: bf16 copies of the backbone for a float32 drafter where they pay
        shared_head = model.lm_head if cfg.draft_vocab_size is None else None
        set_matmul_dtype(model, matmul_dtype, skip=(model.markov_head, model.confidence_head, shared_head))
        model.pack_layer_products()
        release_dense_weights(model)
    if model.markov_head is not None:
        model.markov_head.hold_rows_bf16()
    return DSparkDrafter(model.eval(), num_draft_tokens=cfg.max_draft_tokens)


def make_engine(model, cfg: ModelConfig, drafter: DSparkDrafter, dtype: str, context_len: int) -> Engine:
    block = 16
    blocks = (context_len + 2 * (drafter.num_draft_tokens + 1) + CONTEXT_ROWS) // block + 8
    config = EngineConfig(
        device="cpu", dtype=dtype,
        cache=CacheConfig(kv_block_size=block, num_kv_blocks=2 * blocks, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=max(64, context_len), max_num_seqs=4),
        spec=SpecConfig(method="dspark", model="(random weights)", num_speculative_tokens=drafter.num_draft_tokens))
    return Engine(config, model=model, model_config=cfg, drafter=drafter)


def context_update_fn(engine: Engine, context_len: int, rows: int, seed: int):
    """A callable: one drafter context update of `rows` committed positions (random taps) of a request of its own."""
    drafter, cfg = engine.drafter, engine.model_config
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (context_len + rows,), generator=g).tolist()
    req = Request("projection-context", ids, SamplingParams(temperature=0.0, max_tokens=1))
    if not engine.block_manager.allocate(req, context_len + rows + 1):
        raise RuntimeError("KV pool too small for the context-update request")
    dtype = drafter.model.norm.weight.dtype
    taps = torch.randn(rows, drafter.cfg.num_taps * cfg.hidden_size, generator=g).to(dtype)
    update = ContextUpdate(segments=[ContextSegment("projection-context", req.block_table, context_len,
                                                    ids[context_len:], None, slice(0, rows))], taps=taps)
    return lambda: drafter.extend_context(update)


class Spy:
    """Records what a bound method returns while installed (for the finite-values checks)."""

    def __init__(self, obj, attr: str):
        self.obj, self.attr, self.out = obj, attr, None

    def __enter__(self):
        method = getattr(self.obj, self.attr)

        def spy(*a, **k):
            self.out = method(*a, **k)
            return self.out
        setattr(self.obj, self.attr, spy)
        return self

    def __exit__(self, *exc):
        delattr(self.obj, self.attr)  # the class's method again


def check_finite(profilers: dict, vocab_size: int) -> dict:
    """One step and one proposal per engine with their outputs checked: logits and taps finite, draft ids in the
    vocabulary, confidences finite. Raises on a failure (random weights scaled wrongly)."""
    out = {}
    for label, prof in profilers.items():
        with Spy(prof.engine.runner, "forward") as step:
            prof.windows_step([max(STEP_TOKENS)])
        logits, taps = step.out
        with Spy(prof.engine.drafter, "propose") as prop:
            prof.draft_step(1)
        p = prop.out
        ok = {"logits_finite": bool(torch.isfinite(logits.float()).all()),
              "taps_finite": taps is None or bool(torch.isfinite(taps.float()).all()),
              "draft_ids_in_vocab": bool(((p.draft_ids >= 0) & (p.draft_ids < vocab_size)).all()),
              "confidence_finite": p.confidence is None or bool(torch.isfinite(p.confidence).all())}
        if not all(ok.values()):
            raise RuntimeError(f"{label}: non-finite or out-of-range outputs with random weights: {ok}")
        out[label] = {**ok, "logits_std": round(float(logits.float().std()), 3)}
    return out


def time_rounds(fns: dict, *, repeats: int, warmup: int) -> dict[str, list[float]]:
    """Every callable once per round, the order rotating per round; seconds of the rounds after `warmup`."""
    labels = list(fns)
    times: dict[str, list[float]] = {label: [] for label in labels}
    for r in range(warmup + repeats):
        k = r % len(labels)
        for label in labels[k:] + labels[:k]:
            start = time.perf_counter()
            fns[label]()
            seconds = time.perf_counter() - start
            if r >= warmup:
                times[label].append(seconds)
    return times


def projection(med: dict[str, float], tau_name: str) -> dict:
    """Shares and projected speed-ups from the median seconds."""
    taus = dict(zip(BENCHES, PAPER_TAU[tau_name]))
    points = {"macro": statistics.fmean(taus.values()),
              **{d: statistics.fmean(taus[b] for b in names) for d, names in DOMAINS.items()},
              "min": min(taus.values()), "max": max(taus.values())}
    step1, step4, step8 = (med[f"step_{n}"] for n in STEP_TOKENS)
    base = min(step1, step4, step8)  # a 1-token step slower than a wider one is a slow one-row path, not the cost of a token
    out = {"tau_model": tau_name, "tau": {k: round(v, 3) for k, v in points.items()}, "tau_per_benchmark": taus,
           "step_1_over_step_4": round(step1 / step4, 3)}
    for vocab in ("full_vocab", "reduced_vocab"):
        prop, ctx = med[f"proposal_{vocab}"], med[f"context_update_{vocab}"]
        round_s, round_ctx_s = step8 + prop, step8 + prop + ctx
        out[vocab] = {
            "proposal_over_step_1": round(prop / step1, 4), "proposal_over_verify_4": round(prop / step4, 4),
            "proposal_over_verify_8": round(prop / step8, 4), "context_update_over_step_1": round(ctx / step1, 4),
            "round_s": round(round_s, 6), "round_with_context_update_s": round(round_ctx_s, 6),
            "break_even_tau": round(round_s / step1, 3), "break_even_tau_with_context_update": round(round_ctx_s / step1, 3),
            "projected_speedup": {k: round(t * step1 / round_s, 3) for k, t in points.items()},
            "projected_speedup_with_context_update": {k: round(t * step1 / round_ctx_s, 3) for k, t in points.items()},
            # the baseline the fastest step per call: lower where the 1-token step is slower than a 4- or 8-token one
            "projected_speedup_conservative": {k: round(t * base / round_ctx_s, 3) for k, t in points.items()},
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="qwen3-4b")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bfloat16",
                    help="weights, activations and KV cache (float32: fp32 target products, the drafter's as served)")
    ap.add_argument("--no-decode-layout", action="store_true",
                    help="leave out the [in, out] weight copies dspark's loader adds to a bf16 CPU model (less memory, "
                         "not the served products)")
    ap.add_argument("--draft-vocab", type=int, default=32768, help="the reduced draft vocabulary's size")
    ap.add_argument("--context-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = SHAPES[args.shape]
    dtype = DTYPES[args.dtype]
    cfg = spec["target"]()
    decode_layout = not args.no_decode_layout and dtype != torch.float32  # the loader's rule (kernels serve fp32)
    draft_vocab = min(args.draft_vocab, cfg.vocab_size // 4)
    t0 = time.perf_counter()
    target = build_target(cfg, dtype, decode_layout=decode_layout, seed=args.seed)
    dcfgs = {"full_vocab": drafter_config(cfg, spec, None), "reduced_vocab": drafter_config(cfg, spec, draft_vocab)}
    drafters = {k: build_drafter(c, target, dtype, seed=args.seed + 1) for k, c in dcfgs.items()}
    engines = {k: make_engine(target, cfg, d, args.dtype, args.context_len) for k, d in drafters.items()}
    profilers = {k: StepProfiler(e, context_len=args.context_len, tokens_per_request=max(STEP_TOKENS))
                 for k, e in engines.items()}
    build_s = time.perf_counter() - t0
    print(f"built {args.shape} ({args.dtype}) in {build_s:.1f} s", flush=True)
    try:
        checks = check_finite(profilers, cfg.vocab_size)
        main_prof = profilers["full_vocab"]
        full, reduced = profilers["full_vocab"], profilers["reduced_vocab"]
        fns = {  # target steps and drafter calls interleaved (a drafter call's weights come from memory)
            "step_1": lambda: main_prof.windows_step([1]), "proposal_full_vocab": lambda: full.draft_step(1),
            "step_4": lambda: main_prof.windows_step([4]), "proposal_reduced_vocab": lambda: reduced.draft_step(1),
            "step_8": lambda: main_prof.windows_step([8]),
            **{f"context_update_{k}": context_update_fn(e, profilers[k].context_len, CONTEXT_ROWS, args.seed)
               for k, e in engines.items()}}
        times = time_rounds(fns, repeats=args.repeats, warmup=args.warmup)
    finally:
        for p in profilers.values():
            p.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    params = {"target": sum(p.numel() for p in target.parameters()),
              **{f"drafter_{k}": sum(p.numel() for n, p in d.model.named_parameters()
                                     if not (n == "embed_tokens.weight" or (n == "lm_head.weight" and
                                                                            d.cfg.draft_vocab_size is None)))
                 for k, d in drafters.items()}}
    dc = dcfgs["full_vocab"]
    info = run_info(["python", *(sys.argv if argv is None else ["benchmarks/bench_projection.py", *argv])])
    result = {
        "bench": "projection", **info, "projection": True,
        "note": "random weights at the named shape; step and proposal seconds measured here, tau from the paper: "
                "the speed-up is a projection, not a measured one",
        "shape": args.shape, "dtype": args.dtype, "decode_layout": decode_layout,
        "threads": torch.get_num_threads(), "context_len": profilers["full_vocab"].context_len,
        "repeats": args.repeats, "warmup": args.warmup, "build_s": round(build_s, 1),
        "target": {"architecture": cfg.architecture, "hidden_size": cfg.hidden_size,
                   "num_hidden_layers": cfg.num_hidden_layers, "intermediate_size": cfg.intermediate_size,
                   "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
                   "head_dim": cfg.head_dim, "global_head_dim": cfg.global_head_dim, "vocab_size": cfg.vocab_size,
                   "num_kv_shared_layers": cfg.num_kv_shared_layers,
                   "hidden_size_per_layer_input": cfg.hidden_size_per_layer_input},
        "drafter": {"source": spec["drafter_source"], "num_hidden_layers": dc.num_hidden_layers,
                    "block_size": dc.block_size, "num_draft_tokens": drafters["full_vocab"].num_draft_tokens,
                    "tap_layer_ids": list(dc.tap_layer_ids), "hidden_size": dc.hidden_size,
                    "intermediate_size": dc.intermediate_size, "num_attention_heads": dc.num_attention_heads,
                    "num_key_value_heads": dc.num_key_value_heads, "head_dim": dc.head_dim,
                    "markov_rank": dc.markov_rank, "confidence_head": dc.enable_confidence_head,
                    "draft_vocab_size": {"full_vocab": cfg.vocab_size, "reduced_vocab": draft_vocab},
                    "draft_sample_method": "greedy"},
        "params": params, "checks": checks,
        "tau_source": TAU_SOURCE + ("" if args.shape == "qwen3-4b" else
                                    f"; no figure for this target: {spec['tau']}'s stands in"),
        "step_s": {str(n): round(med[f"step_{n}"], 6) for n in STEP_TOKENS},
        "proposal_s": {k: round(med[f"proposal_{k}"], 6) for k in drafters},
        "context_update_s": {k: round(med[f"context_update_{k}"], 6) for k in drafters},
        "context_update_rows": CONTEXT_ROWS,
        "projected": projection(med, spec["tau"]),
        "samples_s": {k: [round(x, 6) for x in v] for k, v in times.items()},
    }
    line = json.dumps(result)
    if args.out:
        Path(args.out).write_text(line + "\n")
    print(line)
    return result


if __name__ == "__main__":
    main()
