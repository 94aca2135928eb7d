"""The prepared device check (benchmarks/device_check.sh runs it; under 8 minutes on one GPU): on the default
model, bf16 weights on CUDA unless told otherwise,

1. greedy parity: speculative output == plain output for every drafter (shipped DSpark, DFlash, EAGLE-3,
   prompt lookup, a 10-layer draft model), 16 concurrent requests, CUDA graphs on;
2. HF transformers' logits parity in bf16 (and fp32): our prompt logits against `AutoModelForCausalLM` on
   the same GGUF, max |diff| and top-1 agreement per position;
3. CUDA-graph replay == eager: the same requests through the graphed runner and `enforce_eager`, outputs
   and every step's logits compared; first, in a child process (a device-side assert ends its CUDA context),
   the poison confirmation: right after each capture the allocator's free blocks are filled with live
   out-of-range indices (`PoisonedCudaGraphBackend`), so a graph that reads a tensor freed after its capture
   asserts or diverges at its first replay rather than by chance (on the CPU: `LifetimeCheckBackend`);
4. tok/s of plain and speculative decoding (shipped DSpark drafter) at batch 1 and at 32 concurrent, with
   CUDA graphs and eager side by side;
5. with two GPUs: TP=2 (NCCL) logits against TP=1;
6. the new target families (device_check_targets.py): tiny random Gemma 4 and hybrid Qwen3.5 configs, greedy output
   on the device == the CPU's, speculative == plain, batch-1 and c = 8 tok/s.

One JSON out (`--out`). `--device cpu --quick` runs the same code on the CPU in a few minutes (the graph
runner on its eager stand-in): a check of this script, not of CUDA.

    python benchmarks/device_check.py --out benchmarks/results/device_check_cuda.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from device_check_targets import check_new_targets  # noqa: E402 (benchmarks/ is the script's folder)

MODEL = "SmolLM2-135M-Instruct"


def _prompts(n: int, max_chars: int = 600) -> list[str]:
    from dspark.bench.datasets import load_prompts
    return [r.prompt[:max_chars] for r in load_prompts("all", num_prompts=n, seed=0)]


def _llm(device: str, dtype: str, spec=None, *, eager: bool = False, max_num_seqs: int = 32, tp: int = 1):
    from dspark.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig, SpecConfig
    from dspark.engine.build import build_engine
    from dspark.llm import LLM
    config = EngineConfig(model=MODEL, device=device, dtype=dtype, enforce_eager=eager,
                          spec=None if spec is None else SpecConfig.from_dict(spec),
                          cache=CacheConfig(kv_cache_memory_bytes=2 * 2**30),
                          scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=1024),
                          parallel=ParallelConfig(tensor_parallel_size=tp))
    engine, tok = build_engine(config)
    if device == "cpu" and not eager:  # the CPU rehearsal: the graphed runner on its stand-in backend
        from dspark.worker.cuda_graphs import EagerBackend, GraphedRunner
        engine.runner = GraphedRunner(engine.runner, backend=EagerBackend(), max_num_seqs=max_num_seqs)
    return LLM(engine=engine, tokenizer=tok)


def _close(llm) -> None:
    workers = getattr(llm.engine, "workers", None)
    if workers is not None:
        workers.close()


def _chat_ids(llm, prompts):
    return [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
            for p in prompts]


def _greedy(max_tokens: int):
    from dspark.sampling import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def drafter_specs() -> dict[str, dict | None]:
    from dspark.drafters.shipped import drafter_dir
    specs: dict[str, dict | None] = {}
    for method in ("dspark", "dflash", "eagle3"):
        folder = drafter_dir(MODEL, method)
        if folder is not None:
            specs[method] = {"method": method, "model": str(folder), "num_speculative_tokens": 7}
    specs["ngram"] = {"method": "ngram", "num_speculative_tokens": 5}
    specs["draft_model"] = {"method": "draft_model", "draft_num_layers": 10, "num_speculative_tokens": 4}
    return specs


def check_parity(device, dtype, prompts, max_tokens) -> dict:
    plain_llm = _llm(device, dtype)
    ids = _chat_ids(plain_llm, prompts)
    plain = [o.token_ids for o in plain_llm.generate(ids, _greedy(max_tokens))]
    del plain_llm
    out = {}
    for name, spec in drafter_specs().items():
        llm = _llm(device, dtype, spec)
        t = time.perf_counter()
        got = [o.token_ids for o in llm.generate(ids, _greedy(max_tokens))]
        m = llm.engine.metrics
        out[name] = {"prompts": len(ids), "mismatched_prompts": [i for i, (a, b) in enumerate(zip(got, plain))
                                                                 if a != b],
                     "num_drafts": m.num_drafts, "num_accepted_tokens": m.num_accepted_tokens,
                     "seconds": round(time.perf_counter() - t, 2)}
        out[name]["pass"] = not out[name]["mismatched_prompts"] and m.num_drafts > 0
        del llm
    return out


def _our_prompt_logits(model, ids: list[int], device) -> torch.Tensor:
    from dspark.worker.model_runner import allocate_kv_pool
    from dspark.models.attention import flat_batch
    kv_block_size = 16
    blocks = -(-len(ids) // kv_block_size)
    pool = allocate_kv_pool([model.kv_spec] * model.num_kv_layers, num_kv_blocks=blocks,
                            kv_block_size=kv_block_size, dtype=next(model.parameters()).dtype, device=device)
    tokens, positions, meta = flat_batch([(list(range(blocks)), 0, ids)], kv_block_size=kv_block_size,
                                         device=device)
    with torch.inference_mode():
        hidden, _ = model(torch.tensor(tokens, device=device), torch.tensor(positions, device=device), meta, pool)
        return model.compute_logits(hidden).float()  # [len(ids), vocab]


def check_hf_logits(device, prompts) -> dict:
    """Our logits of every prompt position against transformers' (eager attention) in bf16 and fp32."""
    from transformers import AutoModelForCausalLM

    from dspark.models.loader import load_model, resolve_model_path
    path = resolve_model_path(MODEL)
    out = {}
    for dtype_name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        if device == "cpu" and dtype == torch.bfloat16:
            continue  # the CPU rehearsal: fp32 only (bf16 on the CPU is another model: matmul_dtype)
        ours, _, tok = load_model(MODEL, dtype=dtype, device=device)
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype,
                                                  attn_implementation="eager").to(device).eval()
        worst, agree, total = 0.0, 0, 0
        for p in prompts:
            ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
            a = _our_prompt_logits(ours, ids, device)
            with torch.inference_mode():
                b = hf(torch.tensor([ids], device=device)).logits[0].float()
            worst = max(worst, (a - b).abs().max().item())
            agree += int((a.argmax(-1) == b.argmax(-1)).sum())
            total += len(ids)
        out[dtype_name] = {"max_abs_diff": worst, "top1_agreement": agree / total, "positions": total}
        del ours, hf
    bf16 = out.get("bfloat16")
    out["pass"] = (out["float32"]["max_abs_diff"] <= 2e-3 and out["float32"]["top1_agreement"] >= 0.999
                   and (bf16 is None or bf16["top1_agreement"] >= 0.95))
    return out


def _recorded(llm):
    steps = []
    forward = llm.engine.runner.forward

    def recording(batch, **kw):
        logits, taps = forward(batch, **kw)  # rows, or (TP, greedy steps) their merged RowArgmax
        steps.append(logits.float().cpu() if isinstance(logits, torch.Tensor) else
                     torch.stack([logits.values.float().cpu(), logits.indices.float().cpu()], dim=1))
        return logits, taps
    llm.engine.runner.forward = recording
    return steps


def poison_child(device, dtype, quick: bool) -> dict:
    """Plain and prompt-lookup decoding through graphs captured under poison, against eager (the child)."""
    from dspark.worker.cuda_graphs import GraphedRunner, LifetimeCheckBackend, PoisonedCudaGraphBackend
    n, tokens = (4, 16) if quick else (8, 32)
    prompts = _prompts(n)
    out = {}
    for name, spec in (("plain", None), ("ngram", drafter_specs()["ngram"])):
        eager = _llm(device, dtype, spec, eager=True, max_num_seqs=8)
        ids = _chat_ids(eager, prompts)
        expected = [o.token_ids for o in eager.generate(ids, _greedy(tokens))]
        del eager
        llm = _llm(device, dtype, spec, eager=True, max_num_seqs=8)
        backend = PoisonedCudaGraphBackend() if device != "cpu" else LifetimeCheckBackend()
        llm.engine.runner = GraphedRunner(llm.engine.runner, backend=backend, max_num_seqs=8)
        got = [o.token_ids for o in llm.generate(ids, _greedy(tokens))]
        if device != "cpu":
            torch.cuda.synchronize()  # a device-side assert surfaces here at the latest
        out[name] = {"outputs_equal": got == expected, "num_graphs": len(llm.engine.runner.graphs),
                     "num_replays": llm.engine.runner.num_replays}
        out[name]["pass"] = got == expected and llm.engine.runner.num_replays > 0
        del llm
    return out


def check_graph_poison(device, dtype, quick: bool) -> dict:
    """`poison_child` in its own process: a device-side assert there is a FAIL here, not a dead context."""
    env = {**os.environ, "DSPARK_CPU_KERNELS": "0"}  # the CPU rehearsal: attention as aten ops, which the check sees
    cmd = [sys.executable, __file__, "--device", device, "--dtype", dtype, "--poison-child",
           *(["--quick"] if quick else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"pass": False, "returncode": proc.returncode, "stderr_tail": proc.stderr[-2000:]}
    return json.loads(lines[-1])


def check_graphs(device, dtype, prompts, max_tokens) -> dict:
    out = {}
    for name, spec in (("plain", None), ("dspark", drafter_specs().get("dspark"))):
        runs = {}
        for eager in (True, False):
            llm = _llm(device, dtype, spec, eager=eager)
            steps = _recorded(llm)
            ids = _chat_ids(llm, prompts)
            runs[eager] = ([o.token_ids for o in llm.generate(ids, _greedy(max_tokens))], steps,
                           getattr(llm.engine.runner, "num_replays", 0))
            del llm
        (eager_out, eager_steps, _), (graph_out, graph_steps, replays) = runs[True], runs[False]
        same_shapes = [a.shape == b.shape for a, b in zip(eager_steps, graph_steps)]
        diffs = [(a - b).abs().max().item() for a, b in zip(eager_steps, graph_steps) if a.shape == b.shape]
        out[name] = {"outputs_equal": eager_out == graph_out, "num_replays": replays,
                     "steps": len(graph_steps), "steps_same_shape": sum(same_shapes),
                     "max_abs_logit_diff": max(diffs) if diffs else None}
        out[name]["pass"] = eager_out == graph_out and replays > 0
    return out


def check_speed(device, dtype, prompts, max_tokens) -> dict:
    out = {}
    for name, spec, eager in (("plain", None, False), ("dspark", drafter_specs().get("dspark"), False),
                              ("plain_eager", None, True), ("dspark_eager", drafter_specs().get("dspark"), True)):
        for conc in (1, 32):
            llm = _llm(device, dtype, spec, max_num_seqs=conc, eager=eager)
            ids = _chat_ids(llm, prompts[:conc * 2] if conc > 1 else prompts[:4])
            llm.generate(ids[:2], _greedy(16))  # warm-up: kernels, graphs of the first shapes
            t = time.perf_counter()
            if conc == 1:
                outs = [llm.generate([i], _greedy(max_tokens))[0] for i in ids]
            else:
                outs = llm.generate(ids, _greedy(max_tokens))
            seconds = time.perf_counter() - t
            tokens = sum(len(o.token_ids) for o in outs)
            out[f"{name}_c{conc}"] = {"requests": len(ids), "output_tokens": tokens, "seconds": round(seconds, 3),
                                      "tok_per_s": round(tokens / seconds, 1)}
            del llm
    for conc in (1, 32):
        plain, spec = out[f"plain_c{conc}"]["tok_per_s"], out[f"dspark_c{conc}"]["tok_per_s"]
        out[f"speedup_c{conc}"] = round(spec / plain, 3)
        out[f"graphs_over_eager_c{conc}"] = round(plain / out[f"plain_eager_c{conc}"]["tok_per_s"], 3)
    return out


def check_tp(device, dtype, prompts, max_tokens) -> dict:
    if device == "cpu" or torch.cuda.device_count() < 2:
        return {"skipped": "needs two GPUs"}
    from dspark.config import EngineConfig  # noqa: F401 - the spawn children import the same modules
    outs, steps = {}, {}
    for tp in (1, 2):
        llm = _llm(device, dtype, tp=tp, eager=True)
        steps[tp] = _recorded(llm)
        outs[tp] = [o.token_ids for o in llm.generate(_chat_ids(llm, prompts), _greedy(max_tokens))]
        _close(llm)
        del llm
    # TP = 2's greedy steps give each row's (max, argmax) merged from the ranks (dspark.distributed.vocab_argmax)
    merged = [(a, b) for a, b in zip(steps[1], steps[2]) if b.shape == (a.shape[0], 2)]
    diffs = [(a.max(dim=-1).values - b[:, 0]).abs().max().item() for a, b in merged if len(a)]
    agree = [float((a.argmax(dim=-1).float() == b[:, 1]).float().mean()) for a, b in merged if len(a)]
    return {"outputs_equal": outs[1] == outs[2], "argmax_steps": len(merged),
            "max_abs_row_max_diff": max(diffs) if diffs else None,
            "argmax_agreement": min(agree) if agree else None}


def _passed(node) -> bool:
    """No check errored and every nested "pass" flag is true."""
    if not isinstance(node, dict):
        return True
    return "error" not in node and node.get("pass", True) is not False and all(_passed(v) for v in node.values())


def main(argv: list[str] | None = None) -> dict:
    from dspark.bench.report import run_info, write_result_file
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quick", action="store_true", help="fewer prompts and tokens (the CPU rehearsal)")
    p.add_argument("--out", default="benchmarks/results/device_check_cuda.json")
    p.add_argument("--poison-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from dspark.config import resolve_dtype
    dtype = resolve_dtype(args.dtype, args.device)
    if args.poison_child:
        print(json.dumps(poison_child(args.device, dtype, args.quick)), flush=True)
        return {}
    n, tokens = (4, 16) if args.quick else (16, 64)
    prompts = _prompts(max(n, 64))
    result = {**run_info(argv), "device": args.device, "dtype": dtype, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    t0 = time.perf_counter()
    checks = (("greedy_parity", lambda: check_parity(args.device, dtype, prompts[:n], tokens)),
              ("hf_logits", lambda: check_hf_logits(args.device, prompts[:3 if args.quick else 8])),
              ("graph_poison", lambda: check_graph_poison(args.device, dtype, args.quick)),
              ("cuda_graphs", lambda: check_graphs(args.device, dtype, prompts[:n], tokens)),
              ("speed", lambda: check_speed(args.device, dtype, prompts if not args.quick else prompts[:8],
                                            32 if args.quick else 128)),
              ("tensor_parallel", lambda: check_tp(args.device, dtype, prompts[:n], tokens)),
              ("new_targets", lambda: check_new_targets(args.device, args.quick)))
    for name, run in checks:
        t = time.perf_counter()
        try:
            result[name] = run()
        except Exception as e:  # noqa: BLE001 - one failed check must not hide the others
            result[name] = {"error": f"{type(e).__name__}: {e}"}
        result[name]["check_seconds"] = round(time.perf_counter() - t, 1)
        print(name, result[name], flush=True)
        write_result_file(args.out, result)  # what ran so far survives a timeout
    result["total_seconds"] = round(time.perf_counter() - t0, 1)
    result["pass"] = all(_passed(result[name]) for name, _ in checks)
    write_result_file(args.out, result)
    return result


if __name__ == "__main__":
    main()
