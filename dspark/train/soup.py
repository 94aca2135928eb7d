"""Weight soup: the uniform average of drafter exports fine-tuned from one start (Wortsman et al., "Model
soups", 2022). Floating-point tensors are averaged in fp64 and written in their own dtype; integer buffers
(`d2t`) and config.json must be equal across the sources, so only runs of one architecture and draft
vocabulary mix. config.json and train_config.json are the first source's; a calibration.json is not carried
over (the soup's confidences need their own: `dspark calibrate`).

    python -m dspark.train.soup OUT SRC SRC [SRC ...] [--shard-mb 16]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from dspark.drafters.checkpoint import load_tensors, read_config, save_weights

CARRIED = ("config.json", "train_config.json")


def soup(out: str | Path, sources: list[str | Path], *, max_shard_bytes: int | None = None) -> dict[str, torch.Tensor]:
    """Write the average of `sources` (exported drafter folders) to `out`; returns its tensors."""
    if len(sources) < 2:
        raise ValueError("a soup needs at least two exports")
    config = read_config(sources[0])
    weights = []
    for src in sources:
        if read_config(src) != config:
            raise ValueError(f"{src}: config.json differs from {sources[0]}'s; a soup mixes one architecture")
        weights.append(load_tensors(src))
        if weights[-1].keys() != weights[0].keys():
            raise ValueError(f"{src}: tensor names differ from {sources[0]}'s")
    mixed: dict[str, torch.Tensor] = {}
    for name, first in weights[0].items():
        if any(w[name].shape != first.shape or w[name].dtype != first.dtype for w in weights):
            raise ValueError(f"tensor {name!r}: shapes or dtypes differ between the exports")
        if first.is_floating_point():
            mixed[name] = (sum(w[name].double() for w in weights) / len(weights)).to(first.dtype)
        elif all(torch.equal(w[name], first) for w in weights):
            mixed[name] = first
        else:
            raise ValueError(f"integer tensor {name!r} differs between the exports (another draft vocabulary?)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_weights(mixed, out, max_shard_bytes=max_shard_bytes)
    for name in CARRIED:
        if (Path(sources[0]) / name).is_file():
            shutil.copy(Path(sources[0]) / name, out / name)
    return mixed


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the soup's folder")
    p.add_argument("sources", nargs="+", help="exported drafter folders (two or more)")
    p.add_argument("--shard-mb", type=float, default=None, help="safetensors shards of at most this many MB")
    args = p.parse_args(argv)
    shard = None if args.shard_mb is None else int(args.shard_mb * 2 ** 20)
    try:
        mixed = soup(args.out, args.sources, max_shard_bytes=shard)
    except ValueError as e:
        p.error(str(e))
    print(f"{args.out}: {len(mixed)} tensors, the average of {len(args.sources)} exports")


if __name__ == "__main__":
    main()
