"""dspark against llama.cpp on the same GGUF file at a published shape (random weights: gguf_shapes.py for dense
Qwen3, gguf_shapes_hf.py for Qwen3.5 and Gemma 4), side by side in one run: llama.cpp's
`llama-bench -t T -p 128,512 -n 128` and dspark's plain batch-1 prompt processing (one request of 128 / 512 random
token ids, max_tokens 1: tokens ÷ time to first token) and decode (128 new tokens after a 16-token prompt, EOS
ignored: tokens after the first ÷ their time), each engine in its own child process, the engines alternating round
by round; medians over rounds, and dspark ÷ llama.cpp. Also dspark's peak resident memory (the child's max RSS:
load included) beside the file's size, the load path it took (`load_path`: gguf, resident as the file's blocks;
`dense_matrix_gb`: matrices held dense), and the decode limit the machine's memory bandwidth sets (bandwidth ÷ the
bytes a token streams: every weight once, but the embeddings read by rows — Gemma 4's per-layer embedding, an
untied token embedding — and a tied one once, as the head: `gguf_shapes_hf.streamed_bytes`). `--prompts` and
`--gen` shrink the token counts for a smoke run.

    python benchmarks/bench_llama_cpp_shapes.py --shape qwen3-1.7b --types Q4_K_M,Q4_1 --rounds 2 \
        --llama-bin /work/llbuild/bin --out benchmarks/results/llama_cpp_shapes_qwen3_1.7b.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CHILD = r"""
import json, resource, sys, time, torch
from dspark import LLM, SamplingParams
path, dtype, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
prompts, gen_n = [int(n) for n in sys.argv[4].split(",")], int(sys.argv[5])
torch.set_num_threads(threads)
t0 = time.perf_counter()
llm = LLM(path, matmul_dtype=dtype, max_model_len=1024, max_num_seqs=1)
load_s = time.perf_counter() - t0
gen = torch.Generator().manual_seed(0)
ids = lambda n: torch.randint(1000, 100000, (n,), generator=gen).tolist()
run = lambda prompt, n: llm.generate([{"prompt_token_ids": prompt}],
                                     SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)[0]
run(ids(16), 4)  # warm-up
from dspark.models.blocks import held_bytes
model = llm.engine.runner.model
dense = {id(w): w for m in model.modules() for w in [getattr(m, "weight", None)] if w is not None and w.dim() == 2}
out = {"load_s": load_s, "load_path": getattr(model, "matmul_dtype", "dense"), "held_gb": held_bytes(model) / 1e9,
       "dense_matrix_gb": sum(w.numel() * w.element_size() for w in dense.values()) / 1e9}
for n in prompts:
    run(ids(n), 1)
    out[f"pp{n}"] = max(n / run(ids(n), 1).ttft_s for _ in range(2))
o = run(ids(16), gen_n)
out[f"tg{gen_n}"] = (len(o.token_ids) - 1) / (o.e2e_s - o.ttft_s)
out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
print("RESULT " + json.dumps(out))
"""


def run_dspark(path: Path, dtype: str, threads: int, prompts: str = "128,512", gen: int = 128) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path), dtype, str(threads), prompts, str(gen)],
                          capture_output=True, text=True, check=True)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def run_llama(bench: Path, path: Path, threads: int, prompts: str = "128,512", gen: int = 128) -> dict:
    proc = subprocess.run([str(bench), "-m", str(path), "-t", str(threads), "-p", prompts, "-n", str(gen), "-r", "2",
                           "-o", "json"], capture_output=True, text=True, check=True)
    out = {}
    for row in json.loads(proc.stdout):
        key = f"pp{row['n_prompt']}" if row["n_prompt"] else f"tg{row['n_gen']}"
        out[key] = row["avg_ts"]
    return out


def main() -> None:
    import torch
    from bench_decode import memory_bandwidth_gbs
    import gguf_shapes
    import gguf_shapes_hf
    from gguf_shapes_hf import make, streamed_bytes
    from dspark.bench.report import run_info, write_result_file
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-1.7b", choices=sorted({*gguf_shapes.SHAPES, *gguf_shapes_hf.SHAPES}))
    ap.add_argument("--types", default="Q4_K_M,Q4_1")
    ap.add_argument("--dtypes", default="auto", help="dspark --matmul-dtype values, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=Path.home() / ".cache/dspark/shapes")
    ap.add_argument("--llama-bin", type=Path, required=True, help="folder of llama-bench and llama-quantize")
    ap.add_argument("--prompts", default="128,512", help="prompt lengths, comma-separated")
    ap.add_argument("--gen", type=int, default=128, help="new tokens of the decode run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    files = make(args.shape, args.types.split(","), args.dir, args.llama_bin / "llama-quantize")
    bandwidth = memory_bandwidth_gbs()
    torch.set_num_threads(args.threads)
    rows = []
    for qtype, path in files.items():
        size_gb, streamed_gb = path.stat().st_size / 1e9, streamed_bytes(path) / 1e9
        runs: dict[str, list[dict]] = {"llama.cpp": [], **{f"dspark {d}": [] for d in args.dtypes.split(",")}}
        for _ in range(args.rounds):
            runs["llama.cpp"].append(run_llama(args.llama_bin / "llama-bench", path, args.threads, args.prompts,
                                               args.gen))
            for d in args.dtypes.split(","):
                runs[f"dspark {d}"].append(run_dspark(path, d, args.threads, args.prompts, args.gen))
        med = {eng: {k: statistics.median(r[k] for r in rs) if isinstance(rs[0][k], float) else rs[0][k]
                     for k in rs[0]} for eng, rs in runs.items()}
        for eng, m in med.items():
            if eng == "llama.cpp":
                continue
            keys = [f"tg{args.gen}", *(f"pp{n}" for n in args.prompts.split(","))]
            row = {"shape": args.shape, "type": qtype, "engine": eng, "file_gb": size_gb, "streamed_gb": streamed_gb,
                   **m, "llama_cpp": med["llama.cpp"], "ratio": {k: m[k] / med["llama.cpp"][k] for k in keys},
                   "decode_limit_tok_s": bandwidth / streamed_gb, "runs": runs[eng], "llama_runs": runs["llama.cpp"]}
            rows.append(row)
            speeds = ", ".join(f"{k} {m[k]:.2f} ({row['ratio'][k]:.2f}x llama.cpp {med['llama.cpp'][k]:.2f})"
                               for k in keys)
            print(f"{args.shape} {qtype} {eng}: {speeds}; decode limit {bandwidth / streamed_gb:.1f} tok/s "
                  f"({streamed_gb:.2f} GB a token); peak RSS {m['peak_rss_gb']:.2f} GB (file {size_gb:.2f} GB); "
                  f"load path {m['load_path']}, {m['dense_matrix_gb']:.2f} GB of dense matrices",
                  flush=True)
    result = {"benchmark": "llama_cpp_shapes", "bandwidth_gbs": bandwidth, "threads": args.threads, "rows": rows,
              **run_info()}
    if args.out:
        write_result_file(args.out, result)


if __name__ == "__main__":
    main()
