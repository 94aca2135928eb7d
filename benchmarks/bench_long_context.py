"""Speculation against context length, on held-out long prompts: a question from train/'s held-out rows (never
trained on) placed after a stretch of other held-out rows (documents, code, conversations stitched together) to
reach about 512, 1k, 2k, 4k and 8k tokens of the default model's context.

`--measure acceptance` (greedy): tokens per verification step and per-position acceptance of DSpark alone (the
shipped drafter, γ = 7, fixed length, no prompt lookup), with `--draft-windows` (`draft_context_window`: the
drafter's attention over the target's features limited to the last W positions; 0: the whole context; auto: the
640 positions it was trained on) side by side, and of prompt lookup.
`--measure speed` (greedy, batch 1): output tokens a second of plain decoding, the served default and DSpark alone
at each length, the three alternating on each prompt (round-robin), the decode rate measured after the prompt (time
to the last token minus time to the first).

    python benchmarks/bench_long_context.py --measure acceptance --lengths 512,1024,2048,4096,8000 --prompts 3 \
        --max-tokens 64 --draft-windows 0,auto --out benchmarks/results/long_context_acceptance.json \
        --plot docs/img/long_context_acceptance.png
    python benchmarks/bench_long_context.py --measure speed --lengths 512,2048,4096,8000 --prompts 2 \
        --max-tokens 64 --out benchmarks/results/long_context_speed.json --plot docs/img/long_context_speed.png
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TRAIN = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "train"


def held_out_rows() -> list[dict]:
    from dspark.train.data import is_holdout
    from dspark.train.prepare_data import prompt_rows
    return [row for key, row in prompt_rows(str(TRAIN)) if is_holdout(key, 0.05)]


def long_prompts(tokenizer, lengths: list[int], num: int) -> dict[int, list[list[int]]]:
    """num prompts per length: held-out rows as notes until the chat prompt reaches the length, then a held-out
    question (its own row, not among the notes)."""
    rows = held_out_rows()
    questions, notes = rows[:num], [r["turns"][0] for r in rows[num:]]

    def ids(text: str) -> list[int]:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    out = {}
    for length in lengths:
        out[length] = []
        for i, q in enumerate(questions):
            parts, k = [], i * 7  # a different stretch of notes per question
            question = "Answer the question after these notes.\n\nQuestion: " + q["turns"][0]
            while len(ids("\n\n".join(parts + [question]))) < length and k < i * 7 + len(notes):
                parts.append("Note: " + notes[k % len(notes)])
                k += 1
            text = "\n\n".join(parts + [question])
            out[length].append(ids(text)[-length:] if len(ids(text)) > length + 64 else ids(text))
    return out


def acceptance(args, prompts: dict[int, list[list[int]]]) -> dict:
    from dspark.config import DEFAULT_MODEL, SpecConfig
    from dspark.drafters.shipped import DEFAULT_NUM_SPECULATIVE_TOKENS, drafter_dir
    from dspark.llm import LLM
    from dspark.sampling import SamplingParams

    variants = {f"dspark_w{w}": SpecConfig(method="dspark", model=str(drafter_dir(DEFAULT_MODEL, "dspark")),
                                           num_speculative_tokens=DEFAULT_NUM_SPECULATIVE_TOKENS,
                                           draft_context_window=w)
                for w in (x if x == "auto" else int(x) for x in args.draft_windows.split(","))}
    variants["ngram"] = SpecConfig(method="ngram", num_speculative_tokens=DEFAULT_NUM_SPECULATIVE_TOKENS)
    rows = []
    for name, spec in variants.items():
        llm = LLM(speculative_config=spec, max_num_seqs=1, max_model_len=8192)
        m = llm.engine.metrics
        for length, group in prompts.items():
            steps0, acc0, per0 = m.num_drafts, m.num_accepted_tokens, list(m.accepted_per_pos)
            for ids in group:
                llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True),
                             use_tqdm=False)
            steps, acc = m.num_drafts - steps0, m.num_accepted_tokens - acc0
            per = [a - (per0[i] if i < len(per0) else 0) for i, a in enumerate(m.accepted_per_pos)]
            rows.append({"variant": name, "context": length, "prompt_tokens": statistics.mean(len(p) for p in group),
                         "verify_steps": steps, "tokens_per_step": (steps + acc) / steps if steps else None,
                         "acceptance_per_position": [a / steps for a in per] if steps else []})
            print(json.dumps(rows[-1]), flush=True)
    return {"rows": rows}


def speed(args, prompts: dict[int, list[list[int]]]) -> dict:
    from dspark.config import DEFAULT_MODEL, SpecConfig
    from dspark.drafters.shipped import DEFAULT_NUM_SPECULATIVE_TOKENS, drafter_dir
    from dspark.llm import LLM
    from dspark.sampling import SamplingParams

    variants = {"plain": None, "default": "default",  # the served default for the engine's matmul dtype
                "dspark": SpecConfig(method="dspark", model=str(drafter_dir(DEFAULT_MODEL, "dspark")),
                                     num_speculative_tokens=DEFAULT_NUM_SPECULATIVE_TOKENS)}
    llms = {name: LLM(speculative_config=spec, max_num_seqs=1, max_model_len=8192) for name, spec in variants.items()}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for length, group in prompts.items():
        for i, ids in enumerate(group):
            order = list(llms) if i % 2 == 0 else list(llms)[::-1]
            for name in order:
                llm = llms[name]
                first = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
                t0 = time.perf_counter()
                llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
                t_first = time.perf_counter() - t0  # the prompt from the prefix cache: about one step
                t0 = time.perf_counter()
                out = llm.generate([ids], params, use_tqdm=False)
                total = time.perf_counter() - t0
                n = len(out[0].outputs[0].token_ids)
                rows.append({"variant": name, "context": length, "prompt_tokens": len(ids),
                             "decode_tok_s": (n - 1) / max(total - t_first, 1e-9), "first_token_s": t_first})
                del first
                print(json.dumps(rows[-1]), flush=True)
    summary = {}
    for length in prompts:
        rate = {name: statistics.median(r["decode_tok_s"] for r in rows if r["variant"] == name and r["context"] == length)
                for name in llms}
        summary[str(length)] = {**{f"{k}_tok_s": v for k, v in rate.items()},
                                **{f"{k}_over_plain": rate[k] / rate["plain"] for k in llms if k != "plain"}}
    return {"rows": rows, "summary": summary}


def plot(result: dict, measure: str, path: str) -> None:
    """Tokens per verification step (acceptance) or decode speed over plain (speed) against context length, a line
    per variant."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.6))
    if measure == "acceptance":
        for name in dict.fromkeys(r["variant"] for r in result["rows"]):
            rows = [r for r in result["rows"] if r["variant"] == name]
            label = {"dspark_w0": "DSpark, whole context", "dspark_wauto": "DSpark, window = trained length (auto)",
                     "ngram": "prompt lookup (steps with drafts)"}.get(name, name)
            ax.plot([r["context"] for r in rows], [r["tokens_per_step"] for r in rows], marker="o", label=label)
        ax.set_ylabel("tokens per verification step")
    else:
        lengths = [int(k) for k in result["summary"]]
        for key in ("default_over_plain", "dspark_over_plain"):
            ax.plot(lengths, [result["summary"][str(n)][key] for n in lengths], marker="o", label=key)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_ylabel("decode tok/s ÷ plain")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.legend(fontsize=8)
    ax.set_title(f"SmolLM2-135M-Instruct, greedy, batch 1 ({measure})", fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--measure", choices=("acceptance", "speed"), required=True)
    p.add_argument("--lengths", default="512,1024,2048,4096,8000")
    p.add_argument("--prompts", type=int, default=3, help="questions per length")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--draft-windows", default="0,auto",
                   help="acceptance: drafter context windows to compare (0: all; auto: its trained length)")
    p.add_argument("--out", required=True)
    p.add_argument("--plot", default=None, help="also draw the curves into this PNG")
    p.add_argument("--plot-only", action="store_true", help="draw --plot from an existing --out file")
    args = p.parse_args(argv)
    if args.plot_only:
        plot(json.loads(Path(args.out).read_text()), args.measure, args.plot)
        return 0

    import torch
    from dspark.llm import LLM
    tok = LLM(speculative_config=None, max_num_seqs=1).get_tokenizer()
    prompts = long_prompts(tok, [int(x) for x in args.lengths.split(",")], args.prompts)
    result = acceptance(args, prompts) if args.measure == "acceptance" else speed(args, prompts)
    result = {"command": " ".join(["benchmarks/bench_long_context.py", *(argv or sys.argv[1:])]),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{platform.platform()}, {platform.machine()}, torch {torch.__version__}", **result}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.measure, args.plot)
    print(json.dumps(result.get("summary", {})))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
