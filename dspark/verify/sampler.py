"""The target's side of one step: logits rows → processed rows → emitted tokens (and logprobs).

Each emitting request has `1 + num_drafts` logits rows; row j predicts output position
`len(output) + j`. Per request:

1. Logits processors (`logits_processors.py`) and the grammar mask (`structured.py`) at each row,
   with the drafts d1..dj before row j counted as output (plain decoding is the window without
   drafts, so both see the same rows).
2. Greedy requests: the argmax of each processed row; drafts accepted while they equal it.
3. Sampled requests with point-mass drafts (greedy drafters, prompt lookup) or none — the default:
   the target's token at output position p is the inverse-CDF draw at a uniform U keyed on (request
   seed, p): the first token whose cumulative probability exceeds U. The token at a position is
   therefore the same whether a plain step or a verify window reaches it; a draft is accepted exactly
   when it equals that token, which happens with probability prob(draft), as under rejection sampling,
   and a rejected position emits the keyed token itself, which is distributed as the residual (the
   target row with the draft removed). Seeded output is the same as plain decoding with that seed,
   whatever the batch, the drafts or their number. Every sampled row of the step is drawn at once: one
   cumulative sum, one search, one copy to the host.
4. Sampled requests with a draft distribution (`draft_sample_method="probabilistic"`): lossless
   rejection sampling (`verify/rejection.py`) on the processed rows, with the request's generator, token by
   token or, with `rejection_sample_method="block"`, as one block (`verify/block.py`).

Logprobs (`SamplingParams.logprobs`) are log-softmax of the processed rows (processors and grammar
applied, before temperature), for each emitted token, with the top k of its row.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from dspark.request import RequestError
from dspark.logits_processors import WindowRows, apply_processors
from dspark.sampling import RowArgmax, TokenLogprob, greedy_ids, logits_to_probs, target_argmax
from dspark.verify.block import verify_one_block
from dspark.verify.rejection import VerifyResult, accept_greedy, verify_greedy_argmax, verify_one_rejection

_MASK64 = (1 << 64) - 1
KEYED_BLOCK = 512  # tokens per block of the two-level inverse-CDF draw


def position_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed for (request seed, output position): splitmix64 of their mix."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def keyed_uniform(seed: int, position: int) -> float:
    """U[0, 1) that depends only on (seed, position): the top 53 bits of position_seed."""
    return (position_seed(seed, position) >> 10) / 2.0 ** 53


def keyed_samples(probs: torch.Tensor,  # [num_rows, vocab_size], rows summing to ~1
                  keys: list[tuple[int, int]]) -> list[int]:  # (seed, position) per row
    """Inverse-CDF draws, one per row: the first token whose cumulative probability exceeds the row's keyed
    uniform times the row's mass. Two levels, so the full rows are only summed (fp32, in blocks of
    KEYED_BLOCK tokens): the block is found on the fp64 running sum of block masses, the token on the fp64
    running sum inside that block. A zero-probability token is never drawn."""
    num_rows, vocab = probs.shape
    pad = -vocab % KEYED_BLOCK
    blocks = (F.pad(probs, (0, pad)) if pad else probs).reshape(num_rows, -1, KEYED_BLOCK)  # [rows, blocks, KEYED_BLOCK]
    block_cdf = blocks.sum(dim=-1).double().cumsum(dim=-1)  # [num_rows, num_blocks]
    u = torch.tensor([keyed_uniform(seed, pos) for seed, pos in keys], dtype=torch.float64, device=probs.device)
    target = (u * block_cdf[:, -1]).unsqueeze(1)  # [num_rows, 1], below the row's mass
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=block_cdf.shape[1] - 1)  # [num_rows, 1]
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)  # [num_rows, 1]
    rows = torch.arange(num_rows, device=probs.device)
    inner_cdf = blocks[rows, block.squeeze(1)].double().cumsum(dim=-1)  # [num_rows, KEYED_BLOCK]
    # the block's fp32 mass and its fp64 running sum may differ in the last bits: stay inside the block
    inner = torch.minimum(target - before, torch.nextafter(inner_cdf[:, -1:], torch.zeros_like(before)))
    offset = torch.searchsorted(inner_cdf, inner, right=True).clamp_(max=KEYED_BLOCK - 1)  # [num_rows, 1]
    return (block * KEYED_BLOCK + offset).squeeze(1).tolist()


def keyed_sample(probs: torch.Tensor, seed: int, position: int) -> int:
    """The keyed draw from one row `probs` [vocab_size] at (seed, position)."""
    return keyed_samples(probs.unsqueeze(0), [(seed, position)])[0]


def _needs_rows(req) -> bool:
    p = req.params
    return p.has_processors or req.grammar is not None or p.logprobs is not None


def _rejection(s) -> bool:
    """Is this sampled item verified by rejection sampling (drafts with a distribution) rather than keyed?"""
    return s.drafts.probs is not None and s.num_drafts > 0


def argmax_suffices(items: list) -> bool:
    """Does verifying these emitting items read nothing of the target's logits rows but each row's argmax
    (every request greedy, without logprobs, logits processors or a grammar)? Then the step may ask the
    runner for a `RowArgmax` instead of the rows (a vocabulary-parallel head gathers no rows)."""
    return all(s.request.params.is_greedy and not _needs_rows(s.request) for s in items)


NO_TOKEN_ALLOWED = RequestError("no token may follow at this position: the request's min_tokens, allowed_token_ids, "
                                "bad_words or structured output exclude every token")


def sample_step(items: list, logits: "torch.Tensor | RowArgmax", *, eos_token_ids: tuple[int, ...],
                faults: dict[str, str] | None = None, block: bool = False
                ) -> tuple[VerifyResult, dict[str, list[TokenLogprob]]]:
    """Verify every emitting item (`ScheduledRequest`) of a step against its `logits` rows
    [sum of num_logits, vocab_size] (or only their `RowArgmax`, where `argmax_suffices`); returns the
    result (in item order) and the logprobs of the emitted tokens by request id (for requests that
    asked). `block`: drafts with a distribution are verified as one block (`verify/block.py`)."""
    drafts = [s.draft_ids for s in items]  # per item [num_drafts]
    if argmax_suffices(items):
        argmax = target_argmax(logits).tolist()  # [num_logits]: compare-only, no distributions
        bounds = list(itertools.accumulate((s.num_logits for s in items), initial=0))
        return verify_greedy_argmax(target_argmax=[argmax[a:b] for a, b in zip(bounds, bounds[1:])],
                                    draft_ids=drafts), {}
    if isinstance(logits, RowArgmax):
        raise ValueError("a step with sampled, logprobs, processed or structured requests needs the logits rows")
    rows = list(torch.split(logits, [s.num_logits for s in items]))  # per item [num_logits, vocab_size]
    dead_rows: dict[int, list[bool]] = {}
    for i, s in enumerate(items):
        req = s.request
        if req.params.has_processors or req.grammar is not None:
            rows[i] = apply_processors(rows[i], WindowRows(req.params, req.prompt_ids, req.output_ids,
                                                            drafts[i], eos_token_ids))
            if req.grammar is not None:
                rows[i].masked_fill_(~req.grammar.window_masks(drafts[i]).to(rows[i].device), float("-inf"))
            dead = ~torch.isfinite(rows[i]).any(dim=-1)  # [num_logits]: rows that allow no token
            if bool(dead.any()):  # drawn from a harmless row; a request that reaches one is failed below
                rows[i] = rows[i].masked_fill(dead.unsqueeze(1), 0.0)
                dead_rows[i] = dead.tolist()
    sampled = [i for i, s in enumerate(items) if not s.request.params.is_greedy]
    sampled_probs = _probs([items[i] for i in sampled], [rows[i] for i in sampled]) if sampled else None
    probs = dict(zip(sampled, torch.split(sampled_probs, [items[i].num_logits for i in sampled]))) if sampled else {}
    keyed = [i for i in sampled if not _rejection(items[i])]
    draws = iter(())
    if keyed:  # every keyed row in one draw: the sampled rows themselves unless some are verified by rejection
        keyed_probs = sampled_probs if len(keyed) == len(sampled) else torch.cat([probs[i] for i in keyed])
        draws = iter(keyed_samples(keyed_probs, [(items[i].request.sample_seed, len(items[i].request.output_ids) + j)
                                                 for i in keyed for j in range(items[i].num_logits)]))
    results = []
    for i, s in enumerate(items):
        req = s.request
        if req.params.is_greedy:
            results.append(accept_greedy(greedy_ids(rows[i]).tolist(), drafts[i]))
        elif _rejection(s):
            verify = verify_one_block if block else verify_one_rejection
            results.append(verify(probs[i], drafts[i], s.draft_probs, req.generator))
        else:
            results.append(accept_greedy([next(draws) for _ in range(s.num_logits)], drafts[i]))
    result = VerifyResult(num_accepted=[r[0] for r in results], output_ids=[r[1] for r in results],
                          is_bonus=[r[2] for r in results])
    for i, dead in dead_rows.items():  # a row the emitted tokens went through allowed none: the request ends
        if any(dead[:result.num_accepted[i] + 1]) and faults is not None:
            faults[items[i].request.request_id] = NO_TOKEN_ALLOWED
    logprobs = {s.request.request_id: token_logprobs(rows[i], result.output_ids[i], s.request.params.logprobs)
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


def score_prompts(scheduled: list, rows: torch.Tensor) -> None:
    """Each scheduled request's prompt logprobs for the positions it scores this step
    (`ScheduledRequest.prompt_positions`), from their raw logits `rows` [num_prompt_logits, vocab_size] in
    item order."""
    scoring = [(s.request, s.prompt_positions) for s in scheduled if s.prompt_positions]
    for (req, positions), part in zip(scoring, torch.split(rows, [len(p) for _, p in scoring])):
        req.prompt_logprobs += token_logprobs(part, [req.prompt_ids[p + 1] for p in positions],
                                              req.params.prompt_logprobs)


def token_logprobs(rows: torch.Tensor,  # [>= len(token_ids), vocab_size]
                   token_ids: list[int], k: int) -> list[TokenLogprob]:
    """Row j's log-softmax at token_ids[j], that token's rank and the row's top k: an emitted token's under
    its processed row, a prompt token's under the raw row of the position before it."""
    lp = torch.log_softmax(rows[:len(token_ids)].float(), dim=-1)  # [num_tokens, vocab_size]
    chosen = lp.gather(1, torch.tensor(token_ids, device=lp.device).unsqueeze(1))  # [num_tokens, 1]
    ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
    chosen = chosen.squeeze(1).tolist()
    top = lp.topk(k, dim=-1) if k else None
    out = []
    for j, tok in enumerate(token_ids):
        pairs = [] if top is None else list(zip(top.indices[j].tolist(), top.values[j].tolist()))
        out.append(TokenLogprob(tok, chosen[j], pairs, ranks[j]))
    return out
