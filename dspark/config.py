"""Engine configuration: frozen dataclasses composed into `EngineConfig`; every check lives in
`__post_init__`, so a bad combination fails before any weight is loaded.

`SpecConfig.from_dict` accepts vLLM's `--speculative-config` JSON schema (method, model,
num_speculative_tokens, draft_sample_method, ...; vLLM's inference and key names: `dspark.spec_schema`);
unknown keys are errors. Each field's command-line / keyword spelling is its `opt(...)` metadata
(`dspark.utils.options`); `dspark.engine_args` generates the flags from it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from dspark.drafters.methods import method_names, method_record, methods_with, names_phrase
from dspark.utils.options import human_int, opt, optional_human_int

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
# the length policies `length_policy` names (their classes: dspark.speculation.length_policy.LENGTH_POLICIES)
LENGTH_POLICY_NAMES = ("fixed", "threshold", "prefix", "async")
# length_policy "threshold": "cumulative" keeps the drafts whose survival Π_{i≤k} c_i stays >= the threshold;
# "conditional" is DeepSpec's rule, cut at the first position whose own confidence c_k is below it
THRESHOLD_RULES = ("cumulative", "conditional")

MATMUL_DTYPES = ("auto", "float32", "bfloat16", "q4_1", "gguf")
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's other --dtype spellings
DEVICE_KINDS = ("auto", "cpu", "cuda")  # "cuda:N" names one GPU


def resolve_device(device: str) -> str:
    """"auto" -> "cuda" where torch sees a GPU, else "cpu"; "cpu", "cuda", "cuda:N" as given (ValueError
    for anything else)."""
    kind, _, index = str(device).partition(":")
    if kind not in DEVICE_KINDS or (index and (kind != "cuda" or not index.isdigit())):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got {device!r}")
    if kind == "auto":
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"
    return str(device)


def resolve_dtype(dtype: str, device: str) -> str:
    """"auto" -> bfloat16 weights and activations on CUDA, float32 on the CPU (whose matrix products
    `matmul_dtype` sets); other names as given."""
    if dtype == "auto":
        return "bfloat16" if str(device).startswith("cuda") else "float32"
    return dtype


def _gb_to_bytes(text: str) -> int:
    return int(float(text) * 2**30)


@dataclass(frozen=True)
class CacheConfig:
    kv_block_size: int = opt(16, "tokens per KV block", flag="--block-size", name="block_size",
                             aliases=("--kv-block-size",))
    kv_cache_memory_bytes: int = opt(2**30, "KV pool size in bytes when --num-kv-blocks is not given "
                                     "(suffixes: 4G = 4 GiB, 4g = 4e9)", parse=human_int,
                                     converted_aliases={"--kv-cache-memory-gb": _gb_to_bytes})
    # exact pool size (tests use small pools to force preemption)
    num_kv_blocks: int | None = opt(None, "exact number of KV blocks (overrides --kv-cache-memory-bytes)",
                                    aliases=("--num-gpu-blocks-override",), parse=optional_human_int)
    enable_prefix_caching: bool = opt(True, "reuse the KV blocks of earlier requests' equal prefixes",
                                      negatives=("--no-prefix-caching",))
    # the target's K/V in 8 bits (scale 1, as vLLM without calibrated scales), upcast in attention: twice the
    # tokens of a bf16 pool, four times an fp32 one's; the drafters' K/V stay in the activation dtype
    kv_cache_dtype: str = opt("auto", "the target's KV cache: auto (the activation dtype, --dtype), fp8 (= "
                              "fp8_e4m3) or fp8_e5m2: 8-bit K/V, upcast in attention",
                              choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"))
    # CUDA: the pool takes this fraction of the device's memory less what is in use once the weights are
    # loaded (vLLM's flag); the CPU sizes it by kv_cache_memory_bytes
    gpu_memory_utilization: float | None = opt(None, "CUDA: the fraction of the device's memory this engine "
                                               "may use; the KV pool takes what the weights leave of it "
                                               "(the CPU: --kv-cache-memory-bytes)")

    # hybrid targets (Qwen3.5, Qwen3-Next): prefix caching resumes the recurrence from a snapshot of its state at a
    # block boundary (docs/models.md, "Prefix caching"); each costs a state slot of window 1 (18.6 MiB at
    # Qwen3.5-2B's shape), taken from the KV pool's memory
    max_state_snapshots: int = opt(16, "hybrid targets: recurrent-state snapshots kept for prefix caching (0: "
                                   "prefix caching off for them)", parse=human_int)
    state_snapshot_interval: int = opt(512, "hybrid targets: a prompt keeps a state snapshot each time it crosses "
                                       "a multiple of N tokens, besides its last full KV block (0: only there)",
                                       parse=human_int)

    def __post_init__(self) -> None:
        if self.max_state_snapshots < 0:
            raise ValueError(f"max_state_snapshots must be >= 0, got {self.max_state_snapshots}")
        if self.state_snapshot_interval < 0:
            raise ValueError(f"state_snapshot_interval must be >= 0, got {self.state_snapshot_interval}")
        if self.kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"):
            raise ValueError(f"kv_cache_dtype must be auto, fp8, fp8_e4m3 or fp8_e5m2; got {self.kv_cache_dtype!r}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_block_size < 1:
            raise ValueError(f"kv_block_size must be >= 1, got {self.kv_block_size}")
        if self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = opt(64, "requests running at once", parse=human_int)
    max_num_batched_tokens: int = opt(512, "token budget of one step (prompt chunks + decode + drafts)",
                                      parse=human_int)
    max_model_len: int | None = opt(None, "context length, prompt + output (4k = 4000, 4K = 4096; "
                                    "default: the model's max_position_embeddings)", parse=optional_human_int)
    # hold arriving prompts up to this many steps (while they fill under half of a step's budget) so
    # several share one mixed step: a short prompt chunk beside decoding requests costs more a token than
    # a long one, and speculation's uneven finishing times make replacement prompts arrive one by one
    # (docs/design-notes.md, "Prompt coalescing"). 0: off
    coalesce_steps: int = opt(4, "hold an arriving prompt up to N steps while decoding requests run, so "
                              "prompts arriving close together share a prefill step (0: off)")

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 16:
            raise ValueError(f"max_num_batched_tokens must be >= 16, got {self.max_num_batched_tokens}")
        if self.coalesce_steps < 0:
            raise ValueError(f"coalesce_steps must be >= 0, got {self.coalesce_steps}")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism of the target (dspark.distributed): the engine starts `tensor_parallel_size - 1`
    worker processes itself (gloo on the CPU, NCCL on CUDA, rendezvous on 127.0.0.1)."""

    tensor_parallel_size: int = opt(1, "split the target over N processes (heads, MLP columns and vocabulary; "
                                    "gloo on the CPU, NCCL on CUDA); the engine starts the workers itself",
                                    aliases=("-tp",))
    # a collective of a step that does not complete within this many seconds (a rank stuck or gone) is an
    # error: the engine fails loudly instead of hanging
    distributed_timeout_s: float = opt(120.0, "a step's collective that does not finish in this many seconds "
                                       "(a rank stuck or gone) stops the engine with an error")
    # a step whose every request is greedy (no logprobs, processors or grammar) gathers each rank's
    # (max, argmax) per logits row instead of its vocabulary slice of the rows; off: always the rows
    vocab_parallel_argmax: bool = opt(True, "greedy-only steps gather each rank's vocabulary-slice argmax, "
                                      "not the logits rows")

    # several hosts (vLLM's and torchrun's flags): the tensor_parallel_size ranks are spread evenly over `nnodes`
    # hosts, each started on its own with its `node_rank`; they meet at master_addr:master_port (node 0's
    # address), node 0 serves HTTP and the others run their ranks headless (dspark.distributed.rendezvous)
    nnodes: int = opt(1, "hosts the tensor-parallel ranks span (each started with its own --node-rank)")
    node_rank: int = opt(0, "this host's index among --nnodes (0 serves HTTP; the others run their ranks only)")
    master_addr: str = opt("127.0.0.1", "node 0's address, where the ranks of every node meet")
    master_port: int = opt(29501, "node 0's rendezvous port (a TCP store)")
    headless: bool = opt(False, "run this node's ranks without the HTTP server (what a --node-rank > 0 does "
                         "anyway; accepted for vLLM command lines)")

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.distributed_timeout_s <= 0:
            raise ValueError(f"distributed_timeout_s must be > 0, got {self.distributed_timeout_s}")
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, --nnodes {self.nnodes}), got {self.node_rank}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"--tensor-parallel-size {self.tensor_parallel_size} does not spread evenly over "
                             f"--nnodes {self.nnodes} (each node runs the same number of ranks)")
        if not 0 < self.master_port <= 65535:
            raise ValueError(f"--master-port must be in [1, 65535], got {self.master_port}")
        if self.headless and self.node_rank == 0:
            raise ValueError("--headless is for the nodes of --node-rank > 0; node 0 serves HTTP")

    @property
    def local_size(self) -> int:
        """Ranks on each node."""
        return self.tensor_parallel_size // self.nnodes


class SpecConfigError(ValueError):
    """A speculative config that does not fit the target, or names a file that is not there, found before
    weights load (`engine.build`); the `dspark` CLI prints it as an error naming --speculative-config."""


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: vLLM's `speculative_config` keys plus dspark's length-policy keys."""

    method: str
    model: str | None = None  # drafter checkpoint (dspark, dflash, eagle3, draft_model)
    num_speculative_tokens: int = 7  # γ
    draft_sample_method: str = "greedy"
    # how drafts with a distribution (draft_sample_method "probabilistic") are verified at temperature > 0:
    # "standard" token by token, "block" as one block (Sun et al.; dspark.verify.block): both lossless, block
    # accepts at least as many on the same drafts
    rejection_sample_method: str = "standard"
    length_policy: str = "fixed"  # fixed | threshold | prefix | async
    confidence_threshold: float = 0.5
    threshold_rule: str = "cumulative"  # length_policy "threshold": cumulative | conditional (DeepSpec's)
    cost_table: str | None = None  # JSON from `dspark profile`
    online_upkeep: bool = False  # refresh the cost table and confidence temperatures from live steps
    draft_gate: bool = True  # prefix / async: skip drafting in steps where it cannot pay (DraftGate)
    # with the draft gate: a request joining a load where drafting could not pay even with the drafter's long-run
    # survival curve (dspark.speculation.admission) gets no drafter context (its drafts, if any, come from
    # prompt lookup; it takes target-only prefix-cache hits): speculation held off by the load costs no drafter
    # work
    gate_admission: bool = True
    # with the draft gate: speculation on or off per load by the engine's measured seconds per emitted token in
    # decode steps with and without it (dspark.speculation.switch.MeasuredSwitch): off where it does not beat plain
    # decoding by a margin, whatever the cost table predicts
    measured_switch: bool = True
    prompt_lookup_min: int = 2  # n-gram (and ngram_first)
    prompt_lookup_max: int = 5
    ngram_first: bool = False  # model drafters: prompt lookup first, the model where it cannot do better
    # ngram / ngram_first: n-grams kept from finished requests for cross-request lookup (0: own context only)
    lookup_cache_entries: int = 65536
    # ngram / ngram_first: a lookup corpus (`dspark build-corpus`: the target's own answers to training prompts)
    # asked where the context and the cache have no match (dspark.drafters.corpus); None: none
    lookup_corpus: str | None = None
    draft_num_layers: int | None = None  # draft_model: layer-truncated copy of the target
    # dspark / dflash: dtype of the drafter backbone's matrix products (activations and
    # weights keep the engine dtype, a copy is kept in this one). "q4_1": the backbone's matrices (and a
    # reduced-vocabulary LM head) quantized to Q4_1 blocks at load (llama.cpp's quantizer, as gguf implements
    # it) and multiplied as the target's q4_1 products (CPU kernels with AVX2: input widths in multiples of
    # 32, output rows in multiples of 8). "auto": q4_1 for a float32 engine on a CPU whose kernels multiply
    # it and a drafter whose shapes it holds (a third of bf16's bytes at τ within 1%: docs/drafters.md), else
    # bfloat16 on a CPU with bf16 dot products (AVX512-BF16 / AMX; the input rounded to bf16) or with AVX2
    # (the bf16 weights widened against the fp32 input: a bf16 checkpoint's exact fp32 products in half the
    # bytes), else the engine dtype. Drafts only propose, so this never changes the output (the target
    # verifies).
    draft_matmul_dtype: str = "auto"
    # dspark: top-K Markov drafting (vLLM-Metal's `dspark_draft_topk`): at each draft position the K best
    # base logits are the candidates and the Markov head corrects only those rows; 0 (default) corrects the
    # whole draft vocabulary. The drafts (and with sampling, the proposal distribution, zero outside the
    # candidates) change, never the output: the target verifies
    draft_topk: int = 0
    # dspark / dflash / eagle3: a full-vocabulary checkpoint (no d2t) drafts over only this many target tokens,
    # the target's special tokens and the most frequent in `lookup_corpus` (its token counts), chosen at load
    # (dspark.drafters.vocab); its head's other rows are never scored. None: the checkpoint's own vocabulary
    draft_vocab_size: int | None = None
    # dspark / dflash: the draft block attends to the target's features of the last N context positions only.
    # "auto": the sequence length the drafter was trained on (its folder's train_config.json `max_seq_len`; the
    # whole context where the folder does not say): past it the drafter meets distances it never saw and keeps
    # fewer drafts (docs/drafters.md, "Long contexts"); 0: the whole context
    draft_context_window: int | str = "auto"

    def __post_init__(self) -> None:
        record = method_record(self.method)  # what the method needs and accepts (dspark.drafters.methods)
        if record is None:
            raise ValueError(f"speculative method {self.method!r} unknown; choose from {', '.join(method_names())}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if self.draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(f"draft_sample_method {self.draft_sample_method!r} unknown; "
                             f"choose from {', '.join(DRAFT_SAMPLE_METHODS)}")
        if self.rejection_sample_method not in ("standard", "block"):
            raise ValueError(f"rejection_sample_method {self.rejection_sample_method!r} unknown; choose from "
                             f"standard, block")
        if self.rejection_sample_method == "block" and self.draft_sample_method != "probabilistic":
            raise ValueError("rejection_sample_method 'block' verifies drafts sampled from the drafter's distribution: "
                             "it needs draft_sample_method 'probabilistic' (greedy drafts are point masses, which "
                             "block and standard verification accept alike)")
        if self.length_policy not in LENGTH_POLICY_NAMES:
            raise ValueError(f"length_policy {self.length_policy!r} unknown; "
                             f"choose from {', '.join(LENGTH_POLICY_NAMES)}")
        if self.threshold_rule not in THRESHOLD_RULES:
            raise ValueError(f"threshold_rule {self.threshold_rule!r} unknown; choose from {', '.join(THRESHOLD_RULES)}")
        if self.threshold_rule != "cumulative" and self.length_policy != "threshold":
            raise ValueError(f"threshold_rule applies to length_policy 'threshold', not {self.length_policy!r}")
        if not 0.0 <= self.confidence_threshold <= 1.0:
            raise ValueError(f"confidence_threshold must be in [0, 1], got {self.confidence_threshold}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.draft_matmul_dtype not in ("auto", "float32", "bfloat16", "float16", "q4_1"):
            raise ValueError(f"draft_matmul_dtype must be auto, float32, bfloat16, float16 or q4_1, "
                             f"got {self.draft_matmul_dtype!r}")
        if self.draft_topk < 0:
            raise ValueError(f"draft_topk must be >= 0 (0: the whole draft vocabulary), got {self.draft_topk}")
        if self.draft_topk and not record.markov_head:
            raise ValueError(f"draft_topk applies to {names_phrase(methods_with('markov_head'))} (its Markov head); "
                             f"{self.method!r} has none")
        if self.lookup_cache_entries < 0:
            raise ValueError(f"lookup_cache_entries must be >= 0, got {self.lookup_cache_entries}")
        if self.draft_vocab_size is not None and (isinstance(self.draft_vocab_size, bool) or
                                                  not isinstance(self.draft_vocab_size, int) or self.draft_vocab_size < 1):
            raise ValueError(f"draft_vocab_size must be a positive number of tokens, got {self.draft_vocab_size!r}")
        if self.draft_vocab_size is not None and not record.draft_vocab:
            raise ValueError(f"draft_vocab_size applies to {names_phrase(methods_with('draft_vocab'))}, "
                             f"not {self.method!r}")
        window = self.draft_context_window
        if window != "auto" and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
            raise ValueError(f"draft_context_window must be \"auto\" or a number of positions >= 0 (0: the whole "
                             f"context), got {window!r}")
        if window not in ("auto", 0) and not record.context_window:
            raise ValueError(f"draft_context_window applies to {names_phrase(methods_with('context_window'))}, "
                             f"not {self.method!r}")
        if self.lookup_corpus and not (self.ngram_first or record.prompt_lookup or self.draft_vocab_size):
            raise ValueError(f"lookup_corpus applies to {names_phrase(methods_with('prompt_lookup'))}, ngram_first "
                             f"or draft_vocab_size (its token counts), not {self.method!r} alone")
        if self.ngram_first and record.prompt_lookup:
            raise ValueError(f"ngram_first wraps a model drafter; method {self.method!r} is prompt lookup already")
        if record.needs_checkpoint and not self.model:
            raise ValueError(f"speculative method {self.method!r} needs 'model' (the drafter checkpoint)")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | str) -> "SpecConfig":
        if isinstance(d, str):
            try:
                d = json.loads(d)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError("speculative config must be a JSON object")
        from dspark.spec_schema import VLLM_KEYS, normalize
        known = {f.name for f in fields(cls)} | set(VLLM_KEYS)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown speculative config key(s): {', '.join(unknown)}; "
                             f"valid keys: {', '.join(sorted(known))}")
        return cls(**normalize(d))


DEFAULT_SPEC = "default"  # the drafter shipped for the model, as `dspark serve` runs it (resolved by build_engine)


def _spec_option(value):
    """--speculative-config text or dict → SpecConfig; "none" / "off" / null → None (no speculation);
    "default" stays as such until `build_engine` resolves it to the shipped drafter."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", "off")):
        return None
    if isinstance(value, str) and value.strip().lower() == DEFAULT_SPEC:
        return DEFAULT_SPEC
    return value if isinstance(value, SpecConfig) else SpecConfig.from_dict(value)


@dataclass(frozen=True)
class EngineConfig:
    model: str = opt(DEFAULT_MODEL, "GGUF file, HF folder (config.json + safetensors) or the embedded default")
    # weights, activations and KV cache; "auto": bfloat16 on CUDA, float32 on the CPU (resolved here)
    dtype: str = opt("auto", "weights, activations and KV cache; auto: bfloat16 on CUDA, float32 on the CPU "
                     "(half = float16, float = float32)", choices=DTYPE_NAMES + tuple(DTYPE_ALIASES))
    # dtype of the target's matrix products when dtype is float32: "bfloat16" rounds weights and each
    # product's input to bf16 and sums in fp32 (CPU kernels with AVX512-BF16: ~2x the arithmetic, half the
    # weight bytes); norms, attention, residual stream and KV cache stay fp32. "auto": q4_1 for a Q4_1
    # GGUF where the CPU kernels multiply Q4_1 (AVX2 and up), else bfloat16 where they multiply bf16, else
    # float32 (dspark.engine.build.resolve_matmul_dtype). "q4_1": the
    # decoder layers multiply the GGUF's own Q4_1 blocks (a Q4_1 GGUF model only; exact weights, 0.63
    # bytes a weight, each product's input quantized to Q8_1 blocks, integer dot products and fp32 sums
    # over the blocks: llama.cpp's Q4_1 product), the LM head in bf16 where the kernels multiply
    # bf16, else in its own Q8_0 blocks when stored so (dspark.models.loader), else fp32. "gguf": every
    # matrix stays in the GGUF's own blocks whatever their types (dspark.models.blocks: Q4_1, Q8_0, Q5_0,
    # Q4_K, Q6_K multiplied in their blocks, other types dequantized to bf16 at load); "auto" picks it for a
    # quantized GGUF of another kind than all-Q4_1 where the kernels are built.
    matmul_dtype: str = opt("auto", "the target's matrix products with --dtype float32: bfloat16 rounds weights "
                            "and inputs to bf16 and sums in fp32 (CPU kernels with AVX512-BF16); q4_1 multiplies "
                            "a Q4_1 GGUF's own blocks (CPU kernels with AVX2); gguf keeps every matrix in the GGUF's own blocks; auto: q4_1 for a Q4_1 GGUF where "
                            "the kernels support it, else bfloat16 where they support that, else float32",
                            choices=MATMUL_DTYPES)
    # "auto": cuda where torch sees a GPU, else cpu (resolved here, so `config.device` is always concrete)
    device: str = opt("auto", "auto (cuda where torch sees a GPU, else cpu), cpu, cuda or cuda:N")
    # CUDA: run every step eager; --no-enforce-eager captures and replays decode and verification steps as CUDA
    # graphs (dspark.worker.cuda_graphs); eager stays the default until graphed parity is confirmed on a device
    enforce_eager: bool = opt(True, "CUDA: every step eager (the default); --no-enforce-eager replays decode and "
                              "verification steps as CUDA graphs (docs/parallel.md says what they have been "
                              "checked on); the CPU always runs eagerly")
    seed: int = opt(0, "random seed of requests that bring none")
    num_threads: int | None = opt(None, "torch intra-op threads (default: torch's)")
    trust_remote_code: bool = opt(False, "accepted for vLLM command lines; dspark never runs code from a "
                                  "checkpoint (its models are built in)")
    max_logprobs: int = opt(20, "most logprobs a request may ask for (-1: no limit)")
    # sampling defaults of requests that leave a field unset: "auto" reads the model's
    # generation_config.json (HF folders), "vllm" keeps dspark's own defaults, or a folder / file path
    generation_config: str = opt("auto", "sampling defaults from generation_config.json: auto (the model's, "
                                 "if it has one), vllm (none), or a folder / file PATH")
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig | str | None = opt(None, 'JSON (vLLM\'s schema, e.g. \'{"method": "ngram", '
                                        '"num_speculative_tokens": 4}\'), or piecewise --speculative-config.KEY '
                                        'VALUE; "default": the drafter shipped for the model (what serve runs '
                                        'without the flag); "none" turns it off', flag="--speculative-config",
                                  name="speculative_config", json=True, parse=_spec_option)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    @property
    def tensor_parallel_size(self) -> int:
        return self.parallel.tensor_parallel_size

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", DTYPE_ALIASES.get(self.dtype, self.dtype))
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be {', '.join(DTYPE_NAMES)}; got {self.dtype!r}")
        object.__setattr__(self, "device", resolve_device(self.device))
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype, self.device))
        if self.matmul_dtype not in MATMUL_DTYPES:
            raise ValueError(f"matmul_dtype must be {', '.join(MATMUL_DTYPES)}; got {self.matmul_dtype!r}")
        if self.matmul_dtype in ("bfloat16", "q4_1", "gguf") and self.dtype != "float32":
            raise ValueError(f"matmul_dtype={self.matmul_dtype!r} applies to dtype float32 (dtype {self.dtype!r} "
                             f"multiplies in its own dtype); use matmul_dtype 'auto' or 'float32'")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= -1, got {self.max_logprobs}")
        if self.cache.gpu_memory_utilization is not None and not self.device.startswith("cuda"):
            raise ValueError("gpu_memory_utilization sizes the KV pool on CUDA; on the CPU size it with "
                             "--kv-cache-memory-bytes (or --num-kv-blocks)")
        if isinstance(self.spec, str) and self.spec != DEFAULT_SPEC:
            raise ValueError(f"speculative_config must be a SpecConfig, a dict, {DEFAULT_SPEC!r} or None; got {self.spec!r}")
        if isinstance(self.spec, SpecConfig) and self.spec.num_speculative_tokens + 1 > self.scheduler.max_num_batched_tokens:
            raise ValueError("num_speculative_tokens + 1 exceeds max_num_batched_tokens")
