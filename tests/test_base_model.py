"""A base model (a tokenizer without a chat template, like gemma-3-270m's GGUF): /v1/completions
serves, /v1/chat/completions answers 400 saying why and what to do; `--chat-template` supplies one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dspark.models.tokenizer import with_chat_template
from server_harness import MODEL, CharTokenizer, build_tiny_model, make_engine, serve


class BaseCharTokenizer(CharTokenizer):
    chat_template = None


@pytest.fixture(scope="module")
def base():
    with serve(make_engine(build_tiny_model()), tokenizer=BaseCharTokenizer()) as srv:
        yield srv


def test_completions_serve_and_chat_is_refused_with_a_400(base):
    r = base.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    r = base.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 4,
                                                 "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "no chat template" in message and "/v1/completions" in message and "--chat-template" in message


def test_with_chat_template_takes_a_file_or_the_text(tmp_path):
    bundle = SimpleNamespace(tokenizer=SimpleNamespace(chat_template=None))
    assert with_chat_template(bundle, "{{ messages }}").tokenizer.chat_template == "{{ messages }}"
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert with_chat_template(bundle, str(f)).tokenizer.chat_template == f.read_text()
    with pytest.raises(ValueError, match="--chat-template"):
        with_chat_template(bundle, "no-such-file.jinja")


class _PlainTokenizer:
    chat_template = None
    eos_token_ids = (1,)

    def encode(self, text: str) -> list[int]:
        return [2] + [ord(c) % 50 + 3 for c in text]


class _ContinuingLLM:
    """Continues every prompt with 20 tokens; records the prompts it was given."""

    def __init__(self):
        self.tokenizer, self.prompts = _PlainTokenizer(), []

    def generate(self, prompt_ids, params):
        self.prompts += prompt_ids
        return [SimpleNamespace(prompt_token_ids=p, token_ids=[(p[1] + k) % 60 + 3 for k in range(20)])
                for p in prompt_ids]


def test_prepare_data_takes_plain_text_prompts_for_a_base_model(tmp_path):
    """No chat template: the samples are the prompt text's own tokens (BOS first) and the target's
    continuation; too long ones are dropped or, with truncate, keep their end; --magpie is refused."""
    import json

    from dspark.train.data import TokenDataset
    from dspark.train.prepare_data import PrepareConfig, prepare
    prompts = tmp_path / "train"
    prompts.mkdir()
    texts = [f"text {i} " * (2 if i % 3 else 9) for i in range(12)]  # every third one is too long
    (prompts / "toy.jsonl").write_text("\n".join(json.dumps({"turns": [t]}) for t in texts))
    cfg = PrepareConfig(out=str(tmp_path / "data"), model="stub", prompts=str(prompts), batch_size=4,
                        holdout=0.0, max_prompt_tokens=40)
    llm = _ContinuingLLM()
    manifest = prepare(cfg, llm=llm)
    assert sorted(llm.prompts) == sorted(llm.tokenizer.encode(t) for t in texts if len(t) < 40)
    assert manifest["num_samples"]["train"] == 8
    s = TokenDataset(cfg.out, split="train")[0]
    assert s.loss_mask.sum() == 20 and s.input_ids[0] == 2
    llm = _ContinuingLLM()
    prepare(PrepareConfig(**{**cfg.__dict__, "out": str(tmp_path / "cut"), "long_prompts": "truncate"}), llm=llm)
    cut = [p for p in llm.prompts if len(p) == 40]
    tails = sorted(llm.tokenizer.encode(t)[-39:] for t in texts if len(t) >= 40)
    assert len(cut) == 4 and all(p[0] == 2 for p in cut) and sorted(p[1:] for p in cut) == tails
    with pytest.raises(ValueError, match="magpie"):
        prepare(PrepareConfig(**{**cfg.__dict__, "out": str(tmp_path / "m"), "magpie": 2}), llm=llm)
