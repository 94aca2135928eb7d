"""TokenizerBundle: a tokenizer plus what the engine and server need from it (encode, decode, chat template
→ ids, the set of end-of-sequence ids). The tokenizer is transformers' for an HF model folder, and for a GGUF
file the Rust tokenizer of its cached conversion (`FastTokenizer`, models/fast_tokenizer.py: no transformers
import in a served process) where that reproduces the conversion's settings.

A GGUF file embeds its tokenizer; converting it with transformers takes seconds, so the converted
tokenizer is saved once under `gguf_cache_dir(file)` (`~/.cache/dspark/gguf/<hash of the file
identity>`, shared with the loader's converted weights) and later loads read that directory (if the
cache cannot be written, every load converts).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark.models.files import CheckpointError
from dspark.models.family import family_for_gguf
from dspark.models.gguf_format import gguf_field, gguf_reader

logger = logging.getLogger(__name__)

CACHE_ROOT = Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark")) / "gguf"


@dataclass(frozen=True)
class TokenizerBundle:
    tokenizer: Any  # a transformers PreTrainedTokenizerBase, or a FastTokenizer (a cached GGUF tokenizer)
    eos_token_ids: tuple[int, ...]

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                    chat_template: str | None = None, **template_kwargs) -> str:
        """`chat_template` replaces the tokenizer's own; `template_kwargs` (tools=..., ...) reach it."""
        if not (chat_template or self.chat_template):
            raise ValueError("this tokenizer has no chat template; use a completion prompt instead")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, chat_template=chat_template,
                                                  add_generation_prompt=add_generation_prompt,
                                                  **template_kwargs)

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                            chat_template: str | None = None, **template_kwargs) -> list[int]:
        """Chat messages -> prompt ids (the template writes the special tokens itself)."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt,
                                chat_template=chat_template, **template_kwargs)
        return self.encode(text, add_special_tokens=False)


# files one of which an HF model folder needs for transformers to build its tokenizer offline
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "tokenizer_config.json")


def check_tokenizer_files(path: str | Path) -> None:
    """Refuse an HF model folder without tokenizer files (before any weight loads): the engine would load
    the weights and then fail, or transformers would reach for the network."""
    path = Path(path)
    if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(f"{path}: no tokenizer (none of {', '.join(TOKENIZER_FILES)}); copy the model's "
                         "tokenizer files into the folder")


def with_chat_template(bundle: TokenizerBundle, template: str) -> TokenizerBundle:
    """`bundle` with its chat template replaced by `template`: a file holding a Jinja template, or the
    template itself (vLLM's --chat-template); for base models, which ship none."""
    path = Path(template).expanduser()
    text = path.read_text() if len(template) < 4096 and path.is_file() else template
    if "{" not in text:
        raise ValueError(f"--chat-template {template!r}: neither a template file nor a Jinja template")
    bundle.tokenizer.chat_template = text
    return bundle


def load_tokenizer(path: Path, *, eos_token_ids: tuple[int, ...] = ()) -> TokenizerBundle:
    """From a .gguf file (cached conversion) or an HF model directory."""
    path = Path(path)
    if path.suffix == ".gguf":
        tok = _load_gguf_tokenizer(path)
    else:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    _drop_constructor_tables(tok)
    eos = list(eos_token_ids)
    if tok.eos_token_id is not None:
        eos.append(int(tok.eos_token_id))
    if not eos:
        raise ValueError(f"{path}: no end-of-sequence token id in the config or the tokenizer")
    return TokenizerBundle(tokenizer=tok, eos_token_ids=tuple(dict.fromkeys(eos)))


def as_transformers(tok: Any) -> Any:
    """`tok` as transformers' tokenizer: a FastTokenizer's folder loaded by transformers (with its current chat
    template; imports transformers), anything else as it is."""
    from dspark.models.fast_tokenizer import FastTokenizer
    if not isinstance(tok, FastTokenizer):
        return tok
    hf = _cached_tokenizer(Path(tok.name_or_path), thin=False)
    hf.chat_template = tok.chat_template
    return hf


def _drop_constructor_tables(tok: Any) -> None:
    """transformers 5's BPE tokenizers (Gemma, GPT-2, ...) keep the vocabulary and merges they built their
    Rust tokenizer from as Python objects (`_vocab`, `_merges`), read by their constructor only; for Gemma 3's
    262144 tokens and 514906 merges ~180 MB of a served process. Emptied here: the Rust tokenizer holds its
    own tables, and encoding, decoding, the vocabulary and saving all read those."""
    for name, empty in (("_vocab", dict), ("_merges", list)):
        if isinstance(getattr(tok, name, None), empty):
            setattr(tok, name, empty())


def gguf_cache_dir(path: Path) -> Path:
    """Cache directory of one GGUF file, keyed by its path, size, mtime and the transformers version."""
    from importlib.metadata import version  # not transformers.__version__: importing transformers costs ~20 MiB
    st = path.resolve().stat()
    key = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{version('transformers')}"
    return CACHE_ROOT / hashlib.sha256(key.encode()).hexdigest()[:24]


def _cached_tokenizer(cache: Path, *, thin: bool = True) -> Any:
    """The converted tokenizer saved in `cache`: a `FastTokenizer` (no transformers import) where it reproduces
    the folder's settings and `thin`; else transformers' tokenizer, built as follows. Where the class its
    tokenizer_config.json names is a fast one,
    tokenizer.json goes straight into transformers' generic fast class (`PreTrainedTokenizerFast`, with the
    config's settings, the chat template beside it and the named class's padding side): the named class
    (GemmaTokenizer, ...) rebuilds the Rust tokenizer from Python copies of the vocabulary and merges, and
    `from_pretrained` re-adds every added token, whose freed objects stay resident (gemma-3-270m: 126 against
    94 MiB); the same encodings, decodings, vocabulary, special tokens and template (tests/test_loader.py).
    Never through AutoTokenizer, which reads the config.json that the loader's fp32 conversion cache puts in
    the same folder (for a Llama config that imports transformers' model-loading stack, accelerate and sympy
    among it: ~50 MiB resident for the rest of a served process). AutoTokenizer where the named class is not
    transformers' own."""
    from dspark.models.fast_tokenizer import FastTokenizer
    if thin and FastTokenizer.supports(cache):
        return FastTokenizer(cache)
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name
    config = json.loads((cache / "tokenizer_config.json").read_text())
    name = config.get("tokenizer_class")
    cls = tokenizer_class_from_name(name) if isinstance(name, str) else None
    if cls is None or cls.__name__ == "PythonBackend":
        return AutoTokenizer.from_pretrained(str(cache), local_files_only=True)
    if not (issubclass(cls, PreTrainedTokenizerFast) and (cache / "tokenizer.json").is_file()):
        return cls.from_pretrained(str(cache), local_files_only=True)
    settings = {k: v for k, v in config.items() if k not in ("tokenizer_class", "backend", "is_local",
                                                              "local_files_only", "auto_map")}
    settings.setdefault("padding_side", cls.padding_side)
    template = cache / "chat_template.jinja"
    if template.is_file() and "chat_template" not in settings:
        settings["chat_template"] = template.read_text()
    return PreTrainedTokenizerFast(tokenizer_file=str(cache / "tokenizer.json"), **settings)


def _load_gguf_tokenizer(path: Path) -> Any:
    cache = gguf_cache_dir(path)
    if (cache / "tokenizer_config.json").is_file():
        try:
            return _cached_tokenizer(cache)
        except Exception as e:  # a damaged cache entry: convert again
            logger.warning("ignoring tokenizer cache %s: %s", cache, e)
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    # transformers builds a whole model config before the tokenizer, and has none for some families' headers
    # (qwen3next; gemma4's per-layer widths): theirs is built from the tokenizer keys alone
    family = family_for_gguf(gguf_field(gguf_reader(path), "general.architecture"))
    by_keys = family is not None and family.gguf is not None
    tok = (PreTrainedTokenizerFast if by_keys else AutoTokenizer).from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True)
    try:
        tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
        tok.save_pretrained(str(tmp))
        cache.mkdir(parents=True, exist_ok=True)
        for f in tmp.iterdir():  # file by file: the loader may already have put weights here
            os.replace(f, cache / f.name)
        shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        logger.info("tokenizer cache %s not writable (%s); converting on every load", cache, e)
    return tok

