"""`dspark train`: train a DSpark / DFlash / EAGLE-3 drafter on data from `dspark prepare-data`.

    dspark train --method dspark --config configs/train_dspark_smollm2.json --data data/smollm2_train \\
        --out runs/dspark1 [--set max_steps=500 --set lr=3e-4] [--resume] [--export runs/dspark1/export] \\
        [--cache-features runs/cache]
    torchrun --nproc-per-node 2 -m dspark train ...          # data-parallel over 2 processes (gloo)

The final drafter goes to --export (default OUT/export): config.json + model.safetensors that
`--speculative-config '{"method": "dspark", "model": "runs/dspark1/export"}'` loads.
"""

from __future__ import annotations

import argparse
import json
import os


def register(sub) -> None:
    p = sub.add_parser("train", help="train a drafter (dspark | dflash | eagle3)")
    p.add_argument("--method", choices=["dspark", "dflash", "eagle3"], default=None,
                   help="overrides nothing: must agree with the config's method when both are given")
    p.add_argument("--config", default=None, help="JSON preset (configs/train_*.json)")
    p.add_argument("--data", required=True, nargs="+",
                   help="folder written by `dspark prepare-data`; several (or a comma-separated list) read as one set")
    p.add_argument("--out", required=True, help="run folder: train.log, metrics.jsonl, checkpoints/")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key (JSON value); unknown keys are errors")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    p.add_argument("--export", default=None, help="final drafter folder (default OUT/export)")
    p.add_argument("--cache-features", default=None, metavar="DIR",
                   help="keep target taps on disk as fp16 (small sets: later epochs skip the target)")
    p.add_argument("--precompute-features", action="store_true",
                   help="only fill the config's feature_cache (target once over every sample), then exit")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (the config's device key; default cpu)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_main)


def _init_distributed() -> bool:
    import torch.distributed as dist
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
        return True
    return False


def _main(args: argparse.Namespace) -> int:
    from dspark.train.config import load_train_config
    from dspark.train.data import check_feature_caches
    from dspark.train.trainer import Trainer

    try:
        overrides = list(args.set) + ([f"device={args.device}"] if args.device else [])
        cfg = load_train_config(args.config, overrides=overrides, method=args.method)
        check_feature_caches(args.data, cfg.feature_cache)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    started = _init_distributed()
    try:
        trainer = Trainer(cfg, data_dir=",".join(args.data), out_dir=args.out, cache_dir=args.cache_features,
                          show_progress=not args.no_progress)
        if args.precompute_features:
            if not cfg.feature_cache:
                raise SystemExit("error: --precompute-features needs feature_cache in the config (--set feature_cache=DIR)")
            record = trainer.precompute_features() or {"cached_samples": len(trainer.cache)}
            if trainer.rank == 0:
                print(json.dumps(record))
            trainer.close()
            return 0
        record = trainer.fit(resume=args.resume)  # ends with a validation pass when there is a val split
        trainer.export(args.export or os.path.join(args.out, "export"))
        trainer.close()
        if trainer.rank == 0:
            print(json.dumps(record))
    finally:
        if started:
            import torch.distributed as dist
            dist.destroy_process_group()
    return 0
