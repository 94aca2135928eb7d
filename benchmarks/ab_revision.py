"""The engine at a git revision against the working tree's, side by side in one run: greedy tok/s at batch 1 and
with 8 concurrent requests, plain decoding and the served default (`speculative_config="default"`), on the
embedded default model. Each measurement is a child process importing one tree (a detached `git worktree` of the
revision, made once), the order rotating per round, so a load change on a shared machine hits both; medians
over rounds, and the median over rounds of the ratio working tree ÷ revision (the two runs of a round back to back). Greedy outputs are compared too (a
refactor must not change them).

    python benchmarks/ab_revision.py --base 4db87a4 --rounds 3 --out benchmarks/results/ab_revision_spec_controller.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["Explain how a hash map handles collisions.", "Write a Python function that reverses a linked list.",
           "What is 17 times 23? Show your steps.", "Give three tips for writing clear documentation.",
           "Summarise the plot of a heist film in four sentences.", "How do vaccines train the immune system?",
           "List the steps to make a cup of tea.", "Why is the sky blue?"]
CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(int(sys.argv[4]))
from dspark import LLM, SamplingParams
spec = None if sys.argv[2] == "plain" else "default"
num, new = int(sys.argv[3]), int(sys.argv[5])
prompts = json.loads(sys.argv[6])[:num]
llm = LLM(speculative_config=spec, max_num_seqs=max(num, 1))
params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
t = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
seconds = time.perf_counter() - t
print(json.dumps({"tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / seconds,
                  "outputs": [list(o.outputs[0].token_ids) for o in outs], "file": __import__("dspark").__file__}))
"""


def worktree(rev: str) -> Path:
    path = Path("/tmp") / f"dspark-ab-{rev}"
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], cwd=REPO, check=True,
                       capture_output=True)
    return path


def measure(tree: Path, mode: str, num: int, threads: int, new: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(tree), mode, str(num), str(threads), str(new),
                          json.dumps(PROMPTS)], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["file"].startswith(str(tree)), f"the child imported {result['file']}, not {tree}"
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the git revision to compare with")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--out")
    args = ap.parse_args()
    trees = {"base": worktree(args.base), "head": REPO}
    configs = [(mode, num) for mode in ("plain", "default") for num in (1, 8)]
    runs: dict = {f"{m}_{n}": {"base": [], "head": []} for m, n in configs}
    same: dict = {}
    for r in range(args.rounds):
        for mode, num in configs:
            order = ["base", "head"] if r % 2 == 0 else ["head", "base"]
            outs = {}
            for label in order:
                res = measure(trees[label], mode, num, args.threads, args.new)
                runs[f"{mode}_{num}"][label].append(res["tok_s"])
                outs[label] = res["outputs"]
            same[f"{mode}_{num}"] = same.get(f"{mode}_{num}", True) and outs["base"] == outs["head"]
            print(json.dumps({"round": r, "config": f"{mode}_{num}", **{k: v[-1] for k, v in
                                                                         runs[f"{mode}_{num}"].items()}}),
                  flush=True)
    summary = {key: {"base_tok_s": statistics.median(v["base"]), "head_tok_s": statistics.median(v["head"]),
                     # each round's two runs ran back to back: the median of their ratios is the comparison
                     "head_vs_base": statistics.median(h / b for h, b in zip(v["head"], v["base"])),
                     "same_greedy_outputs": same[key]} for key, v in runs.items()}
    result = {"command": " ".join(["python", "benchmarks/ab_revision.py"] + sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
              "base": args.base, "threads": args.threads, "new_tokens": args.new, "summary": summary, "runs": runs}
    line = json.dumps(result)
    if args.out:
        Path(args.out).write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
