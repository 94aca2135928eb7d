"""The target's verification step time against its shape: R requests, each a window of w tokens (the
decoding token + w - 1 drafts), at a fixed context, timed side by side in rounds (every shape once per
round, medians over rounds), so a slow phase of the machine hits all shapes alike.

    python benchmarks/bench_step_curve.py --out benchmarks/results/step_curve.json

Shows where a step's cost grows with its tokens (the marginal cost of a verified draft) and where it
jumps: when `kernels.MAX_ROWS` was 48 a step above 48 rows left the one-call decoder kernel for the per-layer path
(a 56-row step cost ~1.5x a 48-row one); it is 128 now. Times `StepProfiler.windows_step`
(`ModelRunner.prepare` + `forward`), as `dspark profile` does. `--matmul-dtypes float32,bfloat16` builds
one engine per dtype and times them in the same rounds (the ratio per shape is in the summary).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dspark.bench.report import run_info, write_result_file

SHAPES = [(1, w) for w in (1, 2, 4, 8)] + [(8, w) for w in (1, 2, 3, 4, 5, 6, 7, 8, 10, 12)] + \
    [(16, w) for w in (1, 2, 3, 4, 6, 8)] + [(32, w) for w in (1, 2, 4)]


def main(argv: list[str] | None = None) -> dict:
    from dspark.engine.build import resolve_matmul_dtype
    from dspark.llm import LLM
    from dspark.verify.step_profiler import StepProfiler

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context-len", type=int, default=200)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--matmul-dtypes", default="auto",
                   help="comma list of auto, float32, bfloat16: one engine each, timed side by side")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from dspark.models.loader import DEFAULT_MODEL
    dtypes = list(dict.fromkeys(resolve_matmul_dtype(d, model=DEFAULT_MODEL) for d in args.matmul_dtypes.split(",") if d))
    profilers = {}
    for d in dtypes:
        engine = LLM(speculative_config=None, max_num_seqs=64, matmul_dtype=d).engine
        profilers[d] = StepProfiler(engine, context_len=args.context_len,
                                    tokens_per_request=max(w for _, w in SHAPES))

    def step(dtype: str, num_reqs: int, window: int) -> float:
        start = time.perf_counter()
        profilers[dtype].windows_step([window] * num_reqs)
        return time.perf_counter() - start

    times: dict[tuple[str, int, int], list[float]] = {(d, *s): [] for d in dtypes for s in SHAPES}
    with torch.inference_mode():
        for d in dtypes:  # warm-up
            for s in SHAPES:
                step(d, *s)
        for _ in range(args.rounds):
            for s in SHAPES:
                for d in dtypes:
                    times[(d, *s)].append(step(d, *s))
    for prof in profilers.values():
        prof.close()
    rows = [{"matmul_dtype": d, "num_reqs": r, "window": w, "num_tokens": r * w,
             "step_ms": 1000 * statistics.median(times[d, r, w]),
             "ms_per_token": 1000 * statistics.median(times[d, r, w]) / (r * w)} for d in dtypes for r, w in SHAPES]
    for row in rows:
        print(f"{row['matmul_dtype']:>8} {row['num_reqs']:>3} requests x {row['window']:>2} tokens = "
              f"{row['num_tokens']:>3}: {row['step_ms']:7.1f} ms ({row['ms_per_token']:.2f} ms a token)")
    summary = {f"{'' if len(dtypes) == 1 else r['matmul_dtype'] + '_'}r{r['num_reqs']}_w{r['window']}_ms":
               round(r["step_ms"], 1) for r in rows}
    if len(dtypes) == 2:  # the first dtype's step time / the second's, per shape
        a, b = dtypes
        summary.update({f"{a}_over_{b}_r{r}_w{w}": round(statistics.median(times[a, r, w])
                                                         / statistics.median(times[b, r, w]), 2)
                        for r, w in SHAPES})
    result = {"bench": "step_curve", "summary": summary, "config": vars(args), "rows": rows,
              **run_info(None if argv is None else ["benchmarks/bench_step_curve.py", *argv])}
    if args.out:
        write_result_file(args.out, result)
    return result


if __name__ == "__main__":
    main()
