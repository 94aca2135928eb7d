"""A Python-side change under load, side by side: `bench_load_phases.py` (plain decoding against the shipped
speculative default, offline, closed loop) run from a git revision's tree and from the working tree in
alternating child processes, round after round, the first turn alternating from round to round, so the
VM's drifts hit both alike. Each side reports default ÷ plain within its own process, so the ratio is
what the revision changed in speculation's overhead, and the raw tok/s what it changed overall; and the
default's proposing and choosing time a step (`Engine._propose_and_choose`: lookup, drafter, fault check,
length policy), the bookkeeping term itself.

    python benchmarks/ab_load_phases.py --base 07201a3 --concurrency 8,32 --rounds 3 \
        --out benchmarks/results/ab_load_phases.json

The revision is extracted (`bench_resident.checkout`, git archive) in a temporary folder and imported from there
(PYTHONPATH); both sides share this venv, its kernel build cache and `../shared/datasets`. Each child:
`bench_load_phases.py --concurrency C --dataset gsm8k --num-prompts P --max-tokens 64 --natural-stop
--repeats R --variants plain,default` with P = max(24, 2 C).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_resident import checkout
from dspark.bench.report import run_info, write_result_file

ROOT = Path(__file__).resolve().parents[1]


def run_side(tree: Path, *, concurrency: int, repeats: int, out: Path) -> dict:
    """One bench_load_phases run from `tree` → its result JSON."""
    env = {**os.environ, "PYTHONPATH": str(tree),
           "DSPARK_DATASETS": os.environ.get("DSPARK_DATASETS", str(ROOT.parent / "shared" / "datasets"))}
    cmd = [sys.executable, "benchmarks/bench_load_phases.py", "--concurrency", str(concurrency), "--dataset", "gsm8k",
           "--num-prompts", str(max(24, 2 * concurrency)), "--max-tokens", "64", "--natural-stop",
           "--repeats", str(repeats), "--variants", "plain,default", "--out", str(out)]
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="git revision to compare the working tree with")
    p.add_argument("--concurrency", default="8,32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2, help="bench_load_phases repeats per child")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    counts = [int(c) for c in args.concurrency.split(",")]
    runs: dict[str, dict[int, list[dict]]] = {"base": {c: [] for c in counts}, "new": {c: [] for c in counts}}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"base": checkout(args.base, Path(tmp)), "new": ROOT}
        for r in range(args.rounds):
            for c in counts:
                for side in (("base", "new") if r % 2 == 0 else ("new", "base")):
                    res = run_side(trees[side], concurrency=c, repeats=args.repeats,
                                   out=Path(tmp) / f"{side}_c{c}_r{r}.json")
                    med = res["summary"]["median"]
                    row = {"plain_tok_s": med["plain"]["output_tok_s"], "default_tok_s": med["default"]["output_tok_s"],
                           "default_over_plain": med["default"]["tok_s_ratio_vs_plain"],
                           "plain_non_forward_s": med["plain"]["non_forward_s"],
                           "default_non_forward_s": med["default"]["non_forward_s"],
                           "default_propose_ms_per_step": statistics.median(
                               1e3 * x["phase_s"].get("_propose_and_choose", 0.0) / max(x["steps"], 1)
                               for x in res["runs"]["default"])}
                    runs[side][c].append(row)
                    print(f"round {r} c={c} {side}: plain {row['plain_tok_s']:.1f} tok/s, default "
                          f"{row['default_tok_s']:.1f} ({row['default_over_plain']:.3f}x plain), proposing "
                          f"{row['default_propose_ms_per_step']:.3f} ms a step", flush=True)
    summary = {}
    for c in counts:
        for side in ("base", "new"):
            rows = runs[side][c]
            for key in ("plain_tok_s", "default_tok_s", "default_over_plain", "default_non_forward_s",
                        "default_propose_ms_per_step"):
                summary[f"{side}_c{c}_{key}"] = round(statistics.median(x[key] for x in rows), 4)
        summary[f"new_over_base_c{c}_default_tok_s"] = round(
            summary[f"new_c{c}_default_tok_s"] / summary[f"base_c{c}_default_tok_s"], 3)
        summary[f"new_over_base_c{c}_default_propose_ms_per_step"] = round(
            summary[f"new_c{c}_default_propose_ms_per_step"] / summary[f"base_c{c}_default_propose_ms_per_step"], 3)
        summary[f"new_over_base_c{c}_plain_tok_s"] = round(
            summary[f"new_c{c}_plain_tok_s"] / summary[f"base_c{c}_plain_tok_s"], 3)
    result = {"bench": "ab_load_phases", "summary": summary, "config": vars(args), "runs": runs, **run_info(argv)}
    if args.out:
        write_result_file(args.out, result)
    return result


if __name__ == "__main__":
    main()
