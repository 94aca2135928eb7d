"""`dspark prepare-data`: the target regenerates answers to the training prompts (reference §4.1).

    dspark prepare-data --out data/smollm2_train --max-prompts 2000 --max-tokens 384 [--magpie 500]

Prompts: the first user turn of every line of <shared>/datasets/train/*.jsonl (never eval/), shuffled
once with --seed so --max-prompts takes a mix of sources. Each prompt goes through the target's chat
template and the dspark engine itself (`LLM.chat`, --batch-size conversations at a time, greedy or
--temperature); a sample is prompt ids + answer ids (up to and including the end-of-turn token), with
loss_mask 1 on the answer. Optional Magpie-style prompts: the target continues the chat template's user
header with no content and writes a user request itself; that request is then answered like the others.

Speculation (`--speculative-config`, "default": the shipped drafter with prompt lookup first, else vLLM's JSON):
the engine verifies every draft, so at temperature 0 the answers are the plain ones (lossless), only faster.
`--device cuda` generates on a GPU. Prompts are deduplicated before generation: a request whose text (case and
whitespace folded) was already seen, among the train prompts or the Magpie ones, is dropped as
"duplicate_prompt".

Resumable: every batch is written as its own shard (data.py layout) before the next starts; a rerun
skips prompt keys already written or dropped, and reuses the Magpie requests kept in magpie.jsonl.
`--max-minutes` starts no batch after that long (the manifest covers what was written), and no batch of Magpie
requests after half of it, so the answers get the rest. A hash of the key puts --holdout of the samples in the
validation split (used for calibration and validation, never for training).

A base model (no chat template, e.g. gemma-3-270m) takes the prompts as plain text instead
(`--prompt-format plain`, the default "auto" picks it when the tokenizer has no template): a sample is
the prompt's own tokens (with BOS) and the target's continuation of them.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dspark.bench.datasets import datasets_dir
from dspark.train.data import DROPPED, MANIFEST, assert_not_eval, done_keys, is_holdout, shard_paths, write_shard

log = logging.getLogger("dspark.prepare_data")
DEFAULT_PROMPTS = str(datasets_dir() / "train")  # $DSPARK_DATASETS or <repo>/../shared/datasets
MAGPIE_SENTINEL = "MAGPIE_SENTINEL_7f3a"
MAGPIE_FILE = "magpie.jsonl"  # the requests the target wrote for --magpie: {"key", "text"} a line
MAGPIE_SHARE = 0.5  # with --max-minutes, writing Magpie requests starts no batch past this share of them


@dataclass(frozen=True)
class PrepareConfig:
    out: str
    model: str
    prompts: str = DEFAULT_PROMPTS
    max_prompts: int | None = None
    max_tokens: int = 384  # answer tokens per sample
    max_prompt_tokens: int = 1024  # longer prompts are dropped (CPU training cost), or cut to fit
    long_prompts: str = "drop"  # "drop" | "truncate": keep the request's head and tail, "\n...\n" between
    prompt_format: str = "auto"  # "chat" | "plain" (the text itself, continued) | "auto": chat if the model has a template
    min_answer_tokens: int = 14  # DeepSpec drops samples with fewer supervised tokens
    magpie: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    batch_size: int = 32
    holdout: float = 0.05
    seed: int = 0
    dtype: str = "float32"
    # the target's matrix products while generating: float32 by default, the model the trainer computes
    # its features with (dspark.train loads the target in fp32) and the one the shipped drafters saw
    matmul_dtype: str = "float32"
    num_threads: int | None = None
    speculative_config: str | None = None  # "default" (the shipped drafter) or a --speculative-config JSON
    device: str = "cpu"
    max_minutes: float | None = None  # start no batch after this many minutes (a rerun goes on from there)
    enforce_eager: bool = True  # CUDA: every step eager (False: CUDA graphs, the engine's --no-enforce-eager)


def prompt_rows(root: str | Path) -> list[tuple[str, dict]]:
    """(key, row) for every line of root/*.jsonl, the key `stem:line` (what the held-out split hashes)."""
    assert_not_eval(root)
    rows = []
    for path in sorted(Path(root).glob("*.jsonl")):
        assert_not_eval(path)
        for i, line in enumerate(path.read_text().split("\n")):  # not splitlines(): U+2028 in strings
            if line.strip():
                rows.append((f"{path.stem}:{i}", json.loads(line)))
    return rows


def load_prompts(root: str | Path, *, seed: int) -> list[tuple[str, str]]:
    """(key, first user turn) for every line of root/*.jsonl, shuffled deterministically."""
    items = [(key, row["turns"][0]) for key, row in prompt_rows(root) if row["turns"] and row["turns"][0].strip()]
    random.Random(seed).shuffle(items)
    return items


def normalise_prompt(text: str) -> str:
    """The dedup key of a request: case folded, whitespace runs collapsed."""
    return " ".join(text.split()).casefold()


def dedupe(items: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], list[str]]:
    """(items with the first of each normalised text kept, the keys dropped as duplicates)."""
    seen: set[str] = set()
    kept, dropped = [], []
    for key, text in items:
        norm = normalise_prompt(text)
        if norm in seen:
            dropped.append(key)
        else:
            seen.add(norm)
            kept.append((key, text))
    return kept, dropped


def spec_config(cfg: PrepareConfig):
    """The SpecConfig the generating engine drafts with (None: plain decoding)."""
    if cfg.speculative_config is None:
        return None
    from dspark.config import SpecConfig
    if cfg.speculative_config == "default":
        from dspark.drafters.shipped import default_spec_config
        spec = default_spec_config(cfg.model, cfg.matmul_dtype)
        if spec is None:
            raise ValueError(f"--speculative-config default: no drafter is shipped for {cfg.model!r}")
        return spec
    return SpecConfig.from_dict(cfg.speculative_config)


def magpie_header(tokenizer) -> list[int]:
    """Token ids of the chat template up to where a user message's content starts (system prompt and
    user header included): the target continues it by writing a user request."""
    text = tokenizer.render_chat([{"role": "user", "content": MAGPIE_SENTINEL}], add_generation_prompt=False)
    return tokenizer.encode(text[:text.index(MAGPIE_SENTINEL)], add_special_tokens=False)


def fit_prompt(tokenizer, text: str, max_prompt_tokens: int) -> list[int] | None:
    """Chat-template ids of the user request `text`, cut to fit `max_prompt_tokens` when it is longer:
    the first two thirds of the kept content tokens and the last third (task statements lead, format
    instructions trail), joined by an ellipsis line. None when even the empty request does not fit.
    The answer is still the target's own answer to the prompt it was given."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    if len(ids) <= max_prompt_tokens:
        return ids
    content = tokenizer.encode(text, add_special_tokens=False)
    budget = max_prompt_tokens - (len(ids) - len(content)) - 8  # template + ellipsis + re-tokenising slack
    while budget > 0:
        head = budget * 2 // 3
        cut = (tokenizer.decode(content[:head]) + "\n...\n" + tokenizer.decode(content[len(content) - (budget - head):]))
        ids = tokenizer.apply_chat_template([{"role": "user", "content": cut}], add_generation_prompt=True)
        if len(ids) <= max_prompt_tokens:
            return ids
        budget -= 16
    return None


def plain_prompt(tokenizer, text: str, max_prompt_tokens: int, long_prompts: str) -> list[int]:
    """The ids of `text` itself (BOS first) for a base model to continue; a longer one is dropped ([]) or,
    with "truncate", cut to its last `max_prompt_tokens` - 1 tokens after the BOS (a continuation
    follows the text's end)."""
    ids = tokenizer.encode(text)
    if len(ids) <= max_prompt_tokens:
        return ids
    return [] if long_prompts == "drop" else ids[:1] + ids[len(ids) - max_prompt_tokens + 1:]


def _params(cfg: PrepareConfig, max_tokens: int, seed: int):
    from dspark.sampling import SamplingParams
    return SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=max_tokens,
                          seed=None if cfg.temperature == 0 else seed)


def _past(cfg: PrepareConfig, t_start: float, share: float = 1.0) -> bool:
    """Whether `share` of --max-minutes has passed since `t_start` (time.monotonic())."""
    return cfg.max_minutes is not None and time.monotonic() - t_start >= 60 * cfg.max_minutes * share


def magpie_prompts(llm, cfg: PrepareConfig, *, done: set[str], t_start: float) -> list[tuple[str, str]]:
    """Ask the target to write --magpie user requests (keys magpie:i), skipping ones already answered. Each
    batch of requests is appended to magpie.jsonl before the next, so a rerun (or a run that --max-minutes cut
    short) reuses them instead of asking again; text null: the target did not end a usable request."""
    path = Path(cfg.out) / MAGPIE_FILE
    written = {}
    if path.exists():
        written = {row["key"]: row["text"] for row in map(json.loads, path.read_text().splitlines())}
    todo = [i for i in range(cfg.magpie) if f"magpie:{i}" not in done and f"magpie:{i}" not in written]
    header = magpie_header(llm.tokenizer) if todo else []
    from dspark.sampling import SamplingParams
    for start in range(0, len(todo), cfg.batch_size):
        if _past(cfg, t_start, MAGPIE_SHARE):
            log.info("magpie: %.0f%% of max_minutes %.1f spent, %d requests left for a rerun", 100 * MAGPIE_SHARE,
                     cfg.max_minutes, len(todo) - start)
            break
        chunk = todo[start:start + cfg.batch_size]
        params = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=128, seed=cfg.seed * 100_003 + i)
                  for i in chunk]
        rows = []
        for i, res in zip(chunk, llm.generate([list(header)] * len(chunk), params)):
            text = res.text.strip()
            usable = res.outputs[0].finish_reason == "stop" and len(text) >= 8  # a request that ended its turn
            rows.append({"key": f"magpie:{i}", "text": text if usable else None})
        with open(path, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        written.update((row["key"], row["text"]) for row in rows)
    out = [(k, t) for k, t in written.items()
           if t is not None and k not in done and int(k.split(":")[1]) < cfg.magpie]
    log.info("magpie: %d generated requests to answer (%d written so far)", len(out), len(written))
    return out


def prepare(cfg: PrepareConfig, *, llm=None) -> dict:
    """Generate, shard and write; `llm` (anything with .tokenizer, .generate) is injected by tests."""
    from tqdm import tqdm

    t_start = time.monotonic()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(out / "prepare.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    done = done_keys(out, redo_dropped=("prompt_too_long",) if cfg.long_prompts == "truncate" else ())
    items = load_prompts(cfg.prompts, seed=cfg.seed)
    if cfg.max_prompts is not None:
        items = items[:cfg.max_prompts]
    if llm is None:
        from dspark.llm import LLM
        spec = spec_config(cfg)
        llm = LLM(cfg.model, dtype=cfg.dtype, matmul_dtype=cfg.matmul_dtype, seed=cfg.seed, num_threads=cfg.num_threads,
                  max_num_seqs=cfg.batch_size, max_model_len=cfg.max_prompt_tokens + cfg.max_tokens + 8,
                  device=cfg.device, enforce_eager=cfg.enforce_eager,
                  speculative_config=None if spec is None else asdict(spec),
                  max_num_batched_tokens=max(512, cfg.batch_size * (1 + (spec.num_speculative_tokens if spec else 0))))
    has_template = bool(getattr(llm.tokenizer, "chat_template", True))
    plain = cfg.prompt_format == "plain" or (cfg.prompt_format == "auto" and not has_template)
    if plain and cfg.magpie:
        raise ValueError("--magpie needs a chat template; this model takes plain-text prompts")
    items += magpie_prompts(llm, cfg, done=done, t_start=t_start)
    items, duplicates = dedupe(items)
    new_duplicates = [k for k in duplicates if k not in done]
    if new_duplicates:
        with open(out / DROPPED, "a") as f:
            f.writelines(f"{k}\tduplicate_prompt\n" for k in new_duplicates)
        log.info("prepare-data: %d duplicate prompts dropped", len(new_duplicates))
    todo = [(k, p) for k, p in items if k not in done]
    log.info("prepare-data: %d prompts, %d already done, %d to generate (config %s)",
             len(items), len(items) - len(todo), len(todo), json.dumps(asdict(cfg)))
    shard_id = len(shard_paths(out))
    bar = tqdm(total=len(todo), desc="prepare-data", unit="prompt")
    num_tokens = num_kept = 0
    t0 = time.perf_counter()
    for start in range(0, len(todo), cfg.batch_size):
        if _past(cfg, t_start):
            log.info("prepare-data: max_minutes %.1f reached, %d prompts left for a rerun", cfg.max_minutes,
                     len(todo) - start)
            break
        chunk = todo[start:start + cfg.batch_size]
        tok = llm.tokenizer
        if plain:
            prompt_ids = [plain_prompt(tok, p, cfg.max_prompt_tokens, cfg.long_prompts) for _, p in chunk]
        elif cfg.long_prompts == "truncate":
            prompt_ids = [fit_prompt(tok, p, cfg.max_prompt_tokens) or [] for _, p in chunk]
        else:
            prompt_ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
                          for _, p in chunk]
        keep = [i for i, ids in enumerate(prompt_ids) if 0 < len(ids) <= cfg.max_prompt_tokens]
        dropped = [f"{chunk[i][0]}\tprompt_too_long\n" for i in range(len(chunk)) if i not in keep]
        params = [_params(cfg, cfg.max_tokens, cfg.seed * 1_000_003 + start + i) for i in keep]
        results = llm.generate([prompt_ids[i] for i in keep], params) if keep else []
        samples = []
        for i, res in zip(keep, results):
            key, answer = chunk[i][0], list(res.token_ids)
            if len(answer) < cfg.min_answer_tokens:
                dropped.append(f"{key}\tanswer_too_short\n")
                continue
            ids = list(res.prompt_token_ids) + answer
            mask = [0] * len(res.prompt_token_ids) + [1] * len(answer)
            samples.append((key, ids, mask, is_holdout(key, cfg.holdout)))
            num_tokens += len(answer)
        if samples:
            write_shard(out / f"shard-{shard_id:05d}.safetensors", samples)
            shard_id += 1
        if dropped:
            with open(out / DROPPED, "a") as f:
                f.writelines(dropped)
        num_kept += len(samples)
        bar.update(len(chunk))
        rate = num_tokens / max(1e-9, time.perf_counter() - t0)
        bar.set_postfix(tok_s=f"{rate:.0f}", kept=num_kept)
        log.info("shard %d: %d samples kept, %d dropped, %.0f answer tok/s", shard_id - 1, len(samples),
                 len(dropped), rate)
    bar.close()
    manifest = write_manifest(out, cfg)
    log.removeHandler(handler)
    return manifest


def write_manifest(out: Path, cfg: PrepareConfig) -> dict:
    from safetensors import safe_open
    counts = {"train": 0, "val": 0}
    tokens = {"train": 0, "val": 0}
    for p in shard_paths(out):
        with safe_open(str(p), "pt") as f:
            is_val = f.get_tensor("is_val").tolist()
            lengths = f.get_tensor("offsets").diff().tolist()
        for v, n in zip(is_val, lengths):
            counts["val" if v else "train"] += 1
            tokens["val" if v else "train"] += n
    manifest = {"version": 1, "config": asdict(cfg), "num_samples": counts, "num_tokens": tokens,
                "num_shards": len(shard_paths(out))}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    log.info("manifest: %s", json.dumps(manifest))
    return manifest


def register(sub) -> None:
    from dspark.config import DEFAULT_MODEL
    p = sub.add_parser("prepare-data", help="regenerate training answers with the target (drafter data)")
    d = PrepareConfig(out="", model=DEFAULT_MODEL)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--prompts", default=d.prompts, help="folder of train *.jsonl (eval/ is refused)")
    p.add_argument("--max-prompts", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="answer tokens per sample")
    p.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens)
    p.add_argument("--long-prompts", default=d.long_prompts, choices=["drop", "truncate"],
                   help="prompts over --max-prompt-tokens: drop them, or keep their head and tail (a rerun "
                        "with truncate also takes the prompts an earlier run dropped as too long)")
    p.add_argument("--prompt-format", default=d.prompt_format, choices=["auto", "chat", "plain"],
                   help="chat: through the chat template; plain: the prompt text itself, continued by the "
                        "target (base models); auto: chat when the model has a template")
    p.add_argument("--min-answer-tokens", type=int, default=d.min_answer_tokens)
    p.add_argument("--magpie", type=int, default=0, help="also let the target write this many prompts")
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="conversations per engine call")
    p.add_argument("--holdout", type=float, default=d.holdout, help="validation fraction")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16"])
    p.add_argument("--matmul-dtype", default=d.matmul_dtype, choices=["auto", "float32", "bfloat16", "q4_1"],
                   help="the target's matrix products while generating (default float32: the model the "
                        "trainer's features come from)")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--speculative-config", default=None,
                   help='generate with speculation: "default" (the shipped drafter) or a JSON speculative config')
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="start no batch after this many minutes; the manifest covers what was written")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=d.enforce_eager,
                   help="CUDA: every step eager (the default); --no-enforce-eager replays CUDA graphs")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    cfg = PrepareConfig(
        out=args.out, model=args.model, prompts=args.prompts, max_prompts=args.max_prompts,
        max_tokens=args.max_tokens, max_prompt_tokens=args.max_prompt_tokens,
        long_prompts=args.long_prompts, prompt_format=args.prompt_format,
        min_answer_tokens=args.min_answer_tokens, magpie=args.magpie, temperature=args.temperature,
        top_p=args.top_p, batch_size=args.batch_size, holdout=args.holdout, seed=args.seed,
        dtype=args.dtype, matmul_dtype=args.matmul_dtype, num_threads=args.num_threads,
        speculative_config=args.speculative_config, device=args.device, max_minutes=args.max_minutes,
        enforce_eager=args.enforce_eager)
    manifest = prepare(cfg)
    print(json.dumps({"out": cfg.out, **{k: manifest[k] for k in ("num_samples", "num_tokens")}}))
    return 0
