"""Speculation overhead terms at batch 1 on SmolLM2-135M (issue: speculative decoding core).

Per-step wall time split into draft (drafter.extend_context + drafter.propose) and verify (target
forward + verification), versus a plain one-token decode step, and tokens per step — for the n-gram
drafter on code prompts and an untrained (random-weight) DSpark drafter, plus the shipped trained
drafter when present. Timers wrap the engine's phase methods; medians over all decode steps.

    python benchmarks/bench_spec_overhead.py --num-prompts 4 --max-tokens 96 --out benchmarks/results/spec_overhead.json

Targets: DSpark draft ≤ 25% of a target decode step; verifying γ+1 = 8 tokens ≤ 1.5× a one-token step.
The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch


def _timed(obj, name, sink):
    fn = getattr(obj, name)

    def wrapper(*a, **kw):
        t = time.perf_counter()
        out = fn(*a, **kw)
        sink.append(time.perf_counter() - t)
        return out
    setattr(obj, name, wrapper)


class DraftClock:
    """Drafter seconds per engine step: extend_context + propose (when the step drafted at all)."""

    def __init__(self, engine, drafter) -> None:
        self.steps: list[list[float]] = []  # per step: [drafter seconds, proposed?]
        step = engine.step

        def timed_step():
            self.steps.append([0.0, 0.0])
            return step()
        engine.step = timed_step
        for name in ("extend_context", "propose"):
            self._wrap(drafter, name)

    def _wrap(self, drafter, name) -> None:
        fn = getattr(drafter, name)

        def wrapper(*a, **kw):
            t = time.perf_counter()
            out = fn(*a, **kw)
            if self.steps:
                self.steps[-1][0] += time.perf_counter() - t
                self.steps[-1][1] += name == "propose"
            return out
        setattr(drafter, name, wrapper)

    def clear(self) -> None:
        self.steps.clear()

    def drafting_steps(self) -> list[float]:
        return [sec for sec, proposed in self.steps if proposed]


def run_method(model, cfg, tok, prompts, *, spec, max_tokens):
    from dspark.config import CacheConfig, EngineConfig, SchedulerConfig
    from dspark.drafters import build_drafter
    from dspark.engine.engine import Engine
    from dspark.llm import LLM
    from dspark.sampling import SamplingParams
    drafter = None if spec is None else build_drafter(spec, target_config=cfg, target_model=model,
                                                      dtype=torch.float32, device="cpu")
    engine = Engine(EngineConfig(cache=CacheConfig(num_kv_blocks=512), scheduler=SchedulerConfig(max_num_seqs=1),
                                 spec=spec), model=model, model_config=cfg, drafter=drafter,
                    eos_token_ids=tok.eos_token_ids)
    fwd = []
    _timed(engine.runner, "forward", fwd)
    clock = DraftClock(engine, drafter) if drafter is not None else None
    llm = LLM(engine=engine, tokenizer=None)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    fwd.clear()
    if clock is not None:
        clock.clear()
    steps_before = engine.metrics.num_steps
    drafts_before = (engine.metrics.num_drafts, engine.metrics.num_accepted_tokens)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    # batch 1, prompts shorter than the token budget: each request has exactly one prefill step
    # (which emits its first token); every other step is a decode/verify step
    num_decode_steps = engine.metrics.num_steps - steps_before - len(prompts)
    decode_fwd = sorted(fwd)[:max(1, len(fwd) - len(prompts))]  # drop the slowest (prefill) forwards
    num_drafts = engine.metrics.num_drafts - drafts_before[0]
    num_accepted = engine.metrics.num_accepted_tokens - drafts_before[1]
    drafting = clock.drafting_steps() if clock is not None else []
    return {
        "forward_ms_median": 1e3 * statistics.median(decode_fwd),
        # a step that drafts: extend_context + propose
        "draft_ms_median_per_step": 1e3 * statistics.median(drafting) if drafting else 0.0,
        "drafting_step_fraction": len(drafting) / max(1, len(clock.steps)) if clock is not None else 0.0,
        "tokens_per_step": (tokens - len(prompts)) / max(1, num_decode_steps),
        "acceptance_length": 1 + num_accepted / num_drafts if num_drafts else 1.0,
        "output_tok_s": tokens / wall,
    }


def verify_cost(model, *, window: int, context: int = 256, repeats: int = 15) -> float:
    """Median ms of one target forward over `window` new tokens at `context` cached tokens."""
    from dspark.engine.model_runner import allocate_kv_pool
    from dspark.models.attention import SeqSpec, build_attn_metadata
    pool = allocate_kv_pool([model.kv_spec] * model.num_kv_layers, num_kv_blocks=64, kv_block_size=16,
                            dtype=torch.float32, device="cpu")
    table = list(range(64))
    meta = build_attn_metadata([SeqSpec(table, context, window, 0)], num_tokens=window, kv_block_size=16)
    ids = torch.randint(0, 1000, (window,))
    pos = torch.arange(context, context + window)
    times = []
    with torch.inference_mode():
        for i in range(repeats + 3):
            t = time.perf_counter()
            hidden, _ = model(ids, pos, meta, pool)
            model.compute_logits(hidden)
            if i >= 3:
                times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from dspark.bench.datasets import load_prompts
    from dspark.config import SpecConfig
    from dspark.models.loader import load_model
    model, cfg, tok = load_model("default")
    code = [tok.apply_chat_template([{"role": "user", "content": p.prompt}])
            for p in load_prompts("humaneval", num_prompts=args.num_prompts, seed=0)]
    results = {"verify_ms": {f"window_{w}": verify_cost(model, window=w) for w in (1, 2, 4, 8)}}
    results["verify_8_over_1"] = results["verify_ms"]["window_8"] / results["verify_ms"]["window_1"]
    methods = {"none": None, "ngram": SpecConfig(method="ngram", num_speculative_tokens=7)}
    with tempfile.TemporaryDirectory() as tmp:
        from dspark.drafters.dspark import save_dspark
        from dspark.drafters.dspark_config import dspark_config_for_target
        from dspark.drafters.dspark_model import DSparkModel
        # random weights, full vocabulary head; and the shipped drafter's shapes (8192-token draft vocab)
        for name, draft_vocab in (("dspark_untrained", None), ("dspark_untrained_vocab8192", 8192)):
            dcfg = dspark_config_for_target(cfg, num_hidden_layers=2, block_size=7, markov_rank=64,
                                            draft_vocab_size=draft_vocab)
            save_dspark(DSparkModel(dcfg), dcfg, Path(tmp) / name, dtype="float32")
            methods[name] = SpecConfig(method="dspark", model=str(Path(tmp) / name), num_speculative_tokens=7)
        try:
            from dspark.drafters.shipped import default_spec_config
            shipped = default_spec_config("default")
            if shipped is not None:
                methods["dspark_shipped"] = shipped
        except ImportError:
            pass
        for name, spec in methods.items():
            results[name] = run_method(model, cfg, tok, code, spec=spec, max_tokens=args.max_tokens)
    plain = results["none"]["forward_ms_median"]
    for name in methods:
        if name != "none":
            results[name]["draft_over_decode_step"] = results[name]["draft_ms_median_per_step"] / plain
    summary = {"bench": "spec_overhead_batch1", "date": time.strftime("%Y-%m-%d"),
               "machine": platform.platform(), "threads": torch.get_num_threads(),
               "command": "python benchmarks/bench_spec_overhead.py " + " ".join(
                   f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
               **results}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
