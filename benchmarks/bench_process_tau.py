"""Held-out acceptance of the shipped drafters two ways, side by side: `tau_top1` (blocks at uniformly random
answer positions, what training used to log) and `tau_process` (greedy decoding replayed along
each answer, the rounds anchored where the engine anchors them; `dspark.train.anchors.process_rounds`).
Each drafter is loaded through the trainer (`init_from` its shipped folder, its own train_config.json, no
step taken) and scored by `Trainer.evaluate` on the validation split of a `dspark prepare-data` folder,
the target's features computed online.

    dspark prepare-data --out data/val_process_tau --max-prompts 256 --max-tokens 192 --max-prompt-tokens 384 \
        --batch-size 64 --matmul-dtype q4_1 --holdout 0.5 --num-threads 2
    python benchmarks/bench_process_tau.py --data data/val_process_tau --out benchmarks/results/process_tau.json

`--drafter NAME=PATH` adds an exported drafter (e.g. a training run's export) beside the shipped ones.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace

from dspark.bench.report import run_info, write_result_file

METHODS = ("dspark", "dflash", "eagle3")


def main(argv: list[str] | None = None) -> dict:
    from dspark.train.config import load_train_config
    from dspark.train.trainer import Trainer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="a prepare-data folder (its val split is scored)")
    p.add_argument("--methods", default=",".join(METHODS), help="the shipped drafters to score")
    p.add_argument("--drafter", action="append", default=[], metavar="NAME=PATH",
                   help="also score an exported drafter (its folder holds train_config.json); repeatable")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    summary = {}
    drafters = {m: f"dspark/assets/drafters/{m}-smollm2-135m" for m in args.methods.split(",") if m}
    drafters.update(dict(d.split("=", 1) for d in args.drafter))
    for method, folder in drafters.items():
        cfg = replace(load_train_config(f"{folder}/train_config.json"), init_from=folder, feature_cache=None,
                      eval_batches=10_000, eval_process_tau=True, num_threads=args.num_threads)
        with tempfile.TemporaryDirectory() as run_dir:
            trainer = Trainer(cfg, data_dir=args.data, out_dir=run_dir, show_progress=False)
            start = time.perf_counter()
            record = trainer.evaluate()
            seconds = time.perf_counter() - start
            num_val = len(trainer.val_ds)
            trainer.close()
        summary[f"{method}_tau_top1"] = round(record["tau_top1"], 4)
        summary[f"{method}_tau_process"] = round(record["tau_process"], 4)
        summary[f"{method}_process_over_top1"] = round(record["tau_process"] / record["tau_top1"], 3)
        summary["num_val_conversations"] = num_val
        print(f"{method}: tau_top1 {record['tau_top1']:.3f}, tau_process {record['tau_process']:.3f} "
              f"({num_val} conversations, {seconds:.0f} s)", flush=True)
    result = {"bench": "process_tau", "summary": summary, "config": vars(args), **run_info(argv)}
    if args.out:
        write_result_file(args.out, result)
    return result


if __name__ == "__main__":
    main()
