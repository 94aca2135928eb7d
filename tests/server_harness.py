"""Test harness for the server tests: a tiny random-weight Llama engine, a printable-ASCII character
tokenizer with a chat template, and a uvicorn server on 127.0.0.1 (port chosen by the OS) in a
background thread.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

import httpx
import openai
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from dspark.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from dspark.drafters import build_drafter
from dspark.engine.engine import Engine
from dspark.models import build_model
from dspark.models.config import ModelConfig
from dspark.server.app import build_app
from dspark.server.async_engine import AsyncEngine
from dspark.server.config import ServerConfig
from dspark.structured import GrammarCompiler

MODEL = "tiny"
MAX_MODEL_LEN = 128
FIRST_CHAR = 32  # token id t >= NUM_SPECIAL decodes to chr(FIRST_CHAR + t - NUM_SPECIAL)
NUM_SPECIAL = 3  # 0 pad, 1 bos, 2 eos
TINY = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=NUM_SPECIAL + 95, hidden_size=64,
    intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, rms_norm_eps=1e-5,
    max_position_embeddings=256, bos_token_id=1, eos_token_ids=(2,))


class CharTokenizer:
    """Printable-ASCII character tokenizer, its own HF-style `.tokenizer` and chat template."""

    eos_token_ids = (2,)

    @property
    def tokenizer(self):
        return self

    @property
    def vocab_size(self) -> int:
        return TINY.vocab_size

    def convert_ids_to_tokens(self, ids) -> list[str]:
        return [self.decode([t], skip_special_tokens=False) for t in ids]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [NUM_SPECIAL + ord(c) - FIRST_CHAR if FIRST_CHAR <= ord(c) < FIRST_CHAR + 95
                else NUM_SPECIAL + ord("?") - FIRST_CHAR for c in text]

    def token_bytes(self) -> list[bytes]:
        """Each id's bytes (specials empty): the grammar library's view of this vocabulary."""
        return [b""] * NUM_SPECIAL + [bytes([FIRST_CHAR + i]) for i in range(95)]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(FIRST_CHAR + t - NUM_SPECIAL) if t >= NUM_SPECIAL else
                       ("" if skip_special_tokens else f"<{t}>") for t in ids)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **template_kwargs) -> list[int]:
        for m in messages:
            if m["role"] not in ("system", "user", "assistant"):
                raise ValueError(f"unknown role {m['role']!r}")
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return [1] + self.encode(text + ("assistant: " if add_generation_prompt else ""))


def build_tiny_model():
    torch.manual_seed(0)
    model = build_model(TINY, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.05)  # small weights: greedy text falls into loops the n-gram
                # drafter can predict, so speculative chunks carry several tokens
    return model


class ScriptedTarget:
    """A target with a script: at output position i (from `prompt_len`) its logits favour script[i] by a
    margin no random logit reaches; after the script they are the model's own. The position rides in one
    extra hidden column from forward to compute_logits. Makes a random model write what a test needs (a
    think block, a tool call) through the whole engine."""

    def __init__(self, model, prompt_len: int, script: list[int]):
        self.model, self.script = model, {prompt_len + i: t for i, t in enumerate(script)}

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, input_ids, positions, meta, kv_caches, tap_layer_ids=()):
        hidden, taps = self.model(input_ids, positions, meta, kv_caches, tap_layer_ids=tap_layer_ids)
        return torch.cat([hidden, positions.unsqueeze(1).to(hidden.dtype)], dim=1), taps

    def compute_logits(self, hidden):
        logits = self.model.compute_logits(hidden[:, :-1])
        for row, pos in enumerate(hidden[:, -1].long().tolist()):
            if pos + 1 in self.script:
                logits[row, self.script[pos + 1]] += 1e4
        return logits


def make_engine(model, *, spec: SpecConfig | None = None, num_kv_blocks: int = 96,
                max_num_seqs: int = 8, budget: int = 64) -> Engine:
    config = EngineConfig(
        model=MODEL, cache=CacheConfig(kv_block_size=4, num_kv_blocks=num_kv_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                  max_model_len=MAX_MODEL_LEN), spec=spec)
    drafter = None if spec is None else build_drafter(spec, target_config=TINY, target_model=model,
                                                      dtype=torch.float32, device="cpu")
    engine = Engine(config, model=model, model_config=TINY, drafter=drafter, eos_token_ids=(2,))
    engine.grammar_compiler = GrammarCompiler.for_tokenizer(CharTokenizer(), vocab_size=TINY.vocab_size,
                                                            eos_token_ids=(2,))
    return engine


def slowed(engine: Engine, sleep_s: float) -> Engine:
    """`engine` with every step `sleep_s` seconds longer, so a test can act while requests wait or run."""
    real_step = engine.step

    def step():
        time.sleep(sleep_s)
        return real_step()

    engine.step = step
    return engine


@dataclass
class Served:
    base_url: str
    engine: Engine
    async_engine: AsyncEngine
    model_name: str = MODEL

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=api_key, max_retries=0,
                             timeout=60)

    def post(self, path: str, **kwargs) -> httpx.Response:
        return httpx.post(self.base_url + path, timeout=60, **kwargs)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """{(sample name, labels other than model_name / engine): value}; every sample must carry
        vLLM's model_name and engine labels."""
        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = dict(s.labels)
                assert labels.pop("model_name", None) == self.model_name, (s.name, s.labels)
                assert labels.pop("engine", None) == "0", (s.name, s.labels)
                out[(s.name, tuple(sorted(labels.items())))] = s.value
        return out

    def wait_idle(self, timeout_s: float = 20.0) -> None:
        """Until the engine has no request and every KV block is free; then check the pool."""
        bm = self.engine.block_manager
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (not self.engine.requests and bm.num_free_blocks == len(bm.blocks)
                    and not self.async_engine.num_active):
                break
            time.sleep(0.02)
        assert not self.engine.requests, f"left in the engine: {list(self.engine.requests)}"
        assert bm.num_free_blocks == len(bm.blocks), (
            f"{bm.num_free_blocks}/{len(bm.blocks)} blocks free")
        bm.check_invariants()


@contextlib.contextmanager
def run_app(app):
    """`app` under uvicorn on 127.0.0.1 (a port the OS picks) in a background thread: its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(20)


@contextlib.contextmanager
def serve(engine: Engine, *, api_key=None, config: ServerConfig | None = None, tokenizer=None,
          model_name=MODEL):
    config = config or ServerConfig()
    first = model_name if isinstance(model_name, str) else model_name[0]
    async_engine = AsyncEngine(engine, tokenizer or CharTokenizer(), max_num_waiting=config.max_num_waiting,
                               request_timeout_s=config.request_timeout_s, model_name=first)
    app = build_app(async_engine, model_name=model_name, api_key=api_key, config=config)
    with run_app(app) as url:
        yield Served(url, engine, async_engine, first)


def stream_events(srv: Served, path: str, payload: dict) -> list[str]:
    """The `data:` payloads of one SSE response, checking the framing (event, blank line)."""
    with httpx.stream("POST", srv.base_url + path, json=payload, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        body = resp.read().decode()
    events = body.split("\n\n")
    assert events[-1] == "", "the stream must end with a blank line after the last event"
    assert all(e.startswith("data: ") for e in events[:-1]), events
    return [e[len("data: "):] for e in events[:-1]]
