"""`dspark calibrate`: fit Sequential Temperature Scaling (reference §5.6) for a DSpark drafter's
confidence head on held-out *training* prompts, and write the per-position temperatures next to the
drafter, where the DSpark drafter reads them.

    dspark calibrate --drafter ckpt/dspark --data data/prepared --out ckpt/dspark/calibration.json \
        --plot results/reliability.png --num-prompts 200 --max-tokens 256 --temperature 1

How: speculative decoding at a fixed verification length γ (length policy "fixed", so every draft
position is verified whenever the drafter proposes it) over the prompts; the engine's `spec.verify_observers`
records each round's conditional confidences c_k and accepted count. The raw logits are
z_k = logit(c_k) · T_k, with T_k the temperatures the drafter already applied (its
`confidence_temperatures`, read from an existing calibration.json; 1 when none; a fitted shift b_k is
undone first), so re-running
calibrate on a calibrated drafter refits from the raw head.
`fit_sts` then picks T_k sequentially to minimise the 20-bin ECE of the cumulative survival.
`--fit-bias` also searches a shift b_k per position (c_k = σ(z_k/T_k + b_k)), for heads that are too
confident (or too shy) everywhere, which no temperature can fix.
Acceptance differs between greedy and sampled decoding, so there are two fits: `--temperature 0`
writes "greedy_temperatures" (used for greedy requests), any other target temperature writes
"temperatures" (used for requests that sample); the other regime's fit in the file is kept.
Prints per-position ECE and AUROC before/after, saves the reliability diagram, and as the last line
one JSON object with the count-weighted summary.

Prompts: `--data DIR`, the folder `dspark prepare-data` wrote (its held-out "val" split: each sample's
chat-templated prompt ids, i.e. the tokens before the first answer token), or `--prompts FILE.jsonl`
(e.g. a `train/` prompt set; rows `{"turns": [...]}`, `{"messages": [...]}` or `{"prompt": str}`,
the first user turn through the chat template). Paths under the shared `eval/` folder are refused:
calibrating on the evaluation prompts would leak them into the reported ECE.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import random
from pathlib import Path

import torch

from dspark.speculation.acceptance import RoundRecord, RoundRecorder

log = logging.getLogger(__name__)

_MIN_CONFIDENCE = 1e-7  # logit(c) is clamped to about ±16 so a saturated head stays finite


def collect_rounds(llm, prompts: list, *, temperature: float, max_tokens: int,
                   seed: int = 0) -> list[RoundRecord]:
    """Decode every prompt (a conversation, or a list of prompt token ids) speculatively and return
    the verification rounds that carried a confidence (per-sample seed = seed + index)."""
    from dspark.sampling import SamplingParams

    recorder = RoundRecorder().attach(llm.engine)
    try:
        params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i)
                  for i in range(len(prompts))]
        is_ids = bool(prompts) and isinstance(prompts[0][0], int)
        (llm.generate if is_ids else llm.chat)(prompts, params)
    finally:
        recorder.detach(llm.engine)
    return [r for r in recorder.rounds if r.confidence is not None]


def rounds_to_tensors(rounds: list[RoundRecord], *, applied_temperatures=None, applied_biases=None):
    """(logits [num_rounds, γ] float64, num_accepted [num_rounds], num_verified [num_rounds]);
    unverified positions are padded with 0 and masked out by `num_verified` downstream."""
    from dspark.drafters.dspark import per_position

    num_positions = max(r.num_verified for r in rounds)
    logits = torch.zeros(len(rounds), num_positions, dtype=torch.float64)
    for i, r in enumerate(rounds):
        c = torch.tensor(r.confidence[:r.num_verified], dtype=torch.float64)
        c = c.clamp(_MIN_CONFIDENCE, 1 - _MIN_CONFIDENCE)
        logits[i, :len(c)] = torch.log(c) - torch.log1p(-c)
    # c = σ(z / T + b): undo the shift, then the temperature (absent: b = 0, T = 1)
    shift = per_position(applied_biases, num_positions, fill=0.0, dtype=torch.float64)
    temps = per_position(applied_temperatures, num_positions, fill=1.0, dtype=torch.float64)
    logits = (logits - shift) * temps
    num_accepted = torch.tensor([r.num_accepted for r in rounds])
    num_verified = torch.tensor([r.num_verified for r in rounds])
    return logits, num_accepted, num_verified


def calibrate_rounds(rounds: list[RoundRecord], *, applied_temperatures=None, applied_biases=None,
                     plot_path=None, num_bins: int = 20, fit_bias: bool = False, holdout: float = 0.0):
    """Fit STS on recorded rounds. Returns (STSCalibration, report dict with per-position
    before/after ECE and AUROC and the count-weighted summary).

    holdout > 0: the report (and the plot) score a fit made WITHOUT the requests of a `holdout`
    fraction (chosen by a hash of the request id) on exactly those requests, an out-of-sample ECE;
    the returned calibration is then refitted on every round."""
    import zlib

    from dspark.speculation.calibration import (STS_BIAS_GRID, calibration_report, fit_sts, plot_reliability,
                                           survival, survival_labels, verified_mask)

    if not rounds:
        raise ValueError("no verification rounds with confidences were recorded (is the drafter "
                         "'dspark' with a confidence head, and did any prompt reach decoding?)")
    logits, num_accepted, num_verified = rounds_to_tensors(
        rounds, applied_temperatures=applied_temperatures, applied_biases=applied_biases)

    def fit(rows, shifts=fit_bias):
        return fit_sts(logits=logits[rows], num_accepted=num_accepted[rows], num_verified=num_verified[rows],
                       num_bins=num_bins, bias_grid=STS_BIAS_GRID if shifts else None)

    everything = torch.ones(len(rounds), dtype=torch.bool)
    held = torch.tensor([zlib.crc32(r.request_id.encode()) % 1000 < 1000 * holdout for r in rounds])
    out_of_sample = holdout > 0 and bool(held.any()) and bool((~held).any())
    scored, fitted_on = (held, ~held) if out_of_sample else (everything, everything)
    sts = fit(everything)
    sts_scored = fit(fitted_on) if out_of_sample else sts
    # with shifts, also score plain STS (temperatures only) on the same rounds, for comparison
    plain_scored = fit(fitted_on, shifts=False) if fit_bias else None
    logits, num_accepted, num_verified = logits[scored], num_accepted[scored], num_verified[scored]

    def report_of(calibration):
        return calibration_report(logits=logits, num_accepted=num_accepted, num_verified=num_verified,
                                  calibration=calibration, num_bins=num_bins)

    before, after = report_of(None), report_of(sts_scored)
    plain = report_of(plain_scored) if plain_scored is not None else after
    positions = [{"position": b["position"], "num_rounds": b["num_rounds"],
                  "ece_before": b["ece"], "ece_after": a["ece"], "ece_temperature_only": p["ece"],
                  "auroc_before": b["auroc"], "auroc_after": a["auroc"], "temperature": t,
                  "bias": sts.bias(i)}
                 for i, (b, a, p, t) in enumerate(zip(before, after, plain, sts.temperatures))]
    report = {"num_rounds": len(rounds), "num_scored_rounds": int(scored.sum()),
              "out_of_sample": out_of_sample, "temperatures": list(sts.temperatures),
              "biases": None if sts.biases is None else list(sts.biases),
              "positions": positions,
              "summary": {key: _weighted_mean(positions, key)
                          for key in ("ece_before", "ece_after", "ece_temperature_only", "auroc_before",
                                      "auroc_after")}}
    if plot_path:
        labels = survival_labels(num_accepted, logits.shape[1]).double()
        mask = verified_mask(num_verified, *logits.shape)
        curves = {name: (survival(torch.sigmoid(logits) if cal is None else cal.apply(logits))[mask],
                         labels[mask]) for name, cal in (("raw", None), ("STS", sts_scored))}
        Path(plot_path).parent.mkdir(parents=True, exist_ok=True)
        held_note = ", held-out requests" if report["out_of_sample"] else ""
        plot_reliability(curves=curves, path=plot_path, num_bins=num_bins,
                         title=f"cumulative survival, {int(scored.sum())} rounds{held_note}")
    return sts, report


def load_calibration_prompts(*, data: str | None, prompts: str | None, num_prompts: int | None,
                             seed: int = 0) -> list:
    """Prompt token-id lists from the prepared data's held-out split (`data`), or conversations from
    a prompt JSONL (`prompts`); shuffled with `seed`, truncated to `num_prompts`; eval/ is refused."""
    from dspark.bench.datasets import datasets_dir

    if (data is None) == (prompts is None):
        raise ValueError("give exactly one of --data DIR or --prompts FILE.jsonl")
    path = Path(data or prompts)
    eval_dir = (datasets_dir() / "eval").resolve()
    if path.resolve().is_relative_to(eval_dir) or "/datasets/eval" in str(path.resolve()):
        raise ValueError(f"refusing to calibrate on evaluation prompts: {path} is under {eval_dir}")
    out = _holdout_prompt_ids(path) if data else [
        [{"role": "user", "content": t}] for t in _read_prompts(path)]
    if not out:
        raise ValueError(f"no prompts found in {path}")
    random.Random(seed).shuffle(out)
    return out[:num_prompts] if num_prompts else out


def _holdout_prompt_ids(data: Path) -> list[list[int]]:
    """The prompt part (tokens before the first loss-masked answer token) of each held-out sample."""
    from dspark.train.data import TokenDataset

    out = []
    for sample in TokenDataset(data, split="val"):
        answer = sample.loss_mask.nonzero()
        num_prompt = int(answer[0]) if len(answer) else len(sample.input_ids)
        if num_prompt:
            out.append(sample.input_ids[:num_prompt].tolist())
    return out


def _read_prompts(path: Path) -> list[str]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if row.get("turns"):
                out.append(row["turns"][0])
            elif row.get("messages"):
                out.append(next(m["content"] for m in row["messages"] if m.get("role") == "user"))
            elif isinstance(row.get("prompt"), str):
                out.append(row["prompt"])
            else:
                raise ValueError(f"{path}:{line_no}: expected 'turns', 'messages' or 'prompt'")
    return out


def _weighted_mean(positions: list[dict], key: str) -> float | None:
    pairs = [(p["num_rounds"], p[key]) for p in positions
             if p["num_rounds"] and not math.isnan(p[key])]
    total = sum(n for n, _ in pairs)
    return sum(n * v for n, v in pairs) / total if total else None


# --------------------------------------------------------------------------------------------------
# CLI


def register(sub) -> None:
    from dspark.cli import add_engine_args
    p = sub.add_parser("calibrate", help="fit per-position confidence temperatures (STS)")
    add_engine_args(p, positional_model=False)
    p.add_argument("--drafter", default=None, help="DSpark drafter checkpoint folder")
    p.add_argument("--num-speculative-tokens", type=int, default=None, help="γ (default: config's)")
    p.add_argument("--data", default=None, help="prepare-data output folder (its held-out split)")
    p.add_argument("--prompts", default=None, help="a prompt JSONL (not under eval/)")
    p.add_argument("--num-prompts", type=int, default=200, help="0: all")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0,
                   help="target sampling temperature: 0 fits the greedy regime, > 0 the sampling one")
    p.add_argument("--holdout", type=float, default=0.5,
                   help="fraction of requests the reported ECE/AUROC are measured on, with a fit made "
                        "without them (the saved fit uses every request); 0: report in-sample")
    p.add_argument("--fit-bias", action="store_true",
                   help="also search a shift per position, c_k = σ(z_k/T_k + b_k) (plain STS: T_k only)")
    p.add_argument("--out", default=None, help="calibration JSON (default: next to the drafter)")
    p.add_argument("--plot", default=None, help="reliability diagram PNG")
    p.set_defaults(func=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    from dspark.cli import engine_config_from_args
    from dspark.config import SpecConfig
    from dspark.llm import LLM
    from dspark.drafters.dspark import CALIBRATION_NAME

    config = engine_config_from_args(args)
    spec = config.spec
    if args.drafter:
        spec = dataclasses.replace(spec, model=args.drafter) if spec else SpecConfig(
            method="dspark", model=args.drafter)
    if spec is None or not spec.model:
        raise SystemExit("error: dspark calibrate needs --drafter PATH (or --speculative-config)")
    spec = dataclasses.replace(spec, length_policy="fixed", num_speculative_tokens=(
        args.num_speculative_tokens or spec.num_speculative_tokens))
    config = dataclasses.replace(config, spec=spec)
    try:
        prompts = load_calibration_prompts(data=args.data, prompts=args.prompts,
                                           num_prompts=args.num_prompts or None, seed=args.seed)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}")
    out = Path(args.out) if args.out else Path(spec.model) / CALIBRATION_NAME
    llm = LLM(config=config)
    greedy = args.temperature == 0  # fits the greedy regime ("greedy_temperatures") or the sampling one
    drafter = llm.engine.drafter
    applied = (drafter.temperatures_for(greedy) if hasattr(drafter, "temperatures_for")
               else getattr(drafter, "confidence_temperatures", None))  # [γ] tensor or None
    applied = None if applied is None else [float(t) for t in applied]
    shifts = drafter.biases_for(greedy) if hasattr(drafter, "biases_for") else None
    shifts = None if shifts is None else [float(b) for b in shifts]
    rounds = collect_rounds(llm, prompts, temperature=args.temperature, max_tokens=args.max_tokens,
                            seed=args.seed)
    try:
        sts, report = calibrate_rounds(rounds, applied_temperatures=applied, applied_biases=shifts,
                                       plot_path=args.plot, fit_bias=args.fit_bias, holdout=args.holdout)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    write_calibration(out, sts.temperatures, greedy=greedy, biases=sts.biases)
    _print_report(report)
    if report["out_of_sample"]:
        print(f"(ECE/AUROC on {report['num_scored_rounds']} rounds of held-out requests, fitted without them; "
              f"the saved fit uses all {report['num_rounds']} rounds)")
    print(f"wrote {out} ({'greedy_temperatures' if greedy else 'temperatures'})"
          + (f" and {args.plot}" if args.plot else ""))
    print(json.dumps({"out": str(out), "regime": "greedy" if greedy else "sampling",
                      "target_temperature": args.temperature,
                      "num_prompts": len(prompts), "num_rounds": report["num_rounds"],
                      "temperatures": report["temperatures"], "biases": report["biases"],
                      **report["summary"]}))
    return 0


def write_calibration(path: Path, temperatures, *, greedy: bool, biases=None) -> dict:
    """Write one regime's STS fit into calibration.json, keeping the other regime's: "temperatures"
    (+ "biases") serve requests that sample, "greedy_temperatures" (+ "greedy_biases") greedy ones."""
    from dspark.drafters.dspark import CALIBRATION_KEYS

    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(path.read_text()) if path.is_file() else {}
    data = {k: data[k] for k in CALIBRATION_KEYS if k in data}
    prefix = "greedy_" if greedy else ""
    data[prefix + "temperatures"] = [float(t) for t in temperatures]
    data.pop(prefix + "biases", None)
    if biases is not None:
        data[prefix + "biases"] = [float(b) for b in biases]
    if "temperatures" not in data:  # sampling requests keep the raw head until a sampled fit exists
        data["temperatures"] = [1.0] * len(data["greedy_temperatures"])
    data = {"method": "sts", **data}
    path.write_text(json.dumps(data, indent=2) + "\n")
    return data


def _print_report(report: dict) -> None:
    """Per position: fitted T (and shift b), ECE raw / after (/ with temperatures only), AUROC."""
    eces = ("ece_before", "ece_after") + (("ece_temperature_only",) if report["biases"] else ())
    names = ("ECE raw", "ECE fit") + (("ECE T", ) if report["biases"] else ())
    print(f"{'pos':>3} {'rounds':>7} {'T':>6} {'b':>5} " + " ".join(f"{n:>8}" for n in names)
          + f" {'AUC raw':>8} {'AUC fit':>8}")
    for p in report["positions"]:
        print(f"{p['position']:>3} {p['num_rounds']:>7} {p['temperature']:>6.3f} {p['bias']:>5.1f} "
              + " ".join(f"{100 * p[k]:>7.2f}%" for k in eces)
              + f" {p['auroc_before']:>8.3f} {p['auroc_after']:>8.3f}")
    s = report["summary"]
    print("all" + " " * 25 + "".join(f" {100 * s[k]:>7.2f}%" if s[k] is not None else "       –" for k in eces)
          + "".join(f" {s[k]:>8.3f}" if s[k] is not None else "        –" for k in ("auroc_before", "auroc_after")))
