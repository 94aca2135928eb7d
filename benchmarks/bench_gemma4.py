"""Gemma 4 of the E2B shape class (the smallest published one) on the CPU, random weights: no real checkpoint can be
had here. Batch-1 greedy decode tok/s, plain and with the E2B assistant (`method: "mtp"`, 3 drafts), side by side in
one run; and the one-token decode step time of what Gemma 4 adds (KV sharing, per-layer inputs) against a dense
Gemma 3 of equal size.

The shapes (`E2B`, `E2B_ASSISTANT` below, HF config names) come from the public model cards and config.json files of
google/gemma-4-E2B (text decoder: 35 layers, hidden 1536, 8 heads, 1 KV head, head_dim 256 on sliding layers and 512
on full ones, FFN 6144, twice as wide on the KV-shared layers (`use_double_wide_mlp`), window 512, four sliding layers
per full one, the last 20 layers sharing K/V, per-layer inputs of 256, vocabulary 262144, tied head, logit softcap 30)
and google/gemma-4-E2B-it-assistant (4 layers, hidden 256, 4 heads, FFN 2048, the centroid head: 2048 clusters,
top 32). The weights are random (uniform, unit-variance preserving, tiled from a random pool so that 4.6 billion
of them are written in seconds; logits checked finite). The assistant is untrained: its drafts are near chance,
so its row measures what the drafting machinery costs, not the speed-up a trained assistant gives.

Decode: one prompt of random tokens, greedy, EOS ignored, through `dspark.engine.engine.Engine` (plain, and with
the assistant saved to a temporary folder and loaded through `dspark.drafters.build_drafter` as the engine would);
tok/s counts the tokens after the first (prompt excluded), the two engines take turns, the order alternating,
medians over rounds; tau = 1 + accepted / drafts; the greedy outputs must be equal.

Step time: one verification step of one token at a 512-token context (`StepProfiler.verify_step(1)`), timed for
(a) the E2B-shaped Gemma 4, (b) it with `num_kv_shared_layers` 0, (c) it with `hidden_size_per_layer_input` 0,
(d) a dense Gemma 3 (`Gemma3ForCausalLM`) of the same hidden size, layers, layer pattern, heads, head_dim 256, FFN,
vocabulary and softcap; the models take turns, medians, ratios to (d). All four are built at once: a variant's
matrices are the earlier models' tensors where name and shape agree (what it reads per step is unchanged, the
resident bytes are not multiplied; (c) is (a) minus its per-layer-input weights). Each runs its per-layer modules
(the one-call CPU decoder stack, which Gemma 4 lacks, is off for Gemma 3 too: it would only apply in fp32).

`--shape tiny` is a smoke test (about a megabyte of weights, the same features, seconds). The memory the run needs
is estimated (meta tensors) and printed before any weight is made; the run stops when it exceeds 90% of what is
available. The last stdout line is one JSON object; `--out` writes it too.

    python benchmarks/bench_gemma4.py --threads 2 --out benchmarks/results/gemma4_e2b_decode.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from dspark.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from dspark.drafters import build_drafter
from dspark.engine.engine import Engine
from dspark.engine.step_profiler import StepProfiler
from dspark.models import build_model
from dspark.models.config import ModelConfig
from dspark.sampling import SamplingParams

S, F = "sliding_attention", "full_attention"
ROPE = {F: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
        S: {"rope_type": "default", "rope_theta": 10_000.0}}
# google/gemma-4-E2B, text decoder (public model card / config.json `text_config`)
E2B = {
    "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "num_hidden_layers": 35,
    "hidden_size": 1536, "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256, "global_head_dim": 512,
    "intermediate_size": 6144, "use_double_wide_mlp": True, "sliding_window": 512, "layer_types": ([S] * 4 + [F]) * 7,
    "num_kv_shared_layers": 20, "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262144,
    "vocab_size": 262144, "tie_word_embeddings": True, "final_logit_softcapping": 30.0, "attention_k_eq_v": False,
    "rope_parameters": ROPE, "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "bos_token_id": 2, "eos_token_id": 1,
}
# google/gemma-4-E2B-it-assistant (public config.json)
E2B_ASSISTANT = {
    "architectures": ["Gemma4AssistantForCausalLM"], "model_type": "gemma4_assistant", "backbone_hidden_size": 1536,
    "use_ordered_embeddings": True, "num_centroids": 2048, "centroid_intermediate_top_k": 32,
    "tie_word_embeddings": True,
    "text_config": {
        "model_type": "gemma4_text", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 256, "global_head_dim": 512, "intermediate_size": 2048,
        "sliding_window": 512, "layer_types": [S, S, S, F], "num_kv_shared_layers": 4,
        "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0, "vocab_size": 262144,
        "final_logit_softcapping": None, "attention_k_eq_v": False, "enable_moe_block": False,
        "use_double_wide_mlp": False, "rope_parameters": ROPE, "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072, "tie_word_embeddings": True},
}
# a few MB with every feature above: two 4:1 groups, KV shared by the last 4 layers, double-wide MLP, per-layer inputs
TINY = {**E2B, "num_hidden_layers": 10, "hidden_size": 64, "num_attention_heads": 4, "head_dim": 16,
        "global_head_dim": 32, "intermediate_size": 96, "sliding_window": 16, "layer_types": ([S] * 4 + [F]) * 2,
        "num_kv_shared_layers": 4, "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 512,
        "vocab_size": 512}
TINY_ASSISTANT = {**E2B_ASSISTANT, "backbone_hidden_size": 64, "num_centroids": 16, "centroid_intermediate_top_k": 4,
                  "text_config": {**E2B_ASSISTANT["text_config"], "hidden_size": 32, "head_dim": 16,
                                  "global_head_dim": 32, "intermediate_size": 64, "sliding_window": 16,
                                  "vocab_size": 512}}
SHAPES = {  # target, assistant, prompt tokens, new tokens, step-time context
    "e2b": (E2B, E2B_ASSISTANT, 256, 32, 512),
    "tiny": (TINY, TINY_ASSISTANT, 48, 8, 64),
}
K = 3  # the assistant's drafts per step
BLOCK = 16
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
POOL = 1_000_003  # a prime: tiles of the random pool do not line up with rows


def variant_configs(hf: dict) -> dict[str, ModelConfig]:
    """(a) Gemma 4, (b) without KV sharing, (c) without per-layer inputs, (d) a dense Gemma 3 of equal size."""
    gemma3 = {k: hf[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                 "num_attention_heads", "num_key_value_heads", "head_dim", "layer_types",
                                 "sliding_window", "final_logit_softcapping", "tie_word_embeddings", "rms_norm_eps",
                                 "hidden_activation", "max_position_embeddings", "bos_token_id", "eos_token_id")}
    gemma3.update(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", query_pre_attn_scalar=hf["head_dim"],
                  rope_parameters={F: {"rope_type": "default", "rope_theta": 1_000_000.0}, S: ROPE[S]})
    return {"gemma4": ModelConfig.from_hf(hf),
            "no_kv_sharing": ModelConfig.from_hf({**hf, "num_kv_shared_layers": 0}),
            "no_per_layer_inputs": ModelConfig.from_hf({**hf, "hidden_size_per_layer_input": 0}),
            "gemma3_dense": ModelConfig.from_hf(gemma3)}


def share_matrices(model: torch.nn.Module, donors: list[torch.nn.Module]) -> set[int]:
    """Point each matrix (parameter of >= 2 dims) of `model` at the first donor's parameter of the same name, shape
    and dtype (a tied head follows its embedding: both names are listed) -> ids of the parameters now shared."""
    tables = [dict(d.named_parameters(remove_duplicate=False)) for d in donors]
    shared = set()
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        if p.dim() < 2:
            continue
        for table in tables:
            q = table.get(name)
            if q is not None and q.shape == p.shape and q.dtype == p.dtype:
                owner, _, attr = name.rpartition(".")
                setattr(model.get_submodule(owner), attr, q)
                shared.add(id(q))
                break
    return shared


class RandomFill:
    """Uniform weights of variance 1 / fan-in, tiled from one random pool per scale (a random offset per tensor)."""

    def __init__(self, dtype: torch.dtype, seed: int) -> None:
        self.dtype, self.g, self.pools = dtype, torch.Generator().manual_seed(seed), {}

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        fan = t.shape[-1]
        if fan not in self.pools:
            bound = (3.0 / fan) ** 0.5
            pool = torch.empty(POOL, dtype=self.dtype).uniform_(-bound, bound, generator=self.g)
            self.pools[fan] = torch.cat((pool, pool))
        pool, flat = self.pools[fan], t.view(-1)
        offset = int(torch.randint(POOL, (1,), generator=self.g))
        with torch.no_grad():
            for start in range(0, flat.numel(), POOL):
                n = min(POOL, flat.numel() - start)
                flat[start:start + n].copy_(pool[offset:offset + n])
        return t


def build_variants(cfgs: dict[str, ModelConfig], dtype: torch.dtype, device: str, fill: RandomFill | None):
    """The models, each built once, matrices shared where `share_matrices` finds them, the rest filled (on "meta":
    nothing filled) -> (models, parameters in each model, bytes resident in all)."""
    models, counts, seen = {}, {}, {}
    for label, cfg in cfgs.items():
        model = build_model(cfg, dtype=dtype, device=device)
        shared = share_matrices(model, list(models.values()))
        for p in model.parameters():
            if fill is not None and p.dim() >= 2 and id(p) not in shared:
                fill(p.data)
            seen[id(p)] = p.numel() * p.element_size()
        if cfg.architecture == "Gemma3ForCausalLM":
            model._stack_applies = lambda *args: False  # per-layer modules, as Gemma 4 runs (only fp32 stacks)
        counts[label] = sum(p.numel() for p in model.parameters())
        models[label] = model
    return models, counts, sum(seen.values())


def kv_bytes(model, blocks: int, dtype: torch.dtype) -> int:
    specs = model.kv_layer_specs() if hasattr(model, "kv_layer_specs") else [model.kv_spec] * model.num_kv_layers
    return 2 * (blocks + 1) * BLOCK * sum(h * d for h, d in specs) * torch.tensor([], dtype=dtype).element_size()


def write_assistant(path: Path, hf: dict, dtype: torch.dtype, fill: RandomFill | None) -> int:
    """The assistant's config.json under `path`; with `fill`, random weights (transformers' names) beside it ->
    the parameter count."""
    from dspark.drafters.gemma4_assistant import Gemma4Assistant, read_assistant_config
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf))
    shapes = Gemma4Assistant(read_assistant_config(path), device="meta").expected_shapes()
    if fill is not None:
        from safetensors.torch import save_file
        tensors = {}
        for name, shape in shapes.items():
            if name == "masked_embedding.token_ordering":
                tensors[name] = torch.randperm(shape[0], generator=fill.g)
            elif len(shape) < 2:
                tensors[name] = torch.ones(shape, dtype=dtype)  # norms (x * weight) and layer scalars
            else:
                tensors[name] = fill(torch.empty(shape, dtype=dtype))
        save_file(tensors, str(path / "model.safetensors"))
    return sum(torch.Size(s).numel() for s in shapes.values())


def check_finite(model, cfg: ModelConfig, dtype: torch.dtype, n: int = 16) -> float:
    """Logits of n random tokens through a fresh pool: all finite, or raise -> their standard deviation."""
    from dspark.models.attention import SeqSpec, build_attn_metadata
    specs = model.kv_layer_specs() if hasattr(model, "kv_layer_specs") else [model.kv_spec] * model.num_kv_layers
    blocks = -(-n // BLOCK)
    caches = [tuple(torch.zeros(blocks, BLOCK, h, d, dtype=dtype) for _ in "kv") for h, d in specs]
    meta = build_attn_metadata([SeqSpec(list(range(blocks)), 0, n, 0)], num_tokens=n, kv_block_size=BLOCK)
    ids = torch.randint(3, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        hidden, _ = model(ids, torch.arange(n), meta, caches)
        logits = model.compute_logits(hidden)  # [n, vocab] fp32
    if not torch.isfinite(logits).all():
        raise RuntimeError(f"{cfg.architecture}: random weights give non-finite logits")
    return float(logits.std())


def engine_for(model, cfg: ModelConfig, dtype: str, blocks: int, spec: SpecConfig | None = None) -> Engine:
    config = EngineConfig(device="cpu", dtype=dtype, spec=spec,
                          cache=CacheConfig(kv_block_size=BLOCK, num_kv_blocks=blocks, enable_prefix_caching=False),
                          scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=512))
    drafter = None
    if spec is not None:
        drafter = build_drafter(spec, target_config=cfg, target_model=model, dtype=DTYPES[dtype], device="cpu")
    return Engine(config, model=model, model_config=cfg, drafter=drafter)


def generate(engine: Engine, prompt: list[int], new: int) -> tuple[float, list[int]]:
    """Greedy batch-1 decode -> (tok/s from the step after the first token: prompt excluded, the output)."""
    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
    out, start, counted = [], None, 0
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                out += o.new_token_ids
                counted += len(o.new_token_ids) if start is not None else 0
        if start is None and out:
            start = time.perf_counter()
    return counted / (time.perf_counter() - start), out


def decode(engines: dict[str, Engine], prompt: list[int], new: int, rounds: int) -> dict:
    for e in engines.values():
        generate(e, prompt[:16], 4)  # warm-up
    speeds: dict[str, list[float]] = {label: [] for label in engines}
    outputs: dict[str, list[list[int]]] = {label: [] for label in engines}
    labels = list(engines)
    for r in range(rounds):
        for label in labels[r % 2:] + labels[:r % 2]:
            tps, out = generate(engines[label], prompt, new)
            speeds[label].append(tps)
            outputs[label].append(out)
    base = statistics.median(speeds["plain"])
    result = {}
    for label, v in speeds.items():
        m = engines[label].metrics
        result[label] = {"tok_s": statistics.median(v), "tok_s_rounds": v, "vs_plain": statistics.median(v) / base,
                         "same_output_as_plain": all(o == outputs["plain"][0] for o in outputs[label]),
                         "tau": 1 + m.num_accepted_tokens / m.num_drafts if m.num_drafts else None}
    return result


def step_times(engines: dict[str, Engine], context: int, repeats: int, warmup: int = 2) -> dict:
    """Median seconds of one 1-token verification step at `context`, the engines taking turns (order rotating)."""
    profilers = {label: StepProfiler(e, context_len=context, tokens_per_request=1) for label, e in engines.items()}
    times: dict[str, list[float]] = {label: [] for label in engines}
    labels = list(engines)
    try:
        for i in range(warmup + repeats):
            for label in labels[i % len(labels):] + labels[:i % len(labels)]:
                t = time.perf_counter()
                profilers[label].verify_step(1)
                if i >= warmup:
                    times[label].append(time.perf_counter() - t)
    finally:
        for p in profilers.values():
            p.close()
    base = statistics.median(times["gemma3_dense"])
    return {label: {"ms": 1e3 * statistics.median(v), "vs_gemma3_dense": statistics.median(v) / base,
                    "context_len": profilers[label].context_len} for label, v in times.items()}


def mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="e2b")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="decode rounds per engine")
    ap.add_argument("--repeats", type=int, default=10, help="timed steps per model")
    ap.add_argument("--prompt-len", type=int, help="prompt tokens (default: the shape's)")
    ap.add_argument("--new", type=int, help="new tokens (default: the shape's)")
    ap.add_argument("--context", type=int, help="step-time context (default: the shape's)")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target_hf, assistant_hf, prompt_len, new, context = SHAPES[args.shape]
    prompt_len, new, context = args.prompt_len or prompt_len, args.new or new, args.context or context
    dtype = DTYPES[args.dtype]
    cfgs = variant_configs(target_hf)
    blocks = -(-max(prompt_len + new + K + 1, context + 2) // BLOCK) + 4

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "assistant"
        metas, counts, weight_bytes = build_variants(cfgs, dtype, "meta", None)
        assistant_params = write_assistant(folder, assistant_hf, dtype, None)
        pool_bytes = sum(kv_bytes(m, blocks, dtype) for m in metas.values()) + kv_bytes(metas["gemma4"], blocks, dtype)
        estimate = weight_bytes + assistant_params * dtype.itemsize + pool_bytes
        available = mem_available()
        memory = {"estimate_bytes": estimate, "weights_bytes": weight_bytes,
                  "assistant_bytes": assistant_params * dtype.itemsize, "kv_pool_bytes": pool_bytes,
                  "available_bytes": available, "unshared_weights_bytes": sum(
                      n * dtype.itemsize for n in counts.values())}
        print(json.dumps({"memory_bytes": memory, "memory_gib": {k: None if v is None else round(v / 2**30, 3)
                                                                for k, v in memory.items()}, "params": counts}),
              flush=True)
        if available is not None and estimate > 0.9 * available:
            sys.exit(f"the run needs about {estimate / 2**30:.1f} GiB, {available / 2**30:.1f} GiB is available")
        del metas

        fill = RandomFill(dtype, seed=0)
        t0 = time.perf_counter()
        models, _, _ = build_variants(cfgs, dtype, "cpu", fill)
        write_assistant(folder, assistant_hf, dtype, fill)
        build_s = time.perf_counter() - t0
        logit_std = {label: check_finite(m, cfgs[label], dtype) for label, m in models.items()}
        print(json.dumps({"built_s": round(build_s, 1), "logits_finite": True, "logit_std": logit_std}), flush=True)

        target, cfg = models["gemma4"], cfgs["gemma4"]
        spec = SpecConfig(method="mtp", model=str(folder), num_speculative_tokens=K)
        engines = {"plain": engine_for(target, cfg, args.dtype, blocks),
                   "assistant_k3": engine_for(target, cfg, args.dtype, blocks, spec)}
        prompt = torch.randint(3, cfg.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(7)).tolist()
        decoded = decode(engines, prompt, new, args.rounds)
        print(json.dumps({"decode": decoded}), flush=True)

        step_engines = {label: engines["plain"] if label == "gemma4" else engine_for(m, cfgs[label], args.dtype, blocks)
                        for label, m in models.items()}
        steps = step_times(step_engines, context, args.repeats)
        print(json.dumps({"step_time": steps}), flush=True)

    c, a = cfgs["gemma4"], assistant_hf["text_config"]
    results = {
        "command": "python benchmarks/bench_gemma4.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "platform": platform.platform(), "torch": torch.__version__, "threads": args.threads,
        "shape": args.shape, "dtype": args.dtype,
        "config": (f"Gemma 4 {args.shape} shape, random weights: {c.num_hidden_layers} layers "
                   f"({c.layer_types.count(F)} full), hidden {c.hidden_size}, heads {c.num_attention_heads}/"
                   f"{c.num_key_value_heads} KV, head_dim {c.head_dim}/{c.global_head_dim}, FFN "
                   f"{c.intermediate_size} (x2 on the {c.num_kv_shared_layers} KV-shared layers), per-layer inputs "
                   f"{c.hidden_size_per_layer_input}, "
                   f"vocab {c.vocab_size}; assistant: {a['num_hidden_layers']} layers, hidden {a['hidden_size']}, FFN "
                   f"{a['intermediate_size']}, random weights"),
        "params": counts, "assistant_params": assistant_params,
        "memory_bytes": memory, "build_s": round(build_s, 1), "logit_std": logit_std,
        "decode": {"prompt_tokens": prompt_len, "new_tokens": new, "rounds": args.rounds,
                   "num_speculative_tokens": K, **decoded},
        "step_time": {"context_len": context, "tokens": 1, "repeats": args.repeats,
                      "measured": "all four models resident, taking turns", **steps},
    }
    line = json.dumps(results)
    if args.out:
        Path(args.out).write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
