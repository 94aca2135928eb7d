"""Chat templates sent with a request: refused (400 naming the field) unless the server runs with
`--trust-request-chat-template`; a trusted one renders in a child process, so a template that expands without
bound, allocates without bound or loops for hours is a 400 naming `chat_template` within its budget, the
server's memory never holds the expansion, and other clients are served meanwhile."""

from __future__ import annotations

import resource
import threading

import pytest

from dspark.server import request_template
from dspark.server.config import ServerConfig
from server_harness import CharTokenizer, build_tiny_model, make_engine, serve

TOK = CharTokenizer()
MESSAGES = [{"role": "user", "content": "hello there"}]
ECHO = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
BOMBS = {
    "size": "{{ 'x' * 50000000 }}",  # 27 bytes: 50 MB of text
    "memory": "{{ 'x' * 100000000000 }}",  # 100 GB
    "time": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
}


def _chat(srv, **fields):
    return srv.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2,
                                                  "temperature": 0.0, **fields})


@pytest.fixture(scope="module")
def trusted():
    with serve(make_engine(build_tiny_model()), config=ServerConfig(trust_request_chat_template=True)) as srv:
        yield srv


def test_request_templates_are_refused_by_default():
    with serve(make_engine(build_tiny_model())) as srv:
        for fields, param in (({"chat_template": ECHO}, "chat_template"),
                              ({"chat_template_kwargs": {"chat_template": ECHO}}, "chat_template_kwargs")):
            resp = _chat(srv, **fields)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
            assert "--trust-request-chat-template" in resp.json()["error"]["message"]
        assert _chat(srv).status_code == 200  # the model's own template


def test_a_trusted_template_renders_the_conversation(trusted):
    for fields in ({"chat_template": ECHO}, {"chat_template_kwargs": {"chat_template": ECHO}}):
        resp = _chat(trusted, **fields)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["prompt_tokens"] == len("<user>hello there")


@pytest.mark.parametrize("bomb", list(BOMBS))
def test_a_template_past_its_budget_is_a_400_and_costs_the_server_nothing(trusted, monkeypatch, bomb):
    monkeypatch.setattr(request_template, "TIME_BUDGET_S", 1.0)
    monkeypatch.setattr(request_template, "MEMORY_BUDGET_BYTES", 256 << 20)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    resp = _chat(trusted, chat_template=BOMBS[bomb])
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "chat_template", resp.text
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 40 << 10  # the expansion stayed in the child
    assert _chat(trusted, chat_template=ECHO).status_code == 200  # the renderer still serves


def test_other_requests_are_served_while_a_template_renders(trusted, monkeypatch):
    monkeypatch.setattr(request_template, "TIME_BUDGET_S", 5.0)
    slow = threading.Thread(target=lambda: _chat(trusted, chat_template=BOMBS["time"]))
    slow.start()
    try:
        for _ in range(3):
            assert _chat(trusted).status_code == 200
        assert slow.is_alive(), "the other requests waited for the template"
    finally:
        slow.join()
