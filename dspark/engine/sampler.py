"""The target's side of one step: logits rows → processed rows → emitted tokens (and logprobs).

Each emitting request has `1 + num_drafts` logits rows; row j predicts output position
`len(output) + j`. Per request:

1. Logits processors (`logits_processors.py`) and the grammar mask (`structured.py`) at each row,
   with the drafts d1..dj before row j counted as output (plain decoding is the window without
   drafts, so both see the same rows).
2. Greedy requests: the argmax of each processed row; drafts accepted while they equal it.
3. Sampled requests with point-mass drafts (greedy drafters, prompt lookup) or none — the default:
   the target's token at output position p is the Gumbel-max (exponential race) draw
   `argmax_v prob(v) / E_v`, with `E_v = -log U_v` and the uniforms U keyed on (request seed, p).
   The token at a position is therefore the same whether a plain step or a verify window reaches it;
   a draft is accepted exactly when it equals that token, which happens with probability
   prob(draft), as under rejection sampling, and a rejected position emits the keyed token itself,
   which is distributed as the residual (the target row with the draft removed). Seeded output is
   the same as plain decoding with that seed, whatever the batch, the drafts or their number.
4. Sampled requests with a draft distribution (`draft_sample_method="probabilistic"`): lossless
   rejection sampling (`verify/rejection.py`) on the processed rows, with the request's generator.

Logprobs (`SamplingParams.logprobs`) are log-softmax of the processed rows (processors and grammar
applied, before temperature), for each emitted token, with the top k of its row.
"""

from __future__ import annotations

import itertools

import torch

from dspark.logits_processors import WindowRows, apply_processors
from dspark.sampling import RowArgmax, TokenLogprob, greedy_ids, logits_to_probs, target_argmax
from dspark.verify.rejection import (VerifyResult, _accept_greedy, _verify_one_rejection,
                                     verify_greedy_argmax)

_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed for (request seed, output position): splitmix64 of their mix."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def keyed_exponentials(seed: int, position: int, vocab_size: int) -> torch.Tensor:  # [vocab_size]
    """Exp(1) noise that depends only on (seed, position)."""
    g = torch.Generator().manual_seed(position_seed(seed, position))
    return -torch.log(torch.rand(vocab_size, generator=g))  # U = 0 gives +inf: never the argmax


def keyed_sample(probs: torch.Tensor, seed: int, position: int) -> int:
    """Gumbel-max draw from `probs` [vocab_size] with the noise of (seed, position)."""
    noise = keyed_exponentials(seed, position, probs.shape[-1]).to(probs.device)
    return int((probs / noise).argmax())


def _needs_rows(req) -> bool:
    p = req.params
    return p.has_processors or req.grammar is not None or p.logprobs is not None


def argmax_suffices(items: list) -> bool:
    """Does verifying these emitting items read nothing of the target's logits rows but each row's argmax
    (every request greedy, without logprobs, logits processors or a grammar)? Then the step may ask the
    runner for a `RowArgmax` instead of the rows (a vocabulary-parallel head gathers no rows)."""
    return all(s.request.params.is_greedy and not _needs_rows(s.request) for s in items)


def sample_step(items: list, logits: "torch.Tensor | RowArgmax", *,
                eos_token_ids: tuple[int, ...]) -> tuple[VerifyResult, dict[str, list[TokenLogprob]]]:
    """Verify every emitting item (`ScheduledRequest`) of a step against its `logits` rows
    [sum of num_logits, vocab_size] (or only their `RowArgmax`, where `argmax_suffices`); returns the
    result (in item order) and the logprobs of the emitted tokens by request id (for requests that
    asked)."""
    drafts = [s.request.draft_ids[:s.num_drafts] for s in items]
    if argmax_suffices(items):
        argmax = target_argmax(logits).tolist()  # [num_logits]: compare-only, no distributions
        bounds = list(itertools.accumulate((s.num_logits for s in items), initial=0))
        return verify_greedy_argmax(target_argmax=[argmax[a:b] for a, b in zip(bounds, bounds[1:])],
                                    draft_ids=drafts), {}
    if isinstance(logits, RowArgmax):
        raise ValueError("a step with sampled, logprobs, processed or structured requests needs the logits rows")
    rows = list(torch.split(logits, [s.num_logits for s in items]))  # per item [num_logits, vocab_size]
    for i, s in enumerate(items):
        req = s.request
        if req.params.has_processors or req.grammar is not None:
            rows[i] = apply_processors(rows[i], WindowRows(req.params, req.prompt_ids, req.output_ids,
                                                            drafts[i], eos_token_ids))
            if req.grammar is not None:
                rows[i].masked_fill_(~req.grammar.window_masks(drafts[i]).to(rows[i].device), float("-inf"))
    sampled = [i for i, s in enumerate(items) if not s.request.params.is_greedy]
    probs = dict(zip(sampled, torch.split(_probs([items[i] for i in sampled], [rows[i] for i in sampled]),
                                          [items[i].num_logits for i in sampled]))) if sampled else {}
    results = []
    for i, s in enumerate(items):
        req = s.request
        if req.params.is_greedy:
            results.append(_accept_greedy(greedy_ids(rows[i]).tolist(), drafts[i]))
        elif req.draft_probs is not None and s.num_drafts:
            results.append(_verify_one_rejection(probs[i], drafts[i], req.draft_probs[:s.num_drafts],
                                                 req.generator))
        else:
            first = len(req.output_ids)
            targets = [keyed_sample(probs[i][j], req.sample_seed, first + j) for j in range(s.num_logits)]
            results.append(_accept_greedy(targets, drafts[i]))
    result = VerifyResult(num_accepted=[r[0] for r in results], output_ids=[r[1] for r in results],
                          is_bonus=[r[2] for r in results])
    logprobs = {s.request.request_id: _logprobs(rows[i], result.output_ids[i], s.request.params.logprobs)
                for i, s in enumerate(items) if s.request.params.logprobs is not None}
    return result, logprobs


def _probs(items: list, rows: list[torch.Tensor]) -> torch.Tensor:  # [sum of num_logits, vocab_size]
    def per_row(get):
        return [get(s.request.params) for s in items for _ in range(s.num_logits)]
    cat = torch.cat(rows)
    dev = cat.device
    return logits_to_probs(
        cat, temperature=torch.tensor(per_row(lambda p: p.temperature), device=dev),
        top_k=torch.tensor(per_row(lambda p: p.top_k), device=dev),
        top_p=torch.tensor(per_row(lambda p: p.top_p), device=dev),
        min_p=torch.tensor(per_row(lambda p: p.min_p), device=dev))


def _logprobs(rows: torch.Tensor,  # [num_logits, vocab_size] processed
              emitted: list[int], k: int) -> list[TokenLogprob]:
    lp = torch.log_softmax(rows[:len(emitted)].float(), dim=-1)  # [num_emitted, vocab_size]
    chosen = lp.gather(1, torch.tensor(emitted, device=lp.device).unsqueeze(1)).squeeze(1).tolist()
    top = lp.topk(k, dim=-1) if k else None
    out = []
    for j, tok in enumerate(emitted):
        pairs = [] if top is None else list(zip(top.indices[j].tolist(), top.values[j].tolist()))
        out.append(TokenLogprob(tok, chosen[j], pairs))
    return out
