"""Where a DSpark proposal's time goes, beside the target step it has to beat: at each request count, one
one-token target step per request and a 4- and an 8-token verification window per request, the drafter's context
extension (3 newly committed positions a request: about the tokens a step accepts) and the proposal, split
into its parts — the blocks' inputs (rows, RoPE and attention indices: `kernels.draft_inputs`), the one kernel call
or, op by op, the block forward (the fused decoder stack), the LM head, the Markov walk and the confidence head, and
the rest (bookkeeping in Python, the anchors' embeddings). Each drafter path
side by side in one process, each proposal right after a target step (its weights come from memory, as in
serving); medians over rounds.

    python benchmarks/bench_proposal_anatomy.py --num-reqs 1,4,8 --rounds 15 \
        --out benchmarks/results/proposal_anatomy.json

Paths: `auto` (the defaults: `draft_matmul_dtype` Q4_1 blocks on CPUs whose kernels multiply them, the greedy
proposal in one kernel call), `per-op` (the same products, the proposal op by op: the fused stack, then the LM head,
the Markov walk and the confidence head each called from Python), `bf16` (`draft_matmul_dtype` "bfloat16", op by
op: its head's product path depends on the row count) and `one-layer` (the defaults with the drafter's first layer
alone: the cost of a 1-layer shape, whatever its weights would draft); `NAME=FOLDER` is another drafter folder with the
defaults. The target is the default model at `auto` (q4_1 on AVX2 CPUs), 256 context positions per request (`dspark profile`'s
`StepProfiler`). `proposal_over_step_rN` is the proposal ÷ the one-token step at N requests, the issue's measure.
"""

from __future__ import annotations

import argparse
import statistics
import time

from dspark.bench.report import run_info, write_result_file

DRAFTER = "dspark/assets/drafters/dspark-smollm2-135m"
PATHS = {"auto": {}, "per-op": {}, "bf16": {"draft_matmul_dtype": "bfloat16"}, "one-layer": {}}
# (owner, method) → part name; owner "model" is the drafter network, "drafter" the DSparkDrafter, "kernels" the module
PARTS = [("kernels", "draft_inputs", "block_inputs"), ("kernels", "draft_block", "fused_proposal"),
         ("model", "fused_backbone", "block_forward"), ("model", "compute_logits", "lm_head"),
         ("kernels", "markov_walk", "markov_walk"), ("model", "confidence_logits", "confidence")]
CONTEXT_TOKENS = 3


def _timed(owner, method: str, sink: dict, key: str) -> None:
    original = getattr(owner, method)

    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            sink[key] = sink.get(key, 0.0) + time.perf_counter() - start
    setattr(owner, method, run)


def main(argv: list[str] | None = None) -> dict:
    from dspark import kernels
    from dspark.engine.step_profiler import StepProfiler
    from dspark.llm import LLM

    p = argparse.ArgumentParser()
    p.add_argument("--num-reqs", default="1,4,8")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    counts = [int(n) for n in args.num_reqs.split(",")]
    profilers, sinks = {}, {}
    for path in args.paths.split(","):
        name, _, folder = path.partition("=")
        opts = {"model": folder} if folder else dict(PATHS[name])
        llm = LLM(speculative_config={"method": "dspark", "model": DRAFTER, **opts})
        if name == "per-op":
            llm.engine.drafter._fused_proposal = lambda batch: None
        if name == "one-layer":  # the first layer alone, over the first layer's pool entries
            drafter = llm.engine.drafter
            drafter.model.layers = drafter.model.layers[:1]
            drafter.model._frozen = False
            drafter.model.freeze()
            drafter.kv_caches = drafter.kv_caches[:1]
        sink: dict[str, float] = {}
        owners = {"drafter": llm.engine.drafter, "model": llm.engine.drafter.model, "kernels": kernels}
        profilers[name], sinks[name] = StepProfiler(llm.engine), sink
        for owner, method, key in PARTS:
            if owner != "kernels":
                _timed(owners[owner], method, sink, key)
    running: list[str] = []  # the kernels are one module for every path: their timers write to the running path's
    originals = {method: getattr(kernels, method) for owner, method, _ in PARTS if owner == "kernels"}
    for owner, method, key in PARTS:
        if owner == "kernels":
            def timed(*a, _f=originals[method], _key=key, **k):
                start = time.perf_counter()
                try:
                    return _f(*a, **k)
                finally:
                    sink = sinks[running[-1]]
                    sink[_key] = sink.get(_key, 0.0) + time.perf_counter() - start
            setattr(kernels, method, timed)
    samples: dict[str, list[float]] = {}

    def add(key: str, seconds: float, keep: bool) -> None:
        if keep:
            samples.setdefault(key, []).append(seconds * 1e3)

    for r in range(args.rounds + 1):  # round 0 warms up
        for n in counts:
            for name, prof in profilers.items():
                running.append(name)
                for tokens in (1, 4, 8):
                    start = time.perf_counter()
                    prof.windows_step([tokens] * n)
                    add(f"{name}_step{tokens}_r{n}", time.perf_counter() - start, r > 0)
                prof.windows_step([8] * n)
                start = time.perf_counter()
                prof.context_step(n, CONTEXT_TOKENS)
                add(f"{name}_context_r{n}", time.perf_counter() - start, r > 0)
                prof.windows_step([8] * n)
                sinks[name].clear()
                start = time.perf_counter()
                prof.draft_step(n)
                total = time.perf_counter() - start
                add(f"{name}_proposal_r{n}", total, r > 0)
                for _, _, key in PARTS:
                    add(f"{name}_{key}_r{n}", sinks[name].get(key, 0.0), r > 0)
                add(f"{name}_rest_r{n}", total - sum(sinks[name].values()), r > 0)
    for method, original in originals.items():
        setattr(kernels, method, original)
    ms = {key: round(statistics.median(v), 3) for key, v in samples.items()}
    for name in profilers:
        for n in counts:
            ms[f"{name}_proposal_over_step_r{n}"] = round(ms[f"{name}_proposal_r{n}"] / ms[f"{name}_step1_r{n}"], 3)
            ms[f"{name}_proposal_and_context_over_step_r{n}"] = round(
                (ms[f"{name}_proposal_r{n}"] + ms[f"{name}_context_r{n}"]) / ms[f"{name}_step1_r{n}"], 3)
    result = {"bench": "proposal_anatomy", "summary": ms, "config": vars(args),
              "samples_ms": {k: [round(x, 3) for x in v] for k, v in samples.items()}, **run_info(argv)}
    for name in profilers:
        for n in counts:
            parts = "  ".join(f"{key} {ms[f'{name}_{key}_r{n}']:.2f}" for _, _, key in PARTS)
            print(f"{name} {n} req: step1 {ms[f'{name}_step1_r{n}']:.2f} step4 {ms[f'{name}_step4_r{n}']:.2f} "
                  f"step8 {ms[f'{name}_step8_r{n}']:.2f} | context {ms[f'{name}_context_r{n}']:.2f} | proposal "
                  f"{ms[f'{name}_proposal_r{n}']:.2f} ({ms[f'{name}_proposal_over_step_r{n}']:.0%} of step1): {parts}"
                  f"  rest {ms[f'{name}_rest_r{n}']:.2f}")
    if args.out:
        write_result_file(args.out, result)
    return result


if __name__ == "__main__":
    main()
