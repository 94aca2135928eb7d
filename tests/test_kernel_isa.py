"""The CPU kernels' instruction-set level (`DSPARK_CPU_ISA`): what each level compiles with and what its
build multiplies, the Python side reading the CPU at the same level, each level in a build folder of its own,
unknown values and levels this CPU cannot run refused. `scripts/isa_matrix.sh` runs this file (and the other
kernel tests) under every level the CPU runs, where the per-level expectations below are the ones checked.

    pytest tests/test_kernel_isa.py -q
    DSPARK_CPU_ISA=avx512 pytest tests/test_kernel_isa.py -q
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from dspark import kernels
from dspark.kernels import compiled

# what each forced level's build multiplies: bf16 dot products (AVX512-BF16), bf16 weights widened against the
# fp32 input (AVX2 without AVX-512), Q4_1 / Q8_0 / block products (AVX2 + FMA + F16C, all levels), their
# integer sums by AVX512-VNNI; and the Python side's reading: bf16 dot products, AMX tiles (torch's bf16)
LEVELS = {
    "avx2": dict(has_bf16=False, has_bf16w=True, q4_1_vnni=False, vnni=False, kind="avx2", bf16_dot=False, amx=False),
    "avx512": dict(has_bf16=False, has_bf16w=False, q4_1_vnni=False, vnni=False, kind="avx2", bf16_dot=False,
                   amx=False),
    "avx512_bf16": dict(has_bf16=True, has_bf16w=False, q4_1_vnni=True, vnni=True, kind="avx512", bf16_dot=True,
                        amx=False),
    "amx": dict(has_bf16=True, has_bf16w=False, q4_1_vnni=True, vnni=True, kind="avx512", bf16_dot=True, amx=True),
}
# the compiler's macros the kernels' source tests, per level: on / off
MACROS = {
    "avx2": ({"__AVX2__", "__FMA__", "__F16C__"}, {"__AVX512F__", "__AVX512BF16__", "__AVX512VNNI__"}),
    "avx512": ({"__AVX2__", "__FMA__", "__F16C__", "__AVX512F__", "__AVX512BW__", "__AVX512VL__"},
               {"__AVX512BF16__", "__AVX512VNNI__", "__AMX_BF16__"}),
    "avx512_bf16": ({"__AVX512F__", "__AVX512BF16__", "__AVX512VNNI__", "__AVX512VL__"},
                    {"__AMX_BF16__", "__AMX_TILE__"}),
    "amx": ({"__AVX512F__", "__AVX512BF16__", "__AVX512VNNI__", "__AMX_BF16__", "__AMX_TILE__"},
            {"__AVX512VP2INTERSECT__"}),
}


def expected_for(level: str) -> dict:
    """LEVELS' row for a forced level; at the native level the same facts read off this CPU's flags."""
    if level != "native":
        return LEVELS[level]
    f = compiled.cpu_flags()
    avx2 = {"avx2", "fma", "f16c"} <= f
    return dict(has_bf16={"avx512f", "avx512_bf16"} <= f, has_bf16w=avx2 and "avx512f" not in f,
                q4_1_vnni=avx2 and {"avx512f", "avx512_vnni"} <= f, vnni=avx2 and {"avx512vl", "avx512_vnni"} <= f,
                kind="avx512" if {"avx512f", "avx512_bf16"} <= f else "avx2" if avx2 else "torch",
                bf16_dot=bool({"avx512_bf16", "amx_bf16"} & f), amx="amx_bf16" in f)


@pytest.fixture
def level(monkeypatch):
    """set_level(value): DSPARK_CPU_ISA=value for what follows in the test (the cached level re-read)."""
    def set_level(value: str) -> None:
        monkeypatch.setenv("DSPARK_CPU_ISA", value)
        compiled.isa.cache_clear()
    yield set_level
    compiled.isa.cache_clear()  # the next caller reads the process's own level again


def test_the_build_multiplies_what_its_level_has():
    """The loaded build's paths and the Python side's reading of the CPU are the level's (LEVELS), whichever
    CPU runs it; kernels off: none of them."""
    if kernels.ops() is None:
        assert kernels._mode() == "0" or compiled.isa() == "native", "a forced level's build failed"
        assert kernels.kernel_kind() == "torch"
        assert not (kernels.has_bf16_kernels() or kernels.has_bf16w_kernels() or kernels.has_q4_1_kernels())
        return
    k, want = kernels.ops(), expected_for(compiled.isa())
    got = dict(has_bf16=k.has_bf16, has_bf16w=k.has_bf16w, q4_1_vnni=k.q4_1_vnni, vnni=k.vnni,
               kind=kernels.kernel_kind(), bf16_dot=kernels.cpu_has_bf16_dot(), amx=kernels.cpu_has_amx_bf16())
    assert got == want, compiled.isa()
    assert k.has_q4_1 and k.has_q8_0 and k.has_quant  # AVX2 + FMA + F16C at every level
    assert kernels.bf16_kernel_rows() == (kernels.Linear.LOWP_MIN_ROWS if want["amx"] else kernels.MAX_ROWS)
    assert k.q4_1_group_rows == (16 if want["q4_1_vnni"] else 8)
    # a drafter's "auto" products where Q4_1 blocks do not fit: bf16 only where the level multiplies bf16
    from dspark.drafters.dspark import resolve_matmul_dtype
    auto = resolve_matmul_dtype("auto", dtype=torch.float32, device="cpu", q4_1_fits=False)
    assert auto == (torch.bfloat16 if want["bf16_dot"] or want["has_bf16w"] else torch.float32)
    # a bf16 copy the kernels multiply (dot products or AVX2's widening) frees its weight; else it stays
    lin = kernels.Linear(64, 16, bias=False)
    kernels.set_matmul_dtype(lin, torch.bfloat16)
    assert (kernels.release_dense_weights(lin) > 0) == (want["has_bf16"] or want["has_bf16w"])


def test_each_level_compiles_with_its_march_into_its_own_folder(level, monkeypatch):
    monkeypatch.setattr(compiled, "cpu_flags", lambda: compiled.ISA_CPU_FLAGS["amx"])  # a CPU that runs them all
    folders = {}
    for name, march in compiled.ISA_MARCH.items():
        level(name)
        assert compiled.cflags() == ("-O3", *march, "-fopenmp", "-ffp-contract=off")
        folders[name] = compiled.build_dir()
    assert len(set(folders.values())) == len(folders), folders
    assert folders["avx2"].name == folders["native"].name + "-avx2"
    assert compiled.ISA_MARCH["native"] == ("-march=native",)


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
@pytest.mark.parametrize("name", sorted(MACROS))
def test_each_levels_flags_turn_the_sources_macros_on_and_off(name):
    """What `#if defined(__AVX512BF16__)` and the like in cpu_ops_*.inc see at each level (the compiler's
    predefined macros for the level's flags, nothing built)."""
    out = subprocess.run(["g++", *compiled.ISA_MARCH[name], "-dM", "-E", "-x", "c++", "-"], input="",
                         capture_output=True, text=True, check=True).stdout
    defined = {line.split()[1] for line in out.splitlines() if line.startswith("#define ")}
    on, off = MACROS[name]
    assert on <= defined, on - defined
    assert not (off & defined), off & defined


def test_an_unknown_level_is_a_value_error_naming_the_variable(level, monkeypatch):
    level("avx9000")
    with pytest.raises(ValueError, match=r"DSPARK_CPU_ISA must be one of native, avx2, avx512, avx512_bf16, amx; "
                                         r"got 'avx9000'"):
        compiled.isa()
    monkeypatch.setattr(compiled, "cpu_flags", lambda: compiled.ISA_CPU_FLAGS["avx2"])
    level(" AVX2 ")  # case and spaces as the other switches take them
    assert compiled.isa() == "avx2"
    level("")
    assert compiled.isa() == "native"


def test_a_level_this_cpu_cannot_run_is_refused_before_building(level, monkeypatch):
    """A CPU without AMX (its flags those of avx512_bf16): amx is refused naming what it lacks, and the
    kernels' loader raises instead of building code that would die of an illegal instruction; the levels
    below it are taken, and the Python side reads the level's flags, not the CPU's."""
    monkeypatch.setattr(compiled, "cpu_flags", lambda: compiled.ISA_CPU_FLAGS["avx512_bf16"] | {"sse2", "vendor_id"})
    assert compiled.supported_isas() == ["native", "avx2", "avx512", "avx512_bf16"]
    level("amx")
    with pytest.raises(RuntimeError, match="DSPARK_CPU_ISA=amx: this CPU lacks .*amx_bf16"):
        compiled.isa()
    built = []
    monkeypatch.setattr(compiled, "build", lambda *a, **k: built.append(a))
    monkeypatch.setenv("DSPARK_CPU_KERNELS", "1")
    with pytest.raises(RuntimeError, match="lacks"):
        compiled._load.__wrapped__()
    assert not built
    for name in ("avx2", "avx512"):
        level(name)
        assert compiled.isa() == name and not kernels.cpu_has_bf16_dot() and not kernels.cpu_has_amx_bf16()
    level("avx512_bf16")
    assert kernels.cpu_has_bf16_dot() and not kernels.cpu_has_amx_bf16()
    level("native")
    assert kernels.isa_cpu_flags() == compiled.cpu_flags()


def test_without_proc_cpuinfo_torchs_capability_vouches_for_the_levels(level, monkeypatch):
    monkeypatch.setattr(compiled, "cpu_flags", lambda: frozenset())
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert compiled.supported_isas() == ["native", "avx2"]
    level("avx2")
    assert compiled.isa() == "avx2" and kernels.isa_cpu_flags() == compiled.ISA_CPU_FLAGS["avx2"]
    level("avx512")
    with pytest.raises(RuntimeError, match="cannot tell"):
        compiled.isa()
