"""Prompt sets for the serving benchmark (`dspark bench serve --dataset NAME`).

Sources, all JSONL rows shaped `{"turns": [str, ...], "domain": "math|code|chat", "source": NAME}`:

- a prompt-set name: gsm8k, math500, humaneval, mbpp, livecodebench, mt-bench
  (files `<datasets>/eval/<name>.jsonl`);
- a domain name (math, code, chat): the rows of every eval file with that domain;
- `all`: every eval file;
- a path to any JSONL file of the same shape;
- `random`: synthetic prompts of `random_input_len` tokens (vLLM's meaning): common English words,
  cut to exactly that many tokens by the server's `/tokenize` and `/detokenize` (`fit_token_lengths`;
  a server without them keeps `random_input_len` words, about one token each); needs no prompt files;
- `sharegpt` (vLLM's): a ShareGPT JSON file (`dataset_path`): each conversation's first human turn;
- `custom` (vLLM's): a JSONL file (`dataset_path`) of `{"prompt": ...}` rows.

`<datasets>` is `$DSPARK_DATASETS` if set, else `<repo>/../shared/datasets`. Only `eval/` is read; a
path under `<datasets>/train/` is refused, because benchmarking on training prompts inflates
acceptance. The first user turn of each row becomes the chat message (MT-Bench rows have two turns;
the second is dropped). Rows are shuffled with `random.Random(seed)`; asking for more prompts than
the set holds cycles through it again, reshuffled.

Use from Python: `load_prompts("gsm8k", num_prompts=100, seed=0)`.
"""

from __future__ import annotations

import json
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path

EVAL_SET_NAMES = ("gsm8k", "math500", "humaneval", "mbpp", "livecodebench", "mt-bench")
DOMAIN_NAMES = ("math", "code", "chat")
RANDOM_DATASET = "random"
FILE_DATASETS = ("sharegpt", "custom")  # vLLM's dataset names that read --dataset-path

_RANDOM_WORDS = (
    "the of and to in is it that for on was with as at by be this from or had not but what all "
    "were when we there can an your which their said if do will each about how up out them then "
    "she many some so these would other into has more her two like him see time could no make than "
    "first been its who now people my made over did down only way find use may water long little "
    "very after words called just where most know get through back much before go good new write "
    "our used me man too any day same right look think also around another came come work three "
    "word must because does part even place well such here take why things help put years different"
).split()


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark prompt: the user message and where it came from."""

    prompt: str
    domain: str  # math | code | chat | random
    source: str  # gsm8k, mt-bench, ... or "random"
    num_tokens: int | None = None  # random: the prompt's length in tokens (fit_token_lengths)


def datasets_dir() -> Path:
    """The shared datasets folder: `$DSPARK_DATASETS`, else `<repo>/../shared/datasets`."""
    env = os.environ.get("DSPARK_DATASETS")
    if env:
        return Path(env)
    repo_root = Path(__file__).resolve().parents[2]
    return repo_root.parent / "shared" / "datasets"


def _read_jsonl(path: Path) -> list[BenchPrompt]:
    train_dir = (datasets_dir() / "train").resolve()
    if path.resolve().is_relative_to(train_dir):
        raise ValueError(f"refusing to benchmark on training prompts: {path} is under {train_dir}")
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            turns = row.get("turns")
            if not turns or not isinstance(turns[0], str):
                raise ValueError(f"{path}:{line_no}: 'turns' must be a non-empty list of strings")
            domain, source = row.get("domain", "unknown"), row.get("source", path.stem)
            rows.append(BenchPrompt(turns[0], domain, source))
    return rows


def _eval_file(name: str) -> Path:
    path = datasets_dir() / "eval" / f"{name}.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"prompt set {name!r} not found at {path} (set DSPARK_DATASETS?)")
    return path


def _load_rows(dataset: str) -> list[BenchPrompt]:
    if dataset in EVAL_SET_NAMES:
        return _read_jsonl(_eval_file(dataset))
    if dataset == "all" or dataset in DOMAIN_NAMES:
        rows = [r for name in EVAL_SET_NAMES for r in _read_jsonl(_eval_file(name))]
        return rows if dataset == "all" else [r for r in rows if r.domain == dataset]
    path = Path(dataset)
    if path.suffix == ".jsonl" and path.exists():
        return _read_jsonl(path)
    raise ValueError(
        f"unknown dataset {dataset!r}: use one of {', '.join(EVAL_SET_NAMES)}, a domain "
        f"({', '.join(DOMAIN_NAMES)}), 'all', '{RANDOM_DATASET}', or a path to a .jsonl file"
    )


def random_lengths(num_prompts: int, input_len: int, seed: int, range_ratio: float = 0.0) -> list[int]:
    """Each prompt's token count: `input_len`, or uniform in [len*(1-r), len*(1+r)] (vLLM's range ratio)."""
    rng = random.Random(seed + 1)
    lo, hi = max(1, int(input_len * (1 - range_ratio))), max(1, int(input_len * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(num_prompts)]


def random_prompts(num_prompts: int, input_len: int, seed: int, range_ratio: float = 0.0) -> list[BenchPrompt]:
    """`num_prompts` synthetic prompts of random common words, as many words as tokens wanted (a word is
    about one token; `fit_token_lengths` makes the count exact)."""
    rng = random.Random(seed)
    return [BenchPrompt(" ".join(rng.choices(_RANDOM_WORDS, k=n)), RANDOM_DATASET, RANDOM_DATASET, n)
            for n in random_lengths(num_prompts, input_len, seed, range_ratio)]


def _read_sharegpt(path: Path) -> list[BenchPrompt]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    rows = []
    for item in data:
        turns = [t.get("value") for t in item.get("conversations") or [] if t.get("from") in ("human", "user")]
        if turns and isinstance(turns[0], str) and turns[0]:
            rows.append(BenchPrompt(turns[0], "chat", "sharegpt"))
    return rows


def _read_custom(path: Path) -> list[BenchPrompt]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                prompt = json.loads(line).get("prompt")
                if not isinstance(prompt, str) or not prompt:
                    raise ValueError(f"{path}:{line_no}: a custom dataset row needs a non-empty 'prompt'")
                rows.append(BenchPrompt(prompt, "custom", "custom"))
    return rows


def load_prompts(
    dataset: str, num_prompts: int | None = None, seed: int = 0, random_input_len: int = 128,
    dataset_path: str | None = None, random_range_ratio: float = 0.0,
) -> list[BenchPrompt]:
    """Return `num_prompts` prompts (all rows when None) from `dataset`, shuffled with `seed`."""
    if dataset == RANDOM_DATASET:
        return random_prompts(num_prompts or 100, random_input_len, seed, random_range_ratio)
    if dataset in FILE_DATASETS:
        if not dataset_path:
            raise ValueError(f"dataset {dataset!r} needs --dataset-path")
        rows = (_read_sharegpt if dataset == "sharegpt" else _read_custom)(Path(dataset_path))
    else:
        rows = _load_rows(dataset_path or dataset)
    if not rows:
        raise ValueError(f"dataset {dataset!r} has no rows")
    rng = random.Random(seed)
    wanted = len(rows) if num_prompts is None else num_prompts
    out: list[BenchPrompt] = []
    while len(out) < wanted:
        shuffled = rows[:]
        rng.shuffle(shuffled)
        out.extend(shuffled[: wanted - len(out)])
    if wanted > len(rows):
        print(f"[bench] dataset {dataset!r} has {len(rows)} rows; cycling to {wanted} prompts "
              "(repeated prompts may hit the prefix cache)", file=sys.stderr)
    return out


async def fit_token_lengths(prompts: list[BenchPrompt], tokenize, detokenize) -> list[BenchPrompt]:
    """Random prompts cut to exactly `num_tokens` tokens of the served tokenizer: words enough for twice
    the length are tokenized (`await tokenize(text) -> ids`), cut, and detokenized (`await detokenize(ids)
    -> text`). Prompts without `num_tokens` are kept."""
    rng = random.Random(len(prompts))
    out = []
    for p in prompts:
        if p.num_tokens is None:
            out.append(p)
            continue
        ids = await tokenize(p.prompt + " " + " ".join(rng.choices(_RANDOM_WORDS, k=p.num_tokens)))
        out.append(BenchPrompt(await detokenize(ids[:p.num_tokens]), p.domain, p.source, p.num_tokens))
    return out


PROMPT_FORMATS = ("auto", "chat", "plain")


def add_prompt_format_argument(p) -> None:
    """`--prompt-format` of the tools that run eval prompts through a model (eval accept, parity)."""
    p.add_argument("--prompt-format", default="auto", choices=PROMPT_FORMATS,
                   help="chat: each prompt as a user turn through the chat template; plain: the text itself, "
                        "continued (base models); auto: chat when the model has a template")


def resolve_prompt_format(choice: str, tokenizer) -> str:
    """"chat" or "plain": `auto` is chat where the tokenizer has a chat template."""
    if choice != "auto":
        return choice
    return "chat" if getattr(tokenizer, "chat_template", None) else "plain"
