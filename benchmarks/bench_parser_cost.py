"""The tool-call and reasoning parsers' own cost against the length of the output: each parser fed 1 KB, 10 KB,
100 KB and 1 MB of output in 1-, 4- and 16-character deltas, timed per delta (the median over every delta of
the output), and the whole-output parse of N complete calls, timed per call. A parser whose work per delta is
proportional to the delta costs the same per delta at 1 MB as at 1 KB: the summary's `ratio` (per-delta cost at
the largest size over the smallest) is the figure to hold at <= 1.5.

Streamed workloads, per tool parser (hermes, qwen3_coder, llama3_json, pythonic, gemma4):
* `unterminated`: a call's start, then its arguments growing and never closed (the end marker never comes);
* `whitespace`: blank output only (the whole-output formats cannot decide until a non-blank character);
* `calls`: complete calls one after another, streamed.
Per reasoning format (qwen3, deepseek_r1, gemma4), from the phase the prompt leaves it in (R1: thinking):
* `reasoning`: the start tag and a long reasoning block never closed;
* `whitespace`: blank output only;
* `answer`: a short closed block, then a long answer.
Whole: `parse()` of the `calls` text per tool parser, `split()` of the `reasoning` text per reasoning format.

GC is off while a run is timed (collected between runs); a whole parse is the best of 5 in CPU seconds.
`--tool-parsers-file` / `--reasoning-file` time other copies of the modules (e.g. the code before a change,
`git show REV:dspark/chat/tool_parsers.py > /tmp/x.py`); `--parse-calls N` adds a parse() of N calls.

    python benchmarks/bench_parser_cost.py --parse-calls 100000 --out benchmarks/results/parser_cost.json
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

SIZES = [1_000, 10_000, 100_000, 1_000_000]
DELTAS = [1, 4, 16]
FILLER = "The quick brown fox <b>jumps</b> over the lazy dog, {x: [1, 2]} and back; "
BLANK = " \n\t \n  "

# a call's start (the arguments follow, never closed), and one complete call, per tool-call syntax
CALL_START = {
    "hermes": '<tool_call>\n{"name": "write_file", "arguments": {"text": "',
    "qwen3_coder": "<tool_call>\n<function=write_file>\n<parameter=text>\n",
    "llama3_json": '{"name": "write_file", "parameters": {"text": "',
    "pythonic": '[write_file(text="',
    "gemma4": '<|tool_call>call:write_file{text:<|"|>',
}
ONE_CALL = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n',
    "qwen3_coder": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"),
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; ',
    "pythonic": 'get_weather(city="Paris", days=3), ',
    "gemma4": '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>\n',
}


def _load(name: str, path: str | None):
    if path is None:
        return importlib.import_module(f"dspark.chat.{name}")
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module



def _fill(prefix: str, size: int, filler: str = FILLER) -> str:
    body = filler * (max(0, size - len(prefix)) // len(filler) + 1)
    return (prefix + body)[:size]


def _calls_text(parser: str, size: int) -> tuple[str, int]:
    """About `size` characters of complete calls, and how many."""
    one = ONE_CALL[parser]
    n = max(1, size // len(one))
    if parser == "pythonic":
        return "[" + (one * n).rstrip(", ") + "]", n
    return one * n, n


def _time_stream(feed, finish, text: str, delta: int) -> dict:
    pieces = [text[i:i + delta] for i in range(0, len(text), delta)]
    times = [0] * len(pieces)
    clock = time.perf_counter_ns
    gc.collect()
    gc.disable()
    try:
        start = clock()
        for i, piece in enumerate(pieces):
            t = clock()
            feed(piece)
            times[i] = clock() - t
        t = clock()
        finish()
        finish_ns = clock() - t
        total = clock() - start
    finally:
        gc.enable()
    return {"deltas": len(pieces), "median_us_per_delta": statistics.median(times) / 1e3,
            "mean_us_per_delta": sum(times) / len(times) / 1e3, "finish_us": finish_ns / 1e3, "total_s": total / 1e9}


def _time_whole(run, reps: int) -> float:
    """The best of `reps` runs in this process's CPU seconds (a run this long is otherwise timed with the
    other processes' slices of a shared machine in it)."""
    best = float("inf")
    for _ in range(reps):
        gc.collect()
        gc.disable()
        try:
            t = time.process_time()
            run()
            best = min(best, time.process_time() - t)
        finally:
            gc.enable()
    return best


def main(argv: list[str] | None = None) -> dict:
    from dspark.bench.report import run_info, write_result_file

    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="output lengths in characters")
    p.add_argument("--deltas", default=",".join(map(str, DELTAS)), help="characters per streamed delta")
    p.add_argument("--tool-parsers", default=",".join(CALL_START))
    p.add_argument("--reasoning-formats", default="qwen3,deepseek_r1,gemma4")
    p.add_argument("--tool-parsers-file", default=None, help="time this copy of dspark/chat/tool_parsers.py")
    p.add_argument("--reasoning-file", default=None, help="time this copy of dspark/chat/reasoning.py")
    p.add_argument("--parse-calls", type=int, default=0,
                   help="also time parse() of this many complete calls per tool parser")
    p.add_argument("--out", default="benchmarks/results/parser_cost.json")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    deltas = [int(d) for d in args.deltas.split(",")]
    tool_mod = _load("tool_parsers", args.tool_parsers_file)
    reasoning_mod = _load("reasoning", args.reasoning_file)

    streamed, whole = [], []

    def record(kind, name, workload, size, delta, row):
        row = {"kind": kind, "parser": name, "workload": workload, "size": size, "delta_chars": delta, **row}
        streamed.append(row)
        print(f"{kind:9} {name:12} {workload:12} {size:>8} d={delta:<2} {row['median_us_per_delta']:8.2f} us/delta "
              f"({row['total_s']:.2f} s)", flush=True)

    # whole parses first, in a fresh heap (the streamed runs leave millions of pieces freed behind them)
    Phase = reasoning_mod.Phase
    for name in args.tool_parsers.split(","):
        parser = tool_mod.get_tool_parser(name)
        counts = [_calls_text(name, size) for size in sizes]
        if args.parse_calls:
            one = ONE_CALL[name]
            counts.append(("[" + (one * args.parse_calls).rstrip(", ") + "]" if name == "pythonic"
                           else one * args.parse_calls, args.parse_calls))
        for text, n in counts:
            seconds = _time_whole(lambda: parser.parse(text), 5 if len(text) <= 2_000_000 else 1)
            assert len(parser.parse(text).calls) == n, name
            whole.append({"kind": "tool", "parser": name, "workload": "calls", "size": len(text), "calls": n,
                          "seconds": seconds, "us_per_call": seconds / n * 1e6})
            print(f"tool      {name:12} parse {n:>7} calls {seconds * 1e3:9.2f} ms ({seconds / n * 1e6:.2f} us/call)",
                  flush=True)
    for name in args.reasoning_formats.split(","):
        fmt = reasoning_mod.get_reasoning_format(name)
        phase = Phase.THINKING if fmt.always_thinks else Phase.OPEN
        for size in sizes:
            text = _fill(fmt.start, size)
            seconds = _time_whole(lambda: fmt.split(text, phase), 5)
            whole.append({"kind": "reasoning", "parser": name, "workload": "reasoning", "size": size,
                          "seconds": seconds, "us_per_kb": seconds / size * 1e9})

    for name in args.tool_parsers.split(","):
        parser = tool_mod.get_tool_parser(name)
        for size in sizes:
            texts = {"unterminated": _fill(CALL_START[name], size), "whitespace": _fill("", size, BLANK),
                     "calls": _calls_text(name, size)[0]}
            for workload, text in texts.items():
                for delta in deltas:
                    state = parser.stream()
                    record("tool", name, workload, size, delta, _time_stream(state.feed, state.finish, text, delta))
    for name in args.reasoning_formats.split(","):
        fmt = reasoning_mod.get_reasoning_format(name)
        phase = Phase.THINKING if fmt.always_thinks else Phase.OPEN
        for size in sizes:
            texts = {"reasoning": _fill(fmt.start, size), "whitespace": _fill("", size, BLANK),
                     "answer": _fill(f"{fmt.start}short{fmt.end}\n\n", size)}
            for workload, text in texts.items():
                for delta in deltas:
                    state = fmt.stream(phase)
                    record("reasoning", name, workload, size, delta,
                           _time_stream(state.feed, state.finish, text, delta))

    lo, hi = min(sizes), max(sizes)
    summary = {}
    for row in streamed:
        if row["size"] != hi:
            continue
        key = f"{row['kind']}/{row['parser']}/{row['workload']}/d{row['delta_chars']}"
        base = next(r for r in streamed if r["size"] == lo and all(
            r[k] == row[k] for k in ("kind", "parser", "workload", "delta_chars")))
        summary[key] = {f"us_per_delta_at_{lo}": base["median_us_per_delta"],
                        f"us_per_delta_at_{hi}": row["median_us_per_delta"],
                        "ratio": row["median_us_per_delta"] / base["median_us_per_delta"]}
    for row in whole:
        if row["size"] < hi * 0.9 or row["kind"] != "tool":
            continue
        base = min((r for r in whole if r["kind"] == "tool" and r["parser"] == row["parser"]), key=lambda r: r["size"])
        summary[f"tool/{row['parser']}/parse/{row['calls']}_calls"] = {
            "calls_small": base["calls"], "us_per_call_small": base["us_per_call"], "calls": row["calls"],
            "us_per_call": row["us_per_call"], "ratio": row["us_per_call"] / base["us_per_call"]}
    worst = max(summary.items(), key=lambda kv: kv[1]["ratio"])
    result = {**run_info(argv), "sizes": sizes, "delta_chars": deltas,
              "tool_parsers_file": args.tool_parsers_file or "dspark/chat/tool_parsers.py",
              "reasoning_file": args.reasoning_file or "dspark/chat/reasoning.py", "target_ratio": 1.5,
              "worst": {"key": worst[0], **worst[1]}, "summary": summary, "streamed": streamed, "whole": whole}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_result_file(args.out, result)
    print(json.dumps({"worst": result["worst"]}))
    return result


if __name__ == "__main__":
    main()
