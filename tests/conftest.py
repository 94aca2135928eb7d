"""Shared fixtures: tiny random Llama/Qwen3 configs (with their HF transformers twins), a paged-KV
helper, and session-scoped real SmolLM2-135M models (ours via the GGUF loader, HF's own GGUF loading)."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import pytest
import torch

# CI runs alone on its 2 cores; on a shared development box oversubscribed OpenMP threads make tiny
# ops 100x slower, so tests use one thread unless CI is set.
torch.set_num_threads(min(2, os.cpu_count() or 1) if os.environ.get("CI") else 1)

from dspark.models.attention import SeqSpec, build_attn_metadata  # noqa: E402
from dspark.models.config import ModelConfig  # noqa: E402

TINY_LLAMA = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=96,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
    rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1,
    eos_token_ids=(2,))
TINY_LLAMA3_SCALED = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
    rope_theta=500000.0, max_position_embeddings=512, tie_word_embeddings=True,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}, bos_token_id=1, eos_token_ids=(2,))
TINY_QWEN3 = ModelConfig(
    architecture="Qwen3ForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=96,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
    rope_theta=1000000.0, max_position_embeddings=256, tie_word_embeddings=True, qk_norm=True,
    bos_token_id=1, eos_token_ids=(2,))
GEMMA3_WINDOW = 8  # small, so prompts cross it and local layers differ from global ones
TINY_GEMMA3 = ModelConfig(
    architecture="Gemma3ForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=96,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
    rope_theta=1_000_000.0, rope_local_theta=10_000.0, max_position_embeddings=512, tie_word_embeddings=True,
    qk_norm=True, bos_token_id=2, eos_token_ids=(1,), hidden_activation="gelu_pytorch_tanh",
    layer_types=("sliding_attention", "full_attention", "sliding_attention", "sliding_attention"),
    sliding_window=GEMMA3_WINDOW, query_pre_attn_scalar=24.0, final_logit_softcapping=30.0)
TINY_CONFIGS = {"llama": TINY_LLAMA, "llama3_scaled": TINY_LLAMA3_SCALED, "qwen3": TINY_QWEN3}


def hf_twin(cfg: ModelConfig, *, seed: int = 0):
    """A randomly initialised transformers model for `cfg` (fp32, eval, eager attention)."""
    import transformers
    torch.manual_seed(seed)
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf())
    hf_cfg._attn_implementation = "eager"
    model = getattr(transformers, cfg.architecture)(hf_cfg).eval()
    with torch.no_grad():  # non-trivial norm weights, so a missed norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


@dataclass
class PagedKV:
    """A KV pool for one model with a shuffled block table per request."""

    caches: list[tuple[torch.Tensor, torch.Tensor]]
    block_tables: list[list[int]]
    kv_block_size: int

    @classmethod
    def create(cls, model, *, num_requests: int, max_len: int, kv_block_size: int, seed: int = 0,
               dtype: torch.dtype = torch.float32) -> "PagedKV":
        kv_heads, head_dim = model.kv_spec
        per_req = -(-max_len // kv_block_size)
        num_blocks = num_requests * per_req + 3  # spare blocks so tables are not contiguous
        ids = list(range(num_blocks))
        random.Random(seed).shuffle(ids)
        tables = [ids[i * per_req:(i + 1) * per_req] for i in range(num_requests)]
        caches = [(torch.full((num_blocks, kv_block_size, kv_heads, head_dim), float("nan"), dtype=dtype),
                   torch.full((num_blocks, kv_block_size, kv_heads, head_dim), float("nan"), dtype=dtype))
                  for _ in range(model.num_kv_layers)]
        for k, v in caches:  # unwritten slots are NaN so stray reads show, except slot 0: the padding
            k[0].zero_()    # target of build_attn_metadata (a real pool is zero-initialised)
            v[0].zero_()
        return cls(caches, tables, kv_block_size)

    def step(self, model, chunks: list[tuple[list[int], int]], *, tap_layer_ids=()):
        """Run one flat batch; chunks[i] = (new token ids of request i, its number of cached tokens)."""
        seqs, ids, pos, offset = [], [], [], 0
        for r, (tokens, cached) in enumerate(chunks):
            if not tokens:
                continue
            seqs.append(SeqSpec(block_table=self.block_tables[r], num_cached=cached, num_query=len(tokens),
                                token_offset=offset))
            ids += tokens
            pos += range(cached, cached + len(tokens))
            offset += len(tokens)
        meta = build_attn_metadata(seqs, num_tokens=offset, kv_block_size=self.kv_block_size)
        with torch.inference_mode():
            return model(torch.tensor(ids), torch.tensor(pos), meta, self.caches, tap_layer_ids=tap_layer_ids)


@pytest.fixture(params=list(TINY_CONFIGS))
def tiny_config(request) -> ModelConfig:
    return TINY_CONFIGS[request.param]


@pytest.fixture(scope="session")
def smollm2():
    """(our model, ModelConfig, TokenizerBundle) for the default GGUF, fp32; skipped if not installed."""
    from dspark.models.loader import DEFAULT_MODEL, load_model, resolve_model_path
    _require(resolve_model_path, DEFAULT_MODEL)
    return load_model(DEFAULT_MODEL, dtype=torch.float32)


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' own SmolLM2-135M from the same GGUF (fp32, eval), the reference for parity tests."""
    from transformers import AutoModelForCausalLM
    from dspark.models.loader import DEFAULT_MODEL, resolve_model_path
    path = _require(resolve_model_path, DEFAULT_MODEL)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32)
    return model.eval()


def _require(resolve, name):
    """The default model is installed by scripts/setup.sh: in CI its absence is a failure, not a skip."""
    try:
        return resolve(name)
    except FileNotFoundError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(e))


def copy_gguf_tokenizer(name: str, folder) -> None:
    """The converted tokenizer files of shipped GGUF model `name` (its cache entry, made if missing) copied
    into `folder`, without the fp32 conversion's config.json that the cache holds beside them."""
    import shutil

    from dspark.models.loader import resolve_model_path
    from dspark.models.tokenizer import gguf_cache_dir, load_tokenizer
    _require(resolve_model_path, name)
    load_tokenizer(resolve_model_path(name))  # the cache entry
    cache = gguf_cache_dir(resolve_model_path(name))
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (cache / file).is_file():
            shutil.copy(cache / file, folder / file)
