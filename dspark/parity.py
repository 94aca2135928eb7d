"""`dspark parity`: greedy speculative decoding must reproduce plain greedy decoding token for token.

    dspark parity --speculative-config '{"method": "ngram", "num_speculative_tokens": 5}' \
        --dataset gsm8k --num-prompts 20 --max-tokens 128   # --prompt-format plain: base models

One engine (with the drafter) runs every prompt twice at temperature 0: first with speculation
switched off per request (`SamplingParams.speculation=False`, the plain-decoding twin), then with it
on. Prints one line per mismatch (prompt index, first divergent output position, the two tokens
there), then, as the last line, one JSON object: num_prompts, num_exact, num_mismatch, acceptance
length, and the mismatches (`--out PATH`: also a result file for docs/benchmarks.md). Exit code 1 on any
mismatch.

From Python: `check_parity(llm, conversations, max_tokens=128) -> ParityReport`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Mismatch:
    index: int  # prompt index
    first_divergent_pos: int  # first output position where the two token sequences differ
    plain_token_id: int | None  # None: the plain output ended there
    spec_token_id: int | None  # None: the speculative output ended there
    num_plain_tokens: int
    num_spec_tokens: int


@dataclass(frozen=True)
class ParityReport:
    num_prompts: int
    num_exact: int
    mismatches: tuple[Mismatch, ...]
    acceptance_length: float  # τ pooled over every speculative round (1.0 when none)
    num_spec_rounds: int
    # of the speculative run's requests, admitted without drafter context (the draft gate held drafting off
    # at their load: prompt lookup only), and request-steps the gate kept from model drafting
    num_admitted_without_drafter: int = 0
    num_draft_skips: int = 0
    num_measured_off_steps: int = 0  # steps the measured switch held speculation off (dspark.speculation.switch)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def to_dict(self) -> dict:
        return {"num_prompts": self.num_prompts, "num_exact": self.num_exact,
                "num_mismatch": len(self.mismatches), "acceptance_length": self.acceptance_length,
                "num_spec_rounds": self.num_spec_rounds,
                "num_admitted_without_drafter": self.num_admitted_without_drafter,
                "num_draft_skips": self.num_draft_skips,
                "num_measured_off_steps": self.num_measured_off_steps,
                "mismatches": [asdict(m) for m in self.mismatches]}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where `a` and `b` differ (a length difference counts); None if
    equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_parity(llm, prompts: list, *, max_tokens: int = 128, chat: bool = True) -> ParityReport:
    """`prompts` are conversations (`chat=True`) or prompt strings / token-id lists (`chat=False`)."""
    from dspark.sampling import SamplingParams

    def run(speculation: bool):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, speculation=speculation)
        return llm.chat(prompts, params) if chat else llm.generate(prompts, params)

    plain = run(False)
    metrics = llm.engine.metrics
    before = (metrics.num_admitted_without_drafter, metrics.num_draft_skips, metrics.num_measured_off_steps)
    spec = run(True)
    mismatches = []
    for i, (p, s) in enumerate(zip(plain, spec)):
        pos = first_divergence(p.token_ids, s.token_ids)
        if pos is not None:
            mismatches.append(Mismatch(
                index=i, first_divergent_pos=pos,
                plain_token_id=p.token_ids[pos] if pos < len(p.token_ids) else None,
                spec_token_id=s.token_ids[pos] if pos < len(s.token_ids) else None,
                num_plain_tokens=len(p.token_ids), num_spec_tokens=len(s.token_ids)))
    num_rounds = sum(o.spec.num_drafts for o in spec)
    num_accepted = sum(o.spec.num_accepted_tokens for o in spec)
    return ParityReport(num_prompts=len(prompts), num_exact=len(prompts) - len(mismatches),
                        mismatches=tuple(mismatches), num_spec_rounds=num_rounds,
                        acceptance_length=1.0 + num_accepted / num_rounds if num_rounds else 1.0,
                        num_admitted_without_drafter=metrics.num_admitted_without_drafter - before[0],
                        num_draft_skips=metrics.num_draft_skips - before[1],
                        num_measured_off_steps=metrics.num_measured_off_steps - before[2])


def register(sub) -> None:
    from dspark.bench.datasets import add_prompt_format_argument
    from dspark.cli import add_engine_args
    p = sub.add_parser("parity", help="greedy speculative output == plain greedy output?")
    add_engine_args(p, positional_model=False)
    p.add_argument("--dataset", default="gsm8k", help="eval set name or JSONL path")
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=128)
    add_prompt_format_argument(p)
    p.add_argument("--out", default=None, help="also write the report as a result file (command, date, "
                                               "machine, matmul dtype and kernels beside it)")
    p.set_defaults(func=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    from dspark.bench.datasets import load_prompts, resolve_prompt_format
    from dspark.cli import engine_config_from_args
    from dspark.llm import LLM

    config = engine_config_from_args(args)
    if config.spec is None:
        raise SystemExit("error: dspark parity needs --speculative-config")
    try:
        rows = load_prompts(args.dataset, args.num_prompts, args.seed)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}")
    llm = LLM(config=config)
    chat = resolve_prompt_format(args.prompt_format, llm.tokenizer) == "chat"
    prompts = [[{"role": "user", "content": r.prompt}] for r in rows] if chat else [r.prompt for r in rows]
    report = check_parity(llm, prompts, max_tokens=args.max_tokens, chat=chat)
    for m in report.mismatches:
        print(f"mismatch: prompt {m.index} diverges at output position {m.first_divergent_pos} "
              f"(plain {m.plain_token_id}, speculative {m.spec_token_id}; lengths "
              f"{m.num_plain_tokens} vs {m.num_spec_tokens})", file=sys.stderr)
    print(f"{report.num_exact}/{report.num_prompts} exact, acceptance length "
          f"{report.acceptance_length:.2f}", file=sys.stderr)
    print(json.dumps(report.to_dict()))
    if args.out:
        from dspark.bench.report import run_info, write_result_file
        from dspark.kernels import kernel_kind
        matmul_dtype = getattr(llm.engine.runner.model, "matmul_dtype", "float32")
        write_result_file(args.out, {"bench": "greedy_parity", **run_info(), "dataset": args.dataset,
                                     "max_tokens": args.max_tokens, "matmul_dtype": matmul_dtype,
                                     "kernels": kernel_kind(), **report.to_dict()})
    return 0 if report.ok else 1
