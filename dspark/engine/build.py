"""build_engine: configuration → loaded target (+ drafter, length policy) → Engine.

Order matters: the drafter's configuration is checked against the target's (read from the checkpoint
header) before any weight is loaded, so a mismatch fails in a second, not after a long load.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from dspark.config import DEFAULT_SPEC, EngineConfig, SpecConfigError
from dspark.drafters import build_drafter, check_drafter
from dspark.drafters.methods import method_record, methods_with, names_phrase
from dspark.engine.engine import Engine
from dspark.worker.model_runner import DTYPES

log = logging.getLogger(__name__)


def build_engine(config: EngineConfig):
    """Returns (engine, tokenizer_bundle)."""
    from dspark.models.loader import load_model, read_model_config, resolve_model_path
    from dspark.models.tokenizer import check_tokenizer_files

    tp_size = config.tensor_parallel_size
    if tp_size > 1:
        from dspark.distributed.runner import threads_per_rank
        threads = threads_per_rank(config)
        if threads:
            torch.set_num_threads(threads)
    elif config.num_threads:
        torch.set_num_threads(config.num_threads)
    if str(config.device).startswith("cpu"):
        from dspark.utils.host import tune_malloc
        tune_malloc()  # fixed glibc thresholds: a step's temporaries do not depend on the allocation history
    target_config = read_model_config(config.model)
    matmul_dtype = resolve_matmul_dtype(config.matmul_dtype, dtype=config.dtype, device=config.device,
                                        model=config.model, tensor_parallel_size=config.tensor_parallel_size)
    log.info("target matrix products: %s (matmul_dtype=%s)", matmul_dtype, config.matmul_dtype)
    if config.spec == DEFAULT_SPEC:  # the shipped drafter with the cost table of these products
        from dspark.drafters.shipped import default_spec_config
        config = dataclasses.replace(config, spec=default_spec_config(config.model, matmul_dtype=matmul_dtype))
        if config.spec is None:
            raise SpecConfigError(f"--speculative-config default: no drafter is shipped for {config.model!r}")
    if config.spec is not None and method_record(config.spec.method).own_checkpoint and not config.spec.model:
        config = dataclasses.replace(config, spec=dataclasses.replace(
            config.spec, model=str(resolve_model_path(config.model))))
    if config.spec is not None:
        try:
            check_drafter(config.spec, target_config)
            _check_length_policy(config, matmul_dtype)
        except (ValueError, FileNotFoundError) as e:
            raise SpecConfigError(f"--speculative-config: {e}") from e
    check_tokenizer_files(resolve_model_path(config.model))  # after the config checks, before any weight
    workers = None
    if tp_size > 1:
        _check_tensor_parallel(config, matmul_dtype, target_config)
        workers, model, target_config, tokenizer, shared = _start_tensor_parallel(config, matmul_dtype)
    else:
        model, target_config, tokenizer = load_model(config.model, dtype=DTYPES[config.dtype],
                                                     device=config.device, matmul_dtype=matmul_dtype)
        shared = model
    try:
        drafter = None
        if config.spec is not None:  # under tensor parallelism on rank 0, with the whole embedding and head
            drafter = build_drafter(config.spec, target_config=target_config, target_model=shared,
                                    dtype=DTYPES[config.dtype], device=config.device)
        policy, cost = build_policy(config, drafter)
        from dspark.structured import GrammarCompiler
        engine = Engine(config, model=model, model_config=target_config, drafter=drafter, length_policy=policy,
                        cost_table=cost, eos_token_ids=tokenizer.eos_token_ids, workers=workers,
                        wrap_runner=_runner_wrapper(config, model, target_config, workers),
                        grammar_compiler=GrammarCompiler.for_tokenizer(  # built on the first structured request
                            tokenizer, vocab_size=target_config.vocab_size,
                            eos_token_ids=tokenizer.eos_token_ids or target_config.eos_token_ids))
    except BaseException:
        if workers is not None:
            workers.close()
        raise
    if str(config.device).startswith("cpu"):
        from dspark.utils.host import trim_heap
        trim_heap()  # the load's freed temporaries back to the OS (tune_malloc would keep up to 512 MiB)
    return engine, tokenizer


def _runner_wrapper(config: EngineConfig, model, target_config, workers):
    """What wraps the engine's model runner: the tensor-parallel driver over `workers`, CUDA graphs on CUDA
    (unless `enforce_eager`, or a hybrid target), else nothing."""
    if workers is not None:
        from dspark.distributed.runner import TPModelRunner
        return lambda runner: TPModelRunner(runner, workers)
    if not config.device.startswith("cuda") or config.enforce_eager:
        return None
    if getattr(model, "has_recurrent_state", False):
        log.info("CUDA graphs are off for %s: its linear-attention layers read their state bookkeeping on the host (eager)",
                 target_config.architecture)
        return None
    from dspark.worker.cuda_graphs import CudaGraphBackend, GraphedRunner
    return lambda runner: GraphedRunner(runner, backend=CudaGraphBackend(), max_num_seqs=config.scheduler.max_num_seqs)


def _check_tensor_parallel(config: EngineConfig, matmul_dtype: str, target_config) -> None:
    """Before any worker starts: what tensor parallelism cannot split fails here."""
    size = config.tensor_parallel_size
    from dspark.models.family import family_of
    if family_of(target_config.architecture).recurrent_state:
        raise ValueError(f"tensor parallelism over the hybrid {target_config.architecture} is not supported "
                         f"(its linear-attention layers and state slots are not split over ranks); run it "
                         f"with tensor_parallel_size 1")
    if target_config.num_key_value_heads < size:
        raise ValueError(f"tensor_parallel_size {size} exceeds the model's {target_config.num_key_value_heads} "
                         f"KV heads (each rank keeps whole KV heads)")
    if matmul_dtype == "q4_1":
        raise ValueError(f"matmul_dtype q4_1 runs on one process; with tensor_parallel_size {size} use "
                         f"--matmul-dtype auto, float32 or bfloat16 (the ranks multiply slices of the "
                         f"dequantized weights)")
    if config.spec is not None and method_record(config.spec.method).runs_target_layers:
        raise ValueError(f"speculative method {config.spec.method!r} runs the target's own first layers, which "
                         f"tensor parallelism splits over the ranks; with tensor_parallel_size > 1 use dspark, "
                         f"dflash, eagle3 or ngram")


def _start_tensor_parallel(config: EngineConfig, matmul_dtype: str):
    """Rank 0's shard and the started workers -> (workers, model, model config, tokenizer, the whole-vocabulary
    view the drafter shares). Rank 0 loads first, so a GGUF's converted cache is written once before the
    workers read it."""
    from dspark.distributed.rendezvous import agree, fingerprint, open_store
    from dspark.distributed.runner import Workers, load_full_target, shard_target

    store = open_store(config.parallel, master=True)
    agree(store, config.parallel, fingerprint(config, matmul_dtype))  # other nodes checked before any weight loads
    model, target_config, tokenizer = load_full_target(config)
    workers = Workers(config, matmul_dtype, store)
    try:
        shared = shard_target(model, config, workers.tp, matmul_dtype, keep_full_vocab=True)
        workers.wait_ready()
    except BaseException:
        workers.close()
        raise
    log.info("tensor parallelism: %d ranks, rank 0 holds %d of %d KV heads", workers.size, model.kv_spec[0],
             target_config.num_key_value_heads)
    return workers, model, target_config, tokenizer, shared


def run_tensor_parallel_node(config: EngineConfig) -> int:
    """A node of --node-rank > 0 (multi-node tensor parallelism): the checks rank 0 makes, then its ranks
    headless until node 0 stops them (dspark.distributed.runner.run_node). Returns the exit code."""
    from dspark.distributed.runner import run_node
    from dspark.models.loader import read_model_config
    target_config = read_model_config(config.model)
    matmul_dtype = resolve_matmul_dtype(config.matmul_dtype, dtype=config.dtype, device=config.device,
                                        model=config.model, tensor_parallel_size=config.tensor_parallel_size)
    _check_tensor_parallel(config, matmul_dtype, target_config)
    return run_node(config, matmul_dtype)


def resolve_matmul_dtype(matmul_dtype: str, *, dtype: str = "float32", device: str = "cpu",
                         model: str | None = None, tensor_parallel_size: int = 1) -> str:
    """The target's matrix-product dtype (EngineConfig.matmul_dtype), "auto" resolved for a float32 CPU
    engine: q4_1 for a Q4_1 GGUF `model` with a Q8_0 head (the default model) where the kernels multiply Q4_1
    (AVX2 + FMA + F16C): the file's own 4-bit weights, the fastest batch-1 decode of the three since a few-row
    step is bound by the weight bytes it streams (docs/benchmarks.md, "Batch-1 decode"); gguf for another GGUF
    of a family whose blocks load resident (a Q4_1 file with a K-quant head, what llama-quantize writes, among
    them: the q4_1 load would hold that head dense); else bfloat16 where the
    kernels multiply bf16 (AVX512-BF16); else float32. An explicit bfloat16 or q4_1 without such kernels still runs (torch
    multiplies the same values in fp32), slower: said in the log. "auto" device / dtype are resolved first;
    under tensor parallelism (`tensor_parallel_size` > 1) "auto" never means q4_1 (the ranks multiply
    their row or column slices of the dequantized weights: dspark.distributed)."""
    from dspark import kernels
    from dspark.config import resolve_device, resolve_dtype
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    bf16_kernels = device == "cpu" and kernels.has_bf16_kernels()
    if matmul_dtype == "auto":
        if dtype != "float32":
            return "float32"
        if model is not None and device == "cpu" and tensor_parallel_size == 1 and kernels.has_q4_1_kernels():
            from dspark.models.loader import q4_1_head_is_q8_0, q4_1_problem, resolve_model_path
            from dspark.models.blocks import takes_gguf_blocks
            try:
                if q4_1_problem(model) is None and q4_1_head_is_q8_0(model):
                    return "q4_1"
                if takes_gguf_blocks(resolve_model_path(model)):
                    return "gguf"
            except (FileNotFoundError, ValueError):
                pass  # an unknown model fails where it loads, with its own message
        return "bfloat16" if bf16_kernels else "float32"
    if matmul_dtype == "q4_1" and not (device == "cpu" and kernels.has_q4_1_kernels()):
        log.warning("matmul_dtype=q4_1 without Q4_1 CPU kernels (no AVX2/FMA/F16C, kernels off or not a CPU): "
                    "torch multiplies the same weights in fp32, much slower")
    if matmul_dtype == "bfloat16" and not bf16_kernels:
        log.warning("matmul_dtype=bfloat16 without bf16 CPU kernels (no AVX512-BF16, kernels off or not a CPU "
                    "device): the rounded products run through torch in fp32 — the same model, slower")
    return matmul_dtype


def _check_length_policy(config: EngineConfig, matmul_dtype: str = "float32") -> None:
    """Fail closed before loading weights: adaptive verification needs a confidence head (checked
    by the drafter's `check`) and a cost table on disk, profiled with the engine's matmul dtype."""
    spec = config.spec
    if spec.length_policy != "fixed" and not method_record(spec.method).confidence_head:
        raise ValueError(f"length_policy={spec.length_policy!r} needs a drafter with a confidence head "
                         f"({names_phrase(methods_with('confidence_head'))}); {spec.method!r} has none")
    if spec.cost_table and spec.cost_table != "auto" and not Path(spec.cost_table).is_file():
        raise ValueError(f"cost_table {spec.cost_table!r} does not exist (run `dspark profile --out PATH`)")
    if spec.cost_table and spec.cost_table != "auto":
        from dspark.speculation.cost_table import CostTable
        table_dtype = CostTable.load(spec.cost_table).meta.get("matmul_dtype", "float32")
        if table_dtype != matmul_dtype:
            raise ValueError(f"cost_table {spec.cost_table!r} was profiled with {table_dtype} matrix products; "
                             f"this engine multiplies in {matmul_dtype} (its step costs differ ~2x): profile "
                             f"it (`dspark profile --matmul-dtype {matmul_dtype} --out PATH`), pass a table "
                             f"of the same dtype, or set --matmul-dtype {table_dtype}")
    if spec.length_policy in ("prefix", "async") and not spec.cost_table:
        raise ValueError(f"length_policy={spec.length_policy!r} needs a cost table: run `dspark profile "
                         f"--out cost.json` and pass \"cost_table\": \"cost.json\" (or \"auto\": profile at "
                         f"startup) in the speculative config")


def build_policy(config: EngineConfig, drafter):
    """The verify-length policy and its cost table (None, None without speculation)."""
    spec = config.spec
    if spec is None or drafter is None:
        return None, None
    from dspark.speculation.cost_table import CostTable
    from dspark.speculation.length_policy import build_length_policy
    # "auto": profiled at startup once the engine exists (see build_engine)
    cost = CostTable.load(spec.cost_table) if spec.cost_table and spec.cost_table != "auto" else None
    kwargs = {"fixed": {"verify_len": spec.num_speculative_tokens},
              "threshold": {"threshold": spec.confidence_threshold,
                            "cumulative": spec.threshold_rule == "cumulative"},
              "prefix": {}, "async": {"cold_start_len": spec.num_speculative_tokens}}[spec.length_policy]
    policy = build_length_policy(spec.length_policy, confidence_available=drafter.has_confidence,
                                 cost_available=cost is not None or spec.cost_table == "auto", **kwargs)
    return policy, cost
