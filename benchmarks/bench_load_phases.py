"""Where a step's time goes under load: the offline engine at a fixed concurrency, several speculative
configs side by side, with the engine's phases timed.

    python benchmarks/bench_load_phases.py --concurrency 16 --dataset gsm8k --num-prompts 96 \
        --repeats 2 --variants plain,default --out benchmarks/results/load_phases_c16.json

A closed loop like `dspark bench serve`'s clients, without HTTP: `--concurrency` requests in flight,
each finished one replaced by the next prompt at once, so with many prompts per slot the run
approaches a steady state (with one prompt per slot it is a burst and the slowest request sets the
time). Every variant gets the same fresh prompts in a repeat (each repeat takes the next slice of the
dataset, so no run is served from another's prefix cache) and the variants take turns within a
repeat, the first turn rotating from repeat to repeat (the VM's speed drifts within a minute).
Greedy, `--max-tokens` new tokens (EOS ignored unless `--natural-stop`), so every variant emits the
same tokens.

Per run: output tok/s, engine steps, draft tokens verified / accepted, the target forward's seconds
(`ModelRunner.forward`) and every other engine phase (`Engine._run_target` with its verification, the
SpecController's drafter context extension and proposal with length choice, the lookup and the model drafter
inside it): per-token latency = step
time ÷ tokens per step, both terms measured. Medians over repeats, and each variant ÷ the first.

`--coalesce-steps` sets the scheduler's prompt-coalescing bound for every variant (0: off).

Variants: plain (no speculation), default (the shipped config: DSpark + lookup first + prefix
scheduler), dspark (DSpark alone, prefix), dspark-nogate (DSpark alone without the draft gate: the model drafts
every step), dspark-bf16 (DSpark alone with bf16 drafter products, op by op), fp32-draft (default with fp32 drafter products), q4-draft (default
with the drafter's backbone and head quantized to Q4_1 blocks, `draft_matmul_dtype` "q4_1"), topk16 (default with
top-K Markov drafting, K 16), q4-topk16 (both), nogate
(default without the draft gate), nocache (default without the lookup's cross-request cache), nocorpus (default
without the lookup corpus), corpus (default with the lookup corpus file `--corpus`), noswitch (default without the measured
switch, dspark.speculation.switch), upkeep (default with online upkeep of
the cost table and calibration from live steps); each as NAME-fp32 with fp32 matrix
products instead of the default (auto: bf16 or q4_1 where the CPU kernels support it; the shipped cost table of the
variant's dtype). The
warm-up slice is served first, so the cross-request cache starts with its answers, as a server's
would with earlier traffic; the timed prompts are never in it.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import statistics
import time
from pathlib import Path

from dspark.bench.report import run_info, write_result_file

DRAFTER = "dspark/assets/drafters/dspark-smollm2-135m"
CORPUS = "dspark/assets/drafters/lookup-smollm2-135m/corpus.safetensors"
DEFAULT = {"method": "dspark", "model": DRAFTER, "num_speculative_tokens": 7, "length_policy": "prefix",
           "cost_table": f"{DRAFTER}/cost_table.json", "ngram_first": True, "lookup_corpus": CORPUS}
VARIANTS = {
    "plain": None,
    "default": DEFAULT,
    "dspark": {**DEFAULT, "ngram_first": False, "lookup_corpus": None},
    "dspark-nogate": {**DEFAULT, "ngram_first": False, "lookup_corpus": None, "draft_gate": False},
    "dspark-bf16": {**DEFAULT, "ngram_first": False, "lookup_corpus": None, "draft_matmul_dtype": "bfloat16"},
    "fp32-draft": {**DEFAULT, "draft_matmul_dtype": "float32"},
    "q4-draft": {**DEFAULT, "draft_matmul_dtype": "q4_1"},
    "nogate": {**DEFAULT, "draft_gate": False},
    "noswitch": {**DEFAULT, "measured_switch": False},
    "nocache": {**DEFAULT, "lookup_cache_entries": 0},
    "nocorpus": {**DEFAULT, "lookup_corpus": None},
    "upkeep": {**DEFAULT, "online_upkeep": True},
    "topk0": {**DEFAULT, "draft_topk": 0},  # the full Markov head
    "topk16": {**DEFAULT, "draft_topk": 16},
    "q4-topk16": {**DEFAULT, "draft_matmul_dtype": "q4_1", "draft_topk": 16},
    "profiled": DEFAULT,  # with --cost-table
    "drafter": DEFAULT,  # with --drafter: the default with another DSpark drafter folder (its own cost tables)
    "corpus": DEFAULT,  # with --corpus: the default with another lookup corpus file
}


def variant_matmul_dtype(name: str) -> str:
    """NAME-fp32: the variant with fp32 matrix products; otherwise the engine's default (auto)."""
    from dspark.engine.build import resolve_matmul_dtype
    from dspark.models.loader import DEFAULT_MODEL
    return resolve_matmul_dtype("float32" if name.endswith("-fp32") else "auto", model=DEFAULT_MODEL)


def variant_spec(name: str, cost_table: str | None = None, drafter: str | None = None,
                 corpus: str | None = None) -> dict | None:
    """The variant's speculative config, its cost table the shipped one of its matmul dtype ("profiled": the
    default with `cost_table`, e.g. one `dspark profile` wrote on this machine; "drafter": the default with
    the DSpark drafter folder `drafter` and that folder's cost table; "corpus": the default with the lookup
    corpus file `corpus`)."""
    from dspark.drafters.shipped import shipped_cost_table
    if name.removesuffix("-fp32") == "profiled":
        return {**DEFAULT, "cost_table": cost_table}
    if name.removesuffix("-fp32") == "drafter":
        table = shipped_cost_table(Path(drafter), variant_matmul_dtype(name))
        return {**DEFAULT, "model": drafter, "cost_table": str(table)}
    if name.removesuffix("-fp32") == "corpus":
        return {**variant_spec("default"), "lookup_corpus": corpus}
    spec = VARIANTS[name.removesuffix("-fp32")]
    if spec is None or "cost_table" not in spec:
        return spec
    return {**spec, "cost_table": str(shipped_cost_table(Path(DRAFTER), variant_matmul_dtype(name)))}


# (object attribute, method) timed on each engine: "runner" / "scheduler" / "drafter" / "engine" / "spec" (its SpecController)
PHASES = [("engine", "_run_target"), ("spec", "_extend_context"), ("spec", "_propose_and_choose"),
          ("runner", "forward"), ("runner", "prepare"), ("scheduler", "schedule"), ("scheduler", "commit"),
          ("model_drafter", "propose"), ("lookup", "lookup_with_length")]


def _targets(engine) -> dict:
    drafter = engine.drafter
    return {"engine": engine, "spec": engine.spec, "runner": engine.runner, "scheduler": engine.scheduler,
            "model_drafter": getattr(drafter, "model_drafter", drafter),
            "lookup": getattr(drafter, "lookup", None)}


def run_once(llm, prompts: list[list[int]], params, concurrency: int) -> dict:
    """One closed-loop run; returns its figures (phase seconds under their method names)."""
    engine = llm.engine
    seconds: dict[str, float] = collections.defaultdict(float)
    patched = []
    owners = _targets(engine)
    for owner_name, method in PHASES:
        owner = owners.get(owner_name)
        if owner is None or not hasattr(owner, method):
            continue
        original = getattr(owner, method)

        def timed(*args, _f=original, _key=method, **kwargs):
            start = time.perf_counter()
            try:
                return _f(*args, **kwargs)
            finally:
                seconds[_key] += time.perf_counter() - start

        setattr(owner, method, timed)
        patched.append((owner, method))
    # the target forward split by steps with a prompt chunk and decode/verify-only steps
    schedule, forward = engine.scheduler.schedule, engine.runner.forward
    last = {"prompt": False}

    def schedule_noting_prompts(*args, **kwargs):
        out = schedule(*args, **kwargs)
        last["prompt"] = any(s.start_pos < len(s.request.prompt_ids) for s in out.scheduled)
        return out

    def forward_by_kind(*args, **kwargs):
        start = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            kind = "prompt" if last["prompt"] else "decode"
            seconds[f"forward_{kind}_steps"] += time.perf_counter() - start
            seconds[f"num_{kind}_steps"] += 1
    engine.scheduler.schedule, engine.runner.forward = schedule_noting_prompts, forward_by_kind  # (both in
    # PHASES: the cleanup's delattr drops these wrappers with the timers)
    m = engine.metrics
    before = (m.num_steps, m.num_draft_tokens, m.num_accepted_tokens)
    queue, in_flight, tokens = list(prompts), 0, 0
    start = time.perf_counter()
    try:
        while queue or engine.has_unfinished():
            while queue and in_flight < concurrency:
                engine.add_request(queue.pop(0), params)
                in_flight += 1
            for out in engine.step():
                tokens += len(out.new_token_ids)
                in_flight -= out.finished
    finally:
        for owner, method in patched:
            delattr(owner, method)  # back to the class's method
    wall = time.perf_counter() - start
    steps, drafts, accepted = (m.num_steps - before[0], m.num_draft_tokens - before[1],
                               m.num_accepted_tokens - before[2])
    return {"output_tok_s": tokens / wall, "wall_s": wall, "output_tokens": tokens, "steps": steps,
            "tokens_per_step": tokens / max(steps, 1), "step_ms": 1000 * wall / max(steps, 1),
            "draft_tokens": drafts, "accepted_tokens": accepted,
            "non_forward_s": wall - seconds.get("forward", 0.0),
            "phase_s": {k: round(v, 4) for k, v in seconds.items()}}


def main(argv: list[str] | None = None) -> dict:
    from dspark.bench.offline import chat_prompt_ids
    from dspark.llm import LLM
    from dspark.sampling import SamplingParams

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--dataset", default="gsm8k")
    p.add_argument("--num-prompts", type=int, default=96, help="prompts per run (per repeat)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--variants", default="plain,default", help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--natural-stop", action="store_true",
                   help="stop at EOS (greedy: still the same tokens for every variant) instead of always "
                        "--max-tokens; with fixed lengths plain decoding finishes its requests in lockstep "
                        "and batches their replacement prompts, which speculation's staggered finishes "
                        "cannot")
    p.add_argument("--coalesce-steps", type=int, default=None,
                   help="scheduler coalescing bound for every variant (default: the engine's)")
    p.add_argument("--cost-table", default=None, help="the variant 'profiled' runs the default with this cost table")
    p.add_argument("--drafter", default=None, help="the variant 'drafter' runs the default with this DSpark "
                                                   "drafter folder (and its cost table)")
    p.add_argument("--corpus", default=None, help="the variant 'corpus' runs the default with this lookup corpus file")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v.removesuffix("-fp32") not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; known: {', '.join(VARIANTS)} (each also as NAME-fp32)")
    if any(v.removesuffix("-fp32") == "profiled" for v in names) and not args.cost_table:
        p.error("--variants profiled needs --cost-table")
    if any(v.removesuffix("-fp32") == "drafter" for v in names) and not args.drafter:
        p.error("--variants drafter needs --drafter")
    if any(v.removesuffix("-fp32") == "corpus" for v in names) and not args.corpus:
        p.error("--variants corpus needs --corpus")

    llms = {v: LLM(speculative_config=variant_spec(v, args.cost_table, args.drafter, args.corpus), matmul_dtype=variant_matmul_dtype(v),
                   max_num_seqs=max(64, args.concurrency)) for v in names}
    if args.coalesce_steps is not None:
        for llm in llms.values():
            sched = llm.engine.scheduler
            sched.config = dataclasses.replace(sched.config, coalesce_steps=args.coalesce_steps)
    tokenizer = llms[names[0]].tokenizer
    n = args.num_prompts
    prompts = chat_prompt_ids(tokenizer, args.dataset, n * (args.repeats + 1), seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=not args.natural_stop)
    for v in names:  # warm-up on a slice no timed run uses
        run_once(llms[v], prompts[:n], params, args.concurrency)
    runs: dict[str, list[dict]] = {v: [] for v in names}
    for r in range(args.repeats):
        chunk = prompts[n * (r + 1):n * (r + 2)]
        for v in names[r % len(names):] + names[:r % len(names)]:  # turns rotate: no variant always first
            out = run_once(llms[v], chunk, params, args.concurrency)
            runs[v].append(out)
            print(f"[{v}] repeat {r}: {out['output_tok_s']:.1f} tok/s, {out['steps']} steps, "
                  f"{out['step_ms']:.1f} ms/step, forward {out['phase_s'].get('forward', 0):.2f} s, "
                  f"other {out['non_forward_s']:.2f} s, drafts {out['draft_tokens']} "
                  f"(accepted {out['accepted_tokens']})", flush=True)
    medians = {v: {k: statistics.median(o[k] for o in runs[v])
                   for k in ("output_tok_s", "steps", "step_ms", "tokens_per_step", "non_forward_s")}
               for v in names}
    base = medians[names[0]]["output_tok_s"]
    for v in names:
        medians[v]["tok_s_ratio_vs_" + names[0]] = medians[v]["output_tok_s"] / base
    result = {"bench": "load_phases", "summary": {"median": medians}, "config": vars(args),
              "variants": {v: {"speculative_config": variant_spec(v, args.cost_table, args.drafter, args.corpus), "matmul_dtype": variant_matmul_dtype(v)}
                 for v in names},
              "runs": runs, **run_info(None if argv is None else ["benchmarks/bench_load_phases.py", *argv])}
    for v in names:
        print(f"{v}: median {medians[v]['output_tok_s']:.1f} tok/s "
              f"({medians[v]['tok_s_ratio_vs_' + names[0]]:.3f}x {names[0]})")
    if args.out:
        write_result_file(args.out, result)
    return result


if __name__ == "__main__":
    main()
