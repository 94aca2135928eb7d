"""GGUF files at the published shapes of the hybrid Qwen3.5 and Gemma 4 text decoders (random weights), made the way
a user's file is made: an HF checkpoint folder at the shape, converted by llama.cpp's own `convert_hf_to_gguf.py`
(F16), then quantized by llama.cpp's `llama-quantize`; for bench_llama_cpp_shapes.py, which runs llama-bench and
dspark on the same file. (gguf_shapes.py writes the dense Qwen3 shapes directly; these families carry converter
transforms — value-head reorders, A_log -> ssm_a, norm offsets, per-layer embeddings, rope_freqs — that only the
converter itself writes faithfully.)

The folder: tensor names and shapes from transformers' own model of the config, built on the meta device (no
memory), written shard by shard (~2 GB) as bf16 safetensors: matrices N(0, 0.02) tiled from a random pool (the speed
of a step does not depend on the values), each model's RMSNorms at their identity (Qwen3.5's `1 + w` norms 0, the
gated norm and Gemma's norms 1), A_log = log U(1, 16) and dt_bias 1 (transformers' init). The tokenizer: built by
transformers from llama.cpp's `models/ggml-vocab-qwen35.gguf` (151936 BPE tokens; the converter pads the vocabulary
to vocab_size with [PAD] tokens) and, for Gemma 4, a byte-fallback BPE `tokenizer.json` of the 262144 tokens and
merges of `models/ggml-vocab-gemma-4.gguf`. The folder is deleted once converted; the F16 file once quantized
where it is over `--keep-f16-gb`.

Shapes (text decoder only: the converter's text-only architectures `Qwen3_5ForCausalLM`, `Gemma4ForCausalLM`):
* qwen3.5-4b: Qwen/Qwen3.5-4B's public config.json `text_config`; tied embedding (the published file sizes).
* qwen3.5-2b: no config was at hand; reconstructed from public figures (2.27B parameters in all, ~0.33B of them the
  vision tower; an unsloth Q4_K_M file of 1.28 GB) and the family's fixed dims (head_dim 256, GDN heads of 128).
* gemma4-e2b: `E2B` of bench_gemma4.py (google/gemma-4-E2B's config.json `text_config`).
* gemma4-e4b: google/gemma-4-E4B's `text_config` as bench_projection.py's GEMMA4_E4B_HF holds it (the same fields
  appear in public test fixtures of other engines): 42 layers, 5 sliding : 1 full, the last 18 sharing KV.
transformers' Qwen3_5ForCausalLM has no MTP weights (Qwen3.5's published checkpoints do): the Qwen3.5 files are
converted with `--no-mtp` (the converter asks for MTP tensors otherwise) and have no MTP layer, which a decode step
does not read.

    python benchmarks/gguf_shapes_hf.py --shape qwen3.5-2b --types Q4_K_M --dir ~/.cache/dspark/shapes \
        --quantize /work/llbuild/bin/llama-quantize
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gguf_shapes  # noqa: E402

LLAMA_CPP = gguf_shapes.LLAMA_CPP
POOL = 1_000_003  # a prime: tiles of the random pool do not line up with rows
SHARD_BYTES = 2 << 30

S, F, LIN = "sliding_attention", "full_attention", "linear_attention"
GEMMA4_ROPE = {F: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
               S: {"rope_type": "default", "rope_theta": 10_000.0}}
QWEN35_ROPE = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
               "mrope_interleaved": True, "mrope_section": [11, 11, 10]}


def _qwen35(hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int, v_heads: int) -> dict:
    return {"hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": intermediate,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": 256,
            "linear_num_key_heads": 16, "linear_key_head_dim": 128, "linear_num_value_heads": v_heads,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "vocab_size": 248320,
            "layer_types": ([LIN] * 3 + [F]) * (layers // 4), "full_attention_interval": 4,
            "attn_output_gate": True, "tie_word_embeddings": True, "rope_parameters": QWEN35_ROPE,
            "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "bos_token_id": 151643,
            "eos_token_id": 151643}


def _gemma4(**fields: Any) -> dict:
    base = {"vocab_size": 262144, "vocab_size_per_layer_input": 262144, "hidden_size_per_layer_input": 256,
            "num_attention_heads": 8, "head_dim": 256, "global_head_dim": 512, "sliding_window": 512,
            "final_logit_softcapping": 30.0, "attention_k_eq_v": False, "enable_moe_block": False,
            "tie_word_embeddings": True, "rope_parameters": GEMMA4_ROPE, "rms_norm_eps": 1e-6,
            "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072, "bos_token_id": 2,
            "eos_token_id": 1, "pad_token_id": 0}
    return {**base, **fields}


@dataclass(frozen=True)
class HFShape:
    """A published text decoder: the HF architecture, its config fields, the tokenizer maker."""
    architecture: str
    fields: dict = field(hash=False)
    tokenizer: str  # key of TOKENIZERS
    convert_args: tuple[str, ...] = ()  # the converter's options for it


SHAPES = {
    "qwen3.5-2b": HFShape("Qwen3_5ForCausalLM", _qwen35(2048, 24, 6144, 8, 2, 16), "qwen35", ("--no-mtp",)),
    "qwen3.5-4b": HFShape("Qwen3_5ForCausalLM", _qwen35(2560, 32, 9216, 16, 4, 32), "qwen35", ("--no-mtp",)),
    "gemma4-e2b": HFShape("Gemma4ForCausalLM", _gemma4(
        hidden_size=1536, num_hidden_layers=35, intermediate_size=6144, num_key_value_heads=1,
        use_double_wide_mlp=True, layer_types=([S] * 4 + [F]) * 7, num_kv_shared_layers=20), "gemma4"),
    "gemma4-e4b": HFShape("Gemma4ForCausalLM", _gemma4(
        hidden_size=2560, num_hidden_layers=42, intermediate_size=10240, num_key_value_heads=2,
        use_double_wide_mlp=False, layer_types=([S] * 5 + [F]) * 7, num_kv_shared_layers=18), "gemma4"),
}


def hf_config(name: str):
    """transformers' text config of the shape (architectures set, as config.json carries it)."""
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    s = SHAPES[name]
    cls = {"Qwen3_5ForCausalLM": Qwen3_5TextConfig, "Gemma4ForCausalLM": Gemma4TextConfig}[s.architecture]
    cfg = cls(**s.fields)
    cfg.architectures = [s.architecture]
    return cfg


def _fill_value(arch: str, name: str, gen) -> Callable | None:
    """What a vector / scalar parameter of `arch` is filled with (None: the random matrices' values)."""
    import torch
    if name.endswith("A_log"):
        return lambda n: torch.empty(n).uniform_(1, 16, generator=gen).log()
    if name.endswith("dt_bias") or name.endswith("layer_scalar"):
        return lambda n: torch.ones(n)
    if "norm" in name:  # Qwen3.5's RMSNorms multiply by 1 + w (the GDN's gated norm by w); Gemma 4's by w
        one = arch.startswith("Gemma4") or name.endswith("linear_attn.norm.weight")
        return lambda n: torch.full((n,), 1.0 if one else 0.0)
    return None


def random_tensors(name: str, seed: int = 0):
    """(HF name, shape, make) of every tensor of the shape's checkpoint, tied copies left out; `make()` returns
    the bf16 tensor."""
    import torch
    from transformers import AutoModelForCausalLM
    cfg = hf_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    gen = torch.Generator().manual_seed(seed)
    pool = (torch.randn(POOL, generator=gen) * 0.02).to(torch.bfloat16)
    arch = SHAPES[name].architecture
    seen: set[int] = set()
    for i, (hf, p) in enumerate(model.state_dict(keep_vars=True).items()):
        if id(p) in seen or (hf == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        seen.add(id(p))
        shape, n = tuple(p.shape), p.numel()
        const = _fill_value(arch, hf, gen) if len(shape) == 1 else None

        def make(shape=shape, n=n, const=const, shift=(i * 7919) % POOL):
            if const is not None:
                return const(n).to(torch.bfloat16).reshape(shape)
            tiled = torch.roll(pool, shift).repeat(n // POOL + 1)[:n]
            return tiled.reshape(shape).clone()
        yield hf, shape, make


def write_folder(name: str, folder: Path, *, seed: int = 0) -> Path:
    """The shape's HF checkpoint folder: config.json, bf16 safetensors shards with their index, the tokenizer."""
    from safetensors.torch import save_file
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[list[tuple[str, tuple, Callable]]] = [[]]
    size = 0
    for hf, shape, make in random_tensors(name, seed):
        nbytes = 2 * math.prod(shape)
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((hf, shape, make))
        size += nbytes
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {hf: make() for hf, _, make in shard}
        total += sum(t.numel() * 2 for t in tensors.values())
        save_file(tensors, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({hf: fname for hf in tensors})
        del tensors
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    cfg = hf_config(name)
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(str(folder))
    TOKENIZERS[SHAPES[name].tokenizer](folder)
    return folder


def _qwen35_tokenizer(dest: Path) -> None:
    """transformers' tokenizer of llama.cpp's Qwen3.5 vocabulary file, saved into `dest`."""
    from transformers import AutoTokenizer
    AutoTokenizer.from_pretrained(str(LLAMA_CPP / "models"), gguf_file="ggml-vocab-qwen35.gguf").save_pretrained(
        str(dest))


def _gemma4_tokenizer(dest: Path) -> None:
    """A byte-fallback BPE tokenizer of the tokens and merges of llama.cpp's Gemma 4 vocabulary file (the form the
    converter reads), its control tokens special, saved into `dest`."""
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast
    reader = gguf.GGUFReader(LLAMA_CPP / "models" / "ggml-vocab-gemma-4.gguf")
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.ggml.")}
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    merges = [tuple(m.split(" ")) for m in fields["tokenizer.ggml.merges"]]
    bpe = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, unk_token="<unk>",
                               byte_fallback=True, fuse_unk=True))
    bpe.normalizer = normalizers.Replace(" ", "▁")
    bpe.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    bpe.add_special_tokens([AddedToken(t, special=True) for t, k in zip(tokens, types) if k == 3])  # control
    PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                            pad_token="<pad>", mask_token="<mask>").save_pretrained(str(dest))


TOKENIZERS = {"qwen35": _qwen35_tokenizer, "gemma4": _gemma4_tokenizer}


def convert(folder: Path, out: Path, outtype: str = "f16", args: tuple[str, ...] = ()) -> Path:
    """llama.cpp's `convert_hf_to_gguf.py` on `folder`, with llama.cpp's own gguf-py first on its path."""
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    env["PYTHONPATH"] = str(LLAMA_CPP / "gguf-py")
    done = subprocess.run([sys.executable, str(LLAMA_CPP / "convert_hf_to_gguf.py"), str(folder), "--outtype",
                           outtype, "--outfile", str(out), *args], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py {folder} failed:\n{done.stderr[-4000:]}")
    return out


def make(name: str, qtypes: list[str], folder: Path, quantize: Path, threads: int = 2,
         keep_f16_gb: float = 10.0) -> dict[str, Path]:
    """{type: path} of the shape's files in `folder`, made once each (any shape of gguf_shapes.py too)."""
    if name in gguf_shapes.SHAPES:
        return gguf_shapes.make(name, qtypes, folder, quantize, threads)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {t: folder / f"{name}-{t}.gguf" for t in qtypes}
    f16 = folder / f"{name}-F16.gguf"
    if all(p.exists() for p in paths.values()):
        return paths
    if not f16.exists():
        hf_dir = folder / f"{name}-hf"
        shutil.rmtree(hf_dir, ignore_errors=True)
        write_folder(name, hf_dir)
        convert(hf_dir, f16.with_suffix(".tmp"), args=SHAPES[name].convert_args)
        f16.with_suffix(".tmp").rename(f16)
        shutil.rmtree(hf_dir)
    for t, path in paths.items():
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            subprocess.run([str(quantize), str(f16), str(tmp), t, str(threads)], check=True,
                           stdout=subprocess.DEVNULL)
            tmp.rename(path)
    if "F16" not in qtypes and f16.stat().st_size > keep_f16_gb * 1e9:
        f16.unlink()
    return paths


def streamed_bytes(path: Path) -> int:
    """Bytes of the file's weights a decode step reads in whole: every tensor but the embeddings read by rows (the
    token embedding where an own `output.weight` is the head; a tied one counts once, as the head) and Gemma 4's
    per-layer embedding (the token's row of each layer)."""
    import gguf
    reader = gguf.GGUFReader(path)
    names = {t.name for t in reader.tensors}
    by_rows = {"per_layer_token_embd.weight"} | ({"token_embd.weight"} if "output.weight" in names else set())
    return sum(int(t.n_bytes) for t in reader.tensors if t.name not in by_rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--types", default="Q4_K_M", help="llama-quantize types, comma-separated")
    ap.add_argument("--dir", type=Path, default=Path.home() / ".cache/dspark/shapes")
    ap.add_argument("--quantize", type=Path, required=True, help="llama.cpp's llama-quantize binary")
    ap.add_argument("--keep-f16-gb", type=float, default=10.0, help="delete a larger F16 file once quantized")
    args = ap.parse_args()
    for t, p in make(args.shape, args.types.split(","), args.dir, args.quantize,
                     keep_f16_gb=args.keep_f16_gb).items():
        print(t, p, f"{p.stat().st_size / 1e9:.2f} GB (streamed per token {streamed_bytes(p) / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()
