"""lm-evaluation-harness against `dspark serve`, beside transformers' own scoring of the same GGUF.

The harness scores a multiple-choice question by sending context + choice to `/v1/completions` with
`echo: true, logprobs: 1, max_tokens: 0` and summing the choice tokens' logprobs (`local-completions`).
This script serves the default model (speculation on, as `dspark serve` runs it), runs `lm_eval` on the
local task `tests/data/lm_eval_mc.jsonl` (12 questions, 4 choices each), and scores every (question, choice)
again with transformers' `AutoModelForCausalLM` on the same GGUF (fp32): the accuracy of each and the largest
per-choice loglikelihood difference go to one JSON.

lm-eval runs from its own environment (it is not a dspark dependency), e.g.
    python3 -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install "lm-eval[api]==0.4.13"
    python benchmarks/lm_eval_check.py --lm-eval /tmp/lmeval/bin/lm_eval --out benchmarks/results/lm_eval_check.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data" / "lm_eval_mc.jsonl"
MODEL = "SmolLM2-135M-Instruct"
TASK = """task: dspark_mc_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    import httpx
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"dspark serve exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("dspark serve did not become healthy")


def hf_scores(docs: list[dict]) -> list[list[float]]:
    """Per question, each choice's loglikelihood (sum of its tokens' log-softmax given the context) from
    transformers on the same GGUF, tokenized as the harness does (the whole text, split after the context's
    own tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dspark.models.loader import resolve_model_path
    path = resolve_model_path(MODEL)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    out = []
    for doc in docs:
        context = f"Question: {doc['question']}\nAnswer:"
        row = []
        for choice in doc["choices"]:
            ctx = tok(context, add_special_tokens=False).input_ids
            cont = tok(context + " " + choice, add_special_tokens=False).input_ids[len(ctx):]
            ids = torch.tensor([ctx + cont])
            with torch.no_grad():
                lp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)  # [len, vocab]
            row.append(sum(lp[len(ctx) - 1 + j, t].item() for j, t in enumerate(cont)))
        out.append(row)
    return out


def save_tokenizer(folder: Path) -> None:
    """The served model's tokenizer as a transformers folder (the harness tokenizes on its side)."""
    from transformers import AutoTokenizer

    from dspark.models.loader import resolve_model_path
    path = resolve_model_path(MODEL)
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(folder))


def run_lm_eval(lm_eval: str, base_url: str, work: Path, batch_size: int) -> tuple[float, list[list[float]]]:
    task_dir = work / "tasks"
    task_dir.mkdir()
    (task_dir / "dspark_mc_local.yaml").write_text(TASK.format(data=DATA))
    save_tokenizer(work / "tokenizer")
    out_dir = work / "out"
    cmd = [lm_eval, "run", "--model", "local-completions", "--tasks", "dspark_mc_local", "--include_path",
           str(task_dir), "--model_args",
           f"model={MODEL},base_url={base_url}/v1/completions,num_concurrent=1,max_retries=1,"
           f"tokenized_requests=True,tokenizer_backend=huggingface,tokenizer={work / 'tokenizer'}",
           "--batch_size", str(batch_size), "--output_path", str(out_dir), "--log_samples"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"lm_eval failed:\n{proc.stderr[-4000:]}")
    results = json.loads(next(out_dir.rglob("results_*.json")).read_text())
    acc = results["results"]["dspark_mc_local"]["acc,none"]
    samples = [json.loads(line) for line in next(out_dir.rglob("samples_dspark_mc_local_*.jsonl")).read_text().splitlines()]
    samples.sort(key=lambda s: s["doc_id"])
    scores = [[float(r[0][0]) for r in s["resps"]] for s in samples]
    return acc, scores


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--lm-eval", required=True, help="the lm_eval executable (its own environment)")
    p.add_argument("--out", default="benchmarks/results/lm_eval_check.json")
    p.add_argument("--batch-size", type=int, default=4, help="prompts per request (the harness batches them)")
    p.add_argument("--serve-args", default="--matmul-dtype float32",
                   help="extra `dspark serve` flags (default: fp32 products, as transformers computes)")
    args = p.parse_args(argv)
    from dspark.bench.report import run_info, write_result_file
    docs = [json.loads(line) for line in DATA.read_text().splitlines()]
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "dspark", "serve", "--port", str(port), *args.serve_args.split()],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_healthy(url, server)
        with tempfile.TemporaryDirectory() as tmp:
            acc, served = run_lm_eval(args.lm_eval, url, Path(tmp), args.batch_size)
    finally:
        server.terminate()
        server.wait(30)
    reference = hf_scores(docs)
    hf_correct = sum(max(range(len(r)), key=r.__getitem__) == d["answer"] for r, d in zip(reference, docs))
    diff = max(abs(a - b) for ra, rb in zip(served, reference) for a, b in zip(ra, rb))
    result = {**run_info(argv), "serve_args": args.serve_args, "batch_size": args.batch_size,
              "questions": len(docs), "lm_eval_accuracy": acc,
              "transformers_accuracy": hf_correct / len(docs), "max_abs_loglikelihood_diff": diff,
              "served_loglikelihoods": served, "transformers_loglikelihoods": reference,
              "same_choices": [max(range(len(a)), key=a.__getitem__) == max(range(len(b)), key=b.__getitem__)
                               for a, b in zip(served, reference)]}
    write_result_file(args.out, result)
    print(json.dumps({k: result[k] for k in ("lm_eval_accuracy", "transformers_accuracy",
                                             "max_abs_loglikelihood_diff")}))
    return result


if __name__ == "__main__":
    main()
