"""The serving cost of the tool-call and reasoning parsers: `dspark serve` (the default model and drafter)
with `--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3` against the same server
without them, on the same chat requests carrying one tool (`tool_choice` "auto" where parsed; "none" where
not, with the tool handed to the template through `chat_template_kwargs`, so the prompts are the same
tokens), streamed, at 1 and 8 concurrent requests. Both servers stay up; the
variants alternate within each round (order flipped every round) and the tables quote medians and ratios.
End to end the difference sits inside this VM's run-to-run noise, so the parsers' own work is also timed
alone: a 1,000-character answer (thoughts, text, one call) streamed through both parsers in 6-character
deltas, as microseconds per delta, beside the served step time per delta.

    python benchmarks/bench_parsers.py --rounds 3 --out benchmarks/results/parsers_overhead.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}, "required": ["city"]}}}]
PARSERS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]


ANSWER = ("<think>" + "The user asks for the weather; I should call the tool with the city. " * 5 + "</think>\n\n"
          + "Let me look that up for you. " * 10
          + '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


def parser_cost_us(reps: int = 300, delta_chars: int = 6) -> dict:
    """Microseconds per streamed delta of the reasoning and tool parsers together (the work `--reasoning-parser
    qwen3 --tool-call-parser hermes` add to each chunk), the median over `reps` whole answers."""
    from dspark.chat.reasoning import Phase, get_reasoning_format
    from dspark.chat.tool_parsers import get_tool_parser
    fmt, tools = get_reasoning_format("qwen3"), get_tool_parser("hermes")
    deltas = [ANSWER[i:i + delta_chars] for i in range(0, len(ANSWER), delta_chars)]
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        thoughts, calls = fmt.stream(Phase.OPEN), tools.stream()
        for d in deltas:
            calls.feed(thoughts.feed(d)[1])
        calls.feed(thoughts.finish()[1])
        calls.finish()
        times.append((time.perf_counter() - t) / len(deltas) * 1e6)
    assert calls.has_calls
    return {"answer_chars": len(ANSWER), "deltas": len(deltas), "us_per_delta": statistics.median(times)}


def main(argv: list[str] | None = None) -> dict:
    from dspark.bench.cli import run_bench
    from dspark.bench.client import BenchConfig
    from dspark.bench.report import run_info, write_result_file
    from dspark.bench.server_proc import ServerProcess

    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dataset", default="gsm8k")
    p.add_argument("--out", default="benchmarks/results/parsers_overhead.json")
    args = p.parse_args(argv)
    serve = [sys.executable, "-m", "dspark", "serve", "--port", "{port}", "--disable-log-stats"]
    variants = {"off": (serve, "none"), "on": (serve + PARSERS, "auto")}
    loads = {1: 8, 8: 24}  # concurrency -> measured requests
    runs: dict[str, dict[int, list[float]]] = {v: {c: [] for c in loads} for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        servers = {v: ServerProcess(argv_, log_path=Path(tmp) / f"{v}.log") for v, (argv_, _) in variants.items()}
        for s in servers.values():
            s.start()
        try:
            for r in range(args.rounds):
                order = list(variants) if r % 2 == 0 else list(reversed(variants))
                for v in order:
                    for conc, num in loads.items():
                        extra = json.dumps({"tools": TOOLS, "tool_choice": variants[v][1],
                                            **({"chat_template_kwargs": {"tools": TOOLS}} if v == "off" else {})})
                        result = run_bench(BenchConfig(
                            base_url=servers[v].base_url, dataset=args.dataset, num_prompts=num,
                            max_tokens=args.max_tokens, max_concurrency=conc, num_warmup=1, seed=r,
                            extra_body=extra, disable_tqdm=True))
                        assert result["completed"] == num, result.get("errors")
                        runs[v][conc].append(result["output_throughput"])
                        print(f"round {r} {v} c={conc}: {result['output_throughput']:.1f} tok/s", flush=True)
        finally:
            for s in servers.values():
                s.stop()
    summary = {f"c{c}": {"off_tok_s": statistics.median(runs["off"][c]), "on_tok_s": statistics.median(runs["on"][c]),
                         "on_over_off": statistics.median(runs["on"][c]) / statistics.median(runs["off"][c])}
               for c in loads}
    micro = parser_cost_us()
    # a served delta at batch 1 carries ~tokens-per-step tokens; its time is at least one token's at off_tok_s
    micro["share_of_a_token_at_c1"] = micro["us_per_delta"] / (1e6 / summary["c1"]["off_tok_s"])
    summary["parsers_alone"] = micro
    result = {**run_info(argv), "parsers": PARSERS, "max_tokens": args.max_tokens, "dataset": args.dataset,
              "rounds": runs, "summary": summary}
    write_result_file(args.out, result)
    print(json.dumps(summary))
    return result


if __name__ == "__main__":
    main()
