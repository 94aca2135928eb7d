"""FastTokenizer (models/fast_tokenizer.py) against transformers' AutoTokenizer on the same converted GGUF
tokenizer folders: encodings, decodings, token strings, vocabulary, special and added tokens, rendered chats
(generation prompts, continued final messages, tools, template variables, the sandbox's helpers); and a served
GGUF tokenizer loading without importing transformers."""

from __future__ import annotations

import enum
import json
import subprocess
import sys

import pytest

from conftest import _require, copy_gguf_tokenizer
from dspark.models.fast_tokenizer import FastTokenizer
from dspark.models.loader import DEFAULT_MODEL, resolve_model_path
from dspark.models.tokenizer import _cached_tokenizer, as_transformers, load_tokenizer

TEXTS = ["Hello <|im_start|> world\n\n  ü€ 12345 \t tabs", "Hello , world . isn't it ?  don 't",
         "<start_of_turn>user\nhi<end_of_turn>\n<eos>", " lead\n", "<bos><pad><unk>x 你好 é", ""]
CHATS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4", "tool_calls": None}, {"role": "user", "content": "and 3+3?"}],
    [{"role": "user", "content": "Write a haiku"}, {"role": "assistant", "content": "Autumn moon "}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
# exercises what the sandbox provides: tojson without HTML escaping, namespace, loop controls, dict(),
# the special tokens as variables, template kwargs, the generation block, tools and reasoning aliases,
# blocks trimmed of their newline and leading blanks
CUSTOM = ("{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 5 %}{% break %}"
          "{% endif %}{% set ns.n = ns.n + 1 %}<{{ m.role }}>{% if m.thinking %}[{{ m.thinking }}]{% endif %}"
          "{% generation %}{{ m.content }}{% endgeneration %}{{ eos_token }}\n{% endfor %}"
          "{% if tools %}{{ tools | tojson }}{{ dict(a=1) | tojson(indent=2) }}{% endif %}"
          "{{ ns.n }}{{ flavour | default('plain') }}\n  {% if add_generation_prompt %}\n<assistant>\n  {% endif %}\n")


def _folders(name, tmp_path):
    """(FastTokenizer, AutoTokenizer) of shipped GGUF model `name`'s converted tokenizer files."""
    copy_gguf_tokenizer(name, tmp_path)
    from transformers import AutoTokenizer
    assert FastTokenizer.supports(tmp_path)
    return _cached_tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)


@pytest.mark.parametrize("name", [DEFAULT_MODEL, "gemma-3-270m"])
def test_tokens_match_transformers(name, tmp_path):
    ours, auto = _folders(name, tmp_path)
    assert isinstance(ours, FastTokenizer)
    for text in TEXTS:
        for special in (True, False):
            ids = auto.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids
            assert ours.convert_ids_to_tokens(ids) == auto.convert_ids_to_tokens(ids)
            assert ours.convert_tokens_to_ids(auto.convert_ids_to_tokens(ids)) == ids
            for skip in (False, True):
                assert ours.decode(ids, skip_special_tokens=skip) == auto.decode(ids, skip_special_tokens=skip)
    assert ours.convert_tokens_to_ids("no-such-token-here") == auto.convert_tokens_to_ids("no-such-token-here")
    assert ours.convert_ids_to_tokens(5) == auto.convert_ids_to_tokens(5)
    assert len(ours) == len(auto) and ours.get_vocab() == auto.get_vocab()
    assert ours.all_special_ids == auto.all_special_ids and ours.all_special_tokens == auto.all_special_tokens
    assert ours.special_tokens_map == auto.special_tokens_map
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token", "sep_token", "cls_token"):
        assert getattr(ours, attr) == getattr(auto, attr) and getattr(ours, attr + "_id") == getattr(auto, attr + "_id")
    assert {i: str(t) for i, t in ours.added_tokens_decoder.items()} == \
        {i: str(t) for i, t in auto.added_tokens_decoder.items()}
    assert ours.chat_template == auto.chat_template and ours.model_max_length == auto.model_max_length


@pytest.mark.parametrize("name", [DEFAULT_MODEL, "gemma-3-270m"])
def test_chats_match_transformers(name, tmp_path):
    ours, auto = _folders(name, tmp_path)
    templates = [None, CUSTOM] if auto.chat_template else [CUSTOM]
    for template in templates:
        for chat in CHATS:
            for extra in ({"add_generation_prompt": True}, {"add_generation_prompt": False},
                          {"continue_final_message": True}, {"tools": TOOLS, "flavour": "spicy"}):
                if extra.get("continue_final_message") and chat[-1]["role"] != "assistant":
                    continue
                kw = {"chat_template": template, **extra}
                text = auto.apply_chat_template(chat, tokenize=False, **kw)
                assert ours.apply_chat_template(chat, tokenize=False, **kw) == text
                assert ours.apply_chat_template(chat, **kw) == auto.encode(text, add_special_tokens=False)
    flavour = enum.Enum("Flavour", {"SPICY": "spicy"}, type=str).SPICY  # a str subclass: its plain value
    assert ours.apply_chat_template(CHATS[0], chat_template=CUSTOM, tokenize=False, flavour=flavour) == \
        auto.apply_chat_template(CHATS[0], chat_template=CUSTOM, tokenize=False, flavour=flavour)
    thinking = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "reasoning": "greet"}]
    assert ours.apply_chat_template(thinking, chat_template=CUSTOM, tokenize=False) == \
        auto.apply_chat_template(thinking, chat_template=CUSTOM, tokenize=False)
    with pytest.raises(Exception, match="no way"):
        ours.apply_chat_template(CHATS[0], chat_template="{{ raise_exception('no way') }}")
    with pytest.raises(Exception, match="underscore|_secret"):
        ours.apply_chat_template(CHATS[0], chat_template="{% set ns = namespace(_secret=1) %}")
    with pytest.raises(ValueError, match="not compatible"):
        ours.apply_chat_template(CHATS[2], continue_final_message=True, add_generation_prompt=True,
                                 chat_template=CUSTOM)


def test_unreproduced_settings_go_through_transformers(tmp_path):
    """A folder whose settings FastTokenizer does not reproduce loads transformers' tokenizer instead."""
    _folders(DEFAULT_MODEL, tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "add_prefix_space": True}))
    assert not FastTokenizer.supports(tmp_path)
    assert not isinstance(_cached_tokenizer(tmp_path), FastTokenizer)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "clean_up_tokenization_spaces": True}))
    assert not FastTokenizer.supports(tmp_path)


def test_served_gguf_tokenizer_imports_no_transformers():
    """Loading the default GGUF's tokenizer (cached) leaves transformers unimported; `as_transformers` gives
    transformers' tokenizer with the same encodings and template."""
    _require(resolve_model_path, DEFAULT_MODEL)
    load_tokenizer(resolve_model_path(DEFAULT_MODEL))  # the cache entry
    code = ("import sys; from dspark.models.loader import resolve_model_path; "
            "from dspark.models.tokenizer import load_tokenizer; "
            "tok = load_tokenizer(resolve_model_path('default')); tok.apply_chat_template([{'role': 'user', "
            "'content': 'hi'}]); tok.decode(tok.encode('hi there')); assert 'transformers' not in sys.modules, "
            "'transformers imported'; print(type(tok.tokenizer).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "FastTokenizer", out.stderr[-2000:]
    ours = load_tokenizer(resolve_model_path(DEFAULT_MODEL)).tokenizer
    hf = as_transformers(ours)
    assert type(hf).__module__.startswith("transformers")
    assert hf.encode(TEXTS[0]) == ours.encode(TEXTS[0]) and hf.chat_template == ours.chat_template


def test_grammar_masks_match_transformers_tokenizer():
    """Structured output compiles against FastTokenizer's Rust tokenizer exactly as against transformers' (the
    same token masks after the same committed tokens)."""
    from dspark.structured import GrammarCompiler
    _require(resolve_model_path, DEFAULT_MODEL)
    bundle = load_tokenizer(resolve_model_path(DEFAULT_MODEL))
    hf = as_transformers(bundle.tokenizer)
    spec = {"json": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}
    text_ids = bundle.encode('{"n": 42}', add_special_tokens=False)
    masks = []
    for tok in (bundle.tokenizer, hf):
        matcher = GrammarCompiler.for_tokenizer(tok, vocab_size=len(hf), eos_token_ids=bundle.eos_token_ids) \
            .matcher(spec)
        masks.append(matcher.window_masks(text_ids))
    assert masks[0].shape == (len(text_ids) + 1, len(hf)) and bool(masks[0][0].any())
    assert bool((masks[0] == masks[1]).all())
