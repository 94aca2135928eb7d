"""Token-budget scheduler with continuous batching (no prefill/decode phases).

Every step each running request gets a number of new tokens: a prompt chunk, a one-token decode, or a
verify window `[last, d1 .. dℓ]`. They share one flat batch under `max_num_batched_tokens`. Requests
join at any step (prompt coalescing can hold them a bounded number of steps so several share one
step) and leave when they finish. When the KV pool runs short the newest running request is preempted
by recompute: its blocks are freed and it goes back to the front of the queue with its tokens, so no
request is lost.

Drafts arrive as values: after each commit the engine hands over what the speculation controller proposed
(`hold_drafts`), the scheduler keeps each request's `Drafts` until it schedules that request's verify window,
and the window carries them (`ScheduledRequest.drafts`) to the runner and the verifier; the commit, a
preemption or the request's end drops them.

`commit` applies a `VerifyResult`: accepted drafts and the recovered/bonus token become output, the
committed length grows by what was verified (rejected positions roll back by a counter), and stop
conditions that fall inside an accepted run cut the output exactly where plain decoding would.

On a hybrid target with prefix caching, a prefix hit's first step starts from the state snapshot the block
manager matched (`ScheduledRequest.state_from`) and each step keeps the snapshots the manager plans for the block
boundaries its prompt positions cross (`state_saves`); drafts never do (only committed positions are kept).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Mapping

from dspark.config import SchedulerConfig
from dspark.engine.block_manager import BlockManager
from dspark.request import NO_DRAFTS, Drafts, Request, RequestStatus, ScheduledRequest, SchedulerOutput  # noqa: F401


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, *, max_model_len: int,
                 num_lookahead_slots: int = 0, drafter_needs_kv: bool = False,
                 model_drafting: Callable[[int, int], bool] | None = None):
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.num_lookahead_slots = num_lookahead_slots  # drafter scratch past the committed end (γ)
        self.drafter_needs_kv = drafter_needs_kv  # prefix hits must carry drafter K/V too
        # asked at each admission of a speculative request (a preempted one is asked again) with the load it
        # joins (running and waiting requests, up to max_num_seqs) and its length: may the model drafter keep a
        # context for it (`Request.model_drafting`)? None: always (or no drafter context to keep)
        self.model_drafting = model_drafting
        self.drafts: dict[str, Drafts] = {}  # request_id → the drafts its next verify window carries
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []  # finished since the last take_finished()
        self.num_prefix_cache_queries = 0  # tokens of admitted requests looked up in the prefix cache
        self.num_prefix_cache_hits = 0  # ... and found there

    # -- queue management ------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a request. Waiting requests take turns by client (`Request.client`): a client's k-th waiting
        request is queued behind every other client's first k, so one client's batch of prompts cannot hold
        another client's request back for more than a turn (requests of no client: one each, first come first
        served)."""
        last = None if req.client is None else next(
            (r.queue_turn for r in reversed(self.waiting) if r.client == req.client), None)
        head = self.waiting[0].queue_turn if self.waiting else 0
        req.queue_turn = head if last is None else max(head, last + 1)
        i = len(self.waiting)
        while i > 0 and self.waiting[i - 1].queue_turn > req.queue_turn:
            i -= 1
        self.waiting.insert(i, req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def take_finished(self) -> list[Request]:
        out, self.finished = self.finished, []
        return out

    def hold_drafts(self, drafts: Mapping[str, Drafts], *, context_extended: Iterable[Request] = ()) -> None:
        """After the commit: each request's drafts for its next verify window (replacing what it held), and the
        requests whose drafter context grew (their full blocks are registered with drafter K/V)."""
        self.drafts.update(drafts)
        for req in context_extended:
            self.block_manager.commit(req)

    # -- schedule --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        out = SchedulerOutput(scheduled=[])
        scheduled_ids: set[str] = set()
        reserve = self._waiting_reserve(budget)
        # decoding requests (a token and its drafts) first, then prompt chunks, each in arrival order: a long
        # prompt's chunks never take the step from a request that is already answering
        for req in sorted(self.running, key=lambda r: r.num_uncomputed_tokens > 1):
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop, as another's victim
            item = self._fit(req, budget, prompt_budget=max(1, budget - reserve))
            while not self._allocate(req, item):
                victim = self._pick_victim(scheduled_ids)
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is req:
                    item = None
                    break
            if item is None:
                continue  # req itself was preempted
            self._plan_snapshots(item)
            out.scheduled.append(item)
            scheduled_ids.add(req.request_id)
            budget -= item.num_new_tokens
        if not out.preempted_ids:
            self._admit_waiting(out, budget)
        for r in self.waiting:  # held by coalescing, or no room this step
            r.queued_steps += 1
        return out

    def next_step_demand(self) -> tuple[int, int]:
        """(decode tokens, prompt tokens) the next `schedule()` is asked for before any draft: one token
        per decoding request, the prompt chunks still to compute of running requests, and the waiting
        prompts it would admit (none while coalescing holds them; up to the free sequence slots)."""
        remaining = [r.num_uncomputed_tokens for r in self.running]
        decode = sum(1 for n in remaining if n <= 1)
        prompt = sum(n for n in remaining if n > 1)
        left = self.config.max_num_batched_tokens - decode - prompt
        if self.waiting and not self._holds_waiting(left):
            room = max(0, self.config.max_num_seqs - len(self.running))
            prompt += sum(r.num_uncomputed_tokens for r in itertools.islice(self.waiting, room))
        return decode, prompt

    def _holds_waiting(self, budget: int) -> bool:
        """Coalescing: hold the waiting prompts this step (they fill under half of the budget left and
        none has been held `coalesce_steps` steps yet)?"""
        if self.config.coalesce_steps <= 0 or not self.running or budget <= 0:
            return False
        waiting_tokens = sum(r.num_uncomputed_tokens for r in self.waiting)
        return 2 * waiting_tokens < budget and all(r.waiting_steps < self.config.coalesce_steps
                                                   for r in self.waiting)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        if self._holds_waiting(budget):
            for r in self.waiting:
                r.waiting_steps += 1
            return
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            queried, restore = 0, -1
            if not req.block_table and req.num_computed_tokens == 0:
                if req.params.speculation and self.model_drafting is not None:
                    req.model_drafting = self.model_drafting(
                        min(len(self.running) + len(self.waiting), self.config.max_num_seqs), req.num_tokens)
                need_draft_kv = self.drafter_needs_kv and req.needs_draft_context
                # a prompt whose logprobs are still to score computes every position it scores (no hit)
                cached = 0 if req.scores_prompt else self.block_manager.match_prefix(req, need_draft_kv=need_draft_kv)
                restore = self.block_manager.snapshot_entry(req) if cached else -1  # a hybrid hit's state
                req.num_computed_tokens = cached
                req.num_cached_tokens = cached
                req.num_draft_computed = cached if need_draft_kv else 0
                queried = req.num_tokens if self.block_manager.enable_prefix_caching else 0
            item = self._fit(req, budget)
            if not self._allocate(req, item):
                # pool short: give the prefix hit back (it stays cached) and wait for blocks
                self.block_manager.free_request(req)
                req.num_computed_tokens = req.num_cached_tokens = req.num_draft_computed = 0
                break
            self.waiting.popleft()
            item.state_from = restore
            self._plan_snapshots(item)
            self.num_prefix_cache_queries += queried  # tokens looked up in the prefix cache, and hit
            self.num_prefix_cache_hits += req.num_cached_tokens if queried else 0
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(item)
            budget -= item.num_new_tokens

    def _waiting_reserve(self, budget: int) -> int:
        """Tokens a step keeps from running prompt chunks for the waiting head (up to a quarter of the budget),
        where a sequence slot is free for it: a long prompt being computed chunk by chunk never holds a new
        request out of every step until it is done."""
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return 0
        if self.waiting[0].queued_steps < self.config.coalesce_steps:
            return 0  # coalescing may hold it that many steps (and so may the chunks): a bounded wait
        return min(self.waiting[0].num_uncomputed_tokens, budget // 4)

    def _fit(self, req: Request, budget: int, prompt_budget: int | None = None) -> ScheduledRequest:
        """The request's part of the step within `budget`: a prompt chunk (at most `prompt_budget` tokens where
        it stops short of the prompt's end), or the next token with its drafts to verify."""
        remaining = req.num_uncomputed_tokens
        drafts = self.drafts.get(req.request_id, NO_DRAFTS)
        if remaining > 1 or not drafts.ids:
            n = min(remaining, budget)
            if n < remaining and prompt_budget is not None:
                n = min(n, prompt_budget)
            return ScheduledRequest(req, n, 0, emits=n == remaining, start_pos=req.num_computed_tokens,
                                    drafts=drafts)
        num_drafts = min(drafts.verify_len, len(drafts.ids), budget - 1,
                         self.max_model_len - 1 - req.num_tokens)
        num_drafts = max(num_drafts, 0)
        return ScheduledRequest(req, 1 + num_drafts, num_drafts, emits=True,
                                start_pos=req.num_computed_tokens, drafts=drafts)

    def _plan_snapshots(self, item: ScheduledRequest) -> None:
        """A hybrid target's state snapshots at the block boundaries this step's prompt positions cross."""
        item.state_saves = self.block_manager.plan_snapshots(
            item.request, item.start_pos, item.start_pos + item.num_new_tokens - item.num_drafts)

    def _allocate(self, req: Request, item: ScheduledRequest) -> bool:
        lookahead = self.num_lookahead_slots if req.params.speculation else 0
        num_slots = min(req.num_computed_tokens + item.num_new_tokens + lookahead,
                        self.max_model_len + lookahead)
        return self.block_manager.allocate(req, num_slots)

    def _pick_victim(self, scheduled_ids: set[str]) -> Request:
        for req in reversed(self.running):
            if req.request_id not in scheduled_ids:
                return req
        raise RuntimeError("KV pool too small for a single request's step")

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.block_manager.free_request(req)
        req.reset_for_recompute()
        self.drafts.pop(req.request_id, None)
        self.waiting.appendleft(req)

    # -- commit ----------------------------------------------------------------------------------
    def commit(self, out: SchedulerOutput, output_ids: dict[str, list[int]],
               num_accepted: dict[str, int]) -> dict[str, list[int]]:
        """Apply verified tokens; returns the tokens each request emitted this step (stop-truncated)."""
        emitted: dict[str, list[int]] = {}
        for item in out.scheduled:
            req = item.request
            if not item.emits:
                req.num_computed_tokens += item.num_new_tokens
                self.block_manager.commit(req)
                continue
            accepted = num_accepted.get(req.request_id, 0)
            req.num_computed_tokens += item.num_new_tokens - (item.num_drafts - accepted)
            if item.num_drafts:
                self._record_spec(req, item.num_drafts, accepted)
            new_ids = self._append_until_stop(req, output_ids[req.request_id])
            emitted[req.request_id] = new_ids
            self.drafts.pop(req.request_id, None)
            self.block_manager.commit(req)  # a request finishing in its prompt's step still caches it
            if req.is_finished:
                self.running.remove(req)
                self.block_manager.free_request(req)
                self.finished.append(req)
        return emitted

    def _append_until_stop(self, req: Request, new_ids: list[int]) -> list[int]:
        p = req.params
        kept: list[int] = []
        for token in new_ids:
            req.output_ids.append(token)
            kept.append(token)
            reason = None
            if token in p.stop_token_ids or (not p.ignore_eos and token in req.eos_token_ids):
                reason = "stop"
            elif p.max_tokens is not None and len(req.output_ids) >= p.max_tokens:
                reason = "length"
            elif req.num_tokens >= self.max_model_len:
                reason = "length"
            if reason:
                req.status = RequestStatus.FINISHED
                req.finish_reason = reason
                break
        return kept

    @staticmethod
    def _record_spec(req: Request, num_drafts: int, accepted: int) -> None:
        s = req.spec
        s.num_drafts += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += accepted
        if len(s.accepted_per_pos) < num_drafts:
            s.accepted_per_pos.extend([0] * (num_drafts - len(s.accepted_per_pos)))
        for pos in range(accepted):
            s.accepted_per_pos[pos] += 1

    def finish_request(self, req: Request, reason: str) -> None:
        """End a running or waiting request from outside (a stop string found by the detokenizer)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        else:
            return
        self._finish(req, reason)

    def _finish(self, req: Request, reason: str) -> None:
        self.block_manager.free_request(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.drafts.pop(req.request_id, None)
        self.finished.append(req)
