"""Batch-1 greedy decode on gemma-3-270m (Q4_K_M GGUF), side by side in one run, alternating: dspark plain and
with each drafter chosen (default: n-gram prompt lookup; also a layer-truncated draft model of the target, and
that with prompt lookup first; `plain_layer_modules`: plain with the one-call decoder stack off), plus llama.cpp
on the same GGUF, plain and with its prompt-lookup decoding, when llama-cpp-python is installed (PEERS=1
scripts/setup.sh). Every engine is loaded once, then each prompt goes to
each engine in turn (the order rotating per prompt), so a load change on a shared machine hits all of them.
Prompts: gsm8k questions as plain text (a base model continues them), NEW tokens each, EOS ignored.

Reports decode tok/s (first token excluded), medians over prompts, ratios to the first dspark label and to
llama.cpp plain, and whether each greedy output equals dspark plain's. The last stdout line is one JSON object;
`--out` writes it too.

    python benchmarks/bench_gemma_decode.py --num-prompts 3 --new 48 --threads 2 --out benchmarks/results/gemma_decode_batch1.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

NAME = "gemma-3-270m"
DRAFTER = str(Path(__file__).resolve().parent.parent / "dspark" / "assets" / "drafters" / "dspark-gemma-3-270m")
SPECS = {  # label -> speculative_config (None: plain)
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "draft_model_6": {"method": "draft_model", "draft_num_layers": 6, "num_speculative_tokens": 3},
    "draft_model_6_ngram_first": {"method": "draft_model", "draft_num_layers": 6, "num_speculative_tokens": 3,
                                  "ngram_first": True},
    # the shipped DSpark drafter (dspark/assets/drafters/dspark-gemma-3-270m): alone, and as `dspark serve` runs it
    "dspark": {"method": "dspark", "model": DRAFTER, "num_speculative_tokens": 7},
    "dspark_ngram_first": {"method": "dspark", "model": DRAFTER,
                           "num_speculative_tokens": 7, "ngram_first": True},
    # plain, with the one-call decoder stack (kernels.block_layers) off: the per-layer modules, the same numbers
    "plain_layer_modules": None,
}
STACK_OFF = {"plain_layer_modules"}


class DsparkRunner:
    def __init__(self, spec: dict | None, matmul_dtype: str, warm_ids: list[int], *, stack: bool = True) -> None:
        from dspark import LLM, SamplingParams
        self.params = SamplingParams
        self.llm = LLM(NAME, max_num_seqs=1, matmul_dtype=matmul_dtype, speculative_config=spec)
        if not stack:
            self.llm.engine.runner.model._block_stack_list = False  # the per-layer modules run every step
        self.llm.generate([warm_ids], SamplingParams(temperature=0, max_tokens=8))  # warm-up

    def __call__(self, ids: list[int], new: int) -> tuple[float, list[int]]:
        out = self.llm.generate([ids], self.params(temperature=0, max_tokens=new, ignore_eos=True))[0]
        return (len(out.token_ids) - 1) / (out.e2e_s - out.ttft_s), list(out.token_ids)

    def tau(self) -> float | None:
        m = self.llm.engine.metrics
        return 1 + m.num_accepted_tokens / m.num_drafts if m.num_drafts else None


class LlamaCppRunner:
    def __init__(self, path: Path, lookup: int, warm_ids: list[int]) -> None:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup) if lookup else None
        # llama.cpp's defaults, runtime weight repacking included (it works on this GGUF; the Q4_1 crash that
        # dspark.bench.peers avoids is the default model's)
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=2048, n_threads=torch.get_num_threads(),
                                   verbose=False, draft_model=draft)
        self(warm_ids, 8)

    def __call__(self, ids: list[int], new: int) -> tuple[float, list[int]]:
        tokens, t_first = [], None
        for token in self.llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, reset=True):
            tokens.append(int(token))
            t_first = t_first or time.perf_counter()
            if len(tokens) >= new:
                break
        return (len(tokens) - 1) / (time.perf_counter() - t_first), tokens

    def tau(self) -> None:
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--matmul-dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--only", default="plain,ngram", help="comma list of labels of SPECS (the first is the base)")
    ap.add_argument("--lookup", type=int, default=4, help="llama.cpp prompt-lookup tokens (0: plain llama.cpp only)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from dspark.bench.datasets import load_prompts
    from dspark.bench.report import run_info, write_result_file
    from dspark.engine.build import resolve_matmul_dtype
    from dspark.models.loader import resolve_model_path
    from dspark.models.tokenizer import load_tokenizer
    path = resolve_model_path(NAME)
    tok = load_tokenizer(path)
    prompt_ids = [tok.encode(p.prompt) for p in load_prompts("gsm8k", num_prompts=args.num_prompts, seed=0)]
    labels = args.only.split(",")
    runners: dict = {label: DsparkRunner(SPECS[label], args.matmul_dtype, prompt_ids[0], stack=label not in STACK_OFF)
                     for label in labels}
    try:
        import llama_cpp  # noqa: F401
        peer = "llama-cpp-python " + llama_cpp.__version__ + " (defaults: weight repacking on)"
        runners["llama_cpp"] = LlamaCppRunner(path, 0, prompt_ids[0])
        if args.lookup:
            runners[f"llama_cpp_prompt_lookup_k{args.lookup}"] = LlamaCppRunner(path, args.lookup, prompt_ids[0])
    except ImportError:
        peer = "llama-cpp-python not installed: no peer row"
    rates: dict[str, list[float]] = {k: [] for k in runners}
    tokens: dict[str, list[list[int]]] = {k: [] for k in runners}
    names = list(runners)
    for i, ids in enumerate(prompt_ids):
        for name in names[i % len(names):] + names[:i % len(names)]:
            rate, out = runners[name](ids, args.new)
            rates[name].append(rate)
            tokens[name].append(out)
            print(f"prompt {i} {name}: {rate:.2f} tok/s", flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    result = {
        "benchmark": "gemma_decode_batch1", "model": NAME, "gguf": path.name, "new_tokens": args.new,
        "matmul_dtype": args.matmul_dtype, "matmul_dtype_resolved": resolve_matmul_dtype(args.matmul_dtype, model=NAME),
        "threads": torch.get_num_threads(), "llama_cpp": peer,
        "runs": {k: {"tok_s": rates[k], "median_tok_s": med[k], "tau": runners[k].tau()} for k in runners},
        "vs_first": {k: v / med[labels[0]] for k, v in med.items()},
        "vs_llama_cpp": {k: v / med["llama_cpp"] for k, v in med.items()} if "llama_cpp" in med else None,
        "greedy_equal_to_first": {k: tokens[k] == tokens[labels[0]] for k in runners},
        **run_info(),  # command, date, machine (benchmarks/make_board.py reads them)
    }
    if args.out:
        write_result_file(args.out, result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
