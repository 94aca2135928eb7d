"""`dspark eval accept`: offline acceptance evaluation of a drafter (reference §5): accepted length τ
(bonus counted) per dataset and temperature, per-position conditional acceptance and survival,
domain means and the macro average, as JSON plus a markdown table shaped like the DSpark paper's
Table 1 (rows = drafter / temperature, columns = datasets).

    dspark eval accept --speculative-config '{"method": "dspark", "model": "ckpt/dspark"}' \
        --datasets gsm8k,math500,humaneval,mbpp,livecodebench,mt-bench --temperatures 0,1 \
        --num-prompts 50 --max-tokens 256 --out results/accept.json --markdown results/accept.md
    dspark eval table results/dspark.json results/dflash.json --markdown results/table1.md

Protocol: first user turn of each eval row through the chat template (a base model without one, e.g.
gemma-3-270m: the text itself, continued; `--prompt-format`), prompts shuffled with `--seed`
(`dspark.bench.datasets`), per-sample seed = seed + index, every prompt of a (dataset, temperature)
pair submitted as one batch through the `LLM` API. Verification length is fixed at γ (the length
policy is forced to "fixed"), so τ measures the drafter, not the scheduler. Rounds are recorded
exactly through the engine's `spec.verify_observers`; differences from DeepSpec (batch 1, EOS-truncated rounds
counted as accepted + 1) are below the second decimal on these sets.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path

from dspark.bench.datasets import add_prompt_format_argument, resolve_prompt_format
from dspark.speculation.acceptance import AcceptCounts, RoundRecorder, summarize

log = logging.getLogger(__name__)

DEFAULT_DATASETS = ("gsm8k", "math500", "humaneval", "mbpp", "livecodebench", "mt-bench")
DISPLAY_NAMES = {"gsm8k": "GSM8K", "math500": "MATH500", "humaneval": "HumanEval", "mbpp": "MBPP",
                 "livecodebench": "LCB", "mt-bench": "MT-Bench"}
DOMAIN_ORDER = ("math", "code", "chat")


def evaluate_acceptance(llm, prompts_by_dataset: dict, *, temperatures, max_tokens: int,
                        seed: int = 0, num_draft_tokens: int | None = None,
                        prompt_format: str = "chat") -> list[dict]:
    """Run every (dataset, temperature) pair as one batch; returns one result dict per pair.

    `prompts_by_dataset` maps a dataset name to a list of `BenchPrompt` (prompt text + domain);
    `prompt_format` "chat" renders each as a user turn, "plain" submits the text to be continued."""
    from dspark.sampling import SamplingParams

    engine = llm.engine
    recorder = RoundRecorder().attach(engine) if hasattr(engine, "spec") else None
    gamma = num_draft_tokens or getattr(getattr(engine, "drafter", None), "num_draft_tokens", 0)
    results = []
    try:
        for temperature in temperatures:
            for name, prompts in prompts_by_dataset.items():
                params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i)
                          for i in range(len(prompts))]
                start = time.perf_counter()
                if prompt_format == "plain":
                    outputs = llm.generate([p.prompt for p in prompts], params)
                else:
                    outputs = llm.chat([[{"role": "user", "content": p.prompt}] for p in prompts], params)
                wall_s = time.perf_counter() - start
                if recorder is not None:
                    counts = AcceptCounts.from_rounds(recorder.take(o.request_id for o in outputs))
                else:
                    counts = AcceptCounts.from_spec_stats([o.spec for o in outputs],
                                                          num_draft_tokens=gamma)
                num_output = sum(len(o.token_ids) for o in outputs)
                results.append({"dataset": name, "domain": prompts[0].domain if prompts else "unknown",
                                "temperature": float(temperature), "num_prompts": len(prompts),
                                "num_output_tokens": num_output, "wall_s": wall_s,
                                "output_tok_s": num_output / wall_s if wall_s > 0 else 0.0,
                                **counts.to_dict()})
                log.info("%s T=%g: tau %.3f over %d rounds (%d prompts, %.1f s)", name, temperature,
                         counts.acceptance_length, counts.num_rounds, len(prompts), wall_s)
    finally:
        if recorder is not None:
            recorder.detach(engine)
    return results


def summarize_results(results: list[dict]) -> dict[str, dict]:
    """Per temperature: τ by dataset, domain means and macro average (Table 1 convention: means of
    dataset τs), plus `domain_pooled`: every round of a domain pooled, with its per-position
    conditional acceptance and survival (the paper's Figure 2)."""
    out: dict[str, dict] = {}
    for temperature in sorted({r["temperature"] for r in results}):
        rows = [r for r in results if r["temperature"] == temperature]
        taus = {r["dataset"]: r["acceptance_length"] for r in rows}
        pooled: dict[str, AcceptCounts] = {}
        for r in rows:
            counts = _counts(r)
            pooled[r["domain"]] = pooled[r["domain"]] + counts if r["domain"] in pooled else counts
        out[f"T={temperature:g}"] = {
            "acceptance_length": taus, **summarize(taus, {r["dataset"]: r["domain"] for r in rows}),
            "domain_pooled": {d: {k: v for k, v in c.to_dict().items()
                                  if k in ("acceptance_length", "num_rounds", "conditional_acceptance",
                                           "survival")} for d, c in pooled.items()}}
    return out


def _counts(result: dict) -> AcceptCounts:
    return AcceptCounts(
        num_rounds=result["num_rounds"], num_accepted_tokens=result["num_accepted_tokens"],
        num_verified_tokens=result["num_verified_tokens"],
        accepted_per_pos=tuple(result["accepted_per_pos"]),
        verified_per_pos=tuple(result["verified_per_pos"]),
        trials_per_pos=tuple(result["trials_per_pos"]), exact=result["exact"])


def markdown_table(runs: list[dict]) -> str:
    """Table 1 shape: one row per (run label, temperature); columns = datasets (in first-seen order),
    then the domain means and the macro average. `runs` are `dspark eval accept` JSON documents."""
    datasets: list[str] = []
    domains: list[str] = []
    for run in runs:
        for r in run["results"]:
            if r["dataset"] not in datasets:
                datasets.append(r["dataset"])
            if r["domain"] not in domains:
                domains.append(r["domain"])
    domains.sort(key=lambda d: DOMAIN_ORDER.index(d) if d in DOMAIN_ORDER else len(DOMAIN_ORDER))
    header = (["Drafter", "T"] + [DISPLAY_NAMES.get(d, d) for d in datasets]
              + [d.capitalize() for d in domains] + ["Macro"])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for run in runs:
        for key, summary in run["summary"].items():
            taus = summary["acceptance_length"]
            cells = [run.get("label", "?"), key.removeprefix("T=")]
            cells += [_fmt(taus.get(d)) for d in datasets]
            cells += [_fmt(summary["domain_means"].get(d)) for d in domains]
            cells.append(_fmt(summary["macro"]))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _fmt(value) -> str:
    return "–" if value is None else f"{value:.2f}"


# --------------------------------------------------------------------------------------------------
# CLI


def register(sub) -> None:
    from dspark.cli import add_engine_args
    p = sub.add_parser("eval", help="offline drafter evaluation (acceptance length, Table 1)")
    esub = p.add_subparsers(dest="eval_command", required=True)
    acc = esub.add_parser("accept", help="τ and per-position acceptance per dataset and temperature")
    add_engine_args(acc, positional_model=False)
    acc.add_argument("--datasets", default=",".join(DEFAULT_DATASETS),
                     help="comma-separated eval set names or JSONL paths (dspark.bench.datasets)")
    acc.add_argument("--temperatures", default="0,1", help="comma-separated, e.g. 0,1")
    acc.add_argument("--num-prompts", type=int, default=50, help="per dataset (all rows: 0)")
    acc.add_argument("--max-tokens", type=int, default=256)
    add_prompt_format_argument(acc)
    acc.add_argument("--label", default=None, help="row label in the table (default: the method)")
    acc.add_argument("--out", default=None, help="results JSON path")
    acc.add_argument("--markdown", default=None, help="markdown table path")
    acc.set_defaults(func=run_accept)
    tab = esub.add_parser("table", help="merge several `eval accept` JSON files into one table")
    tab.add_argument("results", nargs="+")
    tab.add_argument("--markdown", default=None, help="write here as well as to stdout")
    tab.set_defaults(func=run_table)


def run_accept(args: argparse.Namespace) -> int:
    from dspark.bench.datasets import load_prompts
    from dspark.cli import engine_config_from_args
    from dspark.llm import LLM

    config = engine_config_from_args(args)
    if config.spec is None:
        raise SystemExit("error: dspark eval accept needs --speculative-config")
    if config.spec.length_policy != "fixed":
        log.warning("length_policy %r replaced by 'fixed': τ is measured at a fixed γ",
                    config.spec.length_policy)
        spec = dataclasses.replace(config.spec, length_policy="fixed")
        config = dataclasses.replace(config, spec=spec)
    try:
        temperatures = [float(t) for t in args.temperatures.split(",") if t.strip()]
        datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
        prompts = {d: load_prompts(d, args.num_prompts or None, args.seed) for d in datasets}
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}")
    llm = LLM(config=config)
    prompt_format = resolve_prompt_format(args.prompt_format, llm.tokenizer)
    results = evaluate_acceptance(llm, prompts, temperatures=temperatures, max_tokens=args.max_tokens,
                                  seed=args.seed, prompt_format=prompt_format)
    doc = {"label": args.label or config.spec.method, "model": config.model,
           "speculative_config": dataclasses.asdict(config.spec), "dtype": config.dtype,
           "max_tokens": args.max_tokens, "num_prompts": args.num_prompts, "seed": args.seed,
           "prompt_format": prompt_format,
           "results": results, "summary": summarize_results(results)}
    table = markdown_table([doc])
    print(table)
    _write(args.out, json.dumps(doc, indent=2) + "\n")
    _write(args.markdown, table)
    print(json.dumps({"label": doc["label"], **{k: {"macro": v["macro"], **v["domain_means"]}
                                                 for k, v in doc["summary"].items()}}))
    return 0


def run_table(args: argparse.Namespace) -> int:
    runs = [json.loads(Path(p).read_text()) for p in args.results]
    table = markdown_table(runs)
    sys.stdout.write(table)
    _write(args.markdown, table)
    return 0


def _write(path: str | None, text: str) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
