"""SpecController: the one home of speculation control, the object the engine asks about drafting.

The engine talks to it at four points of a step, and nowhere else:
- admission (`admits_model_drafting`, handed to the scheduler at construction): may the model drafter keep a
  context for a request joining this load? (the admission rule of the draft gate, and the measured switch);
- after verification (`observe_verify`): each request's outcome goes to the observers (the draft gate,
  online upkeep, prompt lookup's acceptance counts, evaluation tools in `verify_observers`);
- after the commit (`after_commit`): which requests draft for the next step (the measured switch, the draft
  gate's pick, the next step's budget), their drafter context extended over what was committed (deferred
  while the gate skips them), then the drafts and each request's verification length (the length policy over
  the cost table);
- the whole step (`observe_step`): its seconds, for the draft gate's live cost and the measured switch.

What each governor decides and why is docs/design-notes.md; their state lives in their own modules
(`draft_gate`, `admission`, `switch`, `upkeep`, `length_policy`, `cost_table`). Without a drafter the engine
holds `NoSpeculation`, whose answers are those of plain decoding.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

import torch

from dspark.drafters.base import ContextSegment, ContextUpdate, Drafter, ProposeBatch, ProposeRequest
from dspark.request import PendingContext, Request
from dspark.speculation.faults import checked_proposal, drafter_fault

log = logging.getLogger(__name__)


class NextStep(NamedTuple):
    num_nondraft: int  # tokens of the next step that are not drafts (within the budget)
    num_prompt: int  # of those, prompt-chunk tokens (the rest: one per decoding request)
    max_drafts: int  # budget left after every non-draft token asked for: drafts beyond it would push
    #                  prompt tokens to a later step


class NoSpeculation:
    """Plain decoding: nothing drafts, nothing is observed."""

    drafter = cost_table = length_policy = None
    draft_gate = switch = upkeep = None

    def __init__(self) -> None:
        self.verify_observers: list = []  # nothing is verified against drafts: never called

    def wants_taps(self, sched) -> bool:
        return False

    def observe_verify(self, items, result) -> None:
        pass

    def observe_target_step(self, *, num_tokens: int, seconds: float) -> None:
        pass

    def after_commit(self, sched, batch, taps, verified, *, demand) -> int:
        return 0

    def observe_step(self, sched, emitted: dict[str, list[int]], *, seconds: float, num_proposed: int) -> None:
        pass

    def finished(self, req: Request, *, failed: bool) -> None:
        pass


class SpecController:
    # Drafter context that may wait (draft gate only): a skipped request's *generated* positions keep
    # their taps and are extended when it next proposes, in one call with that step's positions — a
    # request the gate never lets draft again costs no drafter work at all (its backlog is dropped when
    # it finishes). Prompt positions are extended at once: their drafter K/V make a later prefix hit a
    # draft hit. The kept taps live under one budget for all requests; past it the longest backlogs
    # are extended.
    MAX_DEFERRED_BYTES = 64 * 2**20

    def __init__(self, config, *, drafter: Drafter, length_policy, cost_table, block_manager, metrics,
                 requests: dict[str, Request], vocab_size: int):
        spec = config.spec
        self.config, self.drafter, self.length_policy, self.cost_table = config, drafter, length_policy, cost_table
        self.block_manager, self.metrics, self.requests, self.vocab_size = block_manager, metrics, requests, vocab_size
        self.draft_sample_method = spec.draft_sample_method if spec is not None else "greedy"
        # Called after each verification as f(request_id, draft_confidence, num_verified, num_accepted) for every
        # request that emitted (eval / calibration tools: dspark.speculation.acceptance), whatever proposed its drafts;
        # `model_verify_observers` only for rounds the model drafter proposed (their confidences come from its
        # calibrated head: the draft gate and online calibration learn from them)
        self.verify_observers: list = []
        if drafter.has_free_drafts:  # lookup-first: counts its drafts' outcomes
            self.verify_observers.append(drafter.observe_verify)
        self.model_verify_observers: list = []
        self.draft_gate = None  # cost-aware policies: skip drafting where it cannot pay (spec "draft_gate")
        self.gate_admission = False
        if spec is not None and spec.draft_gate and getattr(length_policy, "needs_cost", False):
            from dspark.speculation.draft_gate import DraftGate
            self.draft_gate = DraftGate()
            self.model_verify_observers.append(self.draft_gate.observe_verify)
            self.gate_admission = spec.gate_admission  # joining a load where drafting cannot pay: no context
        self.switch = None  # speculation on/off per load by measured seconds per token (spec "measured_switch")
        if self.draft_gate is not None and spec.measured_switch:
            from dspark.speculation.switch import MeasuredSwitch
            self.switch = MeasuredSwitch()
        self.upkeep = None  # online cost-table / calibration upkeep (spec "online_upkeep")
        if spec is not None and spec.online_upkeep:
            from dspark.speculation.upkeep import OnlineUpkeep
            self.upkeep = OnlineUpkeep(drafter=drafter, cost_table=cost_table, is_greedy=self._is_greedy)
            self.model_verify_observers.append(self.upkeep.observe_verify)

    def _is_greedy(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        return req is not None and req.params.is_greedy

    # -- admission -------------------------------------------------------------------------------------
    def admits_model_drafting(self, load: int, context_tokens: int = 0) -> bool:
        """Asked by the scheduler while it admits a speculative request; `load`: every running and waiting
        request (the one being admitted among them) up to max_num_seqs, so the first requests of a burst see
        the burst's load; `context_tokens`: the request's prompt."""
        if not self.gate_admission:
            return True
        ok = (self.draft_gate.admits_model_drafting(num_reqs=load, cost=self.cost_table)
              and not (self.switch is not None and self.switch.is_off(num_reqs=load, context_tokens=context_tokens)))
        if not ok:
            self.metrics.num_admitted_without_drafter += 1
        return ok

    # -- the step --------------------------------------------------------------------------------------
    def wants_taps(self, sched) -> bool:
        """Does the target forward return taps this step (some request keeps a drafter context)?"""
        return any(s.request.needs_draft_context for s in sched.scheduled)

    def observe_verify(self, items, result) -> None:
        """Each emitting item's verification outcome (`result.num_accepted` in item order) to the observers."""
        for s, n in zip(items, result.num_accepted):
            rid = s.request.request_id
            for observe in self.verify_observers:
                observe(rid, s.request.draft_confidence, s.num_drafts, n)
            if s.request.draft_from_model:
                for observe in self.model_verify_observers:
                    observe(rid, s.request.draft_confidence, s.num_drafts, n)

    def observe_target_step(self, *, num_tokens: int, seconds: float) -> None:
        """The target forward and verification of a step, timed (online upkeep refreshes the cost table)."""
        if self.upkeep is not None:
            self.cost_table = self.upkeep.observe_step(num_tokens=num_tokens, seconds=seconds)

    def after_commit(self, sched, batch, taps, verified, *, demand) -> int:
        """Drafter context over the committed positions, drafts and verification lengths for the next step;
        returns the number of requests the model drafter proposed for. `demand()`: the next step's (decode,
        prompt) tokens before drafts (`Scheduler.next_step_demand`)."""
        if not sched.scheduled:
            return 0
        proposing, model_allowed, next_step = self._proposing_requests(sched, demand)
        self._extend_context(sched, batch, taps, verified,
                             flush={r.request_id for r, ok in zip(proposing, model_allowed) if ok})
        return self._propose_and_choose(proposing, model_allowed, next_step)

    def observe_step(self, sched, emitted: dict[str, list[int]], *, seconds: float, num_proposed: int) -> None:
        """The whole step, as the gate's live cost and the measured switch's sample."""
        if self.draft_gate is None or not sched.scheduled:
            return
        self.draft_gate.observe_step(
            num_tokens=sched.num_batched_tokens, seconds=seconds,
            drafts_verified=any(s.num_drafts for s in sched.scheduled), num_proposed_reqs=num_proposed,
            cost=self.cost_table)
        if self.switch is not None:
            self.switch.observe_step(
                seconds=seconds, num_emitted=sum(len(ids) for ids in emitted.values()),
                decode_only=not sched.preempted_ids and all(
                    s.start_pos >= len(s.request.prompt_ids) for s in sched.scheduled))

    def finished(self, req: Request, *, failed: bool) -> None:
        """The request ended (finished, aborted or failed): the drafter drops what it keeps for it; a finished
        one's tokens feed prompt lookup's cross-request cache."""
        self.drafter.release(req.request_id)
        if req.uses_speculation and not failed:
            self.drafter.observe_finished(req.all_ids, len(req.prompt_ids))

    # -- who drafts ------------------------------------------------------------------------------------
    def _proposing_requests(self, sched, demand) -> tuple[list[Request], list[bool], NextStep]:
        """The requests that draft for the next step, whether the model drafter may draft for each (the
        draft gate's pick among those that emitted; a drafter with free drafts still proposes for the
        others), and the next step's non-draft token counts. Under a cost-aware policy nothing is
        model-drafted while prompt chunks need the whole next step's budget, nor ever for a request admitted
        without drafter context (`Request.model_drafting`); nothing is proposed at all where the measured
        switch has speculation off at this load, or where the gate finds lookup drafts cannot pay."""
        reqs = [s.request for s in sched.scheduled
                if s.emits and not s.request.is_finished and s.request.uses_speculation]
        if not reqs:
            return [], [], NextStep(0, 0, 0)
        measured_off = self.switch is not None and not self.switch.propose(
            num_reqs=len(reqs), context_tokens=max(r.num_tokens for r in reqs))
        next_step = NextStep(0, 0, 0) if measured_off else self._next_step_tokens(*demand())
        if measured_off or (self.draft_gate is not None and not self.draft_gate.proposing_pays(
                num_reqs=len(reqs), num_nondraft_tokens=next_step.num_nondraft,
                num_prompt_tokens=next_step.num_prompt, cost=self.cost_table)):  # lookup cannot pay for itself
            for r in reqs:
                r.clear_drafts()
            with self.metrics.lock:
                self.metrics.num_proposal_skips += 1
                self.metrics.num_measured_off_steps += measured_off
                self.metrics.verify_lens.extend([0] * len(reqs))
            return [], [], next_step
        cost_aware = getattr(self.length_policy, "needs_cost", False)
        if cost_aware and next_step.max_drafts == 0:
            allowed = [False] * len(reqs)  # no draft could be verified: the prompts take the budget
        elif self.draft_gate is not None:
            drafted = set(self.draft_gate.drafted_requests(
                num_reqs=len(reqs), num_nondraft_tokens=next_step.num_nondraft,
                num_prompt_tokens=next_step.num_prompt, cost=self.cost_table,
                backlog=[r.num_pending_positions if r.model_drafting else float("inf") for r in reqs]))
            allowed = [i in drafted and r.model_drafting for i, r in enumerate(reqs)]
            self.metrics.num_draft_skips += allowed.count(False)
        else:
            allowed = [r.model_drafting for r in reqs]
        for r in (r for r, ok in zip(reqs, allowed) if not ok):
            r.clear_drafts()  # plain decoding in the next step for this request (or free drafts)
        if not self.drafter.has_free_drafts:
            reqs = [r for r, ok in zip(reqs, allowed) if ok]
            allowed = [True] * len(reqs)
        return reqs, allowed, next_step

    def _next_step_tokens(self, decode: int, prompt: int) -> NextStep:
        """The next step's tokens before drafts (`Scheduler.next_step_demand`: decoding requests, prompt
        chunks of running requests and of the waiting prompts it would admit), clipped to the step's
        budget, and the budget they leave for drafts."""
        budget = self.config.scheduler.max_num_batched_tokens
        num_nondraft = min(decode + prompt, budget)
        num_decode = min(decode, num_nondraft)
        return NextStep(num_nondraft=num_nondraft, num_prompt=num_nondraft - num_decode,
                        max_drafts=max(0, budget - decode - prompt))

    # -- drafter context -------------------------------------------------------------------------------
    def _extend_context(self, sched, batch, taps, verified, *, flush: set[str]) -> None:
        """Extend the drafter context over this step's committed positions: now for the requests in
        `flush` (they propose next), for prompt positions, and for every position without a draft gate;
        deferred otherwise (within MAX_DEFERRED_BYTES)."""
        parts: list[tuple[Request, PendingContext]] = []  # what is extended now, pending included
        deferring = False
        for item, offset in zip(sched.scheduled, batch.token_offsets):
            req = item.request
            if req.is_finished or not req.needs_draft_context:
                continue
            rejected = item.num_drafts - verified.num_accepted_by_id.get(req.request_id, 0)
            count = item.num_new_tokens - rejected if item.emits else item.num_new_tokens
            defer = (self.draft_gate is not None and req.request_id not in flush
                     and item.start_pos >= len(req.prompt_ids))
            rows = None if taps is None else taps[offset:offset + count]  # [count, num_taps * hidden]
            part = PendingContext(start_pos=item.start_pos, token_ids=batch.input_id_list[offset:offset + count],
                                  next_token_id=req.token_at(item.start_pos + count),
                                  taps=rows.clone() if defer and rows is not None else rows)
            if defer:
                req.defer_context(part)
                deferring = True
                continue
            parts.append((req, _joined(req.take_pending_context() + [part])))
        if deferring:
            parts += self._over_budget(row_bytes=0 if taps is None else taps.shape[1] * taps.element_size())
        if not parts:
            return
        segments, row = [], 0
        for req, part in parts:
            segments.append(ContextSegment(
                request_id=req.request_id, block_table=req.block_table, start_pos=part.start_pos,
                token_ids=part.token_ids, next_token_id=part.next_token_id,
                tap_rows=slice(row, row + len(part.token_ids))))
            row += len(part.token_ids)
        all_taps = None if taps is None else torch.cat([p.taps for _, p in parts])  # [rows, num_taps * hidden]
        try:
            done = self.drafter.extend_context(ContextUpdate(segments=segments, taps=all_taps))
        except Exception:  # the drafter's context for these requests is lost: they decode plainly
            drafter_fault(self.metrics, [req for req, _ in parts], "extend_context")
            return
        for seg in segments:
            req = self.requests[seg.request_id]
            req.num_draft_computed = done.get(seg.request_id, seg.start_pos + len(seg.token_ids))
            self.block_manager.commit(req)

    def _over_budget(self, *, row_bytes: int) -> list[tuple[Request, PendingContext]]:
        """Backlogs to extend now because the deferred taps exceed MAX_DEFERRED_BYTES: the longest
        first, until the rest fit in half the budget."""
        live = [r for r in self.requests.values() if not r.is_finished]  # (a finished one's blocks are freed)
        total = row_bytes * sum(r.num_pending_positions for r in live)
        parts: list[tuple[Request, PendingContext]] = []
        if total <= self.MAX_DEFERRED_BYTES:
            return parts
        for req in sorted(live, key=lambda r: -r.num_pending_positions):
            if not req.num_pending_positions or (parts and total <= self.MAX_DEFERRED_BYTES // 2):
                break
            total -= row_bytes * req.num_pending_positions
            parts.append((req, _joined(req.take_pending_context())))
        return parts

    # -- drafts and verification lengths ---------------------------------------------------------------
    def _propose_and_choose(self, reqs: list[Request], model_allowed: list[bool], next_step: NextStep) -> int:
        """Drafts and verify lengths for the next step; returns the number of requests the model drafter
        proposed for."""
        model_allowed = [ok and r.model_drafting for r, ok in zip(reqs, model_allowed)]  # after a fault
        if not self.drafter.has_free_drafts:
            reqs = [r for r, ok in zip(reqs, model_allowed) if ok]
            model_allowed = [True] * len(reqs)
        if not reqs:
            return 0
        start = time.perf_counter()
        batch = ProposeBatch(
            requests=[ProposeRequest(
                request_id=r.request_id, all_ids=r.all_ids, anchor_pos=r.num_computed_tokens,
                block_table=r.block_table, num_draft_computed=r.num_draft_computed, params=r.params,
                generator=r.generator, allow_model=ok) for r, ok in zip(reqs, model_allowed)],
            kv_block_size=self.block_manager.kv_block_size, draft_sample_method=self.draft_sample_method)
        proposal, num_valid = checked_proposal(self.drafter, self.metrics, reqs, batch, vocab_size=self.vocab_size)
        if proposal is None:
            return 0
        from_model = [True] * len(reqs) if proposal.from_model is None else list(proposal.from_model)
        draft_ids = proposal.draft_ids.tolist()  # [num_reqs][γ]
        for i, r in enumerate(reqs):  # drafts a grammar forbids could never be accepted: cut them here
            if r.grammar is not None:
                num_valid[i] = r.grammar.valid_prefix(draft_ids[i][:num_valid[i]])
        verify_lens = self._verify_lengths(proposal, num_valid, from_model, next_step, len(reqs))
        confidence = None if proposal.confidence is None else proposal.confidence.tolist()
        for i, r in enumerate(reqs):
            verify_lens[i] = min(int(verify_lens[i]), num_valid[i])
            r.draft_ids = draft_ids[i][:num_valid[i]]
            r.draft_probs = None if proposal.draft_probs is None else proposal.draft_probs[i]
            r.draft_confidence = None if confidence is None else confidence[i]
            r.draft_from_model = from_model[i]
            r.verify_len = int(verify_lens[i])
        with self.metrics.lock:
            self.metrics.verify_lens.extend(int(v) for v in verify_lens)
            self.metrics.num_lookup_drafts += sum(1 for i in range(len(reqs)) if not from_model[i] and num_valid[i])
        if self.draft_gate is not None and not any(from_model):  # a lookup-only proposal: its cost and worth
            self.draft_gate.observe_proposal(seconds=time.perf_counter() - start, confidence=proposal.confidence,
                                             num_proposed=num_valid)
        return sum(from_model)

    def _verify_lengths(self, proposal, num_valid: list[int], from_model: list[bool], next_step: NextStep,
                        num_reqs: int) -> list[int]:
        """Each request's verification length: every valid draft without a length policy, else the policy's
        choice over the confidences and the cost table (which the policy and the gate then observe)."""
        if self.length_policy is None:
            return list(num_valid)
        if not any(num_valid):
            return [0] * num_reqs
        verify_lens = list(self.length_policy.choose(
            confidence=proposal.confidence, num_draft_tokens=proposal.draft_ids.shape[1],
            num_nondraft_tokens=next_step.num_nondraft, num_prompt_tokens=next_step.num_prompt,
            num_drafted_reqs=sum(from_model), max_drafts=next_step.max_drafts, cost=self.cost_table,
            num_reqs=num_reqs, num_proposed=num_valid))
        if hasattr(self.length_policy, "observe") and proposal.confidence is not None:
            # after choose: the async policy's capacity reads confidences two steps old
            self.length_policy.observe(proposal.confidence, num_proposed=num_valid)
        rows = [i for i, m in enumerate(from_model) if m]  # the gate learns the model's curve only
        if self.draft_gate is not None and proposal.confidence is not None and rows:
            self.draft_gate.observe(proposal.confidence[rows], num_proposed=[num_valid[i] for i in rows])
        return verify_lens


def _joined(pending: list[PendingContext]) -> PendingContext:
    """Contiguous parts of one request's context, as one part."""
    if len(pending) == 1:
        return pending[0]
    ids = [t for p in pending for t in p.token_ids]
    assert all(a.start_pos + len(a.token_ids) == b.start_pos for a, b in zip(pending, pending[1:])), \
        "deferred drafter context is not contiguous"
    last = pending[-1]
    return PendingContext(start_pos=pending[0].start_pos, token_ids=ids, next_token_id=last.next_token_id,
                          taps=None if last.taps is None else torch.cat([p.taps for p in pending]))


def build_controller(config, *, drafter: Drafter | None, length_policy, cost_table, block_manager, metrics,
                     requests: dict[str, Request], vocab_size: int):
    """The engine's speculation control: `NoSpeculation` without a drafter."""
    if drafter is None:
        return NoSpeculation()
    return SpecController(config, drafter=drafter, length_policy=length_policy, cost_table=cost_table,
                          block_manager=block_manager, metrics=metrics, requests=requests, vocab_size=vocab_size)
