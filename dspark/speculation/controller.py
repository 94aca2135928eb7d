"""SpecController: the one home of speculation control, the object the engine asks about drafting.

The engine talks to it through three calls, and nowhere else:
- `admit` (handed to the scheduler, which asks it as it admits a speculative request): may the model drafter
  keep a context for a request joining this load? (the draft gate's rule for joining requests, and the
  measured switch);
- `after_commit` -> `NextDrafts`: the step's verification outcomes go to the observers (the draft gate, online
  upkeep, prompt lookup's acceptance counts, evaluation tools in `verify_observers`) and its target seconds to
  the upkeep; then which requests draft for the next step (the measured switch, the draft gate's pick, the next
  step's budget from the demand the engine passes), their drafter context extended over what was committed
  (deferred while the gate skips them), then each request's `Drafts` with its verification length (the length
  policy over the cost table). The engine hands the result to the scheduler;
- `observe_step`: the whole step's seconds, for the draft gate's live cost and the measured switch, and the
  requests that ended in it (the drafter drops what it keeps for them).

It reads the scheduler's output and the requests it names, and calls nothing of the engine, the scheduler or
the block manager. What each governor decides and why is docs/design-notes.md; their state lives in their own
modules (`draft_gate`, `admission`, `switch`, `upkeep`, `length_policy`, `cost_table`). Without a drafter the
engine holds `NoSpeculation`, whose answers are those of plain decoding.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from dspark.drafters.base import ContextSegment, ContextUpdate, Drafter, ProposeBatch, ProposeRequest
from dspark.request import NO_DRAFTS, Drafts, PendingContext, Request
from dspark.speculation.faults import checked_proposal, drafter_fault

log = logging.getLogger(__name__)


class NextStep(NamedTuple):
    num_nondraft: int  # tokens of the next step that are not drafts (within the budget)
    num_prompt: int  # of those, prompt-chunk tokens (the rest: one per decoding request)
    max_drafts: int  # budget left after every non-draft token asked for: drafts beyond it would push
    #                  prompt tokens to a later step


@dataclass(frozen=True)
class NextDrafts:
    """What `after_commit` hands back, for the scheduler (`Scheduler.hold_drafts`)."""

    drafts: dict[str, Drafts] = field(default_factory=dict)  # request_id → its next window's drafts (NO_DRAFTS:
    #                                                           drop what it holds)
    context_extended: tuple[Request, ...] = ()  # requests whose drafter context grew this step


NOTHING_NEXT = NextDrafts()


class NoSpeculation:
    """Plain decoding: nothing drafts, nothing is observed."""

    drafter = cost_table = length_policy = None
    draft_gate = switch = upkeep = None

    def __init__(self) -> None:
        self.verify_observers: list = []  # nothing is verified against drafts: never called

    def admit(self, load: int, context_tokens: int = 0) -> bool:
        return True

    def after_commit(self, sched, batch, taps, num_accepted, *, target_seconds: float, demand) -> NextDrafts:
        return NOTHING_NEXT

    def observe_step(self, sched, emitted, *, seconds: float, finished=()) -> None:
        pass

    def release(self, finished) -> None:
        pass


class SpecController:
    # Drafter context that may wait (draft gate only): a skipped request's *generated* positions keep
    # their taps and are extended when it next proposes, in one call with that step's positions — a
    # request the gate never lets draft again costs no drafter work at all (its backlog is dropped when
    # it finishes). Prompt positions are extended at once: their drafter K/V make a later prefix hit a
    # draft hit. The kept taps live under one budget for all requests; past it the longest backlogs
    # are extended.
    MAX_DEFERRED_BYTES = 64 * 2**20

    def __init__(self, config, *, drafter: Drafter, length_policy, cost_table, metrics, vocab_size: int):
        spec = config.spec
        self.config, self.drafter, self.length_policy, self.cost_table = config, drafter, length_policy, cost_table
        self.metrics, self.vocab_size = metrics, vocab_size
        self.kv_block_size = config.cache.kv_block_size
        self.draft_sample_method = spec.draft_sample_method if spec is not None else "greedy"
        self._deferred: dict[str, Request] = {}  # requests whose drafter context waits (`_extend_context`)
        self._greedy_ids: set[str] = set()  # the greedy requests among those being observed (`_is_greedy`)
        self._num_model_drafted = 0  # requests the model drafter proposed for after this step's commit
        # Called after each verification as f(request_id, draft_confidence, num_verified, num_accepted) for every
        # request that emitted (eval / calibration tools: dspark.speculation.acceptance), whatever proposed its drafts;
        # `model_verify_observers` only for rounds the model drafter proposed (their confidences come from its
        # calibrated head: the draft gate and online calibration learn from them)
        self.verify_observers: list = []
        if drafter.has_free_drafts:  # lookup-first: counts its drafts' outcomes
            self.verify_observers.append(drafter.observe_verify)
        self.model_verify_observers: list = []
        self.draft_gate = None  # cost-aware policies: skip drafting where it cannot pay (spec "draft_gate")
        self.context_by_load = False  # spec "gate_admission": a request joining where drafting cannot pay keeps
        #                               no drafter context
        if spec is not None and spec.draft_gate and getattr(length_policy, "needs_cost", False):
            from dspark.speculation.draft_gate import DraftGate
            self.draft_gate = DraftGate()
            self.model_verify_observers.append(self.draft_gate.observe_verify)
            self.context_by_load = spec.gate_admission
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
        return request_id in self._greedy_ids

    # -- the three calls -------------------------------------------------------------------------------
    def admit(self, load: int, context_tokens: int = 0) -> bool:
        """Asked by the scheduler while it admits a speculative request: may the model drafter keep a context
        for it? `load`: every running and waiting request (the one being admitted among them) up to
        max_num_seqs, so the first requests of a burst see the burst's load; `context_tokens`: its prompt."""
        if not self.context_by_load:
            return True
        ok = (self.draft_gate.admits_model_drafting(num_reqs=load, cost=self.cost_table)
              and not (self.switch is not None and self.switch.is_off(num_reqs=load, context_tokens=context_tokens)))
        if not ok:
            self.metrics.num_admitted_without_drafter += 1
        return ok

    def after_commit(self, sched, batch, taps, num_accepted: Mapping[str, int], *, target_seconds: float,
                     demand: tuple[int, int]) -> NextDrafts:
        """The committed step in, the next step's drafts out. `batch` / `taps` [num_tokens, num_taps * hidden]: the
        step's flat batch and target taps (None without); `num_accepted`: accepted drafts by request (every
        emitting one); `target_seconds`: the target forward and verification, timed; `demand`: the next step's
        (decode, prompt) tokens before drafts (`Scheduler.next_step_demand`)."""
        self._num_model_drafted = 0
        if not sched.scheduled:
            return NOTHING_NEXT
        self._observe_verify(sched, num_accepted)
        if self.upkeep is not None:  # the target's timing refreshes the cost table
            self.cost_table = self.upkeep.observe_step(num_tokens=sched.num_batched_tokens, seconds=target_seconds)
        proposing, model_allowed, next_step = self._proposing_requests(sched, demand)
        drafts: dict[str, Drafts] = {}
        extended = self._extend_context(sched, batch, taps, num_accepted, drafts,
                                        flush={r.request_id for r, ok in zip(proposing, model_allowed) if ok})
        proposed, self._num_model_drafted = self._propose_and_choose(proposing, model_allowed, next_step)
        drafts.update(proposed)
        return NextDrafts(drafts=drafts, context_extended=tuple(extended))

    def observe_step(self, sched, emitted: dict[str, list[int]], *, seconds: float,
                     finished: Sequence[tuple[Request, bool]] = ()) -> None:
        """The whole step, as the gate's live cost and the measured switch's sample; `finished`: (request,
        failed?) for each request that ended in it (finished, aborted or failed): the drafter drops what it
        keeps for it, and a finished one's tokens feed prompt lookup's cross-request cache."""
        self.release(finished)
        if self.draft_gate is None or not sched.scheduled:
            return
        self.draft_gate.observe_step(
            num_tokens=sched.num_batched_tokens, seconds=seconds,
            drafts_verified=any(s.num_drafts for s in sched.scheduled),
            num_proposed_reqs=self._num_model_drafted, cost=self.cost_table)
        if self.switch is not None:
            self.switch.observe_step(
                seconds=seconds, num_emitted=sum(len(ids) for ids in emitted.values()),
                decode_only=not sched.preempted_ids and all(
                    s.start_pos >= len(s.request.prompt_ids) for s in sched.scheduled))

    def release(self, finished: Sequence[tuple[Request, bool]]) -> None:
        """(request, failed?) for requests that ended (in a step, or aborted between steps): the drafter drops
        what it keeps for each, and a finished one's tokens feed prompt lookup's cross-request cache."""
        for req, failed in finished:
            self._deferred.pop(req.request_id, None)
            self.drafter.release(req.request_id)
            if req.params.speculation and not failed:
                self.drafter.observe_finished(req.all_ids, len(req.prompt_ids))

    def _observe_verify(self, sched, num_accepted: Mapping[str, int]) -> None:
        """Each emitting window's verification outcome to the observers, with the drafts it carried."""
        items = [s for s in sched.scheduled if s.emits]
        self._greedy_ids = {s.request.request_id for s in items if s.request.params.is_greedy}
        for s in items:
            rid, confidence = s.request.request_id, s.drafts.confidence
            n = num_accepted[rid]
            for observe in self.verify_observers:
                observe(rid, confidence, s.num_drafts, n)
            if s.drafts.from_model:
                for observe in self.model_verify_observers:
                    observe(rid, confidence, s.num_drafts, n)

    # -- who drafts ------------------------------------------------------------------------------------
    def _proposing_requests(self, sched, demand: tuple[int, int]) -> tuple[list[Request], list[bool], NextStep]:
        """The requests that draft for the next step, whether the model drafter may draft for each (the
        draft gate's pick among those that emitted; a drafter with free drafts still proposes for the
        others), and the next step's non-draft token counts. Under a cost-aware policy nothing is
        model-drafted while prompt chunks need the whole next step's budget, nor ever for a request admitted
        without drafter context (`Request.model_drafting`); nothing is proposed at all where the measured
        switch has speculation off at this load, or where the gate finds lookup drafts cannot pay."""
        reqs = [s.request for s in sched.scheduled
                if s.emits and not s.request.is_finished and s.request.params.speculation]
        if not reqs:
            return [], [], NextStep(0, 0, 0)
        measured_off = self.switch is not None and not self.switch.propose(
            num_reqs=len(reqs), context_tokens=max(r.num_tokens for r in reqs))
        next_step = NextStep(0, 0, 0) if measured_off else self._next_step_tokens(*demand)
        if measured_off or (self.draft_gate is not None and not self.draft_gate.proposing_pays(
                num_reqs=len(reqs), num_nondraft_tokens=next_step.num_nondraft,
                num_prompt_tokens=next_step.num_prompt, cost=self.cost_table)):  # lookup cannot pay for itself
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
        if not self.drafter.has_free_drafts:  # the others decode plainly in the next step
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
    def _extend_context(self, sched, batch, taps, num_accepted: Mapping[str, int], drafts: dict[str, Drafts], *,
                        flush: set[str]) -> list[Request]:
        """Extend the drafter context over this step's committed positions: now for the requests in
        `flush` (they propose next), for prompt positions, and for every position without a draft gate;
        deferred otherwise (within MAX_DEFERRED_BYTES). Returns the requests whose context grew; where the
        drafter raised, its requests lose their drafts (`NO_DRAFTS` into `drafts`) and their context."""
        parts: list[tuple[Request, PendingContext]] = []  # what is extended now, pending included
        deferring = False
        for item, offset in zip(sched.scheduled, batch.token_offsets):
            req = item.request
            if req.is_finished or not req.needs_draft_context:
                continue
            rejected = item.num_drafts - num_accepted.get(req.request_id, 0)
            count = item.num_new_tokens - rejected if item.emits else item.num_new_tokens
            defer = (self.draft_gate is not None and req.request_id not in flush
                     and item.start_pos >= len(req.prompt_ids))
            rows = None if taps is None else taps[offset:offset + count]  # [count, num_taps * hidden]
            part = PendingContext(start_pos=item.start_pos, token_ids=batch.input_id_list[offset:offset + count],
                                  next_token_id=req.token_at(item.start_pos + count),
                                  taps=rows.clone() if defer and rows is not None else rows)
            if defer:
                req.defer_context(part)
                self._deferred[req.request_id] = req
                deferring = True
                continue
            self._deferred.pop(req.request_id, None)
            parts.append((req, _joined(req.take_pending_context() + [part])))
        if deferring:
            parts += self._over_budget(row_bytes=0 if taps is None else taps.shape[1] * taps.element_size())
        if not parts:
            return []
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
            drafts.update((req.request_id, NO_DRAFTS) for req, _ in parts)
            return []
        for (req, _), seg in zip(parts, segments):
            req.num_draft_computed = done.get(seg.request_id, seg.start_pos + len(seg.token_ids))
        return [req for req, _ in parts]

    def _over_budget(self, *, row_bytes: int) -> list[tuple[Request, PendingContext]]:
        """Backlogs to extend now because the deferred taps exceed MAX_DEFERRED_BYTES: the longest
        first, until the rest fit in half the budget."""
        # the live requests with deferred context (a finished one's blocks are freed), oldest first: among
        # equal backlogs the oldest is extended first
        live = sorted((r for r in self._deferred.values() if not r.is_finished), key=lambda r: r.arrival_time)
        total = row_bytes * sum(r.num_pending_positions for r in live)
        parts: list[tuple[Request, PendingContext]] = []
        if total <= self.MAX_DEFERRED_BYTES:
            return parts
        for req in sorted(live, key=lambda r: -r.num_pending_positions):
            if not req.num_pending_positions or (parts and total <= self.MAX_DEFERRED_BYTES // 2):
                break
            total -= row_bytes * req.num_pending_positions
            self._deferred.pop(req.request_id, None)
            parts.append((req, _joined(req.take_pending_context())))
        return parts

    # -- drafts and verification lengths ---------------------------------------------------------------
    def _propose_and_choose(self, reqs: list[Request], model_allowed: list[bool],
                            next_step: NextStep) -> tuple[dict[str, Drafts], int]:
        """Drafts and verify lengths for the next step, by request; and the number of requests the model
        drafter proposed for."""
        model_allowed = [ok and r.model_drafting for r, ok in zip(reqs, model_allowed)]  # after a fault
        if not self.drafter.has_free_drafts:
            reqs = [r for r, ok in zip(reqs, model_allowed) if ok]
            model_allowed = [True] * len(reqs)
        if not reqs:
            return {}, 0
        start = time.perf_counter()
        batch = ProposeBatch(
            requests=[ProposeRequest(
                request_id=r.request_id, all_ids=r.all_ids, anchor_pos=r.num_computed_tokens,
                block_table=r.block_table, num_draft_computed=r.num_draft_computed, params=r.params,
                generator=r.generator, allow_model=ok) for r, ok in zip(reqs, model_allowed)],
            kv_block_size=self.kv_block_size, draft_sample_method=self.draft_sample_method)
        proposal, num_valid = checked_proposal(self.drafter, self.metrics, reqs, batch, vocab_size=self.vocab_size)
        if proposal is None:
            return {}, 0
        from_model = [True] * len(reqs) if proposal.from_model is None else list(proposal.from_model)
        draft_ids = proposal.draft_ids.tolist()  # [num_reqs][γ]
        for i, r in enumerate(reqs):  # drafts a grammar forbids could never be accepted: cut them here
            if r.grammar is not None:
                num_valid[i] = r.grammar.valid_prefix(draft_ids[i][:num_valid[i]])
        verify_lens = self._verify_lengths(proposal, num_valid, from_model, next_step, len(reqs))
        confidence = None if proposal.confidence is None else proposal.confidence.tolist()  # [num_reqs][γ]
        drafts = {}
        for i, r in enumerate(reqs):
            verify_lens[i] = min(int(verify_lens[i]), num_valid[i])
            drafts[r.request_id] = Drafts(
                ids=tuple(draft_ids[i][:num_valid[i]]),
                probs=None if proposal.draft_probs is None else proposal.draft_probs[i],
                confidence=None if confidence is None else tuple(confidence[i]),
                from_model=from_model[i], verify_len=int(verify_lens[i]))
        with self.metrics.lock:
            self.metrics.verify_lens.extend(int(v) for v in verify_lens)
            self.metrics.num_lookup_drafts += sum(1 for i in range(len(reqs)) if not from_model[i] and num_valid[i])
        if self.draft_gate is not None and not any(from_model):  # a lookup-only proposal: its cost and worth
            self.draft_gate.observe_proposal(seconds=time.perf_counter() - start, confidence=proposal.confidence,
                                             num_proposed=num_valid)
        return drafts, sum(from_model)

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


def build_controller(config, *, drafter: Drafter | None, length_policy=None, cost_table=None, metrics,
                     vocab_size: int):
    """The engine's speculation control, whole: `NoSpeculation` without a drafter, else a `SpecController` over
    the drafter, its length policy and the cost table (the profiled one where "cost_table" is "auto")."""
    if drafter is None:
        return NoSpeculation()
    return SpecController(config, drafter=drafter, length_policy=length_policy, cost_table=cost_table,
                          metrics=metrics, vocab_size=vocab_size)
