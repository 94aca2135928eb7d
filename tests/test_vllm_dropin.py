"""A vLLM user's code run against dspark unchanged: a real `dspark serve` process started with a vLLM
launch line (n-gram speculation) and driven by the official openai client, and each form of the Python
API (`LLM(model=..., **engine_args)`, `generate` / `chat`, `RequestOutput`). The model is a tiny random
Llama checkpoint on disk (tests/tiny_checkpoint.py)."""

from __future__ import annotations

import json
import sys

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dspark.bench.server_proc import ServerProcess
from dspark.sampling import SamplingParams
from tiny_checkpoint import write_tiny_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


def test_vllm_launch_line_and_openai_client(tiny_dir, tmp_path):
    argv = [sys.executable, "-m", "dspark", "serve", "--model", str(tiny_dir), "--host", "127.0.0.1",
            "--port", "{port}", "--api-key", "k1", "k2", "--served-model-name", "tiny-a", "tiny-b",
            "--max-model-len", "0.5k", "--max-num-seqs", "4", "--max-num-batched-tokens", "256",
            "--enable-prefix-caching", "--block-size", "16", "--kv-cache-memory-bytes", "16M", "--dtype", "auto",
            "--seed", "0", "--generation-config", "vllm", "--disable-log-requests", "--uvicorn-log-level",
            "warning", "--disable-log-stats", "--max-logprobs", "5", "--tensor-parallel-size", "1",
            "--trust-remote-code", "--enforce-eager",
            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}']
    with ServerProcess(argv, log_path=tmp_path / "serve.log", start_timeout_s=900) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="k2", max_retries=0, timeout=120)
        models = client.models.list().data
        assert [m.id for m in models] == ["tiny-a", "tiny-b"]
        assert all(m.model_extra["max_model_len"] == 500 for m in models)
        chat = client.chat.completions.create(
            model="tiny-b", messages=[{"role": "user", "content": "the water is the water is the"}],
            max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
        assert chat.id.startswith("chatcmpl-") and chat.model == "tiny-a"
        assert chat.usage.completion_tokens == 12 and chat.choices[0].finish_reason == "length"
        chunks = list(client.completions.create(model="tiny-a", prompt="the water is the water is the",
                                                max_tokens=12, temperature=0, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        assert chunks[-1].usage.completion_tokens == 12 and chunks[0].id.startswith("cmpl-")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.base_url + "/v1", api_key="k3", max_retries=0).models.list()
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt="x", max_tokens=1)

        headers = {"Authorization": "Bearer k1"}
        tok = httpx.post(srv.base_url + "/tokenize", json={"prompt": "the water is"}, headers=headers).json()
        assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 500
        detok = httpx.post(srv.base_url + "/detokenize", json={"tokens": tok["tokens"]}, headers=headers).json()
        assert "the water is" in detok["prompt"]
        assert httpx.get(srv.base_url + "/version").json()["version"]

        families = text_string_to_metric_families(httpx.get(srv.base_url + "/metrics").text)
        samples = [s for f in families for s in f.samples]
        assert samples and all(s.labels.get("model_name") == "tiny-a" for s in samples if s.name.startswith("vllm:"))
        value = {(s.name, s.labels.get("position")): s.value for s in samples}
        assert value[("vllm:spec_decode_num_drafts_total", None)] > 0
        assert {p for n, p in value if n == "vllm:spec_decode_num_accepted_tokens_per_pos_total"} == {"0", "1", "2"}
        assert value[("vllm:generation_tokens_total", None)] >= 24
        assert value[("vllm:prefix_cache_queries_total", None)] > 0
        assert ("vllm:inter_token_latency_seconds_count", None) in value


# -- the Python API ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_dir):
    from dspark import LLM
    return LLM(model=str(tiny_dir), max_model_len=256, block_size=8, num_kv_blocks=128, max_num_seqs=8,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3})


PROMPT = "the water is the water is"


def test_generate_accepts_every_prompt_form(llm):
    ids = llm.get_tokenizer().encode(PROMPT)
    forms = [PROMPT, ids, {"prompt": PROMPT}, {"prompt_token_ids": ids}]
    single = [llm.generate(form, sampling_params=GREEDY, use_tqdm=False)[0] for form in forms]
    batch = llm.generate(forms, GREEDY, use_tqdm=False)
    for out in single + batch:
        assert out.finished and out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == single[0].outputs[0].token_ids and len(out.outputs[0].token_ids) == 8
        assert out.outputs[0].text == single[0].outputs[0].text and out.outputs[0].finish_reason == "length"
    assert single[0].prompt == PROMPT and single[1].prompt is None
    m = single[0].metrics
    assert m.arrival_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    assert m.first_token_latency >= 0 and m.num_generation_tokens == 8


def test_generate_per_prompt_params_and_bad_prompts(llm):
    outs = llm.generate([PROMPT, PROMPT], [GREEDY, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)],
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 3]
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {}}, GREEDY)
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate([PROMPT], [GREEDY, GREEDY])


def test_use_tqdm_takes_a_bar_factory(llm):
    bars = []

    class Bar:
        def __init__(self, total, **kwargs):
            self.total, self.done = total, 0
            bars.append(self)

        def update(self, n):
            self.done += n

        def close(self):
            pass

    llm.generate([PROMPT, "water"], GREEDY, use_tqdm=Bar)
    assert [(b.total, b.done) for b in bars] == [(2, 2)]


def test_chat_options(llm):
    messages = [{"role": "user", "content": "the water"}, {"role": "assistant", "content": "is the"}]
    tokenizer = llm.get_tokenizer()
    plain = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    assert plain.prompt_token_ids == tokenizer.encode(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    cont = llm.chat(messages, GREEDY, use_tqdm=False, continue_final_message=True)[0]
    assert tokenizer.decode(cont.prompt_token_ids).rstrip().endswith("is the")
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    custom = llm.chat(messages, GREEDY, use_tqdm=False, chat_template=template, add_generation_prompt=False)[0]
    assert custom.prompt_token_ids == tokenizer.encode("the water is the ", add_special_tokens=False)
    parts = [{"role": "user", "content": [{"type": "text", "text": "the water"}]}]
    assert llm.chat(parts, GREEDY, use_tqdm=False, tools=[{"type": "function", "function": {"name": "f"}}])[0].finished
    many = llm.chat([messages, messages[:1]], GREEDY, use_tqdm=False)
    assert len(many) == 2 and many[0].outputs[0].token_ids == plain.outputs[0].token_ids


def test_generation_config_defaults(tiny_dir, tmp_path):
    from dspark import LLM
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5}))
    llm = LLM(model=str(tiny_dir), max_model_len=128, num_kv_blocks=64, generation_config=str(tmp_path))
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5)
    out = llm.generate(PROMPT, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) <= 5
    with pytest.raises(ValueError, match="generation_config"):
        LLM(model=str(tiny_dir), num_kv_blocks=64, generation_config=str(tmp_path / "none")).get_default_sampling_params()


def test_unknown_engine_arguments_are_type_errors(tiny_dir):
    from dspark import LLM
    with pytest.raises(TypeError, match="bogus, wrong"):
        LLM(model=str(tiny_dir), wrong=1, bogus=2)
    with pytest.raises(TypeError, match="swap_space is not supported"):
        LLM(model=str(tiny_dir), swap_space=4)
