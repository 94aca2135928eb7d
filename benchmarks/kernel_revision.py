"""The CPU kernels' source at a git revision, for the benchmarks that compare a revision's kernels with the
working tree's (ab_kernels.py, bench_q4_kernel.py, bench_decode_kernels.py, ab_quant_ops.py):
`dspark/kernels/cpu_ops.cpp` and the parts it includes (`cpu_ops_*.inc`, where the revision has them), written
into one folder; a revision from before the block products joined them (`quant_ops.cpp`, a module of its own)
builds that file for ab_quant_ops.py.

    from kernel_revision import build_revision
    ops = build_revision("734ca1d")  # compiled once, cached beside the working tree's build
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KERNELS = "dspark/kernels"


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout


def revision_sources(rev: str) -> dict[str, str]:
    """{file name: text} of the kernels' source files at `rev`."""
    names = [Path(p).name for p in _git("ls-tree", "--name-only", rev, f"{KERNELS}/").split()]
    wanted = [n for n in names if n == "cpu_ops.cpp" or (n.startswith("cpu_ops_") and n.endswith(".inc"))]
    return {name: _git("show", f"{rev}:{KERNELS}/{name}") for name in sorted(wanted)}


def write_revision(rev: str, dest: Path) -> Path:
    """The revision's kernel sources written into `dest`; returns the path of its cpu_ops.cpp."""
    dest.mkdir(parents=True, exist_ok=True)
    for name, text in revision_sources(rev).items():
        (dest / name).write_text(text)
    return dest / "cpu_ops.cpp"


def _build_sources(sources: dict[str, str], entry: str, tag: str):
    """Compile the source files `sources` ({file name: text}, `entry` the one to build) as their own module,
    in a folder named by their hash beside the working tree's build (written there once)."""
    import torch

    from dspark import kernels
    digest = hashlib.sha256("".join(sources[n] for n in sorted(sources)).encode()
                            + torch.__version__.encode()).hexdigest()[:16]
    root = kernels.build_dir().parent / f"ab_{tag}{digest}"
    root.mkdir(parents=True, exist_ok=True)
    for name, text in sources.items():
        (root / name).write_text(text)
    return kernels.build(f"dspark_{entry.split('.')[0]}_base_{digest}", root, source=root / entry)


def build_revision(rev: str):
    """The kernels of revision `rev`, compiled as their own module (in a folder named by their hash)."""
    return _build_sources(revision_sources(rev), "cpu_ops.cpp", "")


def build_quant_revision(rev: str):
    """The block products (`block_mm`, `q8_0_mm`) of revision `rev`: its kernels, or where it kept them in
    `dspark/kernels/quant_ops.cpp`, that file compiled as its own module."""
    if "quant_ops.cpp" not in _git("ls-tree", "--name-only", rev, f"{KERNELS}/"):
        return build_revision(rev)
    return _build_sources({"quant_ops.cpp": _git("show", f"{rev}:{KERNELS}/quant_ops.cpp")}, "quant_ops.cpp", "quant_")
