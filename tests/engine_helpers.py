"""Helpers for engine-level tests: tiny random targets (with their HF twins) wrapped in an Engine."""

from __future__ import annotations

import torch

from dspark.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from dspark.engine.engine import Engine
from dspark.llm import LLM
from dspark.models import build_model
from dspark.sampling import SamplingParams


def tiny_target(cfg, *, seed: int = 0):
    """(our model, the HF twin) with the same random weights."""
    from tests.conftest import hf_twin
    hf = hf_twin(cfg, seed=seed)
    model = build_model(cfg, dtype=torch.float32)
    with torch.inference_mode():
        model.load_weights(hf.state_dict().items())
    return model, hf


def make_engine(model, cfg, *, drafter=None, spec: SpecConfig | None = None, num_kv_blocks=256,
                kv_block_size=4, budget=64, max_num_seqs=16, length_policy=None, prefix=True,
                coalesce_steps=0, device="cpu", dtype="float32", kv_cache_dtype="auto", max_state_snapshots=16,
                state_snapshot_interval=512):
    config = EngineConfig(
        device=device, dtype=dtype,
        cache=CacheConfig(kv_block_size=kv_block_size, num_kv_blocks=num_kv_blocks,
                          enable_prefix_caching=prefix, kv_cache_dtype=kv_cache_dtype,
                          max_state_snapshots=max_state_snapshots, state_snapshot_interval=state_snapshot_interval),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                  coalesce_steps=coalesce_steps),
        spec=spec)
    return Engine(config, model=model, model_config=cfg, drafter=drafter, length_policy=length_policy)


def ngram_engine_args() -> dict:
    """make_engine keywords for a prompt-lookup drafter (4 drafts, n-grams of 1 to 3)."""
    from dspark.drafters.ngram import NgramDrafter
    return {"drafter": NgramDrafter(num_draft_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3),
            "spec": SpecConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)}


def run(engine, prompts, params) -> list[list[int]]:
    llm = LLM(engine=engine, tokenizer=None)
    return [o.token_ids for o in llm.generate(prompts, params)]


def run_one_at_a_time(engine, prompts, params) -> list[list[int]]:
    return [run(engine, [p], params)[0] for p in prompts]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def hf_greedy(hf, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                          do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def repetitive_prompts(n: int, vocab: int, *, seed: int = 0, length: int = 40) -> list[list[int]]:
    """Prompts with repeated n-grams (the n-gram drafter finds matches) and shared prefixes (prefix-cache
    hits)."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab, (9,), generator=g).tolist()
    out = []
    for i in range(n):
        motif = torch.randint(3, vocab, (5,), generator=g).tolist()
        body = (motif * (length // 5 + 1))[:length - 9 - i]
        out.append((shared if i % 2 == 0 else []) + body + motif[:2])
    return out


def two_token_law(hf, prompt: list[int], temperature: float, firsts: int = 4):
    """The categories (first token among the `firsts` likeliest, second token) plus one for any other first token,
    and their exact probabilities under the transformers model `hf` at `temperature`: (those first tokens, law)."""
    def last_probs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.softmax(hf(torch.tensor([ids])).logits[0, -1].double() / temperature, -1)
    p1 = last_probs(prompt)
    top = p1.topk(firsts).indices.tolist()
    rows = [p1[t] * last_probs(prompt + [t]) for t in top]
    return top, torch.cat(rows + [torch.tensor([1.0 - p1[top].sum()], dtype=torch.float64)])


def two_token_samples(engine, prompt: list[int], n: int, top: list[int], temperature: float) -> torch.Tensor:
    """n seeded requests of two tokens through `engine` -> each one's category of `two_token_law`."""
    ids = [engine.add_request(prompt, SamplingParams(temperature=temperature, max_tokens=2, ignore_eos=True, seed=s))
           for s in range(n)]
    outs: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
    vocab = engine.model_config.vocab_size
    return torch.tensor([top.index(o[0]) * vocab + o[1] if o[0] in top else len(top) * vocab
                         for o in (outs[i] for i in ids)])
