"""Write F32 / F16 copies of a GGUF (same metadata, dequantized tensors) so llama.cpp can be measured at
the precision dspark runs in. Used by benchmarks/bench_decode.py; cached under ~/.cache/dspark/gguf.

    python benchmarks/gguf_f32.py [--dtype f32|f16]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def convert(src: Path, dst: Path, dtype: str = "f32") -> Path:
    import gguf
    if dst.exists():
        return dst
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst) + ".tmp", arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        value = field.contents()
        if name == "general.file_type":
            value = 0 if dtype == "f32" else 1
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, value)
        else:
            writer.add_key_value(name, value, vtype)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).reshape(list(reversed(t.shape.tolist())))
        is_matrix = len(data.shape) == 2
        out = data.astype(np.float16 if dtype == "f16" and is_matrix else np.float32)
        writer.add_tensor(t.name, out)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    Path(str(dst) + ".tmp").rename(dst)
    return dst


def cached_copy(src: Path, dtype: str) -> Path:
    out_dir = Path.home() / ".cache" / "dspark" / "gguf"
    out_dir.mkdir(parents=True, exist_ok=True)
    return convert(src, out_dir / f"{src.stem}.{dtype.upper()}.gguf", dtype)


def main() -> None:
    from dspark.models.loader import resolve_model_path
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="f32", choices=["f32", "f16"])
    args = p.parse_args()
    print(cached_copy(Path(resolve_model_path("default")), args.dtype))


if __name__ == "__main__":
    main()
