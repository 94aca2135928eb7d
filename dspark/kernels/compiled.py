"""The compiled CPU kernels: their source files, the instruction-set level they are compiled for
(`DSPARK_CPU_ISA`), the build folder named by the sources' hash and the level, the build itself (torch's C++
extension loader), and `ops()`, the loaded module or None (off, or no compiler).
A finished build leaves a stamp beside its `<name>.so` (what it compiled, with which flags); a load whose
stamp matches imports the .so directly, without torch's loader (which imports setuptools and runs ninja).
Imported by `dspark.kernels` and by `kernels.blocks` (which asks the build how it packs Q4_1 rows)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger("dspark.kernels")

# the kernels' source; DSPARK_KERNELS_SOURCE points a process at another revision's file (side-by-side
# benchmarks: benchmarks/bench_decode_kernels.py); each source builds in a folder of its own hash
SOURCE = Path(os.environ.get("DSPARK_KERNELS_SOURCE") or Path(__file__).with_name("cpu_ops.cpp"))
MAX_ROWS = 128  # small_mm and the one-call decoder stack serve up to this many rows (more: BLAS; cpu_ops.cpp)


def _mode() -> str:
    mode = os.environ.get("DSPARK_CPU_KERNELS", "1").strip().lower()
    if mode not in ("0", "1", "require"):
        raise ValueError(f"DSPARK_CPU_KERNELS must be 0, 1 or require; got {mode!r}")
    return mode


def source_files(source: Path = SOURCE) -> list[Path]:
    """The kernels' source: `source` and the parts beside it that it includes (cpu_ops_*.inc)."""
    return [source, *sorted(source.parent.glob("cpu_ops_*.inc"))]


# ------------------------------------------------------------------ the instruction-set level (DSPARK_CPU_ISA)

# each level's gcc flags (in place of -march=native), and the /proc/cpuinfo flags a CPU needs to run what they
# compile (each level's set holds the one below it): "avx2" Haswell (AVX2, FMA, F16C: the Q4_1 / Q8_0 / block
# products, bf16 weights widened); "avx512" Skylake-SP (AVX-512 F/CD/BW/DQ/VL without VNNI or BF16: no bf16
# products in the kernels at all); "avx512_bf16" Cooper Lake (AVX512-VNNI and AVX512-BF16: the bf16 dot
# products); "amx" Sapphire Rapids (AMX tiles, which torch's bf16 products use; gcc 12's sapphirerapids also
# names AVX512-VP2INTERSECT, which those CPUs lack). "native": the compiler's view of this CPU.
ISA_MARCH: dict[str, tuple[str, ...]] = {
    "native": ("-march=native",),
    "avx2": ("-march=haswell",),
    "avx512": ("-march=skylake-avx512",),
    "avx512_bf16": ("-march=cooperlake",),
    "amx": ("-march=sapphirerapids", "-mno-avx512vp2intersect"),
}
_AVX2 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe", "popcnt"})  # abm: LZCNT
_AVX512 = _AVX2 | {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl", "adx"}
_AVX512_BF16 = _AVX512 | {"avx512_vnni", "avx512_bf16"}
_AMX = _AVX512_BF16 | {"amx_tile", "amx_bf16", "amx_int8", "avx512_fp16", "avx512vbmi", "avx512_vbmi2",
                       "avx512_bitalg", "avx512_vpopcntdq", "avx512ifma", "avx_vnni"}
ISA_CPU_FLAGS: dict[str, frozenset[str]] = {"avx2": _AVX2, "avx512": _AVX512, "avx512_bf16": _AVX512_BF16,
                                            "amx": _AMX}
# where /proc/cpuinfo cannot be read: the levels torch's own dispatch (its CPU capability) vouches for
_TORCH_CAPABILITY_ISAS = {"AVX2": ("avx2",), "AVX512": ("avx2", "avx512")}


@cache
def cpu_flags() -> frozenset[str]:
    """The words of Linux /proc/cpuinfo (its "flags" among them); empty where it cannot be read."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()


@cache
def isa() -> str:
    """The instruction-set level the kernels are built for and the process runs at: `DSPARK_CPU_ISA` (native,
    the default; avx2, avx512, avx512_bf16, amx). A level this CPU cannot run is refused (a RuntimeError naming
    the missing flags) rather than built into code that dies of an illegal instruction."""
    level = os.environ.get("DSPARK_CPU_ISA", "native").strip().lower() or "native"
    if level not in ISA_MARCH:
        raise ValueError(f"DSPARK_CPU_ISA must be one of {', '.join(ISA_MARCH)}; got {level!r}")
    if level == "native":
        return level
    flags = cpu_flags()
    if not flags:  # no /proc/cpuinfo (not Linux): torch's own reading of the CPU
        capability = torch.backends.cpu.get_cpu_capability()
        if level not in _TORCH_CAPABILITY_ISAS.get(capability, ()):
            raise RuntimeError(f"DSPARK_CPU_ISA={level}: cannot tell that this CPU runs it (no /proc/cpuinfo; "
                               f"torch's CPU capability is {capability}); use native")
        return level
    missing = sorted(ISA_CPU_FLAGS[level] - flags)
    if missing:
        raise RuntimeError(f"DSPARK_CPU_ISA={level}: this CPU lacks {' '.join(missing)}; its levels: "
                           f"{', '.join(supported_isas())}")
    return level


def supported_isas() -> list[str]:
    """The levels `DSPARK_CPU_ISA` may name on this CPU ("native" always)."""
    flags = cpu_flags()
    if not flags:
        return ["native", *_TORCH_CAPABILITY_ISAS.get(torch.backends.cpu.get_cpu_capability(), ())]
    return ["native", *(level for level, need in ISA_CPU_FLAGS.items() if need <= flags)]


def isa_cpu_flags() -> frozenset[str]:
    """The CPU flags the process may use: this CPU's own (`cpu_flags`) at the native level, a forced level's
    (`ISA_CPU_FLAGS`) otherwise, so the Python side decides as on a CPU of that level (e.g. no bf16 dot
    products at avx2 or avx512)."""
    level = isa()
    return cpu_flags() if level == "native" else ISA_CPU_FLAGS[level]


def cflags() -> tuple[str, ...]:
    """The kernels' compiler flags at the level `isa()`."""
    return ("-O3", *ISA_MARCH[isa()], "-fopenmp", "-ffp-contract=off")


def build_dir() -> Path:
    """The build folder: the sources' and torch's hash, and a forced level's name (`<hash>-avx2`), so each
    level keeps a build of its own."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in source_files())
                            + torch.__version__.encode()).hexdigest()[:16]
    root = Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark"))
    level = isa()
    return root / "kernels" / (digest if level == "native" else f"{digest}-{level}")


LDFLAGS = ("-fopenmp",)


def build(name: str, path: Path, *, source: Path = SOURCE, defines: tuple[str, ...] = ()) -> ModuleType:
    """Compile `source` (default: these kernels) as module `name` in folder `path` with the kernels' flags (at
    the level `isa()`) and preprocessor `defines`: the main build, `ops_variant`, and the benchmarks' builds of
    another revision. A build already there whose stamp matches is imported as it is."""
    flags = [*cflags(), *(f"-D{d}" for d in defines)]
    stamp, so = path / f"{name}.stamp", path / f"{name}.so"
    expected = _stamp_text(name, source, flags)
    if so.is_file() and stamp.is_file() and stamp.read_text() == expected:
        try:
            return _import_built(name, so)
        except ImportError as e:  # a damaged file: torch's loader below (which rebuilds what ninja finds stale)
            logger.warning("rebuilding %s: %s", so, e)
    from torch.utils.cpp_extension import load
    path.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)  # a build stopped part way leaves no stamp
    module = load(name=name, sources=[str(_staged(source, path))], build_directory=str(path),
                  extra_cflags=flags, extra_ldflags=list(LDFLAGS), verbose=False)
    if so.is_file():
        tmp = path / f".{stamp.name}.{os.getpid()}"
        tmp.write_text(expected)
        os.replace(tmp, stamp)
    return module


def _stamp_text(name: str, source: Path, cflags: list[str]) -> str:
    """What a build of `name` from `source` with `cflags` is: the module name, the compiled files' hash, the
    flags, torch's version and the Python ABI (the stamp a finished build writes beside its .so)."""
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in _compiled_files(source))).hexdigest()
    return json.dumps({"name": name, "sources": digest, "cflags": cflags, "ldflags": list(LDFLAGS),
                       "torch": torch.__version__, "python": sys.implementation.cache_tag}, indent=1) + "\n"


def _import_built(name: str, so: Path) -> ModuleType:
    """The built extension `so` imported as module `name`, as torch's loader imports it (torch imported first)."""
    spec = importlib.util.spec_from_file_location(name, so)
    if spec is None or spec.loader is None:
        raise ImportError(f"{so} is not an importable extension")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compiled_files(source: Path) -> list[Path]:
    """`source` and the parts beside it that it includes (by name): the files a build compiles."""
    text = source.read_text()
    return [source, *(f for f in source_files(source)[1:] if f'"{f.name}"' in text)]


def _staged(source: Path, path: Path) -> Path:
    """`source` and the parts it includes copied into `path`/src (rewritten only when their bytes differ), the
    file the build compiles: the build command then names the same file whichever checkout (a git worktree)
    asks, so checkouts of one source share the build instead of recompiling it for each other in turn."""
    staged = path / "src"
    staged.mkdir(exist_ok=True)
    for f in _compiled_files(source):
        target, data = staged / f.name, f.read_bytes()
        if not target.is_file() or target.read_bytes() != data:
            tmp = staged / f".{f.name}.{os.getpid()}"
            tmp.write_bytes(data)
            os.replace(tmp, target)
    return staged / source.name


@cache
def _load() -> ModuleType | None:
    mode = _mode()
    if mode == "0":
        return None
    isa()  # an unknown level, or one this CPU cannot run: an error, not a fallback to torch
    try:
        return build("dspark_cpu_ops", build_dir())
    except Exception as e:  # no compiler / ninja, or a compile error: the torch path still works
        if mode == "require":
            raise RuntimeError(f"DSPARK_CPU_KERNELS=require but the CPU kernels failed to build: {e}") from e
        logger.warning("dspark CPU kernels unavailable, using torch ops (slower decode): %s", e)
        return None


def ops() -> ModuleType | None:
    """The compiled kernels, or None when they are off or failed to build."""
    return _load()


@cache
def ops_variant(*defines: str) -> ModuleType:
    """The same kernels built with preprocessor `defines` (e.g. "DSPARK_Q4_NO_VNNI": the AVX2 integer sums on
    a VNNI CPU), under another module name beside the main build: for tests that compare a build's paths."""
    tag = "_".join(d.lower() for d in defines)
    return build(f"dspark_cpu_ops_{tag}", build_dir() / tag, defines=defines)
