"""A tiny random Llama HF checkpoint on disk (config.json + model.safetensors) with a word-level
`tokenizers` tokenizer and a chat template, loadable by `dspark serve DIR`, `LLM(DIR)` and
`AutoModelForCausalLM`. Used by tests/test_bench_sweep.py; not a test itself.

    write_tiny_checkpoint(tmp_path / "tiny")   # → the folder

The vocabulary is the word list of `dspark.bench.datasets` (dataset "random" prompts use only
these words) plus special and chat tokens. Weights are small (std 0.05), so greedy output falls
into loops that the n-gram drafter predicts.
"""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> "
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]


def write_tiny_checkpoint(path: str | Path, *, seed: int = 0) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from dspark.bench.datasets import _RANDOM_WORDS

    path = Path(path)
    words = list(dict.fromkeys(_RANDOM_WORDS + [".", ",", "?", "!"]))
    vocab = {tok: i for i, tok in enumerate(SPECIAL + words)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>", pad_token="<pad>",
                                  additional_special_tokens=SPECIAL[4:])
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
                         initializer_range=0.05, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    return path
