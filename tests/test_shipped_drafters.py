"""The drafters shipped in dspark/assets/drafters/ and what `dspark serve` drafts with by default per model
(dspark.drafters.shipped): the embedded default gets its DSpark drafter with prompt lookup first (its shipped
lookup corpus, written for its vocabulary from the train split) and the prefix scheduler, gemma-3-270m prompt lookup (its DSpark drafter is shipped but measured slower than plain at batch
1), any other model nothing; the gemma-3-270m drafter's folder fits that target and carries both calibration
fits.

    pytest tests/test_shipped_drafters.py -q
"""

from __future__ import annotations

import json

from dspark.config import DEFAULT_MODEL
from dspark.drafters.corpus import check_corpus
from dspark.drafters.shipped import ASSETS, CORPORA, SHIPPED, default_spec_config, drafter_dir
from dspark.models.loader import read_model_config


def test_served_default_per_model():
    smollm2 = default_spec_config(DEFAULT_MODEL, "q4_1")
    assert smollm2.method == "dspark" and smollm2.ngram_first and smollm2.length_policy == "prefix"
    assert default_spec_config("default").model == smollm2.model
    assert smollm2.lookup_corpus == str(ASSETS / CORPORA[DEFAULT_MODEL])
    meta = check_corpus(smollm2.lookup_corpus, vocab_size=read_model_config(DEFAULT_MODEL).vocab_size)
    assert meta["model"] == DEFAULT_MODEL and "train split" in meta["source"], meta
    gemma = default_spec_config("gemma-3-270m", "gguf")
    assert gemma.method == "ngram" and gemma.model is None and gemma.num_speculative_tokens == 4
    assert gemma.lookup_corpus is None
    assert default_spec_config("some/other-model") is None


def test_every_shipped_folder_is_present():
    for (model, method), name in SHIPPED.items():
        assert drafter_dir(model, method) == ASSETS / name, f"{name} is registered but incomplete"


def test_gemma_drafter_fits_its_target_and_is_calibrated():
    folder = drafter_dir("gemma-3-270m", "dspark")
    cfg = json.loads((folder / "config.json").read_text())
    # gemma-3-270m: hidden 640, 18 layers, 4 query heads and 1 KV head of dim 256, vocabulary 262,144
    assert (cfg["hidden_size"], cfg["num_target_layers"], cfg["vocab_size"]) == (640, 18, 262144)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 1, 256)
    assert cfg["block_size"] == 7 and cfg["markov_rank"] > 0 and cfg["enable_confidence_head"]
    calibration = json.loads((folder / "calibration.json").read_text())
    gamma = cfg["block_size"]
    assert len(calibration["temperatures"]) == len(calibration["greedy_temperatures"]) == gamma
    train = json.loads((folder / "train_config.json").read_text())
    assert train["model"] == "gemma-3-270m" and train["warm_start"] == "none"


# sha256 of each shipped drafter's draft vocabulary as absolute target ids (int64, little-endian), as the files held
# it before their d2t was stored as offsets: loading must give exactly these ids
SHIPPED_VOCAB_SHA256 = {
    "dspark-smollm2-135m": "398f8af3eaa4887c3c27b4039dbddb5ce43b74de1d5f5007a89aa7794a3e2b95",
    "dflash-smollm2-135m": "398f8af3eaa4887c3c27b4039dbddb5ce43b74de1d5f5007a89aa7794a3e2b95",
    "eagle3-smollm2-135m": "398f8af3eaa4887c3c27b4039dbddb5ce43b74de1d5f5007a89aa7794a3e2b95",
    "dspark-gemma-3-270m": "ec520559397f3ee457582439c1751d03597f8ca4798af3e63de54dea85fae582",
}


def test_shipped_d2t_is_stored_as_offsets_and_loads_to_the_same_target_ids():
    """Every shipped drafter stores d2t as offsets (target id = draft id + d2t[draft id], what llama.cpp's
    converter, vLLM and SGLang read), says so in config.json, and loads to the draft vocabulary it was trained
    with: strictly increasing distinct ids inside the target's vocabulary, the same ids as before."""
    import hashlib

    import torch

    from dspark.drafters.vocab import read_d2t, read_maps
    assert {name for name in SHIPPED.values()} == set(SHIPPED_VOCAB_SHA256)
    for name, digest in SHIPPED_VOCAB_SHA256.items():
        folder = ASSETS / name
        cfg = json.loads((folder / "config.json").read_text())
        assert cfg["d2t_format"] == "offset" and cfg["draft_vocab_size"] == 8192, name
        stored = read_maps(folder)["d2t"]
        ids = read_d2t(folder, vocab_size=cfg["vocab_size"], where=name)
        assert torch.equal(ids, stored + torch.arange(stored.numel())), name
        assert bool((ids[1:] > ids[:-1]).all()) and 0 <= int(ids[0]) and int(ids[-1]) < cfg["vocab_size"], name
        assert int(stored.min()) >= 0 and int(stored.max()) + stored.numel() - 1 < cfg["vocab_size"]
        assert hashlib.sha256(ids.numpy().astype("<i8").tobytes()).hexdigest() == digest, name


def test_smollm2_drafter_loads_lean():
    """Checking and loading the shipped SmolLM2 drafter (built on the meta device) imports none of torch's Python
    meta decompositions (sympy: ~70 MiB resident for the rest of a served process), its model has the buffers
    and initialization it had, and what it loads keeps no view of its mapped checkpoint file (33 MiB)."""
    import subprocess
    import sys
    code = """
import sys, torch
from pathlib import Path
from dspark.drafters.checkpoint import load_tensors
from dspark.drafters.dspark_checkpoint import load_dspark, read_dspark_config, expected_shapes
from dspark.drafters.dspark_model import DSparkModel
from dspark.drafters.shipped import drafter_dir
folder = drafter_dir("default", "dspark")
cfg = read_dspark_config(folder, num_target_layers=30)
expected_shapes(cfg)
tensors = load_tensors(folder)
model, temps = load_dspark(folder, num_target_layers=30, embed_weight=torch.zeros(49152, 576),
                           lm_head_weight=torch.zeros(49152, 576))
assert "sympy" not in sys.modules
assert not any("model.safetensors" in line for line in Path("/proc/self/maps").read_text().splitlines())
assert torch.equal(model.d2t, tensors["d2t"] + torch.arange(cfg.draft_vocab_size))  # stored as offsets
assert int(model.t2d[model.d2t[5]]) == 5
assert int((model.t2d >= 0).sum()) == cfg.draft_vocab_size and model.inv_freq.device.type == "cpu"
torch.manual_seed(0)
a = DSparkModel(cfg)
torch.manual_seed(0)
w = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size).weight
assert torch.equal(a.embed_tokens.weight, w) and torch.equal(a.d2t, torch.arange(cfg.draft_vocab_size))
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_llm_speculative_config_default_is_the_served_default(tmp_path):
    """`LLM(speculative_config="default")` drafts with what `dspark serve` runs without the flag (resolved with
    the engine's matmul dtype), and its greedy output equals plain decoding's; a model with nothing shipped
    is refused by name, before any weight loads."""
    import pytest

    from dspark.config import EngineConfig
    from dspark.engine.build import resolve_matmul_dtype
    from dspark.llm import LLM
    from dspark.sampling import SamplingParams
    assert EngineConfig(spec="default").spec == "default"
    with pytest.raises(ValueError, match="speculative_config"):
        EngineConfig(spec="defaults")
    llm = LLM(speculative_config="default")
    matmul = resolve_matmul_dtype("auto", dtype="float32", device="cpu", model=DEFAULT_MODEL, tensor_parallel_size=1)
    assert llm.engine.config.spec == default_spec_config(DEFAULT_MODEL, matmul_dtype=matmul)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    messages = [{"role": "user", "content": "Count from 1 to 10."}]
    spec_out = llm.chat(messages, params, use_tqdm=False)[0].token_ids
    assert llm.engine.metrics.num_drafts > 0
    assert spec_out == LLM(speculative_config=None).chat(messages, params, use_tqdm=False)[0].token_ids
    from tiny_checkpoint import write_tiny_checkpoint
    with pytest.raises(ValueError, match="no drafter is shipped"):
        LLM(str(write_tiny_checkpoint(tmp_path / "tiny")), speculative_config="default")
