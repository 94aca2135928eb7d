"""Issue-5 verdicts from a serving sweep (`dspark bench sweep ... --repeats N`): per dataset and
concurrency, the median over repeats of total output tok/s and mean TPOT for every method, and for each
scheduled policy (prefix, async, threshold by default; `--policies dspark-prefix-lookup,...` for the
prompt-lookup-first family, which is compared with its own fixed K, `dspark-kN-lookup`):

- `pareto`: on or outside the front of the fixed-K methods — no dspark-kN is better on both axes
  (higher tok/s and lower TPOT) by more than `--tol` (relative);
- `beats_k7`: strictly better than K = 7 on both axes;
- `vs_none`: tok/s ÷ plain decoding (no speculation), and whether it is at least 1 - `--tol`.

Writes a JSON with every median and verdict, and prints markdown tables.

    python benchmarks/pareto_check.py benchmarks/results/serving_sweep_gsm8k/results.json \
        --out benchmarks/results/serving_sweep_gsm8k/pareto.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

FIXED = re.compile(r"^dspark-k(\d+)(-lookup)?$")
LOOKUP = "-lookup"  # a family: its scheduled policies are compared with its own fixed K (dspark-kN-lookup)


def family(method: str) -> str:
    return LOOKUP if method.endswith(LOOKUP) else ""


def medians(points: list[dict]) -> dict[tuple[str, str, int], dict]:
    """(dataset, method, concurrency) -> median tok/s, median TPOT ms, repeats, spread of tok/s."""
    groups: dict[tuple[str, str, int], list[dict]] = defaultdict(list)
    for p in points:
        if p.get("num_failed", 0) == 0 and p.get("output_throughput_tok_s"):
            groups[(p["dataset"], p["method"], int(p["max_concurrency"]))].append(p)
    out = {}
    for key, ps in groups.items():
        rates = [p["output_throughput_tok_s"] for p in ps]
        out[key] = {"tok_s": statistics.median(rates), "tpot_ms": statistics.median(p["mean_tpot_ms"] for p in ps),
                    "repeats": len(ps), "tok_s_min": min(rates), "tok_s_max": max(rates),
                    "tau": statistics.median(p["tau"] for p in ps) if ps[0].get("tau") else None}
    return out


def verdicts(med: dict, *, policies: list[str], tol: float) -> list[dict]:
    rows = []
    for dataset, concurrency in sorted({(d, c) for d, _, c in med}):
        here = {m: v for (d, m, c), v in med.items() if d == dataset and c == concurrency}
        none = here.get("none")
        for policy in policies:
            me = here.get(policy)
            if me is None:
                continue
            fixed = {m: v for m, v in here.items() if FIXED.match(m) and family(m) == family(policy)}
            dominated_by = [m for m, v in fixed.items()
                            if v["tok_s"] > me["tok_s"] * (1 + tol) and v["tpot_ms"] < me["tpot_ms"] * (1 - tol)]
            k7 = fixed.get("dspark-k7" + family(policy))
            rows.append({
                "dataset": dataset, "concurrency": concurrency, "policy": policy,
                "tok_s": me["tok_s"], "tpot_ms": me["tpot_ms"],
                "pareto": not dominated_by, "dominated_by": dominated_by,
                "beats_k7": None if k7 is None else (me["tok_s"] > k7["tok_s"] and me["tpot_ms"] < k7["tpot_ms"]),
                "vs_none": None if none is None else me["tok_s"] / none["tok_s"],
                "not_slower_than_none": None if none is None else me["tok_s"] >= none["tok_s"] * (1 - tol),
            })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="results.json of a `dspark bench sweep` run")
    ap.add_argument("--policies", default="dspark-prefix,dspark-async,dspark-threshold")
    ap.add_argument("--tol", type=float, default=0.0,
                    help="relative tolerance for 'better' / 'not slower' (0: strict medians)")
    ap.add_argument("--out", help="write the medians and verdicts here (JSON)")
    args = ap.parse_args()
    data = json.loads(Path(args.results).read_text())
    med = medians(data["points"])
    rows = verdicts(med, policies=args.policies.split(","), tol=args.tol)
    methods = sorted({m for _, m, _ in med}, key=lambda m: (m != "none", m))
    for dataset in sorted({d for d, _, _ in med}):
        cs = sorted({c for d, _, c in med if d == dataset})
        print(f"\n**{dataset}** — median total output tok/s (median mean TPOT ms) over repeats\n")
        print("| method | " + " | ".join(f"c={c}" for c in cs) + " |")
        print("|---|" + "---|" * len(cs))
        for m in methods:
            cells = [f"{med[(dataset, m, c)]['tok_s']:.1f} ({med[(dataset, m, c)]['tpot_ms']:.0f})"
                     if (dataset, m, c) in med else "–" for c in cs]
            print(f"| {m} | " + " | ".join(cells) + " |")
    print("\n| dataset | c | policy | tok/s | TPOT ms | Pareto vs fixed K | beats K=7 | ÷ none |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        front = "yes" if r["pareto"] else "no (" + ", ".join(r["dominated_by"]) + ")"
        print(f"| {r['dataset']} | {r['concurrency']} | {r['policy']} | {r['tok_s']:.1f} | {r['tpot_ms']:.0f} | "
              f"{front} | {r['beats_k7']} | {r['vs_none']:.2f} |")
    summary = {
        "bench": "pareto_check", "source": args.results, "command": data.get("command"), "date": data.get("date"),
        "machine": data.get("machine"), "tol": args.tol,
        "medians": [{"dataset": d, "method": m, "concurrency": c, **v} for (d, m, c), v in sorted(med.items())],
        "verdicts": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
