"""The held-out train/ prompts as prompt files, one per domain (OUT/math.jsonl, code.jsonl, chat.jsonl): the rows `dspark prepare-data --holdout FRAC` puts in the
validation split (by the hash of their key), which no drafter training step and no lookup corpus built from
the train split has seen. Benchmarks read them as datasets (`--dataset FILE`, `--datasets A,B,C`): prompts nothing was tuned
on, beside eval/.

    python benchmarks/heldout_prompts.py --prompts ../shared/datasets/train --out runs/heldout
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dspark.train.data import is_holdout
from dspark.train.prepare_data import prompt_rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", required=True, help="the train/ prompt folder prepare-data read")
    p.add_argument("--holdout", type=float, default=0.05, help="prepare-data's --holdout")
    p.add_argument("--out", required=True, help="a folder: one DOMAIN.jsonl per domain")
    args = p.parse_args(argv)
    rows = [row for key, row in prompt_rows(args.prompts) if is_holdout(key, args.holdout)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for domain in sorted({r["domain"] for r in rows}):
        mine = [r for r in rows if r["domain"] == domain]
        (out / f"{domain}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mine))
        counts[domain] = len(mine)
    print(json.dumps({"out": args.out, "prompts": counts}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
