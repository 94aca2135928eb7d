"""Drafters shipped inside the package: for the embedded default model (SmolLM2-135M-Instruct) and for
gemma-3-270m.

`dspark serve` with no `--speculative-config` uses `default_spec_config(model)`: the drafting fastest at batch 1
for that model (`SERVED_DEFAULTS`, docs/benchmarks.md): for the embedded default the trained DSpark drafter (Markov
head + calibrated confidence head) with prompt lookup first; for gemma-3-270m prompt lookup alone (its shipped
DSpark drafter accepts too little to pay for its 2 layers, docs/benchmarks.md); no speculation for any other
model or where the weights are missing. How they were made: docs/drafters.md.
"""

from __future__ import annotations

from pathlib import Path

from dspark.config import DEFAULT_MODEL, SpecConfig
from dspark.drafters.checkpoint import INDEX_NAME, WEIGHTS_NAME

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "drafters"
SHIPPED: dict[tuple[str, str], str] = {  # (model, method) → folder under ASSETS
    (DEFAULT_MODEL, "dspark"): "dspark-smollm2-135m",
    (DEFAULT_MODEL, "dflash"): "dflash-smollm2-135m",
    (DEFAULT_MODEL, "eagle3"): "eagle3-smollm2-135m",
    ("gemma-3-270m", "dspark"): "dspark-gemma-3-270m",
}
# model -> its shipped lookup corpus under ASSETS (`dspark build-corpus`: the model's own answers to train/ prompts)
CORPORA: dict[str, str] = {DEFAULT_MODEL: "lookup-smollm2-135m/corpus.safetensors"}
DEFAULT_NUM_SPECULATIVE_TOKENS = 7
# model -> the method `dspark serve` drafts with by default (the fastest at batch 1: docs/benchmarks.md)
SERVED_DEFAULTS: dict[str, str] = {DEFAULT_MODEL: "dspark", "gemma-3-270m": "ngram"}
# prompt lookup as served by default: gemma-3-270m's continuations repeat their own text (τ ≈ 4 at γ 4)
NGRAM_DEFAULT = dict(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=5)


def _canonical(model: str) -> str:
    return DEFAULT_MODEL if model in (DEFAULT_MODEL, "default") else model


def drafter_dir(model: str, method: str = "dspark") -> Path | None:
    """The shipped drafter folder for (model, method), or None when none is shipped."""
    name = SHIPPED.get((_canonical(model), method))
    if name is None:
        return None
    path = ASSETS / name
    weights = (path / WEIGHTS_NAME).is_file() or (path / INDEX_NAME).is_file()  # one file, or shards
    return path if (path / "config.json").is_file() and weights else None


# the shipped cost table for each matmul dtype of the target (EngineConfig.matmul_dtype, resolved); a
# table for one kind of kernels (dspark.kernels.kernel_kind) sits beside it as cost_table_q4_1_avx512.json
COST_TABLES = {"float32": "cost_table.json", "bfloat16": "cost_table_bf16.json", "q4_1": "cost_table_q4_1.json"}


def shipped_cost_table(folder: Path, matmul_dtype: str, kind: str | None = None) -> Path | None:
    """The shipped cost table in `folder` for `matmul_dtype`: the one profiled with this machine's kind of
    kernels (`kind`, default `kernel_kind()`) where there is one, else the dtype's; None without either."""
    name = COST_TABLES.get(matmul_dtype)
    if name is None:
        return None
    if kind is None:
        from dspark.kernels import kernel_kind
        kind = kernel_kind()
    for candidate in (folder / name.replace(".json", f"_{kind}.json"), folder / name):
        if candidate.is_file():
            return candidate
    return None


def corpus_path(model: str) -> Path | None:
    """The shipped lookup corpus for `model`, or None when none is shipped."""
    name = CORPORA.get(_canonical(model))
    return ASSETS / name if name is not None and (ASSETS / name).is_file() else None


def default_spec_config(model: str, matmul_dtype: str = "float32") -> SpecConfig | None:
    """DSpark with prompt lookup first (`ngram_first`) and the prefix scheduler (Algorithm 1) on the shipped
    cost table for the engine's matmul dtype and, where one was profiled, this machine's kind of kernels
    (`shipped_cost_table`: profiled on 2-core CPUs); on other hardware run `dspark profile` or pass
    "cost_table": "auto". Lookup first: lookup drafts cost no forward, so at batch 1 they carry most of the
    speedup (docs/drafters.md, docs/benchmarks.md). A model whose served default
    is prompt lookup (`SERVED_DEFAULTS`) gets `NGRAM_DEFAULT`. The lookup asks the shipped corpus where there is
    one (`CORPORA`)."""
    method = SERVED_DEFAULTS.get(_canonical(model))
    if method == "ngram":
        return SpecConfig(method="ngram", **NGRAM_DEFAULT)
    path = drafter_dir(model, "dspark") if method == "dspark" else None
    if path is None:
        return None
    cost = shipped_cost_table(path, matmul_dtype)
    corpus = corpus_path(model)
    lookup = dict(ngram_first=True, lookup_corpus=None if corpus is None else str(corpus))
    if cost is None:
        return SpecConfig(method="dspark", model=str(path), num_speculative_tokens=DEFAULT_NUM_SPECULATIVE_TOKENS,
                          **lookup)
    return SpecConfig(method="dspark", model=str(path), num_speculative_tokens=DEFAULT_NUM_SPECULATIVE_TOKENS,
                      length_policy="prefix", cost_table=str(cost), **lookup)
